"""`finetune export --verify`: the GGUF read back into transformers and compared with the model it came from.

The file is read with gguf-py (`GGUFReader`, `dequantize`: the package the converter writes with), llama.cpp's Q/K
row permutation is undone with transformers' own GGUF tensor processor, and the tensor names are mapped with gguf's
`get_tensor_name_map` (the converter's table). Then, on the run's own rows (its training data, as training tokenized
it; prompts rendered with the trained template when there is no recipe):
- f32: the logits equal bit for bit;
- 16-bit and q8_0: the weights equal the reference rounded the way the converter rounds (gguf-py's quantizers, the
  same code), and KL(reference || GGUF) is within twice what that rounding costs (as `merge --verify` derives its
  tolerance from the rounding it measures), plus a floor;
- K-quants: with llama-cpp-python installed, the weights equal the reference (rounded to the f16/bf16 file the
  quantizer read) rounded by llama.cpp's own ggml_quantize_chunk (finetune.export.ggml_quants), and the KL bound comes
  from that rounding; without it, KL within twice what gguf-py's Q4_0 / Q5_0 / Q8_0 rounding costs (coarser than,
  or as coarse as, the K-quant of the same bits);
- the argmax equal at every position where the reference's top-2 margin exceeds the measured max |logit difference|;
- the metadata: heads, kv-heads, RoPE base, context, BOS/EOS ids, the chat template, and no local path anywhere;
- with llama-cpp-python installed, llama.cpp itself (finetune.export.runtime): its tokens of the trained prompt equal
  transformers', and its argmax equals that of the GGUF's weights in transformers wherever that is decided.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from finetune import objectives
from finetune.export.prompt import TrainedPrompt, render

_ROWS = 16
_KL_FACTOR = 2.0
_KL_FLOOR = 1e-7
# What a K-quant's rounding is measured against: gguf-py's quantizer of the same or fewer bits per weight.
_PROXY = {"Q4_K": "Q4_0", "Q5_K": "Q5_0", "Q6_K": "Q8_0"}


def read_state_dict(path: Path, model) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """{transformers name: float32 tensor} of the GGUF, and {transformers name: GGML type name}."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    reader = gguf.GGUFReader(str(path))
    arch_name = str(reader.fields["general.architecture"].contents())
    arch = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}[arch_name]
    config = model.config
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    to_hf = {}
    for key in model.state_dict():
        base, _, suffix = key.rpartition(".")
        found = names.get_name(base)
        if found is not None:
            to_hf[f"{found}.{suffix}"] = key
    processor = TENSOR_PROCESSORS.get(arch_name, TensorProcessor)(
        config={"num_attention_heads": config.num_attention_heads,
                "num_key_value_heads": getattr(config, "num_key_value_heads", config.num_attention_heads)})
    tensors, types = {}, {}
    for tensor in reader.tensors:
        if tensor.name not in to_hf:
            raise ValueError(f"the GGUF holds {tensor.name}, which maps to no parameter of {type(model).__name__}")
        weights = gguf.dequantize(tensor.data, tensor.tensor_type)
        weights = processor.process(weights=weights, name=tensor.name).weights
        key = to_hf[tensor.name]
        tensors[key] = torch.from_numpy(np.array(weights, dtype=np.float32)).reshape(model.state_dict()[key].shape)
        types[key] = tensor.tensor_type.name
    return tensors, types


