"""Long chat texts tokenized only as far as max_length needs, with the same tokens.

A fast tokenizer first cuts its input at its added tokens (`</s>`, `<|im_end|>`, ...) and then normalizes,
pre-tokenizes and tokenizes each piece between them on its own (tokenizers' AddedVocabulary). So the tokens
of `text[:k]`, when the tokenizer matches an added token ending at k there, are the first tokens of `text`,
provided it matches that token at the same place in `text`: no other added token contains it (a longer match
would win), it needs no word boundary after it (single_word), strips no space around it (lstrip, rstrip), is
matched before normalization, and special tokens are not encoded as text (split_special_tokens).

`Prefixes.ends` picks the cuts: the end of the first such token after where the max_length-th token is
expected, from the characters per token of the batch's first texts (tokenized whole). The caller keeps a
cut only when its tokens number at least max_length and end with that token, spelling the prefix to its
last byte, and tokenizes the whole text otherwise. On the benchmark's ShareGPT rows (scripts/bench_tokenize.py,
max_length 512: 448 tokens kept a row) that tokenizes 562 tokens a row instead of 642 (531 if every cut were
the earliest possible); a long conversation with a short max_length saves more.
"""

from __future__ import annotations

import math
import re
from typing import Any, Optional

PROBE = 16  # texts of each batch tokenized whole, to measure characters per token
MARGIN = 1.15  # cut this much after where the max_length-th token is expected: a cut too early costs a re-encode


class Prefixes:
    """The added tokens a text may be cut after (see the module docstring), as one regular expression."""

    def __init__(self, ids: dict[str, int]) -> None:
        self.ids = ids
        self.lengths = {index: len(content) for content, index in ids.items()}  # in characters
        self.pattern = re.compile("|".join(re.escape(c) for c in sorted(ids, key=len, reverse=True)))

    @classmethod
    def of(cls, tokenizer) -> Optional["Prefixes"]:
        """The added tokens of the fast tokenizer's Rust tokenizer a text may be cut after, or None."""
        from finetune.data.offsets import per_tokenizer

        backend = getattr(tokenizer, "_tokenizer", None)
        if backend is None or not hasattr(backend, "get_added_tokens_decoder"):
            return None

        def build() -> Optional["Prefixes"]:
            added = backend.get_added_tokens_decoder()
            contents = [token.content for token in added.values()]
            ids = {token.content: index for index, token in added.items()
                   if token.content and not (token.lstrip or token.rstrip or token.single_word or token.normalized)
                   and contents.count(token.content) == 1
                   and not any(token.content in other and token.content != other for other in contents)}
            return cls(ids) if ids and not backend.encode_special_tokens else None

        return per_tokenizer(backend, "prefixes", build)

    def ends(self, texts: list[str], chars_per_token: float, max_length: int) -> list[tuple[int, Optional[int]]]:
        """(k, id) for each text: tokenize text[:k], which ends with the added token `id` (None: the whole text)."""
        start = math.ceil(chars_per_token * MARGIN * max_length)
        out = []
        for text in texts:
            found = self.pattern.search(text, start) if len(text) > start else None
            out.append((found.end(), self.ids[found.group()]) if found and found.end() < len(text) else (len(text), None))
        return out


def chars_per_token(offsets: list[Any], max_length: int) -> Optional[float]:
    """The most characters per token up to the max_length-th token among texts (their token offsets, cut at
    max_length), or None when none of them reaches max_length tokens."""
    ratios = [int(o[-1][1]) / max_length for o in offsets if len(o) == max_length]
    return max(ratios) if ratios else None
