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
from finetune.vision_models import FAMILIES, VisionModel, is_vlm_config


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


def load_vision(model: str, processor_dirs: list[Optional[str]]) -> Optional[Vision]:
    """A Vision for a VLM, None for a text model: the model's config.json, the image processor (and its settings,
    which size the images) from the first of `processor_dirs` that holds one (a run's tokenizer/: as trained),
    else the model's own."""
    from finetune.vision_models import PREPROCESSOR_CONFIG, PROCESSOR_CONFIG, model_files, read_json_object, vision_model

    files = model_files(model)
    if files is None or not is_vlm_config(files[0]):
        return None
    where = next((Path(d) for d in processor_dirs if d and any((Path(d) / n).is_file()
                                                                for n in (PREPROCESSOR_CONFIG, PROCESSOR_CONFIG))), None)
    config, preprocessor, processor, source = files
    if where is not None:
        preprocessor = read_json_object(where / PREPROCESSOR_CONFIG) or {}
        processor = read_json_object(where / PROCESSOR_CONFIG)
    from transformers import AutoImageProcessor

    return Vision(vision_model(config, preprocessor, processor, source),
                  AutoImageProcessor.from_pretrained(str(where) if where is not None else model))


def image_problem(path: str, vision: Optional[Vision]) -> Optional[str]:
    """Why `--image PATH` cannot be shown to the model (a text model, no such file, not an image), or None."""
    if vision is None:
        return ("--image needs a vision-language model (its config.json has a vision_config); this one is "
                "a text model")
    from finetune.data.formats import RowProblem
    from finetune.data.images import image_size

    file = Path(path).expanduser()
    if not file.is_file():
        return f"--image {path}: no such file"
    try:
        image_size(file)
    except RowProblem as exc:
        return f"--image {path}: {exc}"
    return None


def checked_images(paths: list[str], vision: Optional[Vision]) -> list[str]:
    """`--image` paths, each an image file Pillow can read; ImageError otherwise."""
    for path in paths:
        problem = image_problem(path, vision)
        if problem:
            raise ImageError(problem)
    return [str(Path(path).expanduser()) for path in paths]


def message_content(text: str, images: Any) -> Any:
    """A user message's content: the text, after one image part per image (the OpenAI / TRL form, as rows write it)."""
    if not images:
        return text
    return [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
