"""A vision-language model's tower and projector in the plan (issue 38).

Image tokens are part of the language model's sequence: data.max_length bounds text and image tokens together
(finetune.data.vision_encode), so the sequence length, the logits and the loss the planner already sizes hold
them. What the language-model planner does not see is here:

- the tower's and projector's weights (frozen 16-bit, partitioned under ZeRO-3 like the rest), their gradients
  and optimizer states when the recipe trains them (`vision.freeze_tower` / `freeze_projector: false`), LoRA
  adapters on the tower's linear layers;
- the activations a trained tower saves for backward, per patch it runs on. A frozen tower saves none: its
  weights need no gradient and its input (the pixels) none either, so autograd keeps nothing (finetune keeps
  transformers' input-gradient hook off the tower's patch embedding: finetune.train.vlm_model). Counted from
  torch's saved tensors on CPU (tests/models/test_vision.py checks these within 2%), per patch, e = bytes of
  the dtype, h / i the tower's width and MLP width, H its heads, d = h / H:
  - Qwen2.5-VL, a block trained in full: (8 + 11e)h + 4e i + 4H + 8 (the RMSNorms' fp32 copies and rsqrt, the
    qkv output, the fp32 rotary products of q and k, attention's output and log-sum-exp, the SwiGLU's three
    i-wide tensors and down_proj's input); with LoRA on its linear layers (8 + 9e)h + 4e i + 4H + 8 + 5 r e;
    checkpointed, e h (the block's input). Outside the blocks: the patches' pixels (3 x 2 x 14 x 14 e) and the
    rotary table (8d) when the patch embedding trains, the merger's RMSNorm and MLP inputs.
  - LLaVA's CLIP, a layer trained in full: 8e h + 3e i + 4H + 4e per position (patches and the class token);
    checkpointed e h; the layers after vision_feature_layer run but their outputs are dropped. With LoRA on its
    layers the same plus r e per adapter: an estimate, not checked against torch (the tests check full training).
- how many patches: a micro batch's rows filled with image tokens up to data.max_length (or the data's largest
  image-token count per row, when `finetune plan` reads the data), times merge^2 patches per token (Qwen) or the
  tower's positions per image (LLaVA). Only a trained tower's activations depend on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from finetune.plan.setup import Setup, Term
from finetune.vision_models import TowerShape, VisionModel


@dataclass(frozen=True)
class VisionSetup:
    tower: TowerShape
    family: str
    tower_mode: str  # "frozen" | "full" | "lora"
    projector_trained: bool
    adapted: tuple[str, ...]  # the tower's block linears with LoRA adapters (tower_mode lora)
    patches: int  # patches (LLaVA: positions) the tower runs on per row of a micro batch
    image_tokens: int  # image tokens per row the patches were sized for
    describe: str  # what an image costs in tokens


def vision_setup(recipe: Any, vm: Optional[VisionModel], seq_len: int,
                 image_tokens: Optional[int] = None) -> Optional[VisionSetup]:
    """The recipe's vision part as the planner sizes it (None for a text model). `image_tokens`: the most image
    tokens a row of the data holds, when known; else rows full of image tokens (the worst case)."""
    if vm is None:
        return None
    section, tower = recipe.vision, vm.tower
    mode = "frozen" if section.freeze_tower else ("full" if recipe.method == "full" else "lora")
    targets = recipe.lora.target_modules
    adapted = tuple(name for name, _, _ in tower.block_linears()
                    if targets == "all-linear" or name.rsplit(".", 1)[-1] in targets) if mode == "lora" else ()
    tokens = min(seq_len, image_tokens if image_tokens is not None else seq_len)
    if vm.family.dynamic:
        patches = tokens * vm.sizing.merge ** 2
    else:
        patches = tokens // max(1, vm.sizing.fixed_tokens) * tower.positions
    return VisionSetup(tower, vm.family.name, mode, not section.freeze_projector, adapted, patches, tokens,
                       vm.sizing.describe())


# ------------------------------------------------------------------------------------------------
# Parameters


def vision_groups(setup: Setup) -> list[dict[str, Any]]:
    """The tower's and projector's parameters, as finetune.plan.params.ParamGroup's keyword arguments (trainable or
    not, LoRA adapters on the tower, the projector's trained copy beside LoRA)."""
    v = setup.vision
    if v is None:
        return []
    t = v.tower
    full_tower = v.tower_mode == "full"
    lora = setup.method != "full"

    def group(name: str, numel: int, count: int, trainable: bool, unit: str, **extra: Any) -> dict[str, Any]:
        return {"name": name, "numel": numel, "count": count, "trainable": trainable, "unit": unit, **extra}

    out = [group(f"vision {name}", rows * cols, 1, full_tower, f"vision.{name.rsplit('.', 1)[0]}")
           for name, rows, cols in t.outer_tensors()]
    out += [group(f"vision block {name}", rows * cols, t.depth, full_tower, f"vision.block.{name.rsplit('.', 1)[0]}",
                  per_layer=True, in_features=cols if name.endswith(".weight") and cols > 1 else 0)
            for name, rows, cols in t.block_tensors()]
    r = setup.lora_r
    for name, inp, outp in t.block_linears():
        if name in v.adapted:
            out += [group(f"vision block {name}.lora_A", r * inp, t.depth, True, f"vision.block.{name}.lora_A", per_layer=True),
                    group(f"vision block {name}.lora_B", outp * r, t.depth, True, f"vision.block.{name}.lora_B", per_layer=True)]
    # the projector: trained whole (full fine-tune), or a trained copy beside the frozen one (LoRA: modules_to_save)
    out += [group(f"projector {name}", rows * cols, 1, v.projector_trained and not lora, f"projector.{name.rsplit('.', 1)[0]}")
            for name, rows, cols in t.projector_tensors()]
    if v.projector_trained and lora:
        out += [group(f"projector {name} copy (modules_to_save)", rows * cols, 1, True,
                      f"projector.{name.rsplit('.', 1)[0]}.copy") for name, rows, cols in t.projector_tensors()]
    return out


