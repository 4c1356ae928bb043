"""Which family a recipe's model is, without torch and without the hub: lint, render and the runner agree.

A `builtin:` model's config, a local directory's config.json, or else the hub id's name matched against the
families' published names (`Qwen/Qwen3-30B-A3B` -> qwen3_moe). None when none of them tells.

    >>> identify("Qwen/Qwen3-30B-A3B").model_type
    'qwen3_moe'
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from finetune.builtin import BuiltinModelError, builtin_config, is_builtin
from finetune.models.families import Family, family, family_by_name
from finetune.recipe.references import MODEL_CONFIG, is_local

# Keys each family's config uses for its number of routed experts (Mixtral/gpt-oss, Qwen-MoE, DeepSeek).
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


@dataclass(frozen=True)
class ModelIdentity:
    model_type: Optional[str]
    family: Optional[Family]
    experts: Optional[int]  # routed experts per MoE layer; 0 dense; None unknown (a hub id: the name says MoE)
    source: str  # where it was read: "builtin", the config.json path, or "the name <id>"
    config: Optional[dict[str, Any]] = None  # the config.json when one was read

    @property
    def moe(self) -> bool:
        return bool(self.experts) or (self.experts is None and self.family is not None and self.family.moe)


def identify(name_or_path: str) -> Optional[ModelIdentity]:
    """The model's family, read from what is on this machine (see the module's docstring)."""
    config = read_config(name_or_path)
    if config is not None:
        config, source = config
        model_type = config.get("model_type") if isinstance(config.get("model_type"), str) else None
        return ModelIdentity(model_type, family(model_type), expert_count(config), source, config)
    fam = family_by_name(name_or_path)
    if fam is None:
        return None
    return ModelIdentity(fam.model_type, fam, None if fam.moe else 0, f"the name {name_or_path}")


def read_config(name_or_path: str) -> Optional[tuple[dict[str, Any], str]]:
    """(config dict, where) for a built-in model or a local directory with a readable config.json, else None."""
    if is_builtin(name_or_path):
        try:
            return builtin_config(name_or_path), "builtin"
        except BuiltinModelError:
            return None
    if not is_local(name_or_path):
        return None
    path = Path(name_or_path).expanduser() / MODEL_CONFIG
    from finetune.fsutil import read_json

    try:
        data = read_json(path)  # a FIFO or a link to a device there is refused, never read (issue 40)
    except (OSError, ValueError):
        return None
    return (data, str(path)) if isinstance(data, dict) else None


def expert_count(config: dict[str, Any]) -> int:
    for key in _EXPERT_KEYS:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0
