"""The rows of TRL's objectives as registered row formats (finetune.data.formats.register_format), so one
mechanism checks them before launch (finetune.data.validate: every row, one cap, one report, the bulk pass)
and reads them for training (`load_rows`: mixtures by weight or samples like SFT's).

    pairs (dpo, orpo, simpo, reward): prompt / chosen / rejected
    kto:                              prompt / completion / label
    prompts (grpo):                   the prompt of a `prompt`, messages, sharegpt or alpaca row; every other
                                      column goes to the reward functions (the answer of an alpaca or
                                      conversation row too, as `answer`)

Each text column is either a string or a list of chat messages ({role, content}) rendered with the chat
template; one row does not mix the two (TRL tokenizes a row one way or the other). `label` is a boolean.
CSV cells are text: a JSON list of messages in a cell is read as one, `true`/`false` as a label.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Optional

from finetune.data.formats import (CHAT_FORMATS, ROLES, Columns, RowProblem, RowSpec, alpaca_prompt, chat_turn,
                                   register_format, text_column)
from finetune.objectives import OBJECTIVES

_BOOLEANS = {"true": True, "false": False}


def _users(row_format: str) -> str:
    names = [o.name for o in OBJECTIVES.values() if o.row_format == row_format]
    return ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else names[0]


def _decoded(value: Any) -> Any:
    """A CSV cell holding a JSON list of messages is that list."""
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            decoded = json.loads(value)
        except json.JSONDecodeError:
            return value
        return decoded if isinstance(decoded, list) else value
    return value


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
    return {c: _decoded(row[names[c]]) if c != "label" else row[names[c]] for c in wanted}


def _same_kind(values: dict[str, Any], spec: RowSpec) -> None:
    kinds = {}
    for column, value in values.items():
        if column == "label":
            continue
        kinds[spec.column(column)] = _kind(value, spec.column(column), column == "prompt")
    if len(set(kinds.values())) > 1:
        shown = ", ".join(f"`{c}` is {k}" for c, k in kinds.items())
        raise RowProblem(f"mixes text and message lists ({shown}): use one form for the whole row")


def _kind(value: Any, column: str, may_be_blank: bool = False) -> str:
    if isinstance(value, str):
        if not value.strip() and not may_be_blank:
            raise RowProblem(f"`{column}` is empty")
        return "text"
    if isinstance(value, list):
        if not value:
            raise RowProblem(f"`{column}` is an empty list of messages")
        for i, message in enumerate(value):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                    or not isinstance(message.get("content"), str):
                raise RowProblem(f"`{column}`[{i}] must be an object with text `role` and `content`")
            if message["role"] not in ROLES:  # as SFT rows (finetune.data.formats): TRL would train it as text
                raise RowProblem(f"`{column}`[{i}]: unknown role `{message['role'][:40]}` (known: {', '.join(ROLES)})")
        return "messages"
    raise RowProblem(f"`{column}` must be text or a list of {{role, content}} messages, got {type(value).__name__}")


def pairs(row: Mapping[str, Any], spec: RowSpec) -> Columns:
    hint = "; kto rows are prompt/completion/label" if "completion" in row and "chosen" not in row else ""
    values = _columns_of(row, spec, ("prompt", "chosen", "rejected"), hint)
    _same_kind(values, spec)
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
    _same_kind(values, spec)
    return Columns(values)


def prompts(row: Mapping[str, Any], spec: RowSpec) -> Columns:
    """GRPO: the prompt (text or messages), a reference answer where the row has one, the other columns."""
    answer: Optional[str] = None
    if spec.format in CHAT_FORMATS:
        prompt, answer, used = _chat_prompt(row, spec)
    elif spec.format == "alpaca":
        instruction, output = text_column(row, spec, "instruction"), text_column(row, spec, "output", required=False)
        prompt, answer = alpaca_prompt(instruction, text_column(row, spec, "input", required=False)), output
        used = {spec.column(c) for c in ("instruction", "input", "output")}
    elif spec.format == "prompt":
        name = spec.column("prompt")
        if row.get(name) is None:
            found = ", ".join(f"`{k}`" for k in row) or "none"
            raise RowProblem(f"no `{name}` column (format prompt needs it; found {found})")
        prompt, used = _decoded(row[name]), {name}
        _kind(prompt, name)
    else:
        raise RowProblem(f"objective grpo reads prompts from formats prompt, messages, sharegpt or alpaca, not {spec.format}")
    values = {"prompt": prompt}
    values.update({k: v for k, v in row.items() if k not in used and k != "prompt"})
    if answer is not None:
        values.setdefault("answer", answer)
    return Columns(values)


def _chat_prompt(row: Mapping[str, Any], spec: RowSpec) -> tuple[list[dict[str, Any]], Optional[str], set[str]]:
    """The turns up to the last assistant turn are the prompt; that turn, if any, is the reference answer."""
    column = spec.column("messages")
    raw = _decoded(row.get(column))
    if not isinstance(raw, list) or not raw:
        raise RowProblem(f"`{column}` must be a non-empty list of turns (format {spec.format})")
    roles = spec.role_map()
    messages = [chat_turn(turn, i, column, spec, roles)[0] for i, turn in enumerate(raw)]
    system = text_column(row, spec, "system", required=False) if spec.column("system") in row else None
    if system:
        messages.insert(0, {"role": "system", "content": system})
    answer = None
    if messages[-1]["role"] == "assistant":
        answer = messages.pop()["content"]
    if not messages or messages[-1]["role"] == "assistant" or all(m["role"] == "system" for m in messages):
        raise RowProblem(f"`{column}` has no user turn to prompt with")
    return messages, answer if isinstance(answer, str) else None, {column, spec.column("system")}


register_format("pairs", pairs)
register_format("kto", kto)
register_format("prompts", prompts)


# ------------------------------------------------------------------------------------------------
# Reading for training (the ranks; preflight has checked every local row with the same converters)


def load_rows(data: Any, objective: str, seed: int):
    """The rows of `objective` as a `datasets.Dataset` in TRL's column names, sources mixed like SFT's
    (finetune.data.mix). Hub sources are read here and converted row by row; a bad row is a DataError."""
    import datasets

    from finetune.data.formats import to_example
    from finetune.data.mix import MixError, mixture, targets
    from finetune.data.sources import sources_of
    from finetune.data.tokenize import DataError, load_raw

    sources = sources_of(data, objective)
    per_source = []
    for source in sources:
        rows = []
        for number, row in enumerate(load_raw(source.path, source.split), 1):
            try:
                rows.append(to_example(row, source.spec).values)
            except RowProblem as exc:
                raise DataError(f"{source.path}: row {number}: {exc}") from None
        per_source.append(rows)
    if len(sources) == 1 and sources[0].weight is None and sources[0].samples is None:
        return datasets.Dataset.from_list(per_source[0])
    try:
        shares = targets([len(rows) for rows in per_source], [s.weight for s in sources],
                         [s.samples for s in sources], [s.path for s in sources])
    except MixError as exc:
        raise DataError(str(exc)) from None
    return datasets.Dataset.from_list([per_source[s][i] for s, i in mixture(shares, seed)])

