"""Preference rows (and the SFT adapter a run continues from), checked before launch: every row of every file, each problem named by file and line.

    dpo, orpo, simpo: prompt / chosen / rejected   (kto: prompt / completion / label)

Each text column is either a string or a list of chat messages ({role, content}) rendered with the chat
template; one row does not mix the two (TRL tokenizes a row one way or the other). `label` is a boolean
(CSV: true/false). Reading every row costs one pass over the file, in this process, without torch: a bad
row found after launch costs every rank's start-up on rented GPUs.

finetune.run.preflight's dataset step calls `check_files`; it returns problems instead of raising, so all of
them (up to MAX_PROBLEMS) are reported at once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from finetune.data.formats import ROLES

PAIRED = ("prompt", "chosen", "rejected")
UNPAIRED = ("prompt", "completion", "label")
MAX_PROBLEMS = 10
_CSV_BOOLEANS = {"true": True, "false": False}


def columns_for(objective: str) -> tuple[str, ...]:
    return UNPAIRED if objective == "kto" else PAIRED


def check_data(data, objective: str) -> tuple[list[str], list[str]]:
    """(notes, errors) for the recipe's data section: one source (data.path), every row checked when local."""
    from finetune.data.sources import SourceProblem, data_files
    from finetune.recipe.references import is_local

    if data.sources:
        return [], [f"dataset: objective {objective} reads one file or folder (data.path); data.sources mixtures "
                    "are for sft"]
    if not is_local(data.path):
        return [f"dataset {data.path}: a hub id, not checked here (read at launch; needs network)"], []
    try:
        files = data_files(Path(data.path).expanduser(), data.split)
    except SourceProblem as exc:
        return [], [f"dataset {exc}"]
    count, problems = check_files(files, objective)
    if problems:
        return [], [f"dataset {problem}" for problem in problems]
    return [f"dataset {data.path}: {count} {objective} row(s), all look right"], []


def check_files(files: list[Path], objective: str) -> tuple[int, list[str]]:
    """(rows read, problems) over every row of `files` for `objective`."""
    from finetune.data.validate import Unreadable

    count, problems = 0, []
    for path in files:
        try:
            for where, row in rows_of(path):
                count += 1
                problem = row_problem(row, objective)
                if problem:
                    problems.append(f"{where}: {problem}")
                    if len(problems) >= MAX_PROBLEMS:
                        return count, problems + ["(stopped after the first problems)"]
        except Unreadable as exc:
            problems.append(str(exc))
    if count == 0 and not problems:
        problems.append(f"{files[0] if files else 'data.path'}: no rows")
    return count, problems


def rows_of(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, row) through the data package's readers (JSON lines, JSON, CSV, parquet, Arrow); CSV cells
    become message lists and booleans the way a preference row needs them."""
    from finetune.data.validate import iter_rows

    for where, row in iter_rows(path):
        yield where, _from_csv(row) if path.suffix == ".csv" and isinstance(row, dict) else row


def _from_csv(row: dict[str, Any]) -> dict[str, Any]:
    """CSV cells are text: a JSON list in a cell is a message list, true/false a label."""
    out: dict[str, Any] = {}
    for key, value in row.items():
        if isinstance(value, str) and value.lstrip().startswith("["):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                pass
        elif key == "label" and isinstance(value, str) and value.strip().lower() in _CSV_BOOLEANS:
            value = _CSV_BOOLEANS[value.strip().lower()]
        out[key] = value
    return out


def row_problem(row: Any, objective: str) -> str | None:
    """What is wrong with one row for `objective`, or None."""
    from finetune.data.validate import BadRow

    if isinstance(row, BadRow):
        return row.message
    if not isinstance(row, dict):
        return f"expected an object with named columns, got {type(row).__name__}"
    wanted = columns_for(objective)
    nulls = [c for c in wanted if c in row and row[c] is None]
    if nulls:  # there, but null: not the same mistake as a column the file does not have
        return f"{' and '.join(f'`{c}`' for c in nulls)} {'is' if len(nulls) == 1 else 'are'} null"
    missing = [c for c in wanted if c not in row]
    if missing:
        found = ", ".join(f"`{k}`" for k in row) or "none"
        hint = "; kto rows are prompt/completion/label" if objective != "kto" and "completion" in row else \
            "; paired rows are for dpo, orpo and simpo" if objective == "kto" and "chosen" in row else ""
        return (f"no {' or '.join(f'`{c}`' for c in missing)} column (objective: {objective} needs "
                f"{', '.join(f'`{c}`' for c in wanted)}; found {found}){hint}")
    if objective == "kto" and not isinstance(row["label"], bool):
        return f"`label` must be true or false, got {type(row['label']).__name__} {row['label']!r:.40}"
    texts = [c for c in wanted if c != "label"]
    kinds = {}
    for column in texts:
        kind, problem = _kind(row[column], column)
        if problem:
            return problem
        kinds[column] = kind
    if len(set(kinds.values())) > 1:
        shown = ", ".join(f"`{c}` is {k}" for c, k in kinds.items())
        return f"mixes text and message lists ({shown}): use one form for the whole row"
    return None


def _kind(value: Any, column: str) -> tuple[str, str | None]:
    if isinstance(value, str):
        return "text", None if value.strip() or column == "prompt" else f"`{column}` is empty"
    if isinstance(value, list):
        if not value:
            return "messages", f"`{column}` is an empty list of messages"
        for i, message in enumerate(value):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                    or not isinstance(message.get("content"), str):
                return "messages", f"`{column}`[{i}] must be an object with text `role` and `content`"
            if message["role"] not in ROLES:  # as SFT rows (finetune.data.formats): TRL would train it as text
                return "messages", (f"`{column}`[{i}]: unknown role `{message['role'][:40]}` "
                                    f"(known: {', '.join(ROLES)})")
        return "messages", None
    return "", f"`{column}` must be text or a list of {{role, content}} messages, got {type(value).__name__}"
