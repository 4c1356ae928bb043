"""Compare ways of stating the plan's upper bound on tests/data/plan_corpus.json, each validated leave one
source out exactly as scripts/plan_corpus.py validates the shipped one (issue 21; docs/plan.md, "The bound").

Every method is `planned + width x scale` on the allocator's part of the counter a source reports (what lies
outside PyTorch is added as planned), with one width per setup class (finetune/plan/bound.py's classes,
BOUND_MIN_CASES cases each): the BOUND_QUANTILE quantile over the class's cases of the margin each needed,
(measured - planned) / scale. They differ in the scale:

    exact share 1      scale = planned: reserved x (1 + width), the shipped method
    exact share 0      scale = the uncertain part (activations, loss blocks, overhead: bound.UNCERTAIN_FIELDS)
    exact share s      scale = uncertain + s x the exactly-counted part (weights, gradients, optimizer, buffers)
    fitted share       s chosen on the training sources only (each fold: the s in 0, 0.1, ..., 1 whose widths
                       give those sources the tightest bound in sample, by the median or the mean above; or
                       the s of a 95% quantile regression of the relative miss on the uncertain share)
    conformal          the ceil((n + 1) x 95%)-th smallest margin of a class's n cases, not the 95% quantile

    python scripts/plan_bound_methods.py
"""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import plan_corpus  # noqa: E402
from finetune.plan import bound  # noqa: E402
from finetune.plan.constants import BOUND_MIN_CASES, BOUND_QUANTILE  # noqa: E402

SHARES = tuple(i / 10 for i in range(11))


def _outside(row: dict) -> float:
    """What lies outside PyTorch in the counter the row's source reports (GiB; added as planned)."""
    views = row["views_gib"]
    return views["nvidia_smi"] - views["reserved"] if row["view"] == "nvidia_smi" else 0.0


def _scale(planned: float, uncertain: float, share: float) -> float:
    return uncertain + share * (planned - uncertain)


def margin(row: dict, share: float) -> float:
    """The smallest width that bounds the row: the bound is the larger phase's, so the phase that needs less."""
    need = row["measured_gib"] - _outside(row)
    return min((need - p) / _scale(p, u, share) for p, u in row["split_gib"].values() if _scale(p, u, share) > 0)


def bounded(row: dict, width: float, share: float) -> float:
    """The row's bound (GiB) for the counter its source reports."""
    return max(p + width * _scale(p, u, share) for p, u in row["split_gib"].values()) + _outside(row)


def conformal_width(margins: list[float], quantile: float = BOUND_QUANTILE) -> float:
    ordered = sorted(margins)
    return max(0.0, ordered[min(len(ordered), math.ceil((len(ordered) + 1) * quantile)) - 1])


def widths(rows: list[dict], share: float, conformal: bool = False) -> dict[str, float]:
    """{class: width} for the classes of BOUND_MIN_CASES cases ("all" always)."""
    if not conformal:  # bound.widths_from takes measured / planned ratios: 1 + the margin
        fitted = bound.widths_from((tuple(r["classes"]), 1 + margin(r, share)) for r in rows)
        return {key: width for key, (width, _) in fitted.items()}
    by_class: dict[str, list[float]] = {}
    for r in rows:
        for key in r["classes"]:
            by_class.setdefault(key, []).append(margin(r, share))
    return {key: conformal_width(m) for key, m in by_class.items() if len(m) >= BOUND_MIN_CASES or key == "all"}


def width_of(row: dict, fitted: dict[str, float]) -> float:
    return next(fitted[key] for key in row["classes"] if key in fitted)


def above(rows: list[dict], fitted: dict[str, float], share: float) -> list[float]:
    """bound / measured - 1 per row."""
    return [bounded(r, width_of(r, fitted), share) / r["measured_gib"] - 1 for r in rows]


def fit_share(rows: list[dict], criterion: Callable[[list[float]], float]) -> float:
    """The share whose widths bound `rows` most tightly in sample (the first, on a tie)."""
    return min(SHARES, key=lambda s: criterion(above(rows, widths(rows, s), s)))


def tightest(criterion: Callable[[list[float]], float]) -> Callable[[list[dict]], float]:
    return lambda rows: fit_share(rows, criterion)


