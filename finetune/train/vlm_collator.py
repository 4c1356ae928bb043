"""The collator of a vision-language model's micro batches (issue 38): token rows padded as for text, the images
through transformers' image processor, and a check that the two agree.

The rows come from the prepared cache (finetune.data.vision_encode): input_ids with each image's token run
already expanded, labels with the prompt, padding and every vision special token at -100, and the row's images
(paths or bytes). Here the image processor makes `pixel_values` (and Qwen's `image_grid_thw`), and the number
of image tokens its output stands for is compared with the ids: a mismatch means the data was prepared with
other image-size settings than the processor has, and is an error rather than a silently wrong batch (the model
would raise "Image features and image tokens do not match" deep inside forward). Qwen2.5-VL also gets
`mm_token_type_ids` (1 on image tokens), which its 3D rotary positions need, as its processor returns them.

A micro batch without images has no pixel_values: under ZeRO-3 finetune.train.vlm_guard makes its forward
enter the tower anyway.
"""

from __future__ import annotations

import io
from typing import Any

from finetune.data.packing import Collator
from finetune.data.tokenize import DataError
from finetune.vision_models import VisionModel


def open_image(stored: dict[str, Any]):
    """A stored image ({bytes, path}) as an RGB PIL image, read whole."""
    from PIL import Image

    source = io.BytesIO(stored["bytes"]) if stored.get("bytes") is not None else stored["path"]
    try:
        with Image.open(source) as image:
            return image.convert("RGB")
    except OSError as exc:
        raise DataError(f"{stored.get('path') or 'image bytes'}: cannot read the image ({exc})") from None


def processor_tokens(vm: VisionModel, processed: dict[str, Any], count: int) -> list[int]:
    """Tokens each image of the image processor's output stands for (transformers' processors' own arithmetic)."""
    grid = processed.get("image_grid_thw")
    if grid is not None:
        return [int(thw.prod()) // (vm.sizing.merge ** 2) for thw in grid]
    return [vm.sizing.fixed_tokens] * count


class VisionCollator:
    def __init__(self, image_processor, vm: VisionModel, pad_token_id: int):
        self.image_processor = image_processor
        self.vm = vm
        self.text = Collator(pad_token_id, always_mask=True)  # the processors' rope indices read it

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.text([{"input_ids": f["input_ids"], "labels": f["labels"]} for f in features])
        stored = [image for f in features for image in (f.get("images") or [])]
        image_ids = batch["input_ids"] == self.vm.image_token_id
        if stored:
            processed = self.image_processor(images=[open_image(s) for s in stored], return_tensors="pt")
            made = processor_tokens(self.vm, processed, len(stored))
            if sum(made) != int(image_ids.sum()):
                raise DataError(f"the image processor makes {sum(made)} image tokens of this batch's {len(stored)} "
                                f"image(s) but the tokenized rows hold {int(image_ids.sum())}: the data was prepared "
                                "with other image-size settings (vision.max_pixels, the model's preprocessor_config.json)")
            batch["pixel_values"] = processed["pixel_values"]
            if "image_grid_thw" in processed:
                batch["image_grid_thw"] = processed["image_grid_thw"]
        if self.vm.family.name == "qwen2_5_vl":
            batch["mm_token_type_ids"] = image_ids.long()
        return batch
