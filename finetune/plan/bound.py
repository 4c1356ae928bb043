"""The stated upper bound: the point estimate widened by how far published measurements of the same kind
of setup have come out above it (tests/data/plan_corpus.json; the method in docs/plan.md, "The bound").

A setup belongs to nested classes, from the most specific to all of them (`class_keys`):
  1. allocator history x method x ZeRO: "one shape / lora / no DeepSpeed"
  2. allocator history x method: "one shape / lora"
  3. allocator history: "one shape"
  4. "all"
"Allocator history" is "shapes vary" when every batch has its own shape and expandable segments are off
(the caching allocator then keeps segments of earlier shapes: finetune/plan/allocator.py), "one shape"
otherwise. The residual of a measured case is measured / planned for the counter its source reports,
taken on the allocator's part (`residual`: what lies outside PyTorch, the CUDA context and NCCL, is
subtracted from an nvidia-smi reading). A class's width is the BOUND_QUANTILE quantile of its cases'
residuals, less 1 (never below 0); a setup takes the width of its most specific class with at least
BOUND_MIN_CASES cases (`width_for`). The widths are recomputed from the corpus by
scripts/plan_corpus.py (`--widths`) and kept in constants.BOUND_WIDTHS (a test checks they agree), and
the method is validated there by leaving each source out in turn.

The width multiplies the whole of reserved, the exactly-counted states and buffers as much as the estimated
activations, loss blocks and allocator overhead. Margins on the estimated part (`split`: width x uncertain,
or x (uncertain + a share of the exact part)) were compared leave-one-source-out (scripts/plan_bound_methods.py;
docs/plan.md, "The bound"): the corpus' largest misses are setups whose estimated part is 5-10% of the plan,
so the uncertain part alone covers 114 of 140 cases where the whole covers 131, and a 95% quantile regression
of the relative miss on the uncertain share puts the share of the exact part at 1 (the miss's tail does not
grow with what is estimated). Until the point estimate's misses lie in its estimated terms, the width stays
on the whole.
"""

from __future__ import annotations

import statistics
from typing import Iterable

from finetune.plan.constants import BOUND_MIN_CASES, BOUND_QUANTILE, BOUND_WIDTHS
from finetune.plan.setup import Setup, Term

SHAPES_VARY = "shapes vary"
ONE_SHAPE = "one shape"


def history(setup: Setup) -> str:
    return SHAPES_VARY if setup.shapes_vary and not setup.expandable_segments else ONE_SHAPE


def zero_kind(setup: Setup) -> str:
    if not setup.deepspeed:
        return "no DeepSpeed"
    return "ZeRO-3" if setup.stage == 3 else "ZeRO-0/1/2"


def class_keys(setup: Setup) -> tuple[str, ...]:
    """The setup's classes, most specific first."""
    h = history(setup)
    return (f"{h} / {setup.method} / {zero_kind(setup)}", f"{h} / {setup.method}", h, "all")


# The kinds of term (Term.field) the planner estimates: activations and the loss blocks (shapes, kernels'
# saved tensors), and the overhead (cuBLAS workspaces, the allocator's rounding, fragmentation and history).
# Weights, gradients, optimizer states and buffers (DeepSpeed's buckets and partitions, dequantized weights)
# are counted from parameter shapes, dtypes and DeepSpeed's configuration.
UNCERTAIN_FIELDS = ("activations", "logits", "overhead")
# The counters the allocator's part of each view adds up (what lies outside PyTorch is added as planned).
VIEW_COUNTERS = {"allocated": ("allocated",), "reserved": ("allocated", "reserved"),
                 "nvidia_smi": ("allocated", "reserved")}


def split(terms: Iterable[Term], view: str) -> dict[str, tuple[int, int]]:
    """{phase: (planned, of which uncertain)} on the allocator's part of the counter `view`."""
    counters, terms = VIEW_COUNTERS[view], list(terms)
    out = {}
    for phase in ("backward", "step"):
        live = [(t.bytes if t.live is None else t.live, t.field in UNCERTAIN_FIELDS) for t in terms
                if t.phase in ("both", phase) and t.counter in counters]
        out[phase] = (sum(b for b, _ in live), sum(b for b, uncertain in live if uncertain))
    return out


def residual(views: dict[str, int], view: str, measured: float) -> float:
    """measured / planned on the allocator's part of the counter `view` reports."""
    if view == "nvidia_smi":
        outside = views["nvidia_smi"] - views["reserved"]
        return (measured - outside) / views["reserved"]
    return measured / views[view]


def bounded(views: dict[str, int], width: float) -> dict[str, int]:
    """Each counter's bound: the allocator's part widened, what lies outside PyTorch added as planned."""
    reserved = int(views["reserved"] * (1 + width))
    return {"allocated": int(views["allocated"] * (1 + width)), "reserved": reserved,
            "nvidia_smi": reserved + views["nvidia_smi"] - views["reserved"]}


def quantile_width(residuals: list[float], quantile: float = BOUND_QUANTILE) -> float:
    if len(residuals) < 2:
        return max(0.0, (residuals or [1.0])[0] - 1)
    cuts = statistics.quantiles(residuals, n=1000, method="inclusive")
    return max(0.0, cuts[round(quantile * 1000) - 1] - 1)


def widths_from(cases: Iterable[tuple[tuple[str, ...], float]], min_cases: int = BOUND_MIN_CASES,
                quantile: float = BOUND_QUANTILE) -> dict[str, tuple[float, int]]:
    """{class: (width, cases)} for every class with at least `min_cases` of the (class_keys, residual)
    cases; "all" always."""
    by_class: dict[str, list[float]] = {}
    for keys, value in cases:
        for key in keys:
            by_class.setdefault(key, []).append(value)
    return {key: (round(quantile_width(values, quantile), 4), len(values)) for key, values in sorted(by_class.items())
            if len(values) >= min_cases or key == "all"}


def width_for(setup: Setup, widths: dict[str, tuple[float, int]] = BOUND_WIDTHS) -> tuple[float, str, int]:
    """(width, the class it comes from, that class's cases)."""
    for key in class_keys(setup):
        if key in widths:
            width, cases = widths[key]
            return width, key, cases
    return 0.0, "none", 0
