"""A chat's turns rendered into prompt token ids the way the run trained on them (finetune.use.chat samples them).

alpaca: each earlier turn is a whole training example (prompt + reply + EOS) in front of the new prompt; messages: the
tokenizer's chat template with the generation prompt; text: the turns joined, continued by the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class Turn:
    user: str
    reply: str
    reply_ids: list[int]
    images: list[str] = field(default_factory=list)  # image files shown with `user` (a VLM)


@dataclass
class Conversation:
    """The turns so far, rendered into prompt token ids the way the run trained on them."""

    tokenizer: Any
    fmt: str
    turns: list[Turn] = field(default_factory=list)
    vision: Optional[Any] = None  # finetune.use.images.Vision: images are placed and expanded as in training

    def reset(self) -> None:
        self.turns.clear()

    def add(self, user: str, reply: str, reply_ids: list[int], images: tuple[str, ...] = ()) -> None:
        self.turns.append(Turn(user, reply, reply_ids, list(images)))

    def images(self, first: int = 0, new: tuple[str, ...] = ()) -> list[str]:
        """The image files of the turns from `first` on and of the new message, in prompt order."""
        return [image for turn in self.turns[first:] for image in turn.images] + list(new)

    def prompt_ids(self, user: str, first: int = 0, images: tuple[str, ...] = (), counts: tuple[int, ...] = ()) -> list[int]:
        """Token ids the model continues to answer `user` (shown with `images`, a VLM's), with the turns from `first`
        on before it; `counts`: the tokens of each image of self.images(first, images), as the processor makes them."""
        if self.fmt == "alpaca":
            return self._alpaca(self.turns[first:], user, images, counts)
        text = self.prompt_text(user, first, images)
        if self.vision is not None and self.fmt == "messages":
            text = self.vision.expand(text, list(counts))  # each image's token run, as training expanded it
        return list(self.tokenizer(text, add_special_tokens=self.adds_special_tokens)["input_ids"])

    @property
    def adds_special_tokens(self) -> bool:
        """Whether the tokenizer adds its special tokens to prompt_text (text rows, as training tokenizes them);
        a chat template writes its own."""
        return self.fmt == "text"

    def prompt_text(self, user: str, first: int = 0, images: tuple[str, ...] = ()) -> Optional[str]:
        """The text prompt_ids tokenizes (messages: the chat template's render, one image token per image; text: the
        turns joined); None for alpaca, whose turns are tokenized one by one."""
        from finetune.use.images import message_content

        turns = self.turns[first:]
        if self.fmt == "alpaca":
            return None
        if self.fmt == "messages":
            messages = []
            for turn in turns:
                messages += [{"role": "user", "content": message_content(turn.user, turn.images)},
                             {"role": "assistant", "content": turn.reply}]
            messages.append({"role": "user", "content": message_content(user, images)})
            from finetune.data.template_budget import render_for

            return render_for(self.tokenizer, messages, add_generation_prompt=True)
        return "".join(turn.user + turn.reply for turn in turns) + user

    def _alpaca(self, turns: list[Turn], user: str, images: tuple[str, ...] = (), counts: tuple[int, ...] = ()) -> list[int]:
        from finetune.data.formats import alpaca_prompt

        eos = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
        left = list(counts)

        def prompt(text: str, shown: list[str]) -> list[int]:
            if not shown:
                return self.tokenizer(alpaca_prompt(text), add_special_tokens=True)["input_ids"]
            here, left[:] = left[:len(shown)], left[len(shown):]
            markup = self.vision.vm.family.markup * len(shown)  # the row's <image> placeholders, as trained
            return self.tokenizer(self.vision.expand(alpaca_prompt(markup + text), here), add_special_tokens=True)["input_ids"]

        ids: list[int] = []
        for turn in turns:
            ids += prompt(turn.user, turn.images) + turn.reply_ids + eos
        return ids + list(prompt(user, list(images)))
