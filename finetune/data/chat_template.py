"""Chat rows: the chat template rendered for a conversation and its prefixes, and where its assistant turns are.

The one renderer of chat rows: finetune.data.tokenize encodes a batch of them with `chat_text` (one render of the
conversation, the character span of each assistant turn, from the template's `{% generation %}` blocks or by
rendering prefixes, and the `<think>` ranges taken out of them for `data.think: mask`), and `finetune train`'s
preflight (finetune.run.preflight) renders every local row the same way before launch (the rows:
finetune.data.validate.chat_rows), with a `ChatRenderer.for_template` when no tokenizer is at hand. A conversation the template cannot render, or whose
turns cannot be located, is a RowProblem (the caller names file and line).
"""

from __future__ import annotations

import re
from typing import Any, Optional

from finetune.data.formats import Chat, RowProblem

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)
# A conversation to render a template on when a source's rows cannot be read here (a hub id).
SAMPLE_CONVERSATION = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi"},
                       {"role": "assistant", "content": "Hello!"}]
# apply_chat_template passes the tokenizer's special tokens to the template (`bos_token + ...` is common); without
# the tokenizer, these stand in: their values do not matter for whether the template renders, only that they are
# strings.
PLACEHOLDER_TOKENS = {name: f"<{name}>" for name in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                                                      "cls_token", "mask_token")}


class TemplateFailed(RowProblem):
    """The template raised on a conversation; `cause` is what it raised (preflight names its type and line)."""

    def __init__(self, cause: Any):
        super().__init__(f"the chat template cannot render this conversation: {cause}")
        self.cause = cause


class ChatRenderer:
    """`tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=...)`, for a conversation
    and its prefixes, within the render budget (finetune.data.template_budget) and at a third of the cost: the
    conversation converted once instead of once per prefix, the template's keyword arguments once per batch.
    Checked against apply_chat_template on the batch's first conversation; when transformers' internals are not
    what this expects, it is apply_chat_template (under the time budget only)."""

    def __init__(self, tokenizer, sample: Optional[list[dict]] = None):
        from finetune.data.template_budget import template_of, tokenizer_kwargs

        self.tokenizer = tokenizer
        self.fast = False
        self.kwargs: Optional[dict[str, Any]] = None
        self.template = template_of(tokenizer)
        if self.template is None:
            return
        try:
            self.kwargs = tokenizer_kwargs(tokenizer)  # apply_chat_template's template_kwargs
        except ImportError:  # transformers moved its helpers: apply_chat_template it is
            return
        from finetune.data.template_budget import TemplateBudget

        try:
            self.fast = sample is None or self._render(self._convert(sample)) == self.slow(sample)
        except TemplateBudget:
            self.fast = True  # a template past the budget: apply_chat_template would not stop it
        except Exception:  # noqa: BLE001 - the slow path will raise what is wrong with the row, as before
            self.fast = False

    @classmethod
    def for_template(cls, template: str, variables: dict[str, Any]) -> "ChatRenderer":
        """A renderer of `template` without a tokenizer (preflight, for a hub model's): `variables` are what
        apply_chat_template would pass besides the conversation (the special tokens: PLACEHOLDER_TOKENS)."""
        render = cls.__new__(cls)
        render.tokenizer, render.template, render.kwargs, render.fast = None, template, dict(variables), True
        return render

    def conversation(self, messages: list[dict]) -> list[dict]:
        """What render_jinja_template hands the template for `messages` (None values dropped, as
        apply_chat_template drops them); a prefix of it is what it hands for a prefix."""
        return self._convert(messages) if self.fast else messages

    def _convert(self, messages: list[dict]) -> list[dict]:
        from finetune.data.template_budget import chat_messages

        return chat_messages(messages)

    def _render(self, chat: list[dict], add_generation_prompt: bool = False) -> str:
        from finetune.data.template_budget import render

        return render(self.template, chat, add_generation_prompt, **self.kwargs)

    def slow(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        from finetune.data.template_budget import TemplateBudget, time_budget

        try:
            with time_budget():
                return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        except TemplateBudget:
            raise
        except Exception as exc:  # noqa: BLE001 - jinja and transformers raise many types on a row the template rejects
            raise TemplateFailed(exc) from None

    def __call__(self, chat: list[dict], add_generation_prompt: bool = False) -> str:
        from finetune.data.template_budget import TemplateBudget

        if not self.fast:
            return self.slow(chat, add_generation_prompt)
        try:
            return self._render(chat, add_generation_prompt)
        except TemplateBudget:
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. raise_exception() in the template
            raise TemplateFailed(exc) from None


def chat_text(example: Chat, render: ChatRenderer, mask_prompt: bool, think: str) -> tuple[str, list[tuple[int, int]]]:
    """(the conversation rendered by `render`; the character spans the loss trains on: the assistant turns whose
    train flag is on, less <think> with think: mask). RowProblem when the template cannot render the row or its
    turns cannot be located."""
    chat = render.conversation(example.messages)
    text = render(chat)
    if mask_prompt:
        turns = assistant_turn_spans(example.messages, text, render, chat)
        flags = [flag for message, flag in zip(example.messages, example.train) if message["role"] == "assistant"]
        spans = [span for span, flag in zip(turns, flags) if flag]
    else:
        spans = [(0, len(text))]
    return text, without_think(spans, text) if think == "mask" else spans


def assistant_turn_spans(messages: list[dict], text: str, render: ChatRenderer,
                         chat: list[dict]) -> list[tuple[int, int]]:
    """Character spans of the assistant turns in `text`, one per assistant message, in order (`chat`:
    render.conversation(messages))."""
    wanted = sum(m["role"] == "assistant" for m in messages)
    if render.kwargs is not None and _GENERATION_TAG.search(render.template):
        from finetune.data.template_budget import chat_messages, render_with_spans

        # What apply_chat_template(return_assistant_tokens_mask=True) uses, at character level, so
        # the per-turn flags and <think> masking can cut inside the turns.
        rendered, indices = render_with_spans(render.template, chat_messages(messages), **render.kwargs)
        if rendered == text and len(indices) == wanted:
            return [tuple(span) for span in indices]
    return _assistant_spans(chat, render, text)


def _assistant_spans(chat: list[dict], render: ChatRenderer, text: str) -> list[tuple[int, int]]:
    """Character spans of the assistant turns in `text` (the whole conversation, rendered).

    Turn i spans from the end of the conversation up to it with the generation prompt to the end of
    the conversation up to and including it (so the template's end-of-turn token is in it). That
    needs a template whose rendering of a shorter conversation is a prefix of the longer one, which
    holds for the common templates.
    """
    spans = []
    for i, message in enumerate(chat):
        if message["role"] != "assistant":
            continue
        before = render(chat[:i], add_generation_prompt=True) if i else ""
        # The last turn's conversation is the whole one, already rendered: one template call fewer per row.
        through = text if i == len(chat) - 1 else render(chat[:i + 1])
        if not (text.startswith(through) and through.startswith(before)):
            raise RowProblem("the chat template renders earlier turns differently in longer conversations, so the "
                            "assistant turns cannot be located; set data.mask_prompt: false or a data.chat_template")
        spans.append((len(before), len(through)))
    return spans


def without_think(spans: list[tuple[int, int]], text: str) -> list[tuple[int, int]]:
    """`spans` minus the <think>...</think> ranges inside them."""
    out = []
    for start, end in spans:
        cursor = start
        for match in _THINK.finditer(text, start, end):
            if match.start() > cursor:
                out.append((cursor, match.start()))
            cursor = match.end()
        if cursor < end:
            out.append((cursor, end))
    return out

