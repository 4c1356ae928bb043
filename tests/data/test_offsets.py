"""finetune.data.offsets: token offsets computed from the ids are the tokenizer's own, or None.

Chat rows are masked by the characters each token covers; the tokenize path asks the tokenizer for them only
where finetune.data.offsets cannot compute them (issue 20: the offsets were a third of the Rust tokenizer's time).
"""

from __future__ import annotations

import random

import pytest

from finetune.data import tokenize
from finetune.data.formats import RowSpec
from finetune.data.offsets import ByteOffsets

PIECES = [chr(i) for i in range(32, 127)] + [
    "\n", "\t\t", "   ", "\r\n", "é", "ü", "ß", "Ω", "中文", "日本語", "😀", "👍🏽", "\u200b", "\u0301", "—", "“", "”",
    " é", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|", "|>", "'s", " the", "123456",
]


def _texts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(PIECES) for _ in range(rng.randint(0, 40))) for _ in range(count)]


def _byte_level(tokenizer_json_pre, post=None, added=(), normalizer=None):
    """A small byte-level BPE (the kind Llama 3 and Qwen ship: a Split pre-tokenizer then ByteLevel), trained here."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = tokenizer_json_pre
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.train_from_iterator(_texts(300, 0), trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens([AddedToken(t, lstrip=t == "<|l|>") for t in ("<|user|>", "</s>", *added)])
    if post is not None:
        tok.post_processor = post
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _llama3_like(normalizer=None):
    from tokenizers import Regex, pre_tokenizers

    split = pre_tokenizers.Split(Regex(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
                                 behavior="isolated")
    return _byte_level(pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
                       normalizer=normalizer)


def _qwen_like():
    from tokenizers import normalizers

    return _llama3_like(normalizer=normalizers.NFC())


@pytest.mark.parametrize("which", ["builtin", "llama3_like", "qwen_like"])
def test_offsets_from_the_ids_are_the_tokenizers(which, tiny_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_dir)) if which == "builtin" else globals()[f"_{which}"]()
    spelled = ByteOffsets.of(tokenizer)
    assert spelled is not None
    backend = tokenizer._tokenizer
    rng = random.Random(1)
    unspelled = 0
    for text in _texts(1500, 2):
        encoding = backend.encode(text, add_special_tokens=False)
        cut = rng.randint(0, len(encoding.ids))  # the first max_length tokens
        offsets = spelled.offsets(text, encoding.ids[:cut])
        if offsets is None:  # NFC composed "e" + U+0301: the tokens spell another text
            unspelled += 1
            assert which == "qwen_like" and "\u0301" in text
            continue
        assert offsets.tolist() == [list(o) for o in encoding.offsets[:cut]], text
    assert unspelled < 300
    # Tokens that do not spell the text: no offsets, never wrong ones.
    assert spelled.offsets("the cat", backend.encode("the dog", add_special_tokens=False).ids) is None
    assert spelled.offsets("x", backend.encode("xx", add_special_tokens=False).ids) is None


def test_tokenizers_of_another_kind_get_the_tokenizers_offsets():
    from tokenizers import normalizers, pre_tokenizers, processors

    level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert ByteOffsets.of(_byte_level(level)) is not None
    assert ByteOffsets.of(_byte_level(pre_tokenizers.ByteLevel(add_prefix_space=True))) is None
    assert ByteOffsets.of(_byte_level(level, normalizer=normalizers.Lowercase())) is None
    assert ByteOffsets.of(_byte_level(level, post=processors.ByteLevel(trim_offsets=True))) is None
    assert ByteOffsets.of(_byte_level(level, added=("<|l|>",))) is None  # lstrip: it covers the spaces before it
    assert ByteOffsets.of(_byte_level(pre_tokenizers.Metaspace())) is None


def test_chat_rows_mask_the_same_with_either_offsets(tiny_dir, monkeypatch):
    """Multi-byte characters, think spans and turns off: the labels do not depend on where the offsets come from."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_dir))
    rng = random.Random(3)
    rows = []
    for _ in range(40):
        turns = []
        for _ in range(rng.randint(1, 3)):
            turns.append({"from": "human", "value": "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 30)))})
            answer = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 30)))
            turns.append({"from": "gpt", "value": f"<think>{answer[:5]}</think>{answer}", "train": rng.random() > 0.3})
        turns[-1]["train"] = True
        rows.append({"conversations": turns})
    spec = RowSpec("sharegpt")
    for think in ("train", "mask"):
        fast = tokenize.tokenize_examples(rows, tokenizer, "sharegpt", 64, spec=spec, think=think)
        assert len(fast) > 30
        with monkeypatch.context() as patched:
            patched.setattr(ByteOffsets, "of", classmethod(lambda cls, tokenizer: None))
            assert tokenize.tokenize_examples(rows, tokenizer, "sharegpt", 64, spec=spec, think=think) == fast
