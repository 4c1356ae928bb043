"""How fast is `finetune lint recipes ds_configs` on this machine, next to `python -c "import torch"`?

    python scripts/bench_lint.py [--runs 15]
    python scripts/bench_lint.py --runs 1 --no-torch   # lint once, no comparison (tests/test_entry_points.py)

Prints the median wall time of both (fresh processes each run) and their ratio. The promise: linting
the shipped recipes and templates takes under 0.5 s median on a 2-core machine, without torch.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def median_seconds(argv: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        done = subprocess.run(argv, cwd=REPO, capture_output=True)
        times.append(time.perf_counter() - start)
        if done.returncode not in (0, 1):
            sys.exit(f"{' '.join(argv)} failed: {done.stderr.decode()[-500:]}")
    return statistics.median(times)


def compare_with_torch(lint: float, runs: int) -> None:
    try:
        torch = median_seconds([sys.executable, "-c", "import torch"], max(3, runs // 3))
    except SystemExit:
        print("torch is not installed here; nothing to compare with")
        return
    print(f'python -c "import torch":                  median {torch:.3f} s')
    print(f"ratio lint / import torch: {lint / torch:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--no-torch", action="store_true", help="time lint alone (importing torch takes seconds)")
    args = parser.parse_args()
    files = len(list((REPO / "recipes").rglob("*.yaml"))) + len(list((REPO / "ds_configs").glob("*.json")))
    lint = median_seconds([sys.executable, "-m", "finetune.cli", "lint", "recipes", "ds_configs"], args.runs)
    print(f"finetune lint recipes ds_configs ({files} files): median {lint:.3f} s over {args.runs} runs")
    if not args.no_torch:
        compare_with_torch(lint, args.runs)
    print("target: lint median < 0.5 s:", "OK" if lint < 0.5 else "MISSED")


if __name__ == "__main__":
    main()
