"""`finetune merge --verify`: logits of the merged model against base + adapter (transformers + peft, CPU)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from finetune.weights.safetensors_io import ST_TO_TORCH

@dataclass
class VerifyResult:
    max_abs_diff: float
    adapter_effect: float  # how much the adapter moves the logits (base vs base + adapter)
    tolerance: float
    rounding: float = 0.0  # what storing base + adapter in the output's dtype costs, measured

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.tolerance


# The tolerance is measured, not assumed: PEFT merges the same base + adapter in float32, the result is
# rounded to the dtype the merged model is stored in, and the logit change that rounding causes is what
# a correct merge may differ by. A fixed fraction of the logits (2% for bf16) was larger than the whole
# effect of a small adapter, so a merge that lost the adapter passed. The floor covers float32 merges,
# where only the order of operations differs (x @ (W + BA) against x @ W + (x @ A) @ B).
_VERIFY_ROUNDING_FACTOR = 2.0
_VERIFY_FLOOR = 1e-5  # of the largest |logit|


def verify(output: Path, base: Path, adapter: Path, prompt: str = "The quick brown fox jumps over the lazy dog.") -> VerifyResult:
    """Logits of the merged model vs. base + adapter (unmerged), all computed in float32 on CPU."""
    import warnings

    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    # Loading progress bars and PEFT's notes would bury the one line verify prints.
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    ids = _prompt_ids(output, prompt)
    weight_dtype = _stored_dtype(output)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        ids = ids % model.config.get_text_config().vocab_size
        peft_model = PeftModel.from_pretrained(model, str(adapter))
        peft_model.eval()
        reference = peft_model(input_ids=ids).logits
        with peft_model.disable_adapter():
            plain = peft_model(input_ids=ids).logits
        expected = peft_model.merge_and_unload()
        for param in expected.parameters():
            param.copy_(param.to(weight_dtype).to(torch.float32))
        rounded = expected(input_ids=ids).logits
        del model, peft_model, expected
        merged = AutoModelForCausalLM.from_pretrained(str(output), dtype=torch.float32)
        merged.eval()
        logits = merged(input_ids=ids).logits
        del merged
    rounding = float((rounded - reference).abs().max())
    scale = max(1.0, float(reference.abs().max()))
    return VerifyResult(float((logits - reference).abs().max()), float((reference - plain).abs().max()),
                        _VERIFY_ROUNDING_FACTOR * rounding + _VERIFY_FLOOR * scale, rounding)


def _prompt_ids(model_dir: Path, prompt: str) -> torch.Tensor:
    try:
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(str(model_dir))(prompt, return_tensors="pt").input_ids
        if ids.numel() >= 4:
            return ids
    except Exception:  # no tokenizer, or one transformers cannot load: fixed ids do as well for a comparison
        pass
    return torch.arange(1, 33).unsqueeze(0)


def _stored_dtype(model_dir: Path) -> torch.dtype:
    files = sorted(model_dir.glob("*.safetensors"))
    with safe_open(str(files[0]), framework="pt") as handle:
        for key in handle.keys():
            dtype = ST_TO_TORCH.get(handle.get_slice(key).get_dtype())
            if dtype in (torch.bfloat16, torch.float16, torch.float32):
                return dtype
    return torch.float32
