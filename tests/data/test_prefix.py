"""finetune.data.prefix: a long chat text tokenized only up to an added token after the max_length-th token
gives the same rows as the whole text, whichever way its offsets come (finetune.data.offsets or the tokenizer)."""

from __future__ import annotations

import random

import pytest

from finetune.builtin import CHAT_TEMPLATE
from finetune.data import prefix, tokenize
from finetune.data.formats import RowSpec
from finetune.data.offsets import ByteOffsets
from tests.data.test_offsets import PIECES, _byte_level


def _rows(count: int, seed: int) -> list[dict]:
    """ShareGPT rows of 1-4 turns; contents with multi-byte characters and special tokens' text in them."""
    rng = random.Random(seed)

    def words(high: int) -> str:
        return "".join(rng.choice(PIECES) for _ in range(rng.randint(1, high)))

    rows = []
    for _ in range(count):
        turns = []
        for _ in range(rng.randint(1, 4)):
            turns += [{"from": "human", "value": words(40)}, {"from": "gpt", "value": words(60), "train": rng.random() > 0.2}]
        turns[-1]["train"] = True
        rows.append({"conversations": turns})
    return rows


def _chat_tokenizer(pre_tokenizer):
    from tokenizers import pre_tokenizers  # noqa: F401 - the caller builds pre_tokenizer with it

    tokenizer = _byte_level(pre_tokenizer, added=("<s>", "<|assistant|>", "<|system|>"))
    tokenizer.bos_token, tokenizer.eos_token, tokenizer.chat_template = "<s>", "</s>", CHAT_TEMPLATE
    return tokenizer


def _tokenizers(tiny_dir):
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    yield "builtin", AutoTokenizer.from_pretrained(str(tiny_dir))
    # add_prefix_space: not one finetune.data.offsets computes offsets for; the tokenizer's offsets check the cuts
    yield "prefix_space", _chat_tokenizer(pre_tokenizers.ByteLevel(add_prefix_space=True))


@pytest.mark.parametrize("margin", [prefix.MARGIN, 0.4])  # 0.4: most cuts too early, so the whole text again
def test_cut_texts_give_the_rows_of_whole_ones(tiny_dir, monkeypatch, margin):
    monkeypatch.setattr(prefix, "MARGIN", margin)
    rows, spec = _rows(70, 5), RowSpec("sharegpt")
    for name, tokenizer in _tokenizers(tiny_dir):
        assert prefix.Prefixes.of(tokenizer) is not None
        assert (ByteOffsets.of(tokenizer) is not None) == (name == "builtin")
        for max_length in (24, 60, 150):
            for think in ("train", "mask"):
                cut = tokenize.tokenize_examples(rows, tokenizer, "sharegpt", max_length, spec=spec, think=think)
                with monkeypatch.context() as patched:
                    patched.setattr(prefix.Prefixes, "of", classmethod(lambda cls, tokenizer: None))
                    whole = tokenize.tokenize_examples(rows, tokenizer, "sharegpt", max_length, spec=spec, think=think)
                assert cut == whole, (name, max_length, think)


def test_the_cuts_are_after_added_tokens_matched_where_they_are_found():
    """Not after one another added token contains (the longer one would win), one that strips spaces, needs a word
    boundary or is matched after normalization; none when special tokens are encoded as text."""
    from tokenizers import AddedToken, pre_tokenizers

    tokenizer = _chat_tokenizer(pre_tokenizers.ByteLevel(add_prefix_space=False))
    tokenizer._tokenizer.add_tokens([AddedToken("</s>\n", normalized=False), AddedToken("<|r|>", rstrip=True),
                                     AddedToken("<|w|>", single_word=True), AddedToken("<|n|>", normalized=True)])
    cuts = prefix.Prefixes.of(tokenizer)
    assert {"<|user|>", "<s>", "<|assistant|>", "</s>\n"} <= set(cuts.ids)
    assert not {"</s>", "<|r|>", "<|w|>", "<|n|>"} & set(cuts.ids)
    tokenizer._tokenizer.encode_special_tokens = True
    assert prefix.Prefixes.of(tokenizer) is None
