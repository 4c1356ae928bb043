"""`finetune data show RECIPE`: one example as the run will train it, its trained tokens marked (issue 24;
axolotl's `preprocess --debug` is what users know).

The row goes through the same functions as training (finetune.data.formats.to_example and
finetune.data.tokenize.tokenize_examples, with the recipe's tokenizer, max_length, mask_prompt and think),
so what it shows between the markers is exactly what the loss sees.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from finetune import objectives
from finetune.errors import FinetuneError

TRAINED_START, TRAINED_END = "[[", "]]"


class ShowError(FinetuneError, ValueError):
    """Why no example can be shown (one line)."""


@dataclass
class Shown:
    where: str  # file and row
    fmt: str
    tokens: int
    trained: int
    text: str  # the decoded sequence, trained spans between TRAINED_START and TRAINED_END
    truncated: bool


def show_example(recipe, tokenizer, row_number: int = 1) -> Shown:
    """Row `row_number` (1-based) of the recipe's first local source, tokenized as training does with
    `tokenizer` (the run's: finetune.tokenizer.load_tokenizer). SFT only: TRL's objectives tokenize their rows
    themselves (finetune.train.show_rows)."""
    row, where, source = nth_row(recipe, row_number)
    from finetune.data import vision_encode  # noqa: F401 - registers the tokenization of rows with images
    from finetune.data.formats import RowProblem
    from finetune.data.tokenize import RowError, tokenize_examples

    try:
        rows = tokenize_examples([row], tokenizer, source.format, recipe.data.max_length, recipe.data.mask_prompt,
                                 spec=source.spec, think=recipe.data.think)
    except RowProblem as exc:
        raise ShowError(f"{where}: {exc}") from None
    except RowError as exc:  # the chat template's refusal, numbered in a batch of one
        raise ShowError(f"{where}: {str(exc).removeprefix(f'example {exc.index}: ')}") from None
    if not rows:
        raise ShowError(f"{where}: nothing to train on after truncation to data.max_length {recipe.data.max_length}")
    ids, labels = rows[0]["input_ids"], rows[0]["labels"]
    return Shown(where, source.format, len(ids), sum(1 for label in labels if label != -100),
                 marked_text(tokenizer, ids, labels), len(ids) >= recipe.data.max_length)


def nth_row(recipe, row_number: int) -> tuple[Any, str, Any]:
    """(row, `file:line`, source) of row `row_number` (1-based) of the recipe's first local source, its source
    read as the recipe's objective reads it (finetune.data.sources.sources_of)."""
    from finetune.data.sources import SourceProblem, data_files, sources_of
    from finetune.recipe.references import is_local
    from finetune.data.validate import BadRow, iter_rows

    from finetune.data.images import vision_data

    vision = vision_data(recipe) if objectives.get(recipe.objective).vision else None  # a VLM's rows, with their images
    source = next((s for s in sources_of(recipe.data, recipe.objective, vision=vision) if is_local(s.path)), None)
    if source is None:
        raise ShowError("no local data source in the recipe (hub data sets are read at launch)")
    try:
        files = data_files(Path(source.path).expanduser(), source.split)
    except SourceProblem as exc:
        raise ShowError(str(exc)) from None
    row, where = _nth_row((r for f in files for r in iter_rows(f)), row_number, source.path)
    if isinstance(row, BadRow):
        raise ShowError(f"{where}: {row.message}")
    return row, where, source


def _nth_row(rows, number: int, path: str) -> tuple[Any, str]:
    for index, (where, row) in enumerate(rows, start=1):
        if index == number:
            return row, where
    raise ShowError(f"{path}: has fewer than {number} row(s)")


def marked_text(tokenizer, ids: list[int], labels: list[int]) -> str:
    """The decoded sequence with each run of trained tokens (label != -100) between the markers. Runs are
    decoded whole, so a word split over tokens reads as one word."""
    out, start = [], 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or (labels[end] != -100) != (labels[start] != -100):
            text = tokenizer.decode(ids[start:end], skip_special_tokens=False)
            out.append(f"{TRAINED_START}{text}{TRAINED_END}" if labels[start] != -100 else text)
            start = end
    return "".join(out)


# The prompt format a run trains with, read off its rows (chat names it; lint R120 compares it with the SFT run a
# preference run continues).


def prompt_kind(recipe) -> Optional[str]:
    """How TRL prompts the model with a preference recipe's rows: "messages" (chat template), "alpaca" (text
    prompts written as the Alpaca prompt), "text" (as written), or None when the first local row is not here."""
    from finetune.data.formats import ALPACA_PROMPT, RowProblem, to_example

    try:
        row, _, source = nth_row(recipe, 1)
        prompt = to_example(row, source.spec).values.get("prompt")
    except (ShowError, RowProblem, OSError, ValueError):
        return None
    if isinstance(prompt, list):
        return "messages"
    if isinstance(prompt, str):
        return "alpaca" if prompt.startswith(ALPACA_PROMPT.split("{")[0]) else "text"
    return None


def trained_format(recipe) -> str:
    """finetune.data.formats.chat_format, for a preference run from the kind of its rows (issue 34: SFT on the
    Alpaca prompt, then DPO on text rows, and chat said "messages (as the run trained)")."""
    from finetune.data.formats import chat_format

    own_rows = not objectives.get(recipe.objective).reads_data_format
    return chat_format(recipe, prompt_kind(recipe) if own_rows else None)


def sft_prompt_kind(formats: list[str]) -> str:
    """The same for an SFT run's data formats: a conversation trains through the chat template."""
    from finetune.data.formats import CHAT_FORMATS

    return "messages" if any(f in CHAT_FORMATS for f in formats) else formats[0]
