"""Tiny models, adapters and real DeepSpeed checkpoints for the merge and convert tests.

Everything is random-init and local (no hub). The builders are plain functions; the bottom of the
file is also a script that torchrun launches to make a real multi-process ZeRO checkpoint:

    torchrun --nproc_per_node 2 tests/weights/merge_fixtures.py train --base BASE --out OUT --stage 3 --method lora
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, Optional

# Shape of the toy Llama: 2 layers, hidden 64, vocab 128 (grouped-query attention, 4 heads / 2 kv heads,
# so k_proj/v_proj are 32 x 64 and a transposed adapter cannot line up by accident).
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)


def build_tokenizer(path: Path) -> None:
    """A word-level tokenizer over TINY's vocabulary, saved the way transformers saves one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, TINY["vocab_size"])})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(str(path))


def build_llama(path: Path, dtype: str = "bfloat16", tie: bool = False, seed: int = 0,
                max_shard_size: Optional[str] = None, tokenizer: bool = True, **overrides: Any) -> Path:
    """Save a random-init tiny LlamaForCausalLM (safetensors) with a tokenizer; returns `path`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY, **overrides}, tie_word_embeddings=tie)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), **kwargs)
    if tokenizer:
        build_tokenizer(path)
    return Path(path)


def build_gpt2(path: Path, seed: int = 0) -> Path:
    """A tiny GPT-2: its attention and MLP are Conv1D layers, stored (in, out), so LoRA uses fan_in_fan_out."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64)
    GPT2LMHeadModel(config).to(torch.bfloat16).save_pretrained(str(path))
    return Path(path)


def build_adapter(base: Path, path: Path, seed: int = 1, **lora: Any) -> Path:
    """Save a PEFT LoRA adapter for `base` whose weights are all non-zero (B is zero at init)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base))
    lora.setdefault("r", 4)
    lora.setdefault("lora_alpha", 8)
    lora.setdefault("target_modules", "all-linear")
    peft_model = get_peft_model(model, LoraConfig(**lora))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if param.requires_grad:
                # Large enough that a wrong scale or a missed layer changes the bf16 result.
                param.copy_(torch.randn_like(param) * (0.5 if "lora_" in name else 1.0))
    peft_model.save_pretrained(str(path))
    # Record the local base like a real run does (PEFT writes the from_pretrained id here).
    config_path = Path(path) / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = str(base)
    config_path.write_text(json.dumps(config, indent=2))
    return Path(path)


def peft_merged_state_dict(base: Path, adapter: Path, dtype: Optional[str] = None) -> dict:
    """The reference: PEFT's merge_and_unload on the whole model, then the state dict save_pretrained writes."""
    import tempfile

    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": getattr(torch, dtype)} if dtype else {"dtype": "auto"}
    model = AutoModelForCausalLM.from_pretrained(str(base), **kwargs)
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    with tempfile.TemporaryDirectory() as tmp:
        merged.save_pretrained(tmp, max_shard_size="100GB")
        return load_file(os.path.join(tmp, "model.safetensors"))


# ------------------------------------------------------------------------------------------------
# Real ZeRO checkpoints: this file run under torchrun (2 processes, DeepSpeed on its CPU accelerator).


def assert_same(ours: dict, reference: dict) -> None:
    """The same tensor names, dtypes and values, bit for bit."""
    import torch

    assert sorted(ours) == sorted(reference)
    for name, expected in reference.items():
        assert ours[name].dtype == expected.dtype, name
        assert torch.equal(ours[name], expected), f"{name} differs"


def safetensors_data_bytes(path: Path) -> int:
    """The tensor bytes of a safetensors file: its size less the 8-byte length and the header."""
    with open(path, "rb") as handle:
        header = int.from_bytes(handle.read(8), "little")
    return path.stat().st_size - 8 - header


def ds_config(stage: int) -> dict:
    zero: dict = {"stage": stage}
    if stage == 3:
        # So trainer.save_model writes real weights, the reference the converted checkpoint must equal.
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    return {
        "zero_optimization": zero,
        "bf16": {"enabled": "auto"},
        # torch_adam: FusedAdam needs a CUDA build; the CPU accelerator runs torch's AdamW.
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
    }


def train(base: Path, out: Path, stage: int, method: str, steps: int = 3) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=2, learning_rate=5e-2,
        save_strategy="steps", save_steps=steps, logging_steps=1, report_to=[], bf16=True,
        deepspeed=ds_config(stage), seed=0, save_only_model=False, dataloader_num_workers=0,
        disable_tqdm=True, use_cpu=True,
    )
    # TrainingArguments(deepspeed=...) above registers the ZeRO-3 config, so from_pretrained builds the
    # model inside zero.Init (partitioned from the start) as a real run does. With use_cpu the arguments
    # do not start the process group, and zero.Init would then see a world of 1 and fail its batch check.
    import deepspeed

    deepspeed.init_distributed()
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.bfloat16)
    if method == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                 modules_to_save=["lm_head"], lora_dropout=0.0),
                               # One dtype for every trainable tensor: ZeRO-3 flattens them into one buffer.
                               autocast_adapter_dtype=False)
    else:
        # A frozen tensor in a full fine-tune: DeepSpeed checkpoints it apart from the optimizer's partitions
        # (frozen_param_fragments), and conversion has to find it there.
        model.model.embed_tokens.weight.requires_grad_(False)
    generator = torch.Generator().manual_seed(0)
    data = torch.randint(3, TINY["vocab_size"], (16, 16), generator=generator)
    dataset = [{"input_ids": row, "labels": row} for row in data]
    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    trainer.train()
    trainer.save_model(str(out / "final"))
    torch.distributed.barrier()
    from finetune.train.shutdown import close_process_group

    close_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train")
    t.add_argument("--base", type=Path, required=True)
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--stage", type=int, default=3)
    t.add_argument("--method", choices=["lora", "full"], default="lora")
    t.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    train(args.base, args.out, args.stage, args.method, args.steps)


if __name__ == "__main__":
    from finetune.train.shutdown import run_as_rank

    # Ends like a real rank: without it a gloo thread can abort a rank that succeeded (finetune/train/shutdown.py).
    run_as_rank(main)
