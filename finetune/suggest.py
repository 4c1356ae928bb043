"""Did-you-mean: the one place a word the user wrote is matched against the names they may have meant.

difflib's ratio (twice the matching characters over both lengths) at difflib's own default cutoff, 0.6:
`lora_alhpa` -> `lora_alpha`, `dp0` -> `dpo`. Callers that match long names sharing most of their
characters pass NEAR instead (see there). Imports only the standard library: recipe loading and lint
use it without torch.
"""

from __future__ import annotations

import difflib
from typing import Iterable

CUTOFF = 0.6  # difflib.get_close_matches' default
# Where the candidates share long parts, 0.6 pairs names that are no typo of one another: DeepSpeed's
# `reduce_bucket_size` and `allgather_bucket_size` score 0.67, `train_batch_size` and
# `train_micro_batch_size_per_gpu` 0.70, the data files `train.jsonl` and `valid.jsonl` 0.73; and a hub id
# missing from our tables is usually no typo at all. There only a near miss is offered: one character wrong
# in five (`stage`, `stagf`: 0.8). tests/lint/test_deepspeed.py pins it (DS105, good_comment_key.json: at 0.6
# `_comment` is matched to a real key and becomes an error).
NEAR = 0.8


def close_matches(word: str, candidates: Iterable, n: int = 1, cutoff: float = CUTOFF,
                  ignore_case: bool = False) -> list[str]:
    """Up to `n` of `candidates` (as strings, best first) close to `word`; with `ignore_case` compared in lower
    case and returned as spelled in `candidates`."""
    words = [str(c) for c in candidates]
    spelled = {w.lower() if ignore_case else w: w for w in words}
    asked = str(word).lower() if ignore_case else str(word)
    return [spelled[m] for m in difflib.get_close_matches(asked, list(spelled), n=n, cutoff=cutoff)]


def closest(word: str, candidates: Iterable, cutoff: float = CUTOFF, ignore_case: bool = False) -> str | None:
    """The one candidate closest to `word`, or None when none is close."""
    found = close_matches(word, candidates, 1, cutoff, ignore_case)
    return found[0] if found else None
