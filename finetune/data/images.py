"""Rows with images (issue 38): the `images` column, the placeholders that say where each image goes, and
each image's size, read from its header before anything trains.

A row of a vision-language model's data names its images in an `images` column (renamed with
`columns: {images: ...}`): a path relative to the data file's folder (or absolute), a `data:image/...;base64,`
URL, image bytes (parquet / Arrow), or datasets' Image struct `{"bytes": ..., "path": ...}`. Each image has a
place in the text: `<image>` in a message's (or alpaca's instruction's) text, or a `{"type": "image"}` part
of a message's content (the OpenAI / TRL form). The converter registered here as the `vision` reader turns a
row of any format into a VisionChat or VisionPrompted: the messages with every image as a content part, and
one ImageRef per image with its width, height and token count (finetune.vision_models.ImageSizing). It raises
RowProblem when the placeholders and the images differ in number, a file is missing, is not an image, or lies
outside the data's folder through a link or `..`; finetune.data.validate runs it on every row before launch
(no torch: Pillow opens only the header), finetune.data.vision_encode tokenizes what it returns.
Video and audio are out of scope.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from finetune.data.formats import FORMATS, Chat, Prompted, RowProblem, RowSpec, Text, register_format
from finetune.vision_models import PLACEHOLDER, ImageSizing

IMAGE_COLUMN = "images"
VISION_READER = "vision"


@dataclass(frozen=True)
class ImageSpec:
    """What the rows of one source need to place and size their images (it travels with the RowSpec)."""

    root: str  # relative image paths are resolved here: the data file's folder (or the source folder)
    sizing: ImageSizing
    markup: str  # one image in an alpaca prompt: the model's own image markup
    image_token: str  # what one token of an image is in the text (Qwen's <|image_pad|>, LLaVA's <image>)
    image_token_id: int
    never_trained: tuple[int, ...]  # the vision special tokens' ids (image pads, vision start/end)


@dataclass(frozen=True)
class ImageRef:
    """One image of a row: a file (absolute path) or bytes, and its size in pixels and tokens."""

    path: Optional[str]
    data: Optional[bytes]
    width: int
    height: int
    tokens: int

    def stored(self) -> dict[str, Any]:
        """The prepared table's form (datasets' Image storage: {bytes, path})."""
        return {"bytes": self.data, "path": self.path}


@dataclass
class VisionChat(Chat):
    images: list[ImageRef] = field(default_factory=list)


@dataclass
class VisionPrompted(Prompted):
    images: list[ImageRef] = field(default_factory=list)


def image_size(source: Any) -> tuple[int, int]:
    """(width, height) from the image's header only (Pillow reads the rest lazily, never here)."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise RowProblem("rows with images need Pillow: pip install 'finetune[vision]'") from None
    try:
        with Image.open(source) as image:
            return image.size
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise RowProblem(f"not an image Pillow can read ({exc})") from None


def read_ref(value: Any, spec: ImageSpec, where: str) -> ImageRef:
    """One entry of the images column as an ImageRef; RowProblem naming `where` when it is unusable."""
    path, data = None, None
    if isinstance(value, Mapping):  # datasets' Image struct
        data = value.get("bytes")
        path = value.get("path") if data is None else None
        if data is None and not path:
            raise RowProblem(f"{where} has neither `bytes` nor `path`")
    elif isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
    elif isinstance(value, str) and value.startswith("data:image/"):
        try:
            data = base64.b64decode(value.split(",", 1)[1], validate=True)
        except (IndexError, ValueError):
            raise RowProblem(f"{where} is a data: URL whose base64 does not decode") from None
    elif isinstance(value, str) and value:
        path = value
    else:
        raise RowProblem(f"{where} must be a path, a data:image URL or image bytes, got {type(value).__name__}")
    if path is not None:
        path = str(_inside(path, spec.root, where))
    try:
        width, height = image_size(path if path is not None else io.BytesIO(bytes(data)))
        tokens = spec.sizing.tokens(width, height)
    except (RowProblem, ValueError) as exc:
        raise RowProblem(f"{where} ({path or 'bytes'}): {exc}") from None
    return ImageRef(path, bytes(data) if data is not None else None, width, height, tokens)


def _inside(path: str, root: str, where: str) -> Path:
    """An absolute path as written; a relative one resolved in `root`, which it must not leave (no `..`, no link
    pointing out of the data's folder)."""
    given = Path(path).expanduser()
    if given.is_absolute():
        found = given
    else:
        base = Path(root).resolve()
        found = (base / given).resolve()
        if found != base and base not in found.parents:
            raise RowProblem(f"{where} ({path}) leaves the data's folder {base} (through `..` or a link); "
                             "give an absolute path to use a file elsewhere")
    from finetune.fsutil import special_kind

    kind = special_kind(found)  # Pillow would block on a FIFO or read a device without end (issue 40)
    if kind:
        raise RowProblem(f"{where}: {found} is {kind}, not an image file")
    if not found.is_file():
        raise RowProblem(f"{where}: no image file {found}")
    return found


