"""Chat rows: the chat template rendered for a conversation and its prefixes, and where its assistant turns are.

finetune.data.tokenize encodes a batch of chat rows with these: one render of the conversation, the character
span of each assistant turn (from the template's `{% generation %}` blocks, or by rendering prefixes), and the
`<think>` ranges taken out of them for `data.think: mask`. A conversation the template cannot render, or whose
turns cannot be located, is a RowProblem (the caller names file and line).
"""

from __future__ import annotations

import re
from typing import Optional

from finetune.data.formats import RowProblem

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)


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
            raise RowProblem(f"the chat template cannot render this conversation: {exc}") from None

    def __call__(self, chat: list[dict], add_generation_prompt: bool = False) -> str:
        from finetune.data.template_budget import TemplateBudget

        if not self.fast:
            return self.slow(chat, add_generation_prompt)
        try:
            return self._render(chat, add_generation_prompt)
        except TemplateBudget:
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. raise_exception() in the template
            raise RowProblem(f"the chat template cannot render this conversation: {exc}") from None


def assistant_turn_spans(messages: list[dict], tokenizer, text: str, render: ChatRenderer,
                          chat: list[dict]) -> list[tuple[int, int]]:
    """Character spans of the assistant turns in `text`, one per assistant message, in order (`chat`:
    render.conversation(messages))."""
    template = tokenizer.get_chat_template()
    wanted = sum(m["role"] == "assistant" for m in messages)
    if _GENERATION_TAG.search(template):
        from finetune.data.template_budget import chat_messages, render_with_spans, tokenizer_kwargs

        # What apply_chat_template(return_assistant_tokens_mask=True) uses, at character level, so
        # the per-turn flags and <think> masking can cut inside the turns.
        rendered, indices = render_with_spans(template, chat_messages(messages), **tokenizer_kwargs(tokenizer))
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
