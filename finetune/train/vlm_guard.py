"""Every micro batch enters the vision tower, with or without images (issue 38; LLaMA-Factory #5616).

Under ZeRO-3 each module gathers its partitioned parameters as forward (and backward) enters it, a collective
every rank must join in the same order. A rank whose micro batch has no image never enters the tower, while a
rank with one does: their gathers fall out of step and the run hangs (or fails at the collective timeout).
Counted without a process group on the tiny Qwen2.5-VL, in the order modules owning parameters are entered:
39 with an image, 21 without.

The guard: a hook on the text embeddings runs the tower (and projector) on a dummy image whenever the model's
forward got no pixel_values, and adds its output times zero to the embeddings. The module sequence is then the
image batch's (embeddings, tower, projector, language model), the loss and the logits are unchanged (zero is
added), and a trained tower gets zero gradients on that rank instead of none (ZeRO's gradient reduction expects
every rank's). LLaMA-Factory puts a masked dummy image in the data instead; ms-swift runs a dummy tower forward.
`vision.tower_guard: auto` installs it when more than one process trains (finetune.train.runner).
"""

from __future__ import annotations

from typing import Any

from finetune.vision_models import VisionModel


def multimodal_model(model):
    """The model's inner image-text module (Qwen2_5_VLModel, LlavaModel): the one whose forward takes
    pixel_values and that runs the tower; found under a peft or DeepSpeed wrapper too."""
    for module in model.modules():
        name = type(module).__name__
        # the class's own method: peft's LoraModel forwards every attribute to the model it wraps
        if hasattr(type(module), "get_image_features") and name.endswith("Model") and "For" not in name:
            return module
    raise ValueError(f"{type(model).__name__} has no image-text module with get_image_features")


def dummy_inputs(vm: VisionModel, inner, device) -> dict[str, Any]:
    """The smallest image the tower takes, as processor output: Qwen one merged token (2 x 2 patches of zeros),
    LLaVA one image of its fixed size."""
    import torch

    dtype = next(inner.parameters()).dtype
    if vm.family.name == "qwen2_5_vl":
        side = vm.sizing.merge
        return {"pixel_values": torch.zeros(side * side, vm.tower.patch_dim, dtype=dtype, device=device),
                "image_grid_thw": torch.tensor([[1, side, side]], device=device)}
    config = inner.config
    return {"pixel_values": torch.zeros(1, 3, vm.sizing.crop, vm.sizing.crop, dtype=dtype, device=device),
            "vision_feature_layer": config.vision_feature_layer,
            "vision_feature_select_strategy": config.vision_feature_select_strategy}


def _pooled(output) -> Any:
    import torch

    pooled = output.pooler_output if hasattr(output, "pooler_output") else output
    return torch.cat(list(pooled)) if isinstance(pooled, (list, tuple)) else pooled


class TowerGuard:
    """install() the hooks; remove() them. `dummy_runs` counts the zero-weighted tower forwards."""

    def __init__(self, model, vm: VisionModel):
        self.inner = multimodal_model(model)
        self.vm = vm
        self.pending = False
        self.dummy_runs = 0
        self.handles: list[Any] = []

    def install(self) -> "TowerGuard":
        self.handles = [self.inner.register_forward_pre_hook(self._before, with_kwargs=True),
                        self.inner.get_input_embeddings().register_forward_hook(self._after_embeddings)]
        return self

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _before(self, module, args, kwargs) -> None:
        self.pending = kwargs.get("pixel_values") is None and kwargs.get("mm_encoder_outputs") is None

    def _after_embeddings(self, module, inputs, output):
        if not self.pending:
            return output
        self.pending = False
        self.dummy_runs += 1
        features = _pooled(self.inner.get_image_features(**dummy_inputs(self.vm, self.inner, output.device)))
        return output + features.sum().to(output.dtype) * 0.0


def wants_guard(setting: str, world_size: int) -> bool:
    return setting == "always" or (setting == "auto" and world_size > 1)
