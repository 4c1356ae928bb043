"""The training data's length statistics as the planner's tokens per sequence (`finetune plan RECIPE`).

Without packing or padding_free a micro batch is padded to its longest example, so when every example
of the data is shorter than data.max_length the activations are those of the longest example, not of
max_length; when its longest examples exceed max_length, their rows are cut to exactly max_length
tokens (`cut`, which finetune.plan.from_recipe reads for Setup.full_rows). Tokens per character come
from the model's own tokenizer.json when it is on this machine
(a local model directory, or a built-in model already built), through the `tokenizers` library (Rust,
no torch), measured on the first SAMPLE_ROWS rows of each source; otherwise characters / 4 (English
through a Llama- or GPT-style BPE; code and other scripts give more tokens per character). The note
says which. Only local sources up to MAX_BYTES in all are read (finetune.data.validate's bulk pass);
with a hub source, a larger one, or packed rows the planner keeps max_length.
"""

from __future__ import annotations

import math
from array import array
from pathlib import Path
from typing import Any, NamedTuple, Optional

from finetune.units import gib_text

CHARS_PER_TOKEN = 4
SAMPLE_ROWS = 200
# Template tokens a chat or Alpaca prompt adds around the text (role headers, "### Response:"), per example.
TEMPLATE_TOKENS = 32
MAX_BYTES = 2**30  # about 15 s of reading on a busy 2-core machine (scripts/bench_validate.py)


class DataLengths(NamedTuple):
    seq_len: int  # tokens per sequence to size the activations for
    note: str  # one line for the plan; "" when it is max_length as usual
    cut: bool = False  # the longest examples exceed max_length: their rows are cut to exactly max_length tokens


def data_seq_len(recipe: Any) -> DataLengths:
    """What the recipe's local data says of its sequences' lengths (the module docstring)."""
    from finetune.data.sources import SourceProblem, data_files, sources_of
    from finetune.recipe.references import is_local
    from finetune.data.validate import length_stats, validate

    from finetune.data.images import vision_data

    data = recipe.data
    if data.packing or data.padding_free:
        return DataLengths(data.max_length, "")
    if not all(is_local(s.path) for s in sources_of(data)):
        return DataLengths(data.max_length, "")
    sources = sources_of(data, vision=vision_data(recipe, download=False))
    try:
        size = sum(f.stat().st_size for s in sources for f in data_files(Path(s.path).expanduser(), s.split))
    except (SourceProblem, OSError):
        return DataLengths(data.max_length, "")
    if size > MAX_BYTES:
        return DataLengths(data.max_length, f"data not read for lengths ({gib_text(size, 1)} > "
                                            f"{gib_text(MAX_BYTES, 0)}): sized for max_length")
    checked = validate(sources)
    ratio, how = _chars_per_token(recipe, sources)
    lengths = array("I")
    for check in checked.checks:
        if check.image_tokens:  # a VLM's rows: each one's image tokens, as characters at the text's rate
            lengths.extend(min(c + math.ceil(t * ratio), 2**32 - 1) for c, t in zip(check.lengths, check.image_tokens))
        else:
            lengths.extend(check.lengths)
    stats: Optional[dict[str, int]] = length_stats(lengths)
    if stats is None or not checked.ok:
        return DataLengths(data.max_length, "")
    longest, p95 = (math.ceil(stats[k] / ratio) + TEMPLATE_TOKENS for k in ("max", "p95"))
    measured = f"longest example ~{longest} tokens, p95 ~{p95} ({how}, {stats['rows']} rows)"
    if longest >= data.max_length:
        return DataLengths(data.max_length, f"{measured}: sized for max_length {data.max_length}", cut=True)
    from finetune.data.packing import padded_width, planned_pad_multiple, width_limit

    multiple = planned_pad_multiple(recipe)  # the collator's widest micro batch on a GPU
    if multiple > 1:
        widest = padded_width(longest, multiple, width_limit(data.max_length))
        if widest > longest:
            measured += f", padded to {widest}"
            longest = widest
    return DataLengths(longest, f"{measured}: activations sized for {longest}, not max_length {data.max_length}")


def _chars_per_token(recipe: Any, sources: list) -> tuple[float, str]:
    fallback = float(CHARS_PER_TOKEN), f"characters/{CHARS_PER_TOKEN}, no tokenizer here"
    path = _tokenizer_file(recipe)
    if path is None:
        return fallback
    try:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(path))
    except Exception:  # noqa: BLE001 - tokenizers missing or an unreadable file: the estimate still works
        return fallback
    texts = [text for source in sources for text in _sample_texts(source)]
    tokens = sum(len(encoding.ids) for encoding in tokenizer.encode_batch(texts)) if texts else 0
    if tokens == 0:
        return fallback
    ratio = sum(len(t) for t in texts) / tokens
    return ratio, f"{ratio:.2f} characters per token of {path.parent.name}'s tokenizer on {len(texts)} rows"


def _tokenizer_file(recipe: Any) -> Optional[Path]:
    from finetune.builtin import builtin_model_dir, is_builtin

    reference = recipe.model.tokenizer or recipe.model.name_or_path
    folder = builtin_model_dir(reference) if is_builtin(reference) else Path(reference).expanduser()
    path = folder / "tokenizer.json"
    return path if path.is_file() else None


def _sample_texts(source: Any) -> list[str]:
    import itertools

    from finetune.data.formats import Chat, Prompted, RowProblem, Text, to_example
    from finetune.data.sources import data_files
    from finetune.data.validate import iter_rows

    texts = []
    for _, row in itertools.islice(iter_rows(data_files(Path(source.path).expanduser(), source.split)[0]), SAMPLE_ROWS):
        try:
            example = to_example(row, source.spec)
        except RowProblem:
            continue
        if isinstance(example, Prompted):
            texts.append(example.prompt + example.response)
        elif isinstance(example, Text):
            texts.append(example.text)
        elif isinstance(example, Chat):
            texts.append("".join(m["content"] for m in example.messages if isinstance(m.get("content"), str)))
    return texts


def data_image_tokens(recipe: Any) -> Optional[int]:
    """The most image tokens one row of a VLM's local data holds (finetune.data.validate reads every row's images
    from their headers), or None when the data is not read here (a hub source, too large, bad rows)."""
    from finetune.data.images import vision_data
    from finetune.data.sources import SourceProblem, data_files, sources_of
    from finetune.recipe.references import is_local
    from finetune.data.validate import validate

    if not all(is_local(s.path) for s in sources_of(recipe.data)):
        return None
    sources = sources_of(recipe.data, vision=vision_data(recipe, download=False))
    try:
        if sum(f.stat().st_size for s in sources for f in data_files(Path(s.path).expanduser(), s.split)) > MAX_BYTES:
            return None
    except (SourceProblem, OSError):
        return None
    checked = validate(sources)
    tokens = [t for check in checked.checks for t in check.image_tokens]
    return max(tokens) if tokens and checked.ok else None
