"""How many chunks `training.loss_kernel: chunked` splits the loss into: the planner sizes the logits by it,
the runner (finetune.train.runner -> finetune.loss_kernel.use_chunked_loss) trains with it. No torch."""

from __future__ import annotations

import math
from typing import Optional

# One chunk's fp32 logits take at most this much (523 tokens at Llama-3's 128,256 vocabulary,
# 2,048 at Llama-2's 32,000). Smaller chunks save little more: the hidden states and their
# gradient (batch x seq x hidden) are then the larger part of the loss's memory.
CHUNK_LOGITS_BYTES = 256 * 2**20


def chunk_tokens(vocab: int, chosen: Optional[int] = None) -> int:
    """Tokens per chunk for a vocabulary of `vocab` entries (`chosen`: training.loss_chunk_tokens)."""
    return chosen if chosen else max(1, CHUNK_LOGITS_BYTES // (4 * vocab))


def chunk_count(max_tokens: int, vocab: int, chosen: Optional[int] = None) -> int:
    """Chunks per forward, fixed for the whole run from the largest micro batch (micro_batch x max_length).

    Fixed, not computed from each batch: under ZeRO-3 every call of the head all-gathers its weight,
    a collective, so every rank must call it equally often, whatever the padded length of its batch.
    """
    return max(1, math.ceil(max_tokens / chunk_tokens(vocab, chosen)))
