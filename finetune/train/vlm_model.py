"""A vision-language model as the runner trains it (issue 38): loaded with its image-text class, the tower and
projector frozen unless the recipe's `vision` section opts them in, LoRA on the language model only, and the
image processor that the collator, `finetune chat` and `merge` use.

What trains, by method and `vision` flags:

| | lora / qlora | full |
|---|---|---|
| language model | LoRA adapters on `lora.target_modules` | every weight |
| tower (`freeze_tower: false`) | LoRA adapters on its matching linear layers | every weight |
| projector (`freeze_projector: false`) | trained whole and saved with the adapter (modules_to_save) | every weight |

peft's "all-linear" alone reaches the tower and projector too (and so would `gate_proj`, a name Qwen2.5-VL's tower
blocks share with the language model): the frozen parts go to LoraConfig's `exclude_modules`.

Gradients reach the adapters inside checkpointed layers through the text embeddings' output only:
transformers' enable_input_require_grads also hooks every sub-model's input embeddings, the vision tower's patch
embedding included, which would make a frozen tower save its activations for a backward that updates nothing.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from finetune.vision_models import FAMILIES, VisionModel, recipe_vision


def is_vlm(recipe) -> bool:
    return recipe_vision(recipe, download=True) is not None


def load_vlm(model_path: str, kwargs: dict[str, Any]):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model_path, **kwargs)


def _projector_inside_tower(vm: VisionModel) -> bool:
    return vm.family.projector.startswith(vm.family.tower + ".")


def lora_exclusions(vm: VisionModel, section) -> Optional[str]:
    """LoraConfig.exclude_modules (a regex peft matches against whole module names): the projector always (trained
    whole or not at all), the tower unless `freeze_tower: false`."""
    tower, projector = re.escape(vm.family.tower), re.escape(vm.family.projector)
    patterns = [rf"{projector}(\..*)?"]
    if section.freeze_tower:
        patterns.append(rf"{tower}\..*")
    return "|".join(f"({p})" for p in patterns)


def lora_kwargs(recipe) -> dict[str, Any]:
    """What a VLM adds to the recipe's LoraConfig: exclusions, and the projector as modules_to_save when trained."""
    vm = recipe_vision(recipe)
    if vm is None:
        return {}
    out: dict[str, Any] = {"exclude_modules": lora_exclusions(vm, recipe.vision)}
    if not recipe.vision.freeze_projector:
        out["modules_to_save"] = [*(recipe.lora.modules_to_save or []), vm.family.projector.rsplit(".", 1)[-1]]
    return out


def frozen_prefixes(vm: VisionModel, section) -> tuple[str, ...]:
    """Module-name prefixes whose weights do not train (full fine-tune)."""
    out = []
    if section.freeze_tower:
        out.append(vm.family.tower + ".")
    if section.freeze_projector:
        out.append(vm.family.projector + ".")
    return tuple(out)


def keep_frozen(model, prefixes: tuple[str, ...], unfreeze: tuple[str, ...] = ()) -> int:
    """requires_grad False for the parameters under `prefixes` (not those under `unfreeze`); how many."""
    count = 0
    for name, param in model.named_parameters():
        if name.startswith(prefixes) and not name.startswith(unfreeze):
            param.requires_grad_(False)
            count += 1
    return count


def freeze_for_full(model, recipe) -> None:
    vm = recipe_vision(recipe)
    if vm is None:
        return
    section = recipe.vision
    # Qwen's projector (the merger) lies inside the tower: a frozen tower with a trained projector keeps it.
    unfreeze = (vm.family.projector + ".",) if section.freeze_tower and not section.freeze_projector \
        and _projector_inside_tower(vm) else ()
    keep_frozen(model, frozen_prefixes(vm, section), unfreeze)


