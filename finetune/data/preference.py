"""The rows of the preference objectives as registered row formats (finetune.data.formats.register_format), so one
mechanism checks them before launch (finetune.data.validate: every row, one cap, one report, the bulk pass) and
reads them for training (finetune.data.trl_rows.load_rows). GRPO's prompts: finetune.data.grpo.

    pairs (dpo, orpo, simpo, reward): prompt / chosen / rejected
    kto:                              prompt / completion / label

Each text column is either a string or a list of chat messages ({role, content}) rendered with the chat
template; one row does not mix the two (TRL tokenizes a row one way or the other). `label` is a boolean.
CSV cells are text: a JSON list of messages in a cell is read as one, `true`/`false` as a label.
"""

from __future__ import annotations

from typing import Any, Mapping

from finetune.data.formats import Columns, RowProblem, RowSpec, cell_kind, decoded_cell, register_format
from finetune.objectives import OBJECTIVES

_BOOLEANS = {"true": True, "false": False}


def _users(row_format: str) -> str:
    names = [o.name for o in OBJECTIVES.values() if o.row_format == row_format]
    return ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else names[0]


def _columns_of(row: Mapping[str, Any], spec: RowSpec, wanted: tuple[str, ...], hint: str) -> dict[str, Any]:
    names = {c: spec.column(c) for c in wanted}
    nulls = [names[c] for c in wanted if names[c] in row and row[names[c]] is None]
    if nulls:  # there, but null: not the same mistake as a column the file does not have
        raise RowProblem(f"{' and '.join(f'`{c}`' for c in nulls)} {'is' if len(nulls) == 1 else 'are'} null")
    missing = [names[c] for c in wanted if names[c] not in row]
    if missing:
        found = ", ".join(f"`{k}`" for k in row) or "none"
        raise RowProblem(f"no {' or '.join(f'`{c}`' for c in missing)} column ({'/'.join(wanted)} rows need "
                         f"{', '.join(f'`{names[c]}`' for c in wanted)}; found {found}){hint}")
    return {c: decoded_cell(row[names[c]]) if c != "label" else row[names[c]] for c in wanted}


def _samecell_kind(values: dict[str, Any], spec: RowSpec) -> None:
    kinds = {}
    for column, value in values.items():
        if column == "label":
            continue
        kinds[spec.column(column)] = cell_kind(value, spec.column(column), column == "prompt")
    if len(set(kinds.values())) > 1:
        shown = ", ".join(f"`{c}` is {k}" for c, k in kinds.items())
        raise RowProblem(f"mixes text and message lists ({shown}): use one form for the whole row")


def pairs(row: Mapping[str, Any], spec: RowSpec) -> Columns:
    hint = "; kto rows are prompt/completion/label" if "completion" in row and "chosen" not in row else ""
    values = _columns_of(row, spec, ("prompt", "chosen", "rejected"), hint)
    _samecell_kind(values, spec)
    return Columns(values)


def kto(row: Mapping[str, Any], spec: RowSpec) -> Columns:
    hint = f"; paired rows are for {_users('pairs')}" if "chosen" in row else ""
    values = _columns_of(row, spec, ("prompt", "completion", "label"), hint)
    label = values["label"]
    if isinstance(label, str) and label.strip().lower() in _BOOLEANS:
        label = _BOOLEANS[label.strip().lower()]
    if not isinstance(label, bool):
        raise RowProblem(f"`{spec.column('label')}` must be true or false, got {type(label).__name__} {label!r:.40}")
    values["label"] = label
    _samecell_kind(values, spec)
    return Columns(values)


register_format("pairs", pairs)
register_format("kto", kto)
