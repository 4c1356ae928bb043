"""Images in `finetune chat` and `finetune eval` of a vision-language model (issue 38).

The prompt is built as training built it: each image a `{"type": "image"}` part (or, for alpaca, the model's
image markup), rendered by the chat template, its token run expanded to what the image processor makes of that
image (finetune.data.vision_encode.expand_images), and the pixels beside the ids. The image processor is the
run's (tokenizer/ holds it with the image-size limits the run trained with), or the model's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from finetune.errors import FinetuneError
from finetune.vision_models import FAMILIES, VisionModel, find_vision_model


class ImageError(FinetuneError, ValueError):
    """An image `finetune chat --image` cannot use (missing, not an image, a text model)."""


@dataclass
class Vision:
    """The image side of a chat with a VLM: its facts and its image processor."""

    vm: VisionModel
    processor: Any

    def inputs(self, paths: list[str], device) -> tuple[list[int], dict[str, Any]]:
        """(tokens each image stands for, the generate() keyword arguments of their pixels)."""
        from finetune.train.vlm_collator import open_image, processor_tokens

        if not paths:
            return [], {}
        processed = self.processor(images=[open_image({"path": p}) for p in paths], return_tensors="pt")
        pixels = {k: v.to(device) for k, v in processed.items() if k in ("pixel_values", "image_grid_thw")}
        return processor_tokens(self.vm, processed, len(paths)), pixels

    def expand(self, text: str, counts: list[int]) -> str:
        from finetune.data.vision_encode import expand_images

        return expand_images(text, FAMILIES[self.vm.family.name].image_token, counts)[0]

    def token_types(self, input_ids) -> dict[str, Any]:
        """Qwen2.5-VL's mm_token_type_ids (1 on image tokens), which its 3D positions need."""
        if self.vm.family.name != "qwen2_5_vl":
            return {}
        return {"mm_token_type_ids": (input_ids == self.vm.image_token_id).long()}


def load_vision(model: str, processor_dirs: list[str]) -> Optional[Vision]:
    """A Vision for a VLM (its image processor from the first of `processor_dirs` that holds one, else the
    model's), None for a text model."""
    from finetune.vision_models import PREPROCESSOR_CONFIG, PROCESSOR_CONFIG

    vm = find_vision_model(model)
    if vm is None:
        return None
    from transformers import AutoImageProcessor

    where = next((d for d in processor_dirs if d and any((Path(d) / n).is_file()
                                                          for n in (PREPROCESSOR_CONFIG, PROCESSOR_CONFIG))), model)
    return Vision(vm, AutoImageProcessor.from_pretrained(where))


def checked_images(paths: list[str], vision: Optional[Vision]) -> list[str]:
    """`--image` paths, each an image file Pillow can read; ImageError otherwise."""
    if paths and vision is None:
        raise ImageError("--image needs a vision-language model (its config.json has a vision_config); this one is "
                         "a text model")
    from finetune.data.formats import RowProblem
    from finetune.data.images import image_size

    out = []
    for path in paths:
        file = Path(path).expanduser()
        if not file.is_file():
            raise ImageError(f"--image {path}: no such file")
        try:
            image_size(file)
        except RowProblem as exc:
            raise ImageError(f"--image {path}: {exc}") from None
        out.append(str(file))
    return out
