"""Row formats: one row of a source -> one example with what it trains on.

Three shapes come out (`to_example`):
- `Prompted` (alpaca): a prompt and a response; the loss covers the response and the EOS after it.
- `Text` (text): every token is trained.
- `Chat` (messages, sharegpt): OpenAI-style messages rendered with the chat template, and one train flag
  per message. Assistant turns train by default; a message with `"train": false` (or axolotl's
  `"weight": 0`) stays in the context but out of the loss; system, user and tool turns never train.

Role names are mapped to system / user / assistant / tool: ShareGPT's `human`, `gpt`, `observation`,
`function_call` ... by `SHAREGPT_ROLES`, anything else by the source's `roles:` map. `function_call`
turns become assistant tool calls, `observation` turns tool results.

A format is a function row -> example that raises `RowProblem`; `register_format` adds one (a
preference format registers its own row check this way).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Union

from finetune import objectives
from finetune.errors import FinetuneError

ROLES = ("system", "user", "assistant", "tool")
# ShareGPT as LLaMA-Factory, FastChat and axolotl write it.
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "model": "assistant",
                  "function_call": "assistant", "observation": "tool", "tool": "tool", "function": "tool",
                  "ipython": "tool"}
MESSAGE_ROLES = {role: role for role in ROLES}
# The columns each format reads, by canonical name; a source's `columns:` renames them.
DEFAULT_COLUMNS = {
    "alpaca": {"instruction": "instruction", "input": "input", "output": "output"},
    "text": {"text": "text"},
    "messages": {"messages": "messages", "role": "role", "content": "content", "system": "system"},
    "sharegpt": {"messages": "conversations", "role": "from", "content": "value", "system": "system"},
    # The rows of TRL's objectives (finetune.objectives; checked by finetune.data.preference).
    "pairs": {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"},
    "kto": {"prompt": "prompt", "completion": "completion", "label": "label"},
    "prompt": {"prompt": "prompt"},
}
ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
ALPACA_PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"


class RowProblem(FinetuneError, ValueError):
    """One row cannot be used: the message names the column (the caller adds file and line)."""


@dataclass
class Prompted:
    prompt: str
    response: str


@dataclass
class Text:
    text: str


@dataclass
class Chat:
    messages: list[dict[str, Any]]
    train: list[bool] = field(default_factory=list)  # one flag per message


@dataclass
class Columns:
    """A row of one of TRL's objectives, by TRL's column names (prompt/chosen/rejected, prompt/completion/label,
    GRPO's prompt and the columns handed to its rewards): TRL tokenizes it itself."""
    values: dict[str, Any]


Example = Union[Prompted, Text, Chat, Columns]


@dataclass(frozen=True)
class RowSpec:
    """How to read a source's rows: format, column names, role map (resolved by finetune.data.sources).
    `reader`: the registered format that converts the rows when it is not `format` itself (GRPO reads the
    prompt out of a messages, sharegpt, alpaca or prompt row: finetune.data.preference; a VLM's rows with their
    images: finetune.data.images)."""
    format: str = "alpaca"
    columns: Mapping[str, str] = field(default_factory=dict)
    roles: Mapping[str, str] = field(default_factory=dict)
    reader: Optional[str] = None
    # A vision-language model's data (finetune.data.images.ImageSpec): where images are and what they cost.
    images: Any = None

    def __post_init__(self) -> None:
        # Resolved once: validation asks for a column name several times per row, millions of rows.
        object.__setattr__(self, "_names", {**DEFAULT_COLUMNS.get(self.format, {}), **self.columns})

    def column(self, name: str) -> str:
        return self._names.get(name, name)

    def role_map(self) -> dict[str, str]:
        base = SHAREGPT_ROLES if self.format == "sharegpt" else MESSAGE_ROLES
        return {**base, **self.roles}


def text_column(row: Mapping[str, Any], spec: RowSpec, name: str, required: bool = True) -> Optional[str]:
    column = spec.column(name)
    value = row.get(column)
    if value is None:
        if required:
            found = ", ".join(f"`{k}`" for k in row) or "none"
            raise RowProblem(f"no `{column}` column (format {spec.format} needs it; found {found}){_hint(row, spec, name)}")
        return None
    if not isinstance(value, str):
        raise RowProblem(f"`{column}` must be text, got {type(value).__name__}")
    return value


# The names other data sets give a column, by the name a format reads (issue 24: name the fix).
SYNONYMS = {
    "output": ("response", "completion", "answer", "target", "chosen"),
    "instruction": ("prompt", "question", "query", "input_text"),
    "text": ("content", "document", "body", "sentence"),
    "messages": ("dialog", "dialogue", "conversation", "conversations", "chat", "turns", "messages"),
}


def _hint(row: Mapping[str, Any], spec: RowSpec, name: str) -> str:
    """Another format whose columns the row has, else the `columns:` entry that maps a column it has."""
    for other, columns in (("alpaca", {"instruction", "output"}), ("text", {"text"}), ("messages", {"messages"}),
                           ("sharegpt", {"conversations"})):
        if other != spec.format and columns <= set(row):
            return f"; did you mean format: {other}?"
    used = set(spec._names.values())
    unused = [k for k in row if k not in used and (name != "messages" or isinstance(row[k], (list, str)))]
    likely = [k for k in unused if k.lower() in SYNONYMS.get(name, ())] or (unused if len(unused) == 1 else [])
    return f"; add `columns: {{{name}: {likely[0]}}}` to the data source" if likely else ""


def alpaca(row: Mapping[str, Any], spec: RowSpec) -> Prompted:
    instruction, output = text_column(row, spec, "instruction"), text_column(row, spec, "output")
    if not output.strip():
        raise RowProblem(f"`{spec.column('output')}` is empty: nothing to train on")
    return Prompted(alpaca_prompt(instruction, text_column(row, spec, "input", required=False)), output)


def alpaca_chat_template() -> str:
    """The Alpaca prompt as a Jinja chat template, for servers (finetune.export.prompt, finetune.serve): every user
    turn is BOS + the prompt, every assistant turn the reply + EOS, as `finetune chat` lays turns out; a system
    turn is not rendered (Alpaca rows have none, so the model never trained on one)."""
    before, after = ALPACA_PROMPT.split("{instruction}")
    assert not any(c in before + after for c in "{}")  # literal text in the template: no Jinja syntax inside
    return ("{% for message in messages %}"
            "{% if message['role'] == 'user' %}{{ bos_token }}" + before + "{{ message['content'] }}" + after +
            "{% elif message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}{% endif %}"
            "{% endfor %}")


def chat_format(recipe, rows_kind: Optional[str] = None) -> str:
    """How to prompt a model trained on `recipe`'s data (chat, export, serve): the chat template when any source
    was a conversation (sharegpt trains through it too), else the format of its sources. TRL's objectives prompt
    with their rows as they are: `rows_kind` (finetune.data.show.prompt_kind: messages, alpaca or text; None when
    the rows are not here: the chat template)."""
    if not objectives.get(recipe.objective).reads_data_format:
        return rows_kind if rows_kind in ("alpaca", "text") else "messages"
    formats = recipe.data.source_formats()  # grpo: prompts read from these formats (a `prompt` column: messages)
    return "messages" if any(f in ("messages", "sharegpt", "prompt") for f in formats) else formats[0]


def alpaca_prompt(instruction: str, extra: Optional[str] = None) -> str:
    if extra:
        return ALPACA_PROMPT_WITH_INPUT.format(instruction=instruction, input=extra)
    return ALPACA_PROMPT.format(instruction=instruction)


def text(row: Mapping[str, Any], spec: RowSpec) -> Text:
    value = text_column(row, spec, "text")
    if not value.strip():
        raise RowProblem(f"`{spec.column('text')}` is empty: nothing to train on")
    return Text(value)


def chat(row: Mapping[str, Any], spec: RowSpec) -> Chat:
    column = spec.column("messages")
    raw = row.get(column)
    if raw is None:
        found = ", ".join(f"`{k}`" for k in row) or "none"
        raise RowProblem(f"no `{column}` column (format {spec.format} needs a list of turns; found {found}){_hint(row, spec, 'messages')}")
    if isinstance(raw, str):  # CSV cells are text; a JSON-encoded list in a cell is what people put there
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            raise RowProblem(f"`{column}` must be a list of turns, got text that is not JSON") from None
    if not isinstance(raw, list) or not raw:
        raise RowProblem(f"`{column}` must be a non-empty list of turns")
    messages: list[dict[str, Any]] = []
    train: list[bool] = []
    system = text_column(row, spec, "system", required=False) if spec.column("system") in row else None
    if system:
        messages.append({"role": "system", "content": system})
        train.append(False)
    roles = spec.role_map()
    for i, turn in enumerate(raw):
        message, trains = chat_turn(turn, i, column, spec, roles)
        messages.append(message)
        train.append(trains)
    if not any(train):
        raise RowProblem(f"`{column}` has no assistant turn to train on")
    return Chat(messages, train)


def chat_turn(turn: Any, i: int, column: str, spec: RowSpec, roles: dict[str, str]) -> tuple[dict[str, Any], bool]:
    role_key, content_key = spec.column("role"), spec.column("content")
    where = f"{column}[{i}]"
    if not isinstance(turn, dict):
        raise RowProblem(f"{where} must be an object with `{role_key}` and `{content_key}`, got {type(turn).__name__}")
    name = turn.get(role_key)
    if not isinstance(name, str):
        raise RowProblem(f"{where} has no `{role_key}` (text)")
    role = roles.get(name)
    if role not in ROLES:
        known = ", ".join(sorted(roles))
        raise RowProblem(f"{where}: unknown role `{name}` (known: {known}; map it with roles: {{{name}: user|assistant|system|tool}})")
    content = turn.get(content_key)
    tool_calls = turn.get("tool_calls")
    if content is not None and not isinstance(content, (str, list)):
        raise RowProblem(f"{where}.{content_key} must be text, got {type(content).__name__}")
    if content is None and not tool_calls:
        raise RowProblem(f"{where} has no `{content_key}`")
    message: dict[str, Any] = {"role": role}
    if name == "function_call" and isinstance(content, str):
        call = _function_call(content)
        if call is not None:
            message["tool_calls"] = [call]
            content = None
    if content is not None:
        message["content"] = content
    for key in ("tool_calls", "tool_call_id", "name", "reasoning_content"):
        if turn.get(key) is not None:
            message[key] = turn[key]
    return message, role == "assistant" and _trains(turn, where)


def _trains(turn: dict, where: str) -> bool:
    """The per-message switch: `train: false`, or axolotl's `weight: 0`."""
    flag = turn.get("train", True)
    if not isinstance(flag, bool):
        raise RowProblem(f"{where}.train must be true or false, got {flag!r}")
    weight = turn.get("weight", 1)
    if weight not in (0, 1) or isinstance(weight, bool):
        raise RowProblem(f"{where}.weight must be 0 or 1, got {weight!r}")
    return flag and weight == 1


def _function_call(value: str) -> Optional[dict[str, Any]]:
    """LLaMA-Factory's function_call turn holds `{"name": ..., "arguments": ...}` as JSON text."""
    try:
        call = json.loads(value)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    return {"type": "function", "function": {"name": call["name"], "arguments": call.get("arguments", {})}}


FORMATS: dict[str, Callable[[Mapping[str, Any], RowSpec], Any]] = {
    "alpaca": alpaca, "text": text, "messages": chat, "sharegpt": chat,
}
CHAT_FORMATS = ("messages", "sharegpt")


def register_format(name: str, convert: Callable[[Mapping[str, Any], RowSpec], Any]) -> None:
    """Add a row format: `convert(row, spec)` returns an example or raises RowProblem (validation and
    tokenization both call it, so a check written once runs on every row before launch)."""
    FORMATS[name] = convert


def to_example(row: Any, spec: RowSpec) -> Any:
    if not isinstance(row, dict):
        raise RowProblem(f"expected an object with named columns, got {type(row).__name__}")
    try:
        convert = FORMATS[spec.reader or spec.format]
    except KeyError:
        raise RowProblem(f"unknown format `{spec.reader or spec.format}` (known: {', '.join(FORMATS)})") from None
    return convert(row, spec)


# ------------------------------------------------------------------------------------------------
# Cells of TRL objectives' rows (finetune.data.preference, finetune.data.grpo)


def decoded_cell(value: Any) -> Any:
    """A CSV cell holding a JSON list of messages is that list."""
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            decoded = json.loads(value)
        except json.JSONDecodeError:
            return value
        return decoded if isinstance(decoded, list) else value
    return value


def cell_kind(value: Any, column: str, may_be_blank: bool = False) -> str:
    """"text" or "messages": what a column of a TRL objective's row holds (TRL tokenizes a row one way or the other)."""
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
