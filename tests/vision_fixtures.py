"""Helpers of the vision-language tests: the tiny VLMs' recipes, prepared rows and the pieces the runner uses.

    recipe = vlm_recipe("tiny-qwen2.5-vl", data_file)           # a Recipe on a local data file
    rows, collator, model = vlm_pieces(recipe, cache)          # tokenized rows, our collator, the prepared model
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def vlm_recipe(name: str, data_file: Path, **sections: Any):
    from finetune.recipe import Recipe

    base = {"model": {"name_or_path": f"builtin:{name}", "dtype": "float32"},
            "data": {"path": str(data_file), "format": "messages", "max_length": 64},
            "lora": {"r": 8, "alpha": 16, "dropout": 0.0}, "training": {"gradient_checkpointing": False}}
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return Recipe.model_validate(base)


def tokenized(recipe, cache: Path):
    """(tokenizer, model directory, the recipe's rows as finetune.data.prepare makes them)."""
    from finetune.builtin import ensure_builtin_model
    from finetune.data.prepare import tokenize_for_training
    from finetune.data.spec import DataSpec
    from finetune.tokenizer import load_tokenizer

    before = os.environ.get("FINETUNE_CACHE")
    os.environ["FINETUNE_CACHE"] = str(cache)
    try:
        path = str(ensure_builtin_model(recipe.model.name_or_path, cache))
        tokenizer = load_tokenizer(recipe, path)
        rows = tokenize_for_training(DataSpec.of(recipe), tokenizer, cache / "tokenized", log=lambda s: None)
    finally:
        if before is None:
            os.environ.pop("FINETUNE_CACHE")
        else:
            os.environ["FINETUNE_CACHE"] = before
    return tokenizer, path, rows


def vlm_pieces(recipe, cache: Path):
    """(tokenizer, rows, our collator, the model as finetune.train.model prepares it, in train mode)."""
    from finetune.train.model import load_model, prepare_model
    from finetune.train.vlm_model import vision_collator

    tokenizer, path, rows = tokenized(recipe, cache)
    collator, _ = vision_collator(recipe, path, tokenizer)
    model = prepare_model(load_model(recipe, path), recipe)
    model.train()
    return tokenizer, rows, collator, model


def entered_modules(model, batch) -> list[str]:
    """The modules owning parameters, in the order forward and backward enter them (ZeRO-3 gathers in this order)."""
    order: list[str] = []
    hooks = [module.register_forward_pre_hook(lambda m, a, name=name: order.append(name))
             for name, module in model.named_modules() if any(True for _ in module.parameters(recurse=False))]
    try:
        model(**batch).loss.backward()
    finally:
        for hook in hooks:
            hook.remove()
    return order


def saved_bytes(model, run) -> int:
    """Bytes autograd saves for backward while `run()` goes forward: distinct storages, parameters left out
    (a linear layer's weight is saved by reference, it allocates nothing)."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    total = 0

    def pack(tensor):
        nonlocal total
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in params and pointer not in seen:
            seen.add(pointer)
            total += tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return total
