"""Mixing arithmetic: how many examples of each source go into the training set, and which.

Semantics (README "Mixing sources"):
- no `weight` or `samples` anywhere: every example of every source, once.
- `samples: N`: exactly N examples of that source. N below the source's size: a seeded random subset;
  above it: every example N // size times plus a seeded subset for the remainder (repetition, never
  sampling with replacement, so no example is left out while another appears three times).
- `weight: w`: the weighted sources make up the mixture in proportion to their weights, and the one
  with the largest weight (the first such, on a tie) is kept whole: each other weighted source gets
  round(size_of_largest x w / w_largest) examples, subset or repeated as above. A small domain set
  weighted up is repeated; nothing of the main set is thrown away.
- A source with `weight` next to one with neither is refused (lint R115): its share would be a guess.

Counts are examples after tokenization (a `text` document split into max_length pieces counts each
piece; examples dropped by truncation are gone before mixing), so the proportions hold for what trains.
The order is shuffled with the seed (data.seed, else training.seed), so packing mixes the sources too.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional, Sequence

from finetune.errors import FinetuneError


class MixError(FinetuneError, ValueError):
    """A mixture that cannot be built: the message names the source."""


@dataclass(frozen=True)
class Share:
    available: int
    target: int

    def describe(self) -> str:
        if self.target == self.available:
            return "all"
        if self.target < self.available:
            return f"a random {self.target / self.available:.0%} subset"
        return f"repeated {self.target / self.available:.2f}x"


def spec_problems(weights: Sequence[Optional[float]], samples: Sequence[Optional[int]]) -> list[tuple[int, str]]:
    """(source index, problem) for a weight/samples specification that cannot be mixed."""
    problems = []
    for i, (weight, count) in enumerate(zip(weights, samples)):
        if weight is not None and count is not None:
            problems.append((i, "give either weight or samples, not both"))
    if any(w is not None for w in weights):
        for i, (weight, count) in enumerate(zip(weights, samples)):
            if weight is None and count is None:
                problems.append((i, "has neither weight nor samples while other sources have a weight; "
                                    "give every source a weight (or samples)"))
    return problems


def targets(counts: Sequence[int], weights: Sequence[Optional[float]], samples: Sequence[Optional[int]],
            names: Sequence[str]) -> list[Share]:
    """How many examples of each source the mixture takes."""
    problems = spec_problems(weights, samples)
    if problems:
        i, problem = problems[0]
        raise MixError(f"data.sources[{i}] ({names[i]}): {problem}")
    for i, count in enumerate(counts):
        if count == 0 and (samples[i] or weights[i]):
            raise MixError(f"data.sources[{i}] ({names[i]}): no example left to mix (empty, or every one dropped by truncation)")
    weighted = [i for i, w in enumerate(weights) if w is not None]
    out = []
    largest = max(weighted, key=lambda i: (weights[i], -i)) if weighted else None
    for i, count in enumerate(counts):
        if samples[i] is not None:
            out.append(Share(count, samples[i]))
        elif weights[i] is not None and largest is not None:
            out.append(Share(count, max(1, round(counts[largest] * weights[i] / weights[largest]))))
        else:
            out.append(Share(count, count))
    return out


def pick(available: int, target: int, rng: random.Random) -> list[int]:
    """`target` indices into `available` examples: a subset, or whole repeats plus a subset."""
    return _pick(available, target, rng).tolist()


def _pick(available: int, target: int, rng: random.Random):
    import numpy as np

    repeats, rest = divmod(target, available)
    subset = np.sort(np.fromiter(rng.sample(range(available), rest), dtype=np.int64, count=rest))
    return np.concatenate([np.tile(np.arange(available, dtype=np.int64), repeats), subset])


def mixture(shares: Sequence[Share], seed: int) -> list[tuple[int, int]]:
    """(source index, example index) of the mixed training set, shuffled; the same for the same seed."""
    sources, indices = mixture_arrays(shares, seed)
    return list(zip(sources.tolist(), indices.tolist()))


def mixture_arrays(shares: Sequence[Share], seed: int):
    """`mixture` as two numpy arrays (source index, example index): 16 bytes per example, not a Python
    tuple each, for millions of them."""
    import numpy as np

    sources, indices = [], []
    for source, share in enumerate(shares):
        # One generator per source: adding a source does not change which examples the others give.
        rng = random.Random(f"{seed}:{source}")
        chosen = _pick(share.available, share.target, rng)
        indices.append(chosen)
        sources.append(np.full(len(chosen), source, dtype=np.int64))
    source_of = np.concatenate(sources) if sources else np.zeros(0, dtype=np.int64)
    index_of = np.concatenate(indices) if indices else np.zeros(0, dtype=np.int64)
    # random.shuffle swaps positions in an order that depends only on the length: shuffling the positions
    # gives the permutation that shuffling the (source, index) pairs themselves gave.
    order = list(range(len(source_of)))
    random.Random(seed).shuffle(order)
    permutation = np.array(order, dtype=np.int64)
    del order
    return source_of[permutation], index_of[permutation]