def quantile_regression_share(rows: list[dict], quantile: float = BOUND_QUANTILE) -> float:
    """The share of the 95% quantile regression of the relative miss on the plan's uncertain and exact shares:
    (measured - planned) / planned ~ w x (u + s x (1 - u)), u = uncertain / planned at the planned peak, fitted by
    the pinball (check) loss, the loss whose minimum is a quantile. For a given s the best w is the
    x-weighted quantile of y / x (x = u + s (1 - u)); s is the grid point of least loss."""
    points = []
    for r in rows:
        planned, uncertain = max(r["split_gib"].values())
        points.append(((r["measured_gib"] - _outside(r) - planned) / planned, uncertain / planned))

    def loss(share: float) -> float:
        xy = [(u + share * (1 - u), y) for y, u in points]
        ordered, total, seen, width = sorted((y / x, x) for x, y in xy), sum(x for x, _ in xy), 0.0, 0.0
        for ratio, x in ordered:
            seen += x
            if seen >= quantile * total:
                width = max(ratio, 0.0)
                break
        return sum((quantile if y >= width * x else quantile - 1) * (y - width * x) for x, y in xy)

    return min(SHARES, key=loss)


def evaluate(rows: list[dict], share: Optional[float] = None, fit: Optional[Callable[[list[dict]], float]] = None,
             conformal: bool = False) -> dict:
    """Leave one source out: each source's rows bounded with what the other sources give (widths, and the share
    from `fit` when `share` is None); then the same fitted on every row (in sample)."""
    planned = [r for r in rows if r["error"] is not None]
    covered, over, per_source = 0, [], {}
    for source in sorted({r["source"] for r in planned}):
        mine, rest = [r for r in planned if r["source"] == source], [r for r in planned if r["source"] != source]
        s = share if share is not None else fit(rest)
        mine_over = above(mine, widths(rest, s, conformal), s)
        hits = sum(1 for o in mine_over if o >= 0)
        covered, over = covered + hits, over + mine_over
        per_source[source] = {"covered": hits, "cases": len(mine), "median_over": statistics.median(mine_over),
                              "share": s}
    s = share if share is not None else fit(planned)
    inside = above(planned, widths(planned, s, conformal), s)
    return {"covered": covered, "cases": len(planned), "coverage": covered / len(planned),
            "median_over": statistics.median(over), "p90_over": statistics.quantiles(over, n=10)[-1],
            "sources": per_source, "share": s,
            "in_sample_coverage": sum(1 for o in inside if o >= 0) / len(planned),
            "in_sample_median_over": statistics.median(inside)}


METHODS: dict[str, dict] = {
    "exact share 1 (shipped: reserved x (1 + width))": {"share": 1.0},
    "exact share 0 (uncertain part only)": {"share": 0.0},
    "exact share 0.5": {"share": 0.5},
    "exact share 0.3": {"share": 0.3},
    "share fitted per fold (tightest median)": {"fit": tightest(statistics.median)},
    "share fitted per fold (tightest mean)": {"fit": tightest(statistics.fmean)},
    "share fitted per fold (95% quantile regression)": {"fit": quantile_regression_share},
    "exact share 1, conformal quantile": {"share": 1.0, "conformal": True},
    "exact share 0, conformal quantile": {"share": 0.0, "conformal": True},
}


def main() -> int:
    rows = plan_corpus.evaluate(plan_corpus.load())
    print(f"{'method':<50}{'LOSO covered':>16}{'median above':>14}{'90% above':>11}{'in sample':>11}{'above':>8}  "
          "per source covered (share used)")
    for name, kw in METHODS.items():
        v = evaluate(rows, **kw)
        sources = ", ".join(f"{src} {s['covered']}/{s['cases']}" + ("" if "share" in kw else f" ({s['share']:g})")
                            for src, s in v["sources"].items())
        print(f"{name:<50}{v['covered']:>5} of {v['cases']} {v['coverage']:6.1%}{v['median_over']:+13.1%}"
              f"{v['p90_over']:+10.1%}"
              f"{v['in_sample_coverage']:10.1%}{v['in_sample_median_over']:+9.1%}  {sources}"
              + ("" if "share" in kw else f"; on all sources: {v['share']:g}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