# ------------------------------------------------------------------------------------------------
# Activations


def saved_per_patch(tower: TowerShape, mode: str, projector_trained: bool, e: int, checkpointing: bool,
                    lora_r: int = 0, adapted: int = 0) -> float:
    """Bytes a trained tower (and the projector after it) saves for backward per patch (Qwen) or per position
    (LLaVA's CLIP); 0 for a frozen tower. The module docstring says where each term comes from."""
    if mode == "frozen":
        return 0.0
    h, i, heads = tower.hidden, tower.intermediate, tower.heads
    if tower.kind == "qwen":
        if checkpointing:
            block = e * h
        elif mode == "full":
            block = (8 + 11 * e) * h + 4 * e * i + 4 * heads + 8
        else:
            block = (8 + 9 * e) * h + 4 * e * i + 4 * heads + 8 + adapted * lora_r * e
        outside = (tower.patch_dim * e + 4 + (0 if checkpointing else 8 * (h // heads))) if mode == "full" else 2
        merger = (4 + e) * h + 4 + 3 * e * h if projector_trained else 4 * h + 4 + e * h
        return outside + tower.depth * block + merger
    layers = tower.depth if tower.feature_layer == -1 else tower.depth + tower.feature_layer + 1
    block = e * h if checkpointing else 8 * e * h + 3 * e * i + 4 * heads + 4 * e + adapted * lora_r * e
    patches = tower.positions - 1
    outside = tower.patch_dim * e * patches / tower.positions + 8 + e * (h + 2) if mode == "full" else e * (h + 2)
    post = e * h if tower.feature_layer == -1 else 0
    o = tower.out_hidden
    projector = (e * h + 2 * e * o if projector_trained else e * o) * patches / tower.positions
    return outside + layers * block + post + projector


def vision_terms(setup: Setup) -> list[Term]:
    v = setup.vision
    if v is None or v.tower_mode == "frozen":
        return []
    per_patch = saved_per_patch(v.tower, v.tower_mode, v.projector_trained, setup.element_bytes,
                                setup.gradient_checkpointing, setup.lora_r, len(v.adapted))
    patches = v.patches * setup.micro_batch
    return [Term("activations", "vision tower (trained)", int(per_patch * patches), phase="backward",
                 note=f"{patches:,} patches x {per_patch:,.0f} B ({v.tower_mode}"
                      f"{', checkpointed' if setup.gradient_checkpointing else ''})")]


def vision_notes(setup: Setup) -> list[str]:
    v = setup.vision
    if v is None:
        return []
    tower = f"{v.tower.tower_params() / 1e6:,.1f}M-parameter tower"
    if v.tower_mode == "frozen":
        what = f"{tower} frozen: its weights are counted, no saved activations (nothing in it needs a gradient)"
    else:
        what = (f"{tower} trained ({v.tower_mode}): its activations are sized for {v.patches:,} patches a row "
                f"({v.image_tokens:,} image tokens)")
    return [f"vision: {v.describe}; image tokens count toward data.max_length, the logits and the loss; {what}"]