def text_inputs_require_grads(model) -> None:
    """Make every later enable_input_require_grads of `model` (transformers' activation_checkpointing_enable calls it,
    so do peft's get_peft_model and the Trainer's checkpointing) hook the text embeddings only: see the module
    docstring. An attribute of this instance, so every caller gets it, whatever wrapper it calls through."""
    import types

    def text_only(self) -> None:
        def make_inputs_require_grads(module, inputs, output):
            output.requires_grad_(True)

        self.disable_input_require_grads()
        self._require_grads_hooks = [self.get_input_embeddings().register_forward_hook(make_inputs_require_grads)]

    model.enable_input_require_grads = types.MethodType(text_only, model)
    # The frozen tower's blocks are checkpointing layers too: under reentrant checkpointing (LoRA + ZeRO-3) torch
    # warns on every step that none of their inputs requires a gradient, which is the point of a frozen tower.
    import warnings

    warnings.filterwarnings("ignore", message="None of the inputs have requires_grad=True", category=UserWarning)


# ------------------------------------------------------------------------------------------------
# The image processor


def image_processor_kwargs(vm: VisionModel) -> dict[str, Any]:
    """The recipe's size limits as the image processor's settings (Qwen: size {shortest_edge, longest_edge})."""
    if not FAMILIES[vm.sizing.family].dynamic:
        return {}
    return {"size": {"shortest_edge": vm.sizing.min_pixels, "longest_edge": vm.sizing.max_pixels}}


def load_image_processor(model_path: str, vm: VisionModel, revision: Optional[str] = None):
    """transformers' image processor of the model (torchvision's backend where installed, else Pillow's: the
    Qwen-VL processor classes need torchvision in transformers 5.24, their image processors do not)."""
    from transformers import AutoImageProcessor

    kwargs = {"revision": revision} if revision else {}
    return AutoImageProcessor.from_pretrained(model_path, **kwargs, **image_processor_kwargs(vm))


def save_processor_files(image_processor, vm: VisionModel, folder) -> None:
    """The image processor's settings as trained (the recipe's size limits) beside the tokenizer: a run's
    tokenizer/ (and a merged model) load as the model's processor. LLaVA's in processor_config.json with the
    processor's own settings, as transformers 5 writes it (the image processor nested in it)."""
    import json
    from pathlib import Path

    if vm.family.name != "llava":
        image_processor.save_pretrained(str(folder))
        return
    from finetune.fsutil import write_atomic
    from finetune.vision_models import PROCESSOR_CONFIG

    settings = {"processor_class": "LlavaProcessor", "image_token": vm.family.image_token,
                "patch_size": vm.sizing.patch, "vision_feature_select_strategy":
                    vm.config.get("vision_feature_select_strategy", "default"),
                "num_additional_image_tokens": _additional_tokens(vm), "image_processor": image_processor.to_dict()}
    write_atomic(Path(folder) / PROCESSOR_CONFIG, json.dumps(settings, indent=2, default=str) + "\n")


def _additional_tokens(vm: VisionModel) -> int:
    """num_additional_image_tokens that gives the sizing's fixed count (the class token LLaVA-1.5 adds back)."""
    base = (vm.sizing.crop // vm.sizing.patch) ** 2
    drop = 1 if vm.config.get("vision_feature_select_strategy", "default") == "default" else 0
    return vm.sizing.fixed_tokens - base + drop


# ------------------------------------------------------------------------------------------------
# What the runner (finetune.train.runner) swaps for a VLM


def vision_collator(recipe, model_path: str, tokenizer):
    """(the collator of a VLM's micro batches, the image processor), or (None, None) for a text model."""
    vm = recipe_vision(recipe)
    if vm is None:
        return None, None
    from finetune.train.vlm_collator import VisionCollator

    processor = load_image_processor(model_path, vm, recipe.model.revision)
    return VisionCollator(processor, vm, tokenizer.pad_token_id), processor


def install_guard(model, recipe, world_size: int):
    """finetune.train.vlm_guard's hooks when vision.tower_guard asks for them at this world size, else None."""
    from finetune.train.vlm_guard import TowerGuard, wants_guard

    vm = recipe_vision(recipe)
    if vm is None or not wants_guard(recipe.vision.tower_guard, world_size):
        return None
    return TowerGuard(model, vm).install()
