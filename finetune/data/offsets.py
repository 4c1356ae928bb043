"""Character offsets of a byte-level BPE tokenizer's tokens, from their ids: what masking a chat row needs,
without asking the tokenizer for offsets.

The fast tokenizer's `encode_batch` (what `tokenizer(texts, return_offsets_mapping=True)` calls) converts
every token's byte offsets to character offsets through a hash map of every byte of the text, and keeps
every token's string; `encode_batch_fast` does neither (its offsets are zeros). On the benchmark's ShareGPT
rows (scripts/bench_tokenize.py) that is ~400 us a row against ~260, and turning the offsets into Python
tuples cost another ~60 us. For a tokenizer whose tokens spell the text byte for byte (byte-level BPE: no
normalizer other than a Unicode normal form, no prefix space, no offset trimming; GPT-2, Llama 3, Qwen 2/3,
the built-in model), a token's offsets are where its bytes sit: the running sum of the tokens' byte lengths,
in characters (a token starts at the character that holds its first byte and ends after the one that holds
its last, as the tokenizer reports them).

`ByteOffsets.of(tokenizer)` says whether the tokenizer is of that kind (None otherwise); `offsets(text, ids)`
returns the (start, end) character offsets of the tokens, or None when it cannot vouch for them: tokens that
do not spell the text (checked byte for byte, so a tokenizer that breaks an assumption above gives None, never
wrong offsets). The caller asks the tokenizer for offsets then. tests/data/test_offsets.py compares them with
the tokenizer's own on random texts (ASCII, multi-byte characters, special tokens).
"""

from __future__ import annotations

import json
from typing import Any, Callable, Optional

# Pre-tokenizers that only cut the text (every byte stays in exactly one piece) or map bytes to the byte-level
# alphabet one to one; anything else (Whitespace drops characters, Metaspace inserts some) is not this kind.
_CUTTING = {"Split", "Digits", "Punctuation"}
# Normalizers that leave a text already in their Unicode form as it is, character for character (Qwen 2/3 ship
# NFC); a text they change is not spelled by its tokens, which the check below finds.
_UNICODE_FORMS = {"NFC", "NFD", "NFKC", "NFKD"}
# Post-processors that leave the offsets of a sequence encoded without special tokens as they are.
_KEEPING = {"TemplateProcessing"}
_CACHE: dict[tuple, tuple[Any, Any]] = {}


