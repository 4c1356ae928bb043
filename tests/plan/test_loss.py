"""The loss's working set (finetune/plan/loss.py): each kernel's bytes and the note printed with them
come from one function, and the note's arithmetic is the bytes (issue 19: Gemma-2's note said 12 B per
token x vocab while the bytes used 16)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from finetune.plan import Setup, plan
from finetune.plan.archs import BY_NAME
from finetune.plan.loss import LOSS_KERNELS


def evaluate(note: str) -> int:
    """The value of a note's expression (before ';'): numbers joined by ' x ' and ' + ', each followed by
    the word for what it counts, in parentheses where needed."""
    expression = note.split(";", 1)[0]
    out = []
    for token in re.findall(r"\d[\d,]*|\(|\)|\+|(?<!\S)x(?!\S)|[^\s()+]+", expression):
        if token[0].isdigit():
            out.append(token.replace(",", ""))
        elif token in "()+":
            out.append(token)
        elif token == "x":
            out.append("*")
    return int(eval("".join(out), {"__builtins__": {}}))  # digits and * + ( ) only


SETUPS = [
    {"objective": objective, "loss_kernel": kernel, "loss_dtype": dtype, "micro_batch": b, "seq_len": s}
    for objective in ("sft", "dpo", "kto", "orpo", "grpo", "reward")
    for kernel in LOSS_KERNELS
    for dtype in ("float32", "bfloat16")
    for b, s in ((1, 512), (4, 8192))
]


@pytest.mark.parametrize("model", ["gemma-2-9b", "llama-3-8b", "qwen2.5-0.5b"])
def test_each_loss_note_states_the_bytes_it_comes_with(model):
    arch = BY_NAME[model]
    base = Setup(arch=arch, params=arch.total_params, method="lora")
    for settings in SETUPS:
        result = plan(replace(base, **settings))
        [term] = [t for t in result.terms if t.field == "logits"]
        assert evaluate(term.note) == term.bytes, (settings, term.note)
        assert term.note in result.render_text()


def test_gemma2_softcap_note_says_14_bytes_per_token_and_vocab_entry():
    arch = BY_NAME["gemma-2-9b"]
    result = plan(Setup(arch=arch, params=arch.total_params, method="lora", micro_batch=1, seq_len=1024))
    [term] = [t for t in result.terms if t.field == "logits"]
    assert term.bytes == 1024 * arch.vocab * 14
    assert f"1,024 tokens x {arch.vocab:,} vocab x 14 B" in term.note and "softcap" in term.note
