"""The prompt a run trained with, in the forms servers read: a Jinja chat template (GGUF's
`tokenizer.chat_template`, vLLM's and SGLang's `--chat-template`), an Ollama Go `TEMPLATE`, and the stop tokens.

The demo trains the Alpaca prompt while its tokenizer carries a `<|user|>` chat template (issue 36): a server that
prompts with the tokenizer's template talks to the model in a format it never saw. So the trained prompt wins:
- alpaca: the prompt finetune.data.formats builds, one turn after another as `finetune chat` lays them out
  (BOS + prompt, the reply + EOS);
- messages / sharegpt: the chat template the run trained with (the run's tokenizer, which holds the recipe's);
- text: no chat template (the model continues plain text).

The Go template is derived, not hand-written per model family: the Jinja template is rendered on conversations whose
contents are sentinels, the text around each sentinel is the role's prefix and suffix, and the pieces are checked by
rebuilding other conversations from them (one to three turns, with and without a system turn) and comparing with the
Jinja renders. A template that does not decompose that way gets no TEMPLATE, and the caller says so.

No torch here; rendering uses jinja2's sandbox (transformers' choice for chat templates too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from finetune.data.formats import alpaca_chat_template

# Three different, unlikely strings: the text between them in a render is the template's own.
_SENTINELS = {"system": "\x02SYS\x03", "user": "\x02USR\x03", "assistant": "\x02AST\x03"}


@dataclass
class TrainedPrompt:
    fmt: str                       # alpaca | messages | text
    chat_template: Optional[str]   # Jinja; None for text
    origin: str                    # how it was found, for the messages we print
    bos_token: str = ""
    eos_token: str = ""
    stops: list[str] = field(default_factory=list)   # token texts that end a reply
    tokenizer_template: Optional[str] = None         # the tokenizer's own template (None: it has none)

    @property
    def differs_from_tokenizer(self) -> bool:
        return self.chat_template is not None and self.chat_template != self.tokenizer_template


def trained_prompt(fmt: str, tokenizer_template: Optional[str], bos_token: str, eos_token: str,
                   end_of_turn: tuple[str, ...] = ()) -> TrainedPrompt:
    """The trained prompt for a run of format `fmt` (alpaca, messages, text) whose tokenizer holds
    `tokenizer_template`; `end_of_turn`: special tokens besides EOS that end a reply (generation_config's)."""
    if fmt == "alpaca":
        prompt = TrainedPrompt("alpaca", alpaca_chat_template(), "the Alpaca prompt the run trained with",
                               bos_token, eos_token, tokenizer_template=tokenizer_template)
    elif fmt == "messages":
        if not tokenizer_template:
            raise ValueError("the run trained on chat messages but its tokenizer has no chat template")
        prompt = TrainedPrompt("messages", tokenizer_template, "the chat template the run trained with",
                               bos_token, eos_token, tokenizer_template=tokenizer_template)
    else:
        prompt = TrainedPrompt("text", None, "plain text (the run trained on text rows: no chat template)",
                               bos_token, eos_token, tokenizer_template=tokenizer_template)
    prompt.stops = _stops(prompt, end_of_turn)
    return prompt


def _stops(prompt: TrainedPrompt, end_of_turn: tuple[str, ...]) -> list[str]:
    """EOS, the generation config's other end tokens, and the special token that ends an assistant turn in the
    template (`<|im_end|>`, `<|eot_id|>`...) when it is not EOS."""
    stops = [prompt.eos_token] if prompt.eos_token else []
    roles = role_pieces(prompt)
    if roles is not None:
        suffix = roles.suffix["assistant"]
        for token in end_of_turn:
            if token and token in suffix and token not in stops:
                stops.append(token)
    for token in end_of_turn:
        if token and token not in stops:
            stops.append(token)
    return stops


def render(template: str, messages: list[dict], bos_token: str, eos_token: str, add_generation_prompt: bool) -> str:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)  # transformers' settings
    env.globals["raise_exception"] = _raise
    return env.from_string(template).render(messages=messages, bos_token=bos_token, eos_token=eos_token,
                                            add_generation_prompt=add_generation_prompt)


def _raise(message: str):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


@dataclass
class RolePieces:
    """The text a template puts around each role's content, and after the last user turn for a reply."""
    first_user_prefix: str   # the first user turn's (it may carry BOS, or follow a system turn)
    prefix: dict[str, str]   # later turns'
    suffix: dict[str, str]
    generation: str          # after the last user turn: the assistant header
    system_first: Optional[str] = None  # what opens a conversation that starts with a system turn (its prefix)


def role_pieces(prompt: TrainedPrompt) -> Optional[RolePieces]:
    """The per-role prefix and suffix of the trained template, or None when it does not decompose (checked)."""
    if prompt.chat_template is None:
        return None
    from jinja2 import TemplateError

    try:
        pieces = _decompose(prompt)
        if pieces is not None and _rebuilds(prompt, pieces):
            return pieces
    except (TemplateError, ValueError, TypeError):
        pass
    return None


def _split(prompt: TrainedPrompt, roles: list[str], generation: bool) -> Optional[list[str]]:
    text = render(prompt.chat_template, [{"role": r, "content": _SENTINELS[r]} for r in roles],
                  prompt.bos_token, prompt.eos_token, generation)
    parts, rest = [], text
    for role in roles:
        before, found, rest = rest.partition(_SENTINELS[role])
        if not found:
            return None  # the template drops that turn (alpaca: a system turn)
        parts.append(before)
    return parts + [rest]


