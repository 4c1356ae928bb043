"""Recipe rules for vision-language models (R170-R175, issue 38): what a VLM recipe cannot do yet, keys that do
nothing for its model, and what an image costs in tokens.

The model is recognised from its config.json without torch (finetune.vision_models): a local directory, a
`builtin:` tiny VLM, the Hugging Face cache, or the published configs finetune knows. A hub model that is none of
these is not checked here (preflight reads it at launch).
"""

from __future__ import annotations

from typing import Iterator, Optional

from finetune import objectives
from finetune.lint.deepspeed.context import RawFinding
from finetune.lint.recipe_rules import RULES, rule
from finetune.recipe import LoadedRecipe
from finetune.recipe.schema import VisionSection
from finetune.vision_models import FAMILIES, VisionModel, VisionModelError, recipe_vision

VISION_RULES: dict[str, str] = {
    "R170": "Packing or padding_free with a vision-language model (a packed row would separate images from their tokens).",
    "R171": "A vision-language model family finetune does not support yet (supported: Qwen2.5-VL, LLaVA).",
    "R172": "A vision-language model with what its rows cannot do yet: an objective other than sft, parallel.sequence or parallel.tensor.",
    "R173": "A `vision` key that does nothing: a text model, or an image-size limit for LLaVA's fixed-size images.",
    "R174": "data.max_length at or below what one image can cost: rows with such images are dropped.",
    "R175": "What an image costs in tokens (info).",
}
RULES.update(VISION_RULES)
SIZE_KEYS = ("max_pixels", "min_pixels", "max_image_tokens")


def _vision(loaded: LoadedRecipe) -> tuple[Optional[VisionModel], Optional[str]]:
    try:
        return recipe_vision(loaded.recipe), None
    except VisionModelError as exc:
        return None, str(exc)


def _set_keys(loaded: LoadedRecipe) -> list[str]:
    """The `vision` keys set away from their defaults (a run directory's recipe.yaml writes every section out,
    defaults included, and must lint as its recipe did)."""
    raw = loaded.raw.get("vision") if isinstance(loaded.raw.get("vision"), dict) else {}
    defaults = VisionSection.model_fields
    return [key for key, value in raw.items() if key in defaults and value != defaults[key].default]


@rule
def vision_model(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    r = loaded.recipe
    vm, unsupported = _vision(loaded)
    if unsupported:
        yield RawFinding("R171", "error", ("model", "name_or_path"), unsupported,
                         "use a Qwen2.5-VL or LLaVA-1.5 model, or follow issue 38 for more families")
        return
    written = _set_keys(loaded)
    if vm is None:
        if written and _model_known(r.model.name_or_path):
            yield RawFinding("R173", "warning", ("vision", written[0]),
                             f"`vision` does nothing: {r.model.name_or_path} is a text model (no vision_config in its "
                             "config.json)", "remove the vision section")
        return
    for key in ("packing", "padding_free"):
        if getattr(r.data, key):
            yield RawFinding("R170", "error", ("data", key), f"data.{key} with a vision-language model: a row's images "
                             "travel with its tokens, which packing would mix with other rows'", f"set data.{key}: false")
    if not objectives.get(r.objective).vision:
        yield RawFinding("R172", "error", ("objective",), f"objective {r.objective} with a vision-language model: only "
                         "sft reads rows with images so far (TRL's trainers would drop the images)", "use objective: sft")
    for key in ("sequence", "tensor"):
        if getattr(r.parallel, key) > 1:
            yield RawFinding("R172", "error", ("parallel", key), f"parallel.{key} with a vision-language model is not "
                             "supported: the tower's image tokens would be split across processes", f"set parallel.{key}: 1")
    if not FAMILIES[vm.family.name].dynamic:
        for key in SIZE_KEYS:
            if key in written:
                yield RawFinding("R173", "warning", ("vision", key), f"vision.{key} does nothing for {vm.family.name}: "
                                 f"{vm.sizing.describe()}", f"remove vision.{key}")
    if vm.sizing.max_tokens >= r.data.max_length:
        yield RawFinding("R174", "warning", ("data", "max_length"),
                         f"one image can cost {vm.sizing.max_tokens:,} tokens, data.max_length is {r.data.max_length:,}: "
                         "rows with such an image are dropped (never cut inside an image)",
                         "raise data.max_length or lower vision.max_pixels / vision.max_image_tokens")
    yield RawFinding("R175", "info", ("model", "name_or_path"), vm.describe())


def _model_known(name: str) -> bool:
    """Whether this machine can tell the model is a text model (its config.json, or a built-in)."""
    from finetune.builtin import is_builtin
    from finetune.vision_models import model_files

    return is_builtin(name) or model_files(name) is not None
