"""The checkpoint tensor a module's weight is stored under, through transformers' own key mapping (issue 38).

transformers 5 names the modules of some models in a new layout while their checkpoints keep the old tensor
names: Qwen2.5-VL's language model is `model.language_model.layers.*` in the model (and in a peft adapter
trained on it) but `model.layers.*` in its safetensors, its tower `model.visual.*` against `visual.*`; LLaVA's
`model.language_model.*` against `language_model.model.*`. from_pretrained renames each checkpoint key with the
conversion mapping registered for the model's class (then its model_type) in transformers.conversion_mapping,
and save_pretrained writes the old names back. The merge reads the checkpoint's names, so it renames them the
same way, with the same functions (get_checkpoint_conversion_mapping, rename_source_key), to find the tensor an
adapter's module updates; the merged model keeps the checkpoint's names, as save_pretrained would write them.

Only renamings are followed. A conversion that fuses or splits tensors (a WeightConverter: MoE experts) has no
one tensor per module name; those keys keep their checkpoint names. transformers is imported only for a base
whose names an adapter does not match as they are (the merge otherwise needs torch and safetensors alone).
"""

from __future__ import annotations

from typing import Optional

from finetune.weights.safetensors_io import BaseModel, MergeError


def _transforms(config: dict) -> list:
    """The conversion mapping transformers registers for this model: by class name first, then model_type."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        raise MergeError("this base model's checkpoint names its tensors in an older layout than its modules; "
                         "mapping them needs transformers (pip install 'finetune[vision]')") from None
    for key in [*(config.get("architectures") or []), config.get("model_type")]:
        found = get_checkpoint_conversion_mapping(key) if isinstance(key, str) else None
        if found:
            return found
    return []


def model_names(base: BaseModel) -> dict[str, str]:
    """{the model's name of a tensor: its name in the checkpoint}, for the tensors whose names differ."""
    cached = base.__dict__.get("_model_names")
    if cached is not None:
        return cached
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    renamings = [t for t in _transforms(base.config) if isinstance(t, WeightRenaming)]
    names: dict[str, str] = {}
    if renamings:
        for name in base.tensors:
            renamed, _ = rename_source_key(name, renamings, [])
            if renamed != name:
                names[renamed] = name
    base.__dict__["_model_names"] = names
    return names


def checkpoint_name(base: BaseModel, name: str) -> Optional[str]:
    """The checkpoint tensor the model calls `name`, when the checkpoint keeps another layout; else None."""
    if not (base.config.get("architectures") or base.config.get("model_type")):
        return None
    return model_names(base).get(name)