def _decompose(prompt: TrainedPrompt) -> Optional[RolePieces]:
    one = _split(prompt, ["user"], False)
    one_gen = _split(prompt, ["user"], True)
    two = _split(prompt, ["user", "assistant"], False)
    three = _split(prompt, ["user", "assistant", "user"], False)
    if None in (one, one_gen, two, three):
        return None
    first_user_prefix, user_suffix = one
    if not one_gen[1].startswith(user_suffix) or not two[1].startswith(user_suffix):
        return None
    generation = one_gen[1][len(user_suffix):]
    assistant_prefix, assistant_suffix = two[1][len(user_suffix):], two[2]
    if not three[2].startswith(assistant_suffix):
        return None
    user_prefix = three[2][len(assistant_suffix):]
    pieces = RolePieces(first_user_prefix, {"user": user_prefix, "assistant": assistant_prefix},
                        {"user": user_suffix, "assistant": assistant_suffix}, generation)
    system = _split(prompt, ["system", "user"], False)
    if system is not None:
        system_prefix, between = system[0], system[1]
        # After a system turn the user turn opens with the later-turn prefix (the BOS, if any, was the system's).
        if between.endswith(user_prefix):
            pieces.system_first = system_prefix
            pieces.suffix["system"] = between[:len(between) - len(user_prefix)]
    return pieces


def rebuild(pieces: RolePieces, messages: list[dict], add_generation_prompt: bool) -> Optional[str]:
    """A conversation laid out from the pieces, as the Go template lays it out (None: a system turn the
    pieces cannot place)."""
    out = []
    for index, message in enumerate(messages):
        role = message["role"]
        if role == "system":
            if index != 0 or pieces.system_first is None:
                return None
            out.append(pieces.system_first + message["content"] + pieces.suffix["system"])
        elif role == "user":
            first = index == 0
            out.append((pieces.first_user_prefix if first else pieces.prefix["user"]) + message["content"]
                       + pieces.suffix["user"])
        else:
            out.append(pieces.prefix["assistant"] + message["content"] + pieces.suffix["assistant"])
    if add_generation_prompt and messages and messages[-1]["role"] == "user":
        out.append(pieces.generation)
    return "".join(out)


_CHECKS = [
    ([("user", "Hi there")], True),
    ([("user", "What is 2+2?"), ("assistant", "4"), ("user", "And 3+3?")], True),
    ([("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d")], False),
    ([("system", "Be brief."), ("user", "Name a colour."), ("assistant", "Red."), ("user", "Another?")], True),
]


def _rebuilds(prompt: TrainedPrompt, pieces: RolePieces) -> bool:
    for turns, generation in _CHECKS:
        messages = [{"role": r, "content": c} for r, c in turns]
        if turns[0][0] == "system" and pieces.system_first is None:
            continue  # a template that drops system turns (alpaca): the Go template drops them too
        expected = render(prompt.chat_template, messages, prompt.bos_token, prompt.eos_token, generation)
        if rebuild(pieces, messages, generation) != expected:
            return False
    return True


def ollama_template(prompt: TrainedPrompt, adds_bos: bool) -> Optional[str]:
    """The trained prompt as an Ollama Go TEMPLATE over .Messages, or None when it cannot be derived. `adds_bos`:
    the GGUF tells llama.cpp to put BOS before the prompt itself (tokenizer.ggml.add_bos_token), so a BOS the
    template opens with is left out here (it would be there twice)."""
    pieces = role_pieces(prompt)
    if pieces is None:
        return None
    first_user = _without_bos(pieces.first_user_prefix, prompt.bos_token, adds_bos)
    parts = [
        "{{- $seen := false }}",  # a dropped turn (Alpaca's system) does not make the next user turn a later one
        "{{- range $i, $m := .Messages }}",
        "{{- $last := eq (len (slice $.Messages $i)) 1 }}",
    ]
    if pieces.system_first is not None:
        system_first = _without_bos(pieces.system_first, prompt.bos_token, adds_bos)
        parts.append('{{- if eq $m.Role "system" }}' + _go(system_first) + "{{ $m.Content }}"
                     + _go(pieces.suffix["system"]) + "{{ $seen = true }}")
        parts.append('{{- else if eq $m.Role "user" }}')
    else:
        parts.append('{{- if eq $m.Role "user" }}')
    parts.append("{{- if not $seen }}" + _go(first_user) + "{{ else }}" + _go(pieces.prefix["user"]) + "{{ end }}"
                 "{{- $m.Content }}" + _go(pieces.suffix["user"])
                 + "{{- if $last }}" + _go(pieces.generation) + "{{ end }}{{ $seen = true }}")
    parts.append('{{- else if eq $m.Role "assistant" }}' + _go(pieces.prefix["assistant"]) + "{{ $m.Content }}"
                 + _go(pieces.suffix["assistant"]) + "{{ $seen = true }}")
    parts.append("{{- end }}")
    parts.append("{{- end }}")
    text = "\n".join(parts)
    return None if '"""' in text else text


def _without_bos(prefix: str, bos: str, adds_bos: bool) -> str:
    return prefix[len(bos):] if adds_bos and bos and prefix.startswith(bos) else prefix


def _go(text: str) -> str:
    """Literal text as a Go string action: the template's own layout is trimmed by `{{-`, which would also eat a
    literal's leading or trailing newlines; inside an action they are kept exactly (JSON escapes are Go's too)."""
    import json

    return "{{ " + json.dumps(text) + " }}" if text else ""
