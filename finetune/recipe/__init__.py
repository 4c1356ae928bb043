"""The recipe: one YAML file that is the single source of truth for a fine-tuning run.

This package holds the schema (`schema`) (pydantic: defaults, types, docs and validation in one place) and
loading (`loading`): YAML with line numbers, `extends:` chains, `--set a.b=value` overrides, and error
reports that name the file, line and key. It never imports torch.

A minimal recipe:

    model: {name_or_path: meta-llama/Meta-Llama-3-8B-Instruct}
    method: qlora
    data: {path: data/alpaca.jsonl, format: alpaca}
    deepspeed: {stage: 3}
"""

from finetune.recipe.loading import (
    RecipeProblem, Problem, LoadedRecipe, MAX_EXTENDS, load_recipe, apply_set, validate, PEER_KEYS, unknown_key_fix,
)
from finetune.recipe.schema import (
    Dtype, Offload, MAX_BATCH, MAX_COUNT, MAX_PROCS, MAX_ELEMENTS, MAX_SECONDS, parse_size, NAME_MAX, PATH_MAX,
    plain_path, ModelSection, LoraSection, QuantizationSection, known_roles, DataFormat, SourceSection, DataSection,
    PREFERENCE_OBJECTIVES, DPO_LOSSES, KTO_LOSSES, ReferenceSection, PreferenceSection, RewardSection, GrpoSection,
    TrainingSection,
    DeepSpeedSection, LaunchSection, HardwareSection, Recipe, section_model, json_schema,
)

__all__ = [
    "DPO_LOSSES", "KTO_LOSSES", "MAX_BATCH", "MAX_COUNT", "MAX_ELEMENTS", "MAX_EXTENDS", "MAX_PROCS", "MAX_SECONDS",
    "NAME_MAX", "PATH_MAX", "PEER_KEYS", "PREFERENCE_OBJECTIVES", "apply_set", "DataFormat", "DataSection",
    "DeepSpeedSection", "Dtype", "HardwareSection", "json_schema", "known_roles", "LaunchSection", "load_recipe",
    "LoadedRecipe", "LoraSection", "ModelSection", "Offload", "parse_size", "plain_path", "PreferenceSection",
    "Problem", "QuantizationSection", "RewardSection", "GrpoSection", "Recipe", "RecipeProblem", "ReferenceSection", "section_model",
    "SourceSection", "TrainingSection", "unknown_key_fix", "validate",
]