def row_images(row: Mapping[str, Any], spec: RowSpec) -> list[ImageRef]:
    column = spec.column(IMAGE_COLUMN)
    value = row.get(column)
    if value is None:
        return []
    values = value if isinstance(value, (list, tuple)) else [value]
    return [read_ref(item, spec.images, f"{column}[{i}]") for i, item in enumerate(values)]


def as_parts(content: Any, where: str) -> tuple[Any, int]:
    """(content with each `<image>` of its text turned into an image part, images it places)."""
    if isinstance(content, str):
        if PLACEHOLDER not in content:
            return content, 0
        pieces = content.split(PLACEHOLDER)
        parts: list[dict[str, Any]] = []
        for i, piece in enumerate(pieces):
            if i:
                parts.append({"type": "image"})
            if piece:
                parts.append({"type": "text", "text": piece})
        return parts, len(pieces) - 1
    if not isinstance(content, list):
        return content, 0
    out, count = [], 0
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image":
            out.append({"type": "image"})
            count += 1
        elif kind == "text" and isinstance(part.get("text"), str):
            text, found = as_parts(part["text"], where)
            out.extend(text if isinstance(text, list) else [part])
            count += found
        elif kind in ("video", "audio", "input_audio", "image_url", "video_url"):
            raise RowProblem(f"{where}[{i}] is a `{kind}` part: rows place images with {{\"type\": \"image\"}} parts "
                             "and the images column (video and audio are not supported)")
        else:
            raise RowProblem(f"{where}[{i}] must be a {{\"type\": \"text\", \"text\": ...}} or {{\"type\": \"image\"}} part")
    return out, count


def vision_example(row: Mapping[str, Any], spec: RowSpec) -> Any:
    """A row of any SFT format with its images (the `vision` reader of finetune.data.formats)."""
    if spec.images is None:
        raise RowProblem("rows with images need a vision-language model (its config.json has a vision_config)")
    example = FORMATS[spec.format](row, spec)
    images = row_images(row, spec)
    if isinstance(example, Chat):
        messages, placed = [], 0
        for i, message in enumerate(example.messages):
            content, count = as_parts(message.get("content"), f"{spec.column('messages')}[{i}].content")
            messages.append({**message, "content": content} if count or content is not message.get("content") else message)
            placed += count
        _same_count(placed, images, spec)
        return VisionChat(messages, example.train, images)
    if isinstance(example, Prompted):
        if PLACEHOLDER in example.response:
            raise RowProblem(f"`{spec.column('output')}` holds {PLACEHOLDER}: images go in the prompt, not the answer")
        _same_count(example.prompt.count(PLACEHOLDER), images, spec)
        return VisionPrompted(example.prompt.replace(PLACEHOLDER, spec.images.markup), example.response, images)
    if isinstance(example, Text) and images:
        raise RowProblem(f"format text takes no images (`{spec.column(IMAGE_COLUMN)}` has {len(images)}); use messages")
    return example


def _same_count(placed: int, images: list[ImageRef], spec: RowSpec) -> None:
    if placed != len(images):
        raise RowProblem(f"{placed} image placeholder(s) ({PLACEHOLDER} or {{\"type\": \"image\"}} parts) but "
                         f"{len(images)} image(s) in `{spec.column(IMAGE_COLUMN)}`: each image needs its place")


def image_tokens(example: Any) -> int:
    return sum(ref.tokens for ref in getattr(example, "images", ()))


register_format(VISION_READER, vision_example)


def vision_data(recipe: Any, download: bool = True) -> Optional[dict[str, Any]]:
    """The recipe's image sizing as plain values for the data section (None for a text model): what
    sources_of turns into each source's ImageSpec, in the launcher and in every rank alike. `download`: a hub
    model's config files may be fetched (training; `finetune plan` passes False: it never goes to the network)."""
    from dataclasses import asdict

    from finetune.vision_models import FAMILIES, recipe_vision

    found = recipe_vision(recipe, download=download)
    if found is None:
        return None
    family = FAMILIES[found.sizing.family]
    return {"sizing": asdict(found.sizing), "markup": family.markup, "image_token": family.image_token,
            "image_token_id": found.image_token_id, "never_trained": list(found.special_ids)}


def with_images(spec: RowSpec, path: str, vision: dict[str, Any]) -> RowSpec:
    """`spec` reading its rows with their images: relative paths resolve in the data file's folder."""
    from dataclasses import replace

    local = Path(path).expanduser()
    root = local if local.is_dir() else local.parent
    images = ImageSpec(str(root.absolute()), ImageSizing(**vision["sizing"]), vision["markup"], vision["image_token"],
                       int(vision["image_token_id"]), tuple(vision["never_trained"]))
    return replace(spec, reader=VISION_READER, images=images)


def image_note(check: Any, max_length: int) -> str:
    """What a source's images cost, for preflight's line about it ("" without images)."""
    tokens = list(check.image_tokens)
    with_images = [t for t in tokens if t]
    if not with_images:
        return ""
    over = sum(1 for t in with_images if t >= max_length)
    note = (f"; {len(with_images)} with images, {min(with_images)} to {max(with_images)} image tokens a row "
            f"(within max_length {max_length})")
    if over:
        note += (f"; {over} row(s) hold max_length {max_length} or more image tokens and will be dropped "
                 "(a row is never cut inside an image)")
    return note
