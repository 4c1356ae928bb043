"""Vision-language models as finetune knows them without torch: recognised from config.json, sized from the
image processor's settings (issue 38).

A model is a VLM when its config.json has a `vision_config` and an image token (`image_token_id`; LLaVA's
`image_token_index`). Two families are supported, each with what the data checks, the collator, LoRA, the plan
and the merge need to know:

- qwen2_5_vl (Qwen2.5-VL): an image is resized so both sides are multiples of patch x merge (14 x 2 = 28 pixels)
  and its area lies within [min_pixels, max_pixels] (transformers' smart_resize), then cut into 14-pixel
  patches; every 2 x 2 patches become one token: tokens = (h / 28) x (w / 28). In the prompt one image is
  `<|vision_start|><|image_pad|><|vision_end|>`, the pad repeated once per token.
- llava (LLaVA-1.5): every image is resized and cropped to the tower's square; tokens = (crop / patch)^2
  + num_additional_image_tokens, less the class token when vision_feature_select_strategy is "default"
  (576 for llava-1.5-7b-hf: 336 / 14 = 24, 24^2 + 1 - 1).

Where the numbers come from: config.json, preprocessor_config.json (and LLaVA's processor_config.json) of a
local model directory, a `builtin:` tiny VLM (finetune.builtin_vision), the Hugging Face cache, or
PUBLISHED below (the hub's files, for lint and plan on a machine that has not downloaded the model).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from finetune.errors import FinetuneError
from finetune.recipe.references import MODEL_CONFIG

PREPROCESSOR_CONFIG = "preprocessor_config.json"
PROCESSOR_CONFIG = "processor_config.json"
# A processor's files beside its tokenizer: its image-size settings travel with a run's tokenizer/ and a merge.
PROCESSOR_FILES = (PREPROCESSOR_CONFIG, PROCESSOR_CONFIG, "video_preprocessor_config.json")
# The placeholder a data row writes for an image in its text (LLaVA's and LLaMA-Factory's convention).
PLACEHOLDER = "<image>"


class VisionModelError(FinetuneError, ValueError):
    """A vision-language model finetune cannot train (an unsupported family, unreadable processor settings)."""


@dataclass(frozen=True)
class Family:
    """What one VLM family looks like in transformers 5: its image token, the markup of one image in a prompt,
    where its tower and projector live (module names of the model, not of the checkpoint), its special tokens."""

    name: str
    image_token: str
    markup: str
    tower: str  # module prefix of the vision tower
    projector: str  # module prefix of the projector (inside the tower for Qwen: its merger)
    special_keys: tuple[str, ...]  # config.json keys of the token ids never trained
    dynamic: bool  # tokens depend on the image's size


FAMILIES = {
    "qwen2_5_vl": Family("qwen2_5_vl", "<|image_pad|>", "<|vision_start|><|image_pad|><|vision_end|>",
                         "model.visual", "model.visual.merger",
                         ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"), True),
    "llava": Family("llava", "<image>", "<image>", "model.vision_tower", "model.multi_modal_projector",
                    ("image_token_index",), False),
}


@dataclass(frozen=True)
class ImageSizing:
    """How many tokens an image of a given size becomes (picklable: it travels with the data's row spec)."""

    family: str
    patch: int
    merge: int = 1  # patches per token side (Qwen's spatial merge)
    min_pixels: int = 0
    max_pixels: int = 0
    fixed_tokens: int = 0  # LLaVA: every image the same
    crop: int = 0  # LLaVA: the side every image is resized to

    @property
    def factor(self) -> int:
        return self.patch * self.merge

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) the image processor gives the tower (transformers' smart_resize for Qwen)."""
        if not FAMILIES[self.family].dynamic:
            return self.crop, self.crop
        if max(width, height) > 200 * min(width, height):
            raise VisionModelError(f"a {width}x{height} image: Qwen's processor refuses aspect ratios above 200")
        f = self.factor
        h, w = round(height / f) * f, round(width / f) * f
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h, w = max(f, math.floor(height / beta / f) * f), max(f, math.floor(width / beta / f) * f)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
        return w, h

    def patches(self, width: int, height: int) -> int:
        """Patches the vision tower runs on for one image (Qwen: before the 2 x 2 merge)."""
        w, h = self.resized(width, height)
        return (w // self.patch) * (h // self.patch)

    def tokens(self, width: int, height: int) -> int:
        if not FAMILIES[self.family].dynamic:
            return self.fixed_tokens
        return self.patches(width, height) // (self.merge * self.merge)

    @property
    def max_tokens(self) -> int:
        return self.fixed_tokens or self.max_pixels // (self.factor * self.factor)

    def describe(self) -> str:
        if not FAMILIES[self.family].dynamic:
            return (f"every image is {self.fixed_tokens} tokens ({self.crop}x{self.crop} pixels in {self.patch}-pixel "
                    "patches)")
        low = max(1, self.min_pixels // (self.factor * self.factor))
        return (f"an image is {low} to {self.max_tokens} tokens: one per {self.factor}x{self.factor} pixels "
                f"(patch {self.patch} x merge {self.merge}), resized to {self.min_pixels:,}-{self.max_pixels:,} "
                f"pixels; e.g. 448x448 -> {self.tokens(448, 448)} tokens")


@dataclass(frozen=True)
class TowerShape:
    """The vision tower and projector's shapes, for the planner (parameters, activations per patch)."""

    kind: str  # "qwen" (Qwen2.5-VL's RMSNorm/SwiGLU blocks, window attention) or "clip" (LLaVA's CLIP)
    depth: int
    hidden: int
    intermediate: int
    heads: int
    patch_dim: int  # inputs per patch (channels x patch^2, x temporal patch for Qwen)
    out_hidden: int  # the language model's width the projector writes
    positions: int = 0  # CLIP's learned positions (patches + class token)
    feature_layer: int = -1  # LLaVA's vision_feature_layer (layers after it run but are not used)

    def block_tensors(self) -> list[tuple[str, int, int]]:
        """(name, rows, columns) of every parameter of one tower block: a linear layer's weight is (out, in), a
        bias or norm weight (n, 1). Qwen: 2 RMSNorms, qkv + proj, a SwiGLU MLP, every linear with a bias; CLIP:
        2 LayerNorms (weight + bias), q/k/v/out, fc1/fc2 with biases."""
        h, i = self.hidden, self.intermediate
        if self.kind == "qwen":
            linears = [("attn.qkv", h, 3 * h), ("attn.proj", h, h), ("mlp.gate_proj", h, i), ("mlp.up_proj", h, i),
                       ("mlp.down_proj", i, h)]
            norms = [("norm1", h), ("norm2", h)]
        else:
            linears = [(f"self_attn.{n}", h, h) for n in ("q_proj", "k_proj", "v_proj", "out_proj")] + \
                [("mlp.fc1", h, i), ("mlp.fc2", i, h)]
            norms = [(f"{ln}.{p}", h) for ln in ("layer_norm1", "layer_norm2") for p in ("weight", "bias")]
        return ([(f"{name}.weight", out, inp) for name, inp, out in linears]
                + [(f"{name}.bias", out, 1) for name, inp, out in linears] + [(name, n, 1) for name, n in norms])

    def block_linears(self) -> list[tuple[str, int, int]]:
        """(module name, in_features, out_features) of a block's linear layers (what LoRA can adapt)."""
        return [(name[:-len(".weight")], cols, rows) for name, rows, cols in self.block_tensors()
                if name.endswith(".weight") and cols > 1]

    def outer_tensors(self) -> list[tuple[str, int, int]]:
        """The tower's parameters outside its blocks (patch embedding; CLIP: class token, positions, norms)."""
        h = self.hidden
        if self.kind == "qwen":
            return [("patch_embed.proj.weight", h, self.patch_dim)]
        return [("embeddings.patch_embedding.weight", h, self.patch_dim), ("embeddings.class_embedding", h, 1),
                ("embeddings.position_embedding.weight", self.positions, h)] + \
            [(f"{ln}.{p}", h, 1) for ln in ("pre_layrnorm", "post_layernorm") for p in ("weight", "bias")]

    def projector_tensors(self) -> list[tuple[str, int, int]]:
        h, o = self.hidden, self.out_hidden
        if self.kind == "qwen":  # the merger: RMSNorm, Linear(4h, 4h), GELU, Linear(4h, out)
            return [("ln_q.weight", h, 1), ("mlp.0.weight", 4 * h, 4 * h), ("mlp.0.bias", 4 * h, 1),
                    ("mlp.2.weight", o, 4 * h), ("mlp.2.bias", o, 1)]
        return [("linear_1.weight", o, h), ("linear_1.bias", o, 1), ("linear_2.weight", o, o), ("linear_2.bias", o, 1)]

    def tower_params(self) -> int:
        return sum(r * c for _, r, c in self.outer_tensors()) + self.depth * sum(r * c for _, r, c in self.block_tensors())

    def projector_params(self) -> int:
        return sum(r * c for _, r, c in self.projector_tensors())


@dataclass(frozen=True)
class VisionModel:
    family: Family
    image_token_id: int
    special_ids: tuple[int, ...]
    sizing: ImageSizing
    tower: TowerShape
    source: str = ""
    config: dict = field(default_factory=dict, compare=False, repr=False)

    def describe(self) -> str:
        return f"{self.family.name} vision-language model ({self.sizing.describe()})"


def is_vlm_config(config: Any) -> bool:
    return isinstance(config, dict) and isinstance(config.get("vision_config"), dict) and (
        "image_token_id" in config or "image_token_index" in config)


def vision_model(config: dict, preprocessor: dict, processor: Optional[dict], source: str) -> VisionModel:
    """The VisionModel of a VLM's config.json and processor settings; VisionModelError for one not supported."""
    model_type = str(config.get("model_type"))
    family = FAMILIES.get(model_type)
    if family is None:
        raise VisionModelError(f"{source}: {model_type} vision-language models are not supported yet "
                               f"(supported: {', '.join(FAMILIES)}); issue 38")
    ids = tuple(int(config[k]) for k in family.special_keys if isinstance(config.get(k), int))
    vision = config["vision_config"]
    text = config.get("text_config") or config
    if family.name == "llava":
        return VisionModel(family, int(config["image_token_index"]), ids, _llava_sizing(config, preprocessor, processor or {}),
                           _clip_tower(vision, config, int(text["hidden_size"])), source, config)
    return VisionModel(family, int(config["image_token_id"]), ids, _qwen_sizing(vision, preprocessor),
                       _qwen_tower(vision), source, config)


def _qwen_sizing(vision: dict, pre: dict) -> ImageSizing:
    size = pre.get("size") if isinstance(pre.get("size"), dict) else {}
    # older files write min_pixels / max_pixels, transformers 5 writes size: {shortest_edge, longest_edge}
    low = pre.get("min_pixels") or size.get("shortest_edge") or 56 * 56
    high = pre.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280
    return ImageSizing("qwen2_5_vl", int(pre.get("patch_size") or vision.get("patch_size", 14)),
                       int(pre.get("merge_size") or vision.get("spatial_merge_size", 2)), int(low), int(high))


def _llava_sizing(config: dict, pre: dict, processor: dict) -> ImageSizing:
    pre = processor.get("image_processor") or pre
    crop = pre.get("crop_size") or config["vision_config"].get("image_size", 336)
    side = int(crop["height"]) if isinstance(crop, dict) else int(crop)
    patch = int(processor.get("patch_size") or config["vision_config"].get("patch_size", 14))
    tokens = (side // patch) ** 2 + int(processor.get("num_additional_image_tokens") or 0)
    if (processor.get("vision_feature_select_strategy") or config.get("vision_feature_select_strategy")) == "default":
        tokens -= 1
    return ImageSizing("llava", patch, fixed_tokens=tokens, crop=side)


def _qwen_tower(v: dict) -> TowerShape:
    patch, temporal = int(v.get("patch_size", 14)), int(v.get("temporal_patch_size", 2))
    return TowerShape("qwen", int(v["depth"]), int(v["hidden_size"]), int(v["intermediate_size"]), int(v["num_heads"]),
                      int(v.get("in_channels", 3)) * temporal * patch * patch, int(v["out_hidden_size"]))


def _clip_tower(v: dict, config: dict, text_hidden: int) -> TowerShape:
    patch, side = int(v.get("patch_size", 14)), int(v.get("image_size", 336))
    layer = config.get("vision_feature_layer", -2)
    return TowerShape("clip", int(v["num_hidden_layers"]), int(v["hidden_size"]), int(v["intermediate_size"]),
                      int(v["num_attention_heads"]), int(v.get("num_channels", 3)) * patch * patch, text_hidden,
                      positions=(side // patch) ** 2 + 1, feature_layer=layer if isinstance(layer, int) else -2)


# ------------------------------------------------------------------------------------------------
# Where a model's files are

# Qwen/Qwen2.5-VL-7B-Instruct's config.json and preprocessor_config.json as published on the hub
# (https://huggingface.co/Qwen/Qwen2.5-VL-7B-Instruct, transformers_version 4.53.1 in the file), the keys the
# planner and the data checks read. Text: hidden 3584, 28 layers, 28/4 heads, vocab 152064, untied head;
# tower: 32 blocks of width 1280 (SwiGLU 3420, 16 heads), patch 14, temporal patch 2, merge 2, out 3584.
PUBLISHED: dict[str, dict[str, Any]] = {
    "qwen2.5-vl-7b": {
        "pattern": r"qwen2\.5-vl-7b",
        "hub_ids": ("Qwen/Qwen2.5-VL-7B-Instruct",),
        "config": {
            "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
            "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
            "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False,
            "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
            "vision_end_token_id": 151653,
            "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                              "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2,
                              "temporal_patch_size": 2, "in_channels": 3, "window_size": 112,
                              "fullatt_block_indexes": [7, 15, 23, 31]},
        },
        "preprocessor": {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
                         "merge_size": 2},
    },
}


def read_json_object(path: Path) -> Optional[dict]:
    """A JSON file holding an object, else None (missing, unreadable, not an object)."""
    from finetune.fsutil import read_json

    try:  # the one door: a FIFO or device named config.json is refused, never waited on
        data = read_json(path)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def model_files(name_or_path: str, revision: Optional[str] = None,
                download: bool = False) -> Optional[tuple[dict, dict, Optional[dict], str]]:
    """(config, preprocessor, processor, where) of a model reference, read without torch; None when its
    config.json is nowhere on this machine (a hub id not downloaded and not in PUBLISHED). `download`: fetch a
    hub model's config files first (training reads them anyway; lint and plan never go to the network)."""
    from finetune.recipe.references import BUILTIN_PREFIX

    if name_or_path.startswith(BUILTIN_PREFIX):  # the built-in VLMs' config.json, without building them
        from finetune.builtin_vision import VLM_SPECS

        spec = VLM_SPECS.get(name_or_path[len(BUILTIN_PREFIX):])
        if spec is None:
            return None
        return spec["config"], spec["preprocessor"], spec.get("processor"), name_or_path
    local = Path(name_or_path).expanduser()
    if local.is_dir():
        config = read_json_object(local / MODEL_CONFIG)
        if config is None:
            return None
        return (config, read_json_object(local / PREPROCESSOR_CONFIG) or {}, read_json_object(local / PROCESSOR_CONFIG),
                str(local / MODEL_CONFIG))
    cached = _hub_cache(name_or_path, revision, download)
    if cached is not None:
        return cached
    text = name_or_path.strip().lower().replace("_", "-")
    for key, entry in PUBLISHED.items():
        if re.search(rf"(?<![a-z0-9.]){entry['pattern']}(?![0-9.])", text):
            return entry["config"], entry["preprocessor"], None, f"{name_or_path} [published config of {key}]"
    return None


def _hub_cache_dir() -> Path:
    """huggingface_hub's cache folder, as it resolves it (HF_HUB_CACHE, HF_HOME/hub, ~/.cache/huggingface/hub)."""
    import os

    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def _hub_cache(repo_id: str, revision: Optional[str], download: bool) -> Optional[tuple[dict, dict, Optional[dict], str]]:
    # Without the repo's folder in the cache there is nothing to read: huggingface_hub is not even imported
    # (its first use costs lint about 0.6 s).
    if not download and not (_hub_cache_dir() / f"models--{repo_id.replace('/', '--')}").is_dir():
        return None
    try:
        from huggingface_hub import hf_hub_download, try_to_load_from_cache
    except ImportError:
        return None
    def read(name: str) -> Optional[dict]:
        try:
            path = try_to_load_from_cache(repo_id, name, revision=revision)
            if download and not isinstance(path, str):
                path = hf_hub_download(repo_id, name, revision=revision)
        except Exception:  # noqa: BLE001 - not a repo id, not on the hub, offline: what is cached is what there is
            path = None
        return read_json_object(Path(path)) if isinstance(path, str) else None

    config = read(MODEL_CONFIG)
    if config is None:
        return None
    if not is_vlm_config(config):  # a text model: no processor files to look for (nor to download)
        return config, {}, None, f"{repo_id} (hub cache)"
    return config, read(PREPROCESSOR_CONFIG) or {}, read(PROCESSOR_CONFIG), f"{repo_id} (hub cache)"


def find_vision_model(name_or_path: str, revision: Optional[str] = None, download: bool = False) -> Optional[VisionModel]:
    """The VisionModel of a reference, None for a text model or a config this machine cannot read;
    VisionModelError for a VLM family that is not supported."""
    files = model_files(name_or_path, revision, download)
    if files is None or not is_vlm_config(files[0]):
        return None
    return vision_model(*files)


def recipe_vision(recipe: Any, download: bool = False) -> Optional[VisionModel]:
    """The recipe's model as a VisionModel with the recipe's image-size limits applied (vision.max_pixels,
    vision.min_pixels, vision.max_image_tokens), or None for a text model. `download`: see model_files."""
    found = find_vision_model(recipe.model.name_or_path, recipe.model.revision, download)
    if found is None:
        return None
    return replace(found, sizing=limited(found.sizing, recipe.vision))


def limited(sizing: ImageSizing, section: Any) -> ImageSizing:
    """The recipe's limits on Qwen's dynamic resizing (LLaVA's fixed size takes none: lint says so)."""
    if not FAMILIES[sizing.family].dynamic:
        return sizing
    high = section.max_pixels or (section.max_image_tokens * sizing.factor ** 2 if section.max_image_tokens else 0)
    low = section.min_pixels or sizing.min_pixels
    return replace(sizing, max_pixels=high or sizing.max_pixels, min_pixels=min(low, high or sizing.max_pixels))


def published_hub_ids() -> list[str]:
    """The hub ids of PUBLISHED (preflight's did-you-mean knows them beside finetune.plan.archs.HUB_IDS)."""
    return [hub_id for entry in PUBLISHED.values() for hub_id in entry["hub_ids"]]
