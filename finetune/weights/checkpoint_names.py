"""The checkpoint tensor a module's weight is stored under, through transformers' own key mapping (issue 38).

transformers 5 names the modules of some models in a new layout while their checkpoints keep the old tensor
names: Qwen2.5-VL's language model is `model.language_model.layers.*` in the model (and in a peft adapter
trained on it) but `model.layers.*` in its safetensors, its tower `model.visual.*` against `visual.*`; LLaVA's
`model.language_model.*` against `language_model.model.*`. from_pretrained renames each checkpoint key with the
conversion mappings registered for the model's class and its sub-models in transformers.conversion_mapping, and
save_pretrained writes the old names back. The merge reads the checkpoint's names, so it renames them the same
way, with the same functions (get_model_conversion_mapping on the model built on the meta device, no memory;
rename_source_key), to find the tensor an adapter's module updates; the merged model keeps the checkpoint's
names, as save_pretrained would write them.

Only renamings are followed. A conversion that fuses or splits tensors (a WeightConverter: MoE experts) has no
one tensor per module name; those keys keep their checkpoint names. transformers is imported only for a base
whose names an adapter does not match as they are (the merge otherwise needs torch and safetensors alone).
"""

from __future__ import annotations

from typing import Optional

from finetune.weights.errors import MergeError
from finetune.weights.safetensors_io import BaseModel


def _model_on_meta(base: BaseModel):
    """The base's model class built on the meta device (no memory, no weights): what from_pretrained builds."""
    try:
        import torch
        import transformers
    except ImportError:
        raise MergeError("this base model's checkpoint names its tensors in an older layout than its modules; "
                         "mapping them needs transformers (pip install 'finetune[vision]')") from None
    architecture = (base.config.get("architectures") or [None])[0]
    model_class = getattr(transformers, architecture, None) if isinstance(architecture, str) else None
    if model_class is None:
        return None
    config = transformers.AutoConfig.from_pretrained(str(base.path))
    with torch.device("meta"):
        return model_class._from_config(config)


def model_names(base: BaseModel) -> dict[str, str]:
    """{the model's name of a tensor: its name in the checkpoint}, for the tensors whose names differ: each
    checkpoint key renamed as from_pretrained renames it (the conversions of the model and of its sub-models,
    scoped to them, with the base-model prefix added or dropped where the model needs it)."""
    cached = base.__dict__.get("_model_names")
    if cached is not None:
        return cached
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    names: dict[str, str] = {}
    model = _model_on_meta(base)
    if model is not None:
        renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
        meta = model.state_dict()
        for name in base.tensors:
            renamed, _ = rename_source_key(name, renamings, [], model.base_model_prefix, meta)
            if renamed != name and renamed in meta:
                names[renamed] = name
    base.__dict__["_model_names"] = names
    return names


def checkpoint_name(base: BaseModel, name: str) -> Optional[str]:
    """The checkpoint tensor the model calls `name`, when the checkpoint keeps another layout; else None."""
    if not base.config.get("architectures"):
        return None
    return model_names(base).get(name)
