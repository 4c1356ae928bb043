"""finetune's own cost per step, measured on CPU: its steady step time against scripts/bench_hf.py's, the plain
Hugging Face Trainer, with the same DeepSpeed config, model, rows, LoRA, micro batch and processes (issue 35).

    python scripts/bench_overhead.py                  # tiny Llama, LoRA, ZeRO-2, 2 CPU processes, 4 rounds of 250 steps
    python scripts/bench_overhead.py --steps 80 --rounds 2
    python scripts/bench_overhead.py --set deepspeed.stage=0 --set launch.procs_per_node=1   # the GPU pairs' shape
    python scripts/bench_overhead.py --syncs --rounds 1 --set launch.procs_per_node=1 --set deepspeed.enabled=false

Each round trains recipes/tiny/lora_zero2.yaml with `finetune train`, then bench_hf.py on that run directory with
the run's own deepspeed.json (what DeepSpeed ran, less nothing: the same engine settings and optimizer), the order
alternating between rounds; both report finetune.speed's steady figures (the steps after the warm-up). Prints
each round, the ratio of the medians, finetune / bench_hf (the target: at most 1.02), and each round's own
ratio (its two runs follow each other). What finetune adds around the step is what differs: its callbacks (the
step clock, the stop flag, the last step's log), its collator with the host-side token count, the summary;
bench_hf's collator is transformers' DataCollatorForSeq2Seq. On a machine shared with other jobs, single rounds
swing: compare the medians of one invocation, never numbers across runs.

--syncs also counts, over 3 steps after the warm-up of each run, the host syncs and collectives per step and the
lines that make them (finetune.train.syncs: FINETUNE_SYNCS for finetune, --syncs for bench_hf), and prints both
sides' tables: what a GPU step waits for, found on a CPU. Those steps are left out of the steady figures.

Not run by the tests: each round is two 2-process training runs (minutes on 2 cores); its parts are
tested: bench_hf.py through tests/launches/test_gpu_speed.py, finetune train everywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
RECIPE = REPO / "recipes" / "tiny" / "lora_zero2.yaml"


from finetune.run.launch.commands import free_port  # noqa: E402 (after the path above)
from finetune.train.syncs import ENV as SYNCS_ENV, summary_lines  # noqa: E402


def run(cmd: list[str], env: dict[str, str]) -> None:
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"bench_overhead: {' '.join(cmd[:4])} ... failed:\n{(result.stdout + result.stderr)[-3000:]}")


def finetune(out: Path, steps: int, env: dict[str, str], recipe: Path = RECIPE, sets: tuple[str, ...] = (),
             census: bool = False) -> dict:
    if census:
        env = {**env, SYNCS_ENV: str(out.parent / f"{out.name}.syncs.json")}
    run([sys.executable, "-m", "finetune.cli", "train", str(recipe), "--output-dir", str(out), "--overwrite",
         "--set", f"training.max_steps={steps}", "--set", "training.logging_steps=10", "--master-port", str(free_port()),
         *[arg for value in sets for arg in ("--set", value)]], env)
    return json.loads((out / "summary.json").read_text())["steady"]


def bench_hf(run_dir: Path, out: Path, env: dict[str, str], census: bool = False) -> dict:
    engine = json.loads((run_dir / "summary.json").read_text()).get("deepspeed", True)
    run([sys.executable, str(REPO / "scripts" / "bench_hf.py"), str(run_dir), "--out", str(out),
         *(["--deepspeed-config", str(run_dir / "deepspeed.json")] if engine else ["--no-deepspeed"]),
         *(["--syncs"] if census else [])], env)
    return json.loads((out / "summary.json").read_text())["steady"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=250, help="optimizer steps per run (the first 5 are warm-up)")
    parser.add_argument("--rounds", type=int, default=4, help="finetune + bench_hf pairs, alternating order")
    parser.add_argument("--recipe", type=Path, default=RECIPE, help="the recipe both train (default: %(default)s)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a recipe override for finetune train (bench_hf trains the run's recipe.yaml)")
    parser.add_argument("--syncs", action="store_true", help="also count host syncs and collectives per step")
    args = parser.parse_args(argv)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    ours, theirs = [], []
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        last = None  # a finetune run directory: bench_hf trains what it says
        for r in range(args.rounds):
            order = ("finetune", "bench_hf") if r % 2 == 0 or last is None else ("bench_hf", "finetune")
            results = {}
            for tool in order:
                if tool == "finetune":
                    last = Path(tmp) / f"run{r}"
                    results[tool] = finetune(last, args.steps, env, args.recipe, tuple(args.set), args.syncs)
                else:
                    results[tool] = bench_hf(last, Path(tmp) / f"bench{r}", env, args.syncs)
            ours.append(results["finetune"])
            theirs.append(results["bench_hf"])
            print(f"round {r + 1} ({' then '.join(order)}): finetune {results['finetune']['step_seconds_p50']:.4f} s/step, "
                  f"{results['finetune']['tokens_per_second']:,.0f} tokens/s; bench_hf "
                  f"{results['bench_hf']['step_seconds_p50']:.4f} s/step, {results['bench_hf']['tokens_per_second']:,.0f} "
                  "tokens/s", flush=True)
            if args.syncs:
                for tool, path in (("finetune", Path(tmp) / f"run{r}.syncs.json"),
                                   ("bench_hf", Path(tmp) / f"bench{r}" / "syncs.json")):
                    print(f"  {tool}:", *summary_lines(json.loads(path.read_text()), top=8), sep="\n    ")
    step_ours = statistics.median(s["step_seconds_p50"] for s in ours)
    step_theirs = statistics.median(s["step_seconds_p50"] for s in theirs)
    tps_ours = statistics.median(s["tokens_per_second"] for s in ours)
    tps_theirs = statistics.median(s["tokens_per_second"] for s in theirs)
    print(f"median steady step time (p50): finetune {step_ours:.4f} s, bench_hf {step_theirs:.4f} s: "
          f"finetune / bench_hf = {step_ours / step_theirs:.3f} (target <= 1.02)")
    print(f"median steady tokens/s: finetune {tps_ours:,.0f}, bench_hf {tps_theirs:,.0f}: "
          f"finetune / bench_hf = {tps_ours / tps_theirs:.3f}")
    # each round's two runs follow each other: their ratio is the least touched by the machine's load drifting
    paired = [a["step_seconds_p50"] / b["step_seconds_p50"] for a, b in zip(ours, theirs)]
    print(f"step time ratio of each round: {', '.join(f'{r:.3f}' for r in paired)}; median "
          f"{statistics.median(paired):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