def rounded_like(model, types: dict[str, str], intermediate: Optional[str] = None
                 ) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The reference's weights rounded as the GGUF stores each one, and the names rounded by proxy.

    gguf-py's quantizers for F16/BF16/Q8_0 (the converter's code); llama.cpp's own for K-quants when
    llama-cpp-python is installed (finetune.export.ggml_quants), else gguf-py's Q4_0/Q5_0/Q8_0 by proxy. A K-quant
    export was quantized from an f16 or bf16 file (`intermediate`), so its tensors are rounded to that first."""
    import gguf

    from finetune.export import ggml_quants

    middle = {"f16": torch.float16, "bf16": torch.bfloat16}.get(intermediate or "")
    out, proxied = {}, set()
    for key, value in model.state_dict().items():
        kind = types.get(key, "F32")
        if kind == "F32":
            out[key] = value.detach().to(torch.float32).clone()
            continue
        tensor = value.detach()
        if middle is not None:
            tensor = tensor.to(middle)
        array = tensor.to(torch.float32).numpy()
        back = ggml_quants.round_trip(array, kind) if kind in _PROXY else None
        if back is None:
            if kind in _PROXY:
                proxied.add(key)
            qtype = gguf.GGMLQuantizationType[_PROXY.get(kind, kind)]
            try:
                back = gguf.quants.dequantize(gguf.quants.quantize(array, qtype), qtype)
            except (NotImplementedError, gguf.quants.QuantError):
                back = array
        out[key] = torch.from_numpy(np.ascontiguousarray(back, dtype=np.float32)).reshape(value.shape)
    return out, proxied


def _rows(model_dir: Path, source, prompt: TrainedPrompt, tokenizer) -> list[list[int]]:
    if source.recipe is not None and objectives.get(source.recipe.objective).pretokenized:  # rows we tokenize
        try:
            from finetune.use.evaluate import eval_rows

            rows, _, _ = eval_rows(source.path, source.recipe, tokenizer, None, lambda s: None)
            picked = [list(r["input_ids"]) for r in rows[:_ROWS] if len(r["input_ids"]) > 1]
            if picked:
                return picked
        except Exception:  # the data moved or changed since training: the fixed prompts below still compare
            pass
    return [list(tokenizer(text, add_special_tokens=specials)["input_ids"]) for text, specials in prompt_texts(prompt)]


def prompt_texts(prompt: TrainedPrompt) -> list[tuple[str, bool]]:
    """Fixed questions in the trained prompt, as text, and whether the tokenizer adds its special tokens to it (a
    chat template writes its own BOS; plain text gets the tokenizer's)."""
    texts = ["What is the capital of France?", "Add 7 and 5.", "Name a primary colour.", "Reverse the word cat."]
    if prompt.chat_template is None:
        return [(text, True) for text in texts]
    return [(render(prompt.chat_template, [{"role": "user", "content": text}], prompt.bos_token, prompt.eos_token,
                    True), False) for text in texts]


def _logits(model, rows: list[list[int]]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(input_ids=torch.tensor([ids])).logits[0].to(torch.float64) for ids in rows]


def compare(reference: list[torch.Tensor], other: list[torch.Tensor]) -> dict[str, float]:
    """Mean KL(reference || other) per position, max |logit difference|, argmax agreement where it is decided."""
    kl_sum, positions, max_diff, decided, agree = 0.0, 0, 0.0, 0, 0
    for ref, oth in zip(reference, other):
        p = torch.log_softmax(ref, -1)
        q = torch.log_softmax(oth, -1)
        kl_sum += float((p.exp() * (p - q)).sum())
        positions += ref.shape[0]
        max_diff = max(max_diff, float((ref - oth).abs().max()))
    for ref, oth in zip(reference, other):
        top = ref.topk(2, -1).values
        margin = top[:, 0] - top[:, 1]
        sure = margin > max_diff
        decided += int(sure.sum())
        agree += int((ref.argmax(-1) == oth.argmax(-1))[sure].sum())
    return {"kl": kl_sum / max(positions, 1), "max_abs_logit_diff": max_diff, "positions": positions,
            "decided_positions": decided, "argmax_agree": agree}


def check_metadata(path: Path, model_config, tokenizer, prompt: TrainedPrompt, context: Optional[int]) -> list[str]:
    """What the GGUF's header says that it should not (an empty list: all as expected)."""
    import gguf

    fields = gguf.GGUFReader(str(path)).fields
    arch = str(fields["general.architecture"].contents())

    def value(key: str) -> Any:
        field_ = fields.get(key)
        return field_.contents() if field_ is not None else None

    problems = []
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    expected = {
        f"{arch}.attention.head_count": text.num_attention_heads,
        f"{arch}.attention.head_count_kv": getattr(text, "num_key_value_heads", text.num_attention_heads),
        f"{arch}.block_count": text.num_hidden_layers,
        "tokenizer.ggml.bos_token_id": tokenizer.bos_token_id,
        "tokenizer.ggml.eos_token_id": tokenizer.eos_token_id,
        "tokenizer.chat_template": prompt.chat_template,
    }
    rope = (getattr(text, "rope_parameters", None) or {}).get("rope_theta") or getattr(text, "rope_theta", None)
    if rope is not None:
        expected[f"{arch}.rope.freq_base"] = float(rope)
    for key, want in expected.items():
        got = value(key)
        if isinstance(want, float) and got is not None:
            ok = abs(float(got) - want) <= 1e-6 * max(1.0, abs(want))
        else:
            ok = got == want
        if want is not None and not ok:
            problems.append(f"{key} is {got!r}, expected {want!r}")
    for key, field_ in fields.items():
        if key.startswith("tokenizer.ggml.") or not field_.types or field_.types[-1] != gguf.GGUFValueType.STRING:
            continue
        contents = field_.contents()
        for item in contents if isinstance(contents, list) else [contents]:
            if isinstance(item, str) and _local_path(item):
                problems.append(f"{key} names a local path ({item})")
    return problems


def _local_path(text: str) -> bool:
    home = os.path.expanduser("~")
    return text.startswith(("/", "~")) or (home != "/" and home in text) or os.getcwd() in text


def verify_export(path: Path, model_dir: Path, source, prompt: TrainedPrompt,
                  intermediate: Optional[str] = None) -> dict[str, Any]:
    """The numbers and the verdict, as export.json keeps them (`why` says what failed). `intermediate`: the f16 or
    bf16 file a K-quant was quantized from."""
    import warnings

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(str(source.tokenizer_dir or model_dir))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    rows = _rows(model_dir, source, prompt, tokenizer)
    reference = _logits(model, rows)
    loaded, types = read_state_dict(path, model)
    missing = sorted(set(model.state_dict()) - set(loaded))
    result: dict[str, Any] = {"rows": len(rows), "types": sorted(set(types.values()))}
    if missing:
        # Tied embeddings have one GGUF tensor for two names.
        tied = getattr(model.config, "tie_word_embeddings", False)
        missing = [m for m in missing if not (tied and m.endswith("lm_head.weight"))]
    if missing:
        return {**result, "ok": False, "why": f"no tensor in the GGUF for {', '.join(missing[:5])}"}
    rounded, proxied = rounded_like(model, types, intermediate)
    exact = all(torch.equal(loaded[k], rounded[k]) for k in loaded if k not in proxied)
    model.load_state_dict(rounded, strict=False)
    expected = compare(reference, _logits(model, rows))
    model.load_state_dict(loaded, strict=False)
    loaded_logits = _logits(model, rows)
    got = compare(reference, loaded_logits)
    bound = _KL_FACTOR * expected["kl"] + _KL_FLOOR
    result.update({"kl": got["kl"], "kl_bound": bound, "rounding_kl": expected["kl"],
                   "max_abs_logit_diff": got["max_abs_logit_diff"], "positions": got["positions"],
                   "decided_positions": got["decided_positions"], "argmax_agree": got["argmax_agree"],
                   "weights_equal_rounding": exact,
                   "rounding": "gguf-py's Q4_0/Q5_0/Q8_0 for the K-quants (llama-cpp-python is not installed)"
                   if proxied else "the quantizers that wrote the file"})
    problems = check_metadata(path, model.config, tokenizer, prompt, None)
    all_f32 = set(types.values()) == {"F32"}
    if all_f32 and got["max_abs_logit_diff"] != 0.0:
        problems.append(f"f32 logits differ (max {got['max_abs_logit_diff']:.3g}); they must be equal")
    if got["kl"] > bound:
        problems.append(f"KL {got['kl']:.3g} > bound {bound:.3g}")
    if got["argmax_agree"] != got["decided_positions"]:
        problems.append(f"argmax differs at {got['decided_positions'] - got['argmax_agree']} positions where the "
                        "reference's margin exceeds the logit difference")
    if not exact:
        problems.append("the weights differ from the reference rounded as the GGUF's types round")
    from finetune.export.runtime import llama_cpp_run

    ran = llama_cpp_run(path, tokenizer, prompt_texts(prompt), rows)
    if ran is not None:
        differ, computed = ran
        numbers = compare(loaded_logits, computed)
        runtime = {"tokens_equal": not differ, "tokens_differ": "; ".join(differ[:2]), "kl": numbers["kl"],
                   "max_abs_logit_diff": numbers["max_abs_logit_diff"],
                   "decided_positions": numbers["decided_positions"], "argmax_agree": numbers["argmax_agree"]}
        result["llama_cpp"] = runtime
        if not runtime["tokens_equal"]:
            problems.append(f"llama.cpp tokenizes the trained prompt differently ({runtime['tokens_differ']})")
        if runtime["argmax_agree"] != runtime["decided_positions"]:
            problems.append(f"llama.cpp's argmax differs at {runtime['decided_positions'] - runtime['argmax_agree']} "
                            "positions where the GGUF's own logits in transformers are decided")
    result["ok"] = not problems
    result["why"] = "; ".join(problems)
    return result
