"""Tokenizing rows with images (issue 38): each image's token run expanded in the text, its tokens never trained,
a row dropped (and counted) rather than cut inside an image.

The text is what the model's processor would tokenize: the chat template (or the alpaca prompt with the model's
image markup) renders one image token per image, and each is repeated as many times as the image costs
(finetune.vision_models.ImageSizing: Qwen2.5-VL's smart_resize arithmetic, LLaVA's fixed count). The collator
(finetune.train.vlm_collator) gets the pixels from the image processor and checks that they make exactly that
many tokens; tests/models/test_vision.py checks the ids against the processor's own.

Labels are -100 on the prompt (data.mask_prompt), on padding and on every vision special token (the image pads,
Qwen's vision start/end): TRL's collator leaves the image tokens in the loss. A row longer than max_length keeps
its text up to max_length when every image token lies before the cut, and is dropped (counted like a row with
nothing left to train) when the cut would fall inside or before an image.

Registered with finetune.data.tokenize on import: finetune.data.prepare, `finetune data show` and `finetune eval`
import this module.
"""

from __future__ import annotations

from typing import Any

from finetune.data.chat_template import ChatRenderer, chat_text
from finetune.data.formats import RowProblem, RowSpec
from finetune.data.images import IMAGE_COLUMN, ImageRef, VisionChat, VisionPrompted
from finetune.data.tokenize import IGNORE_INDEX, RowError, register_encoder


def expand_images(text: str, image_token: str, counts: list[int],
                  spans: tuple[tuple[int, int], ...] = ()) -> tuple[str, list[tuple[int, int]]]:
    """(text with the i-th `image_token` repeated counts[i] times, `spans` moved to the new text)."""
    out, grown, cursor = [], [], 0
    for n in counts:
        at = text.find(image_token, cursor)
        if at < 0:
            raise RowProblem(f"the rendered text has fewer image tokens ({image_token}) than the row has images: "
                             "the chat template drops some image parts")
        end = at + len(image_token)
        out += [text[cursor:at], image_token * n]
        grown.append((end, (n - 1) * len(image_token)))
        cursor = end
    if text.find(image_token, cursor) >= 0:
        raise RowProblem(f"the text holds {image_token} itself: write images as {{\"type\": \"image\"}} parts or <image>")
    out.append(text[cursor:])

    def moved(position: int) -> int:
        return position + sum(added for end, added in grown if end <= position)

    return "".join(out), [(moved(start), moved(end)) for start, end in spans]


def _row(ids: list[int], trained: list[bool], images: list[ImageRef], spec, max_length: int) -> list[dict[str, Any]]:
    """The sequence, or [] when max_length cuts an image or leaves nothing to train."""
    images_spec = spec.images
    wanted = sum(ref.tokens for ref in images)
    ids, trained = ids[:max_length], trained[:max_length]
    if sum(1 for i in ids if i == images_spec.image_token_id) != wanted:
        return []
    never = set(images_spec.never_trained)
    labels = [i if t and i not in never else IGNORE_INDEX for i, t in zip(ids, trained)]
    if all(label == IGNORE_INDEX for label in labels[1:]):
        return []
    return [{"input_ids": ids, "labels": labels, "images": [ref.stored() for ref in images]}]


def _offsets(tokenizer, texts: list[str]) -> tuple[list[list[int]], list[list[tuple[int, int]]]]:
    encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    return encoded["input_ids"], encoded["offset_mapping"]


def encode_vision_chat(examples: list[VisionChat], indices: list[int], tokenizer, max_length: int, mask_prompt: bool,
                       think: str, spec) -> list[list[dict[str, Any]]]:
    render = ChatRenderer(tokenizer, examples[0].messages if examples else None)
    texts, all_spans = [], []
    for index, example in zip(indices, examples):
        try:
            text, spans = chat_text(example, render, mask_prompt, think)  # as a text row's
            text, spans = expand_images(text, spec.images.image_token, [ref.tokens for ref in example.images],
                                        tuple(spans))
        except RowProblem as exc:
            raise RowError(index, f"example {index}: {exc}") from None
        texts.append(text)
        all_spans.append(spans)
    out = []
    for ids, offsets, spans, example in zip(*_offsets(tokenizer, texts), all_spans, examples):
        trained = [any(start < end and a < end and b > start for start, end in spans) for a, b in offsets]
        out.append(_row(list(ids), trained, example.images, spec, max_length))
    return out


def encode_vision_prompted(examples: list[VisionPrompted], indices: list[int], tokenizer, max_length: int,
                           mask_prompt: bool, think: str, spec) -> list[list[dict[str, Any]]]:
    prompts = []
    for index, example in zip(indices, examples):
        try:
            prompts.append(expand_images(example.prompt, spec.images.image_token, [r.tokens for r in example.images])[0])
        except RowProblem as exc:
            raise RowError(index, f"example {index}: {exc}") from None
    prompt_ids = tokenizer(prompts, add_special_tokens=True)["input_ids"]
    response_ids = tokenizer([e.response for e in examples], add_special_tokens=False)["input_ids"]
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    out = []
    for prompt, response, example in zip(prompt_ids, response_ids, examples):
        ids = list(prompt) + list(response) + eos
        trained = [not mask_prompt] * len(prompt) + [True] * (len(ids) - len(prompt))
        out.append(_row(ids, trained, example.images, spec, max_length))
    return out


def undecoded(raw: Any, spec: RowSpec) -> Any:
    """`raw` (a datasets.Dataset) with its image column left as {bytes, path}: datasets decodes an Image column
    into PIL images when rows are read, which reading the header here does not need (nor the cache)."""
    import datasets

    column = spec.column(IMAGE_COLUMN)
    feature = raw.features.get(column) if spec.images is not None else None
    inner = getattr(feature, "feature", None)  # List(Image) / Sequence(Image)
    if isinstance(feature, datasets.Image):
        return raw.cast_column(column, datasets.Image(decode=False))
    if isinstance(inner, datasets.Image):
        return raw.cast_column(column, datasets.List(datasets.Image(decode=False)))
    return raw


def image_column(sequences: list[dict[str, Any]]):
    """The prepared table's `images` column of a batch's sequences: datasets' Image storage, {bytes, path}."""
    import pyarrow as pa

    stored = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    return pa.array([s.get("images", []) for s in sequences], type=pa.list_(stored))


register_encoder(VisionChat, encode_vision_chat)
register_encoder(VisionPrompted, encode_vision_prompted)
