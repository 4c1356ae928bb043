"""GRPO's rows as a registered row format (finetune.data.formats.register_format): `prompts`, read from a `prompt`,
messages, sharegpt or alpaca row. The prompt is what the policy completes; every other column goes to the reward
functions (the answer of an alpaca or conversation row too, as `answer`). Checked before launch like every row
(finetune.data.validate), read for training by finetune.data.trl_rows.load_rows.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from finetune.data.formats import (
    CHAT_FORMATS, Columns, RowProblem, RowSpec, alpaca_prompt, cell_kind, chat_turn, decoded_cell, register_format,
    text_column,
)


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
        prompt, used = decoded_cell(row[name]), {name}
        cell_kind(prompt, name)
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
    raw = decoded_cell(row.get(column))
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


register_format("prompts", prompts)
