"""The loss's working set: one function per loss kernel, each returning `(bytes, note)` together.

The note states the arithmetic of the bytes it comes with, as `<expression>; <why>`: the expression
is numbers joined by ` x ` and ` + ` (with parentheses), each number followed by what it counts, and
evaluates to the bytes exactly (tests/plan/test_planner.py::test_each_loss_note_states_the_bytes_it_comes_with).
"""

from __future__ import annotations

import math
from typing import Callable

from finetune.chunks import chunk_count
from finetune.plan.preference import FUSED_LOGPROB_OBJECTIVES, SCORE_HEAD_OBJECTIVES, TOKEN_TILE, VOCAB_TILE
from finetune.plan.setup import Setup

Sized = tuple[int, str]


def loss_working_set(setup: Setup) -> Sized:
    """The loss's bytes at the start of backward, and their arithmetic, for the setup's kernel."""
    if setup.objective in FUSED_LOGPROB_OBJECTIVES:
        return fused_logprob_loss(setup)
    if setup.objective in SCORE_HEAD_OBJECTIVES:
        return score_head_loss(setup)
    return LOSS_KERNELS[setup.loss_kernel](setup)


def loss_element_bytes(setup: Setup) -> int:
    """Bytes of one log-prob in the cross-entropy: 4 when it runs in fp32 (transformers' upcast, or
    autocast), 2 when a model's own loss runs on 16-bit logits without autocast (Setup.loss_dtype)."""
    return 4 if setup.loss_dtype == "float32" else 2


def _per_vocab_entry(setup: Setup) -> Sized:
    """Bytes per token and vocabulary entry of transformers' loss: the log-probs, nll_loss's gradient
    and log_softmax's gradient alive together at the start of backward (3 x the loss dtype; the 16-bit
    logits and the fp32 copy of the forward are gone by then), and Gemma 2's final soft-capping
    (logits / cap, tanh, x cap) keeps the tanh's 16-bit output for its backward (1 x the model dtype: a
    division or product by a number saves nothing; the trace of Gemma-2-2B shows 14 bytes in all)."""
    assert setup.arch is not None
    loss = 3 * loss_element_bytes(setup)
    why = f"{setup.loss_dtype} log-probs + 2 grads"
    if setup.arch.logit_softcap:
        return loss + setup.element_bytes, why + ", and the softcap's tanh output"
    return loss, why


def default_loss(setup: Setup) -> Sized:
    """transformers' ForCausalLMLoss on the full logits: every token's vocabulary row at once."""
    assert setup.arch is not None
    tokens = setup.micro_batch * setup.seq_len
    per, why = _per_vocab_entry(setup)
    return tokens * setup.arch.vocab * per, f"{tokens:,} tokens x {setup.arch.vocab:,} vocab x {per} B; {why}"


def loss_chunk_tokens(setup: Setup) -> int:
    """Tokens whose logits exist at once with loss_kernel: chunked (finetune/loss_kernel.py)."""
    tokens = setup.micro_batch * setup.seq_len
    assert setup.arch is not None
    return math.ceil(tokens / chunk_count(tokens, setup.arch.vocab, setup.loss_chunk_tokens))


def chunked_loss(setup: Setup) -> Sized:
    """finetune/loss_kernel.py: one chunk of tokens' logits at a time, each under checkpoint."""
    assert setup.arch is not None
    chunk = loss_chunk_tokens(setup)
    per, why = _per_vocab_entry(setup)
    tokens = setup.micro_batch * setup.seq_len
    return chunk * setup.arch.vocab * per, (f"{chunk:,} tokens x {setup.arch.vocab:,} vocab x {per} B; "
                                            f"chunked: one chunk of {tokens:,} tokens at a time, {why}")


def liger_chunk_tokens(setup: Setup) -> int:
    """Liger's fused_linear_cross_entropy_forward: chunk = next_pow2(ceil(BT / ceil(V / H))), at most BT,
    so one chunk's logits are about as large as the hidden states."""
    arch = setup.arch
    assert arch is not None
    tokens = setup.micro_batch * setup.seq_len
    per_chunk = math.ceil(tokens / math.ceil(arch.vocab / arch.hidden))
    return min(tokens, 1 << (per_chunk - 1).bit_length())


def liger_loss(setup: Setup) -> Sized:
    """Liger computes each chunk's logits in the model dtype and overwrites them with their gradient
    in place; beside them it keeps the input's gradient (BT x H, model dtype) and a fp32 loss per token."""
    arch = setup.arch
    assert arch is not None
    tokens = setup.micro_batch * setup.seq_len
    e, chunk = setup.element_bytes, liger_chunk_tokens(setup)
    size = chunk * arch.vocab * e + tokens * (arch.hidden * e + 4)
    return size, (f"{chunk:,} tokens x {arch.vocab:,} vocab x {e} B + {tokens:,} tokens x "
                  f"({arch.hidden:,} hidden x {e} B + 4 B); liger: one chunk's logits, the input gradient "
                  "and a fp32 loss per token")


def fused_logprob_loss(setup: Setup) -> Sized:
    """TRL's fused LM head (finetune/plan/preference.py): one fp32 tile of logits in forward and one in
    backward, plus the fp32 gradient of the hidden states it accumulates per token."""
    assert setup.arch is not None
    tokens = setup.micro_batch * setup.seq_len
    rows, cols = min(tokens, TOKEN_TILE), min(setup.arch.vocab, VOCAB_TILE)
    size = 2 * rows * cols * 4 + tokens * setup.arch.hidden * 4
    return size, (f"2 tiles x {rows:,} tokens x {cols:,} vocab x 4 B + {tokens:,} tokens x "
                  f"{setup.arch.hidden:,} hidden x 4 B; TRL fused log-probs: fp32 tiles and the hidden gradient")


def score_head_loss(setup: Setup) -> Sized:
    """A reward model's head (AutoModelForSequenceClassification, num_labels 1): one score per token of the
    hidden states (the last one is picked), fp32 with its gradient, instead of vocabulary-sized logits."""
    tokens = setup.micro_batch * setup.seq_len
    return 2 * 4 * tokens, f"2 x {tokens:,} tokens x 4 B; reward head: one fp32 score per token and its gradient"


LOSS_KERNELS: dict[str, Callable[[Setup], Sized]] = {
    "default": default_loss, "chunked": chunked_loss, "liger": liger_loss,
}