def per_tokenizer(backend, name: str, build: Callable[[], Any]) -> Any:
    """build(), once per Rust tokenizer and process (a datasets worker builds it on its first batch), and again
    when the tokenizer is changed in place: tokens added, another normalizer, pre- or post-processor."""
    def state(part: Any) -> Any:
        return None if part is None else part.__getstate__()

    key = (name, id(backend), backend.get_vocab_size(with_added_tokens=True), backend.encode_special_tokens,
           state(backend.normalizer), state(backend.pre_tokenizer), state(backend.post_processor),
           tuple((index, str(token)) for index, token in backend.get_added_tokens_decoder().items()))
    cached = _CACHE.get(key)
    if cached is None or cached[0] is not backend:
        if len(_CACHE) > 8:
            _CACHE.clear()  # one tokenizer per process in practice; never keep dead ones' arrays
        cached = _CACHE[key] = (backend, build())
    return cached[1]


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet (tokenizers' ByteLevel): the character that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def _byte_level(config: dict[str, Any]) -> bool:
    """Whether a tokenizer.json describes a byte-level BPE whose tokens spell the text byte for byte."""
    model, pre, post = config.get("model") or {}, config.get("pre_tokenizer") or {}, config.get("post_processor")
    normalizer = config.get("normalizer") or {"type": "Sequence", "normalizers": []}
    forms = normalizer.get("normalizers") if normalizer.get("type") == "Sequence" else [normalizer]
    if any(n.get("type") not in _UNICODE_FORMS for n in forms) or model.get("type") != "BPE" or model.get("dropout"):
        return False
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return False
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
    levels = [s for s in steps if s.get("type") == "ByteLevel"]
    if len(levels) != 1 or levels[0].get("add_prefix_space") or steps[-1] is not levels[0]:
        return False
    if any(s.get("type") not in _CUTTING | {"ByteLevel"} or s.get("behavior") == "Removed" for s in steps):
        return False
    posts = [] if post is None else post.get("processors") if post.get("type") == "Sequence" else [post]
    return all(p.get("type") in _KEEPING or (p.get("type") == "ByteLevel" and not p.get("trim_offsets")) for p in posts)


class ByteOffsets:
    """The byte string of every token id, as numpy arrays (see the module docstring)."""

    def __init__(self, backend) -> None:
        import numpy as np

        decoder = _byte_decoder()
        pieces: dict[int, bytes] = {}
        for token, index in backend.get_vocab(with_added_tokens=False).items():
            # A character outside the alphabet cannot come from a byte: its own UTF-8 bytes, which the spelling
            # check then fails to match.
            pieces[index] = b"".join(bytes([decoder[c]]) if c in decoder else c.encode() for c in token)
        for index, added in backend.get_added_tokens_decoder().items():
            pieces[index] = added.content.encode()  # matched in the raw text, before byte-level
        size = max(pieces) + 1 if pieces else 0
        self.lengths = np.zeros(size, dtype=np.int64)
        for index, piece in pieces.items():
            self.lengths[index] = len(piece)
        self.starts = np.zeros(size, dtype=np.int64)
        np.cumsum(self.lengths[:-1], out=self.starts[1:])
        self.bytes = np.frombuffer(b"".join(pieces.get(i, b"") for i in range(size)), dtype=np.uint8)

    @classmethod
    def of(cls, tokenizer) -> Optional["ByteOffsets"]:
        """For the fast tokenizer's Rust tokenizer when it is byte-level BPE as above, else None."""
        backend = getattr(tokenizer, "_tokenizer", None)
        if backend is None or not hasattr(backend, "encode_batch_fast"):
            return None

        def build() -> Optional["ByteOffsets"]:
            added = backend.get_added_tokens_decoder().values()
            # An added token that strips the spaces around it covers them: its offsets are not its own bytes.
            if any(t.lstrip or t.rstrip for t in added) or not _byte_level(json.loads(backend.to_str())):
                return None
            return cls(backend)

        return per_tokenizer(backend, "offsets", build)

    def spells_all(self, text: str, tokens) -> bool:
        """Whether `tokens` (numpy int64) spell all of `text`, byte for byte: the last one ends with it."""
        spelled = self._spelled(text, tokens)
        return spelled is not None and int(spelled[1][-1]) == len(spelled[2])

    def offsets(self, text: str, ids):
        """(n, 2) int64 character offsets of `ids` (a list or numpy array) in `text`, or None when the tokens do
        not spell the start of the text byte for byte."""
        import numpy as np

        tokens = np.asarray(ids, dtype=np.int64)
        if len(tokens) == 0:
            return np.zeros((0, 2), dtype=np.int64)
        spelled = self._spelled(text, tokens)
        if spelled is None:
            return None
        starts, ends, raw = spelled
        if len(raw) == len(text):  # ASCII: a byte is a character
            return np.stack([starts, ends], axis=1)
        # A token starts at the character holding its first byte and ends after the one holding its last: a
        # character split between tokens (byte-level BPE cuts inside UTF-8 sequences) is in each of them.
        chars = np.cumsum((raw[:int(ends[-1])] & 0xC0) != 0x80) - 1
        return np.stack([chars[starts], chars[ends - 1] + 1], axis=1)

    def _spelled(self, text: str, tokens):
        """(byte starts, byte ends, the text's bytes) of non-empty `tokens` when they spell the start of `text`
        byte for byte, else None."""
        import numpy as np

        try:
            raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        except UnicodeEncodeError:  # a lone surrogate: the tokenizer's own call says what it makes of it
            return None
        if len(tokens) == 0 or tokens.max() >= len(self.lengths) or tokens.min() < 0:
            return None
        lengths = self.lengths[tokens]
        ends = np.cumsum(lengths)
        spelled = int(ends[-1])
        if spelled > len(raw) or not lengths.all():
            return None
        starts = ends - lengths
        # Byte p of the text is byte (p - start) of the token that covers it.
        source = np.repeat(self.starts[tokens] - starts, lengths) + np.arange(spelled)
        if not np.array_equal(self.bytes[source], raw[:spelled]):
            return None
        return starts, ends, raw
