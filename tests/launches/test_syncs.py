"""What a step makes the host wait for (finetune.train.syncs, issue 35): finetune's LoRA step on the plain
Trainer path (what `auto` picks on one GPU) against scripts/bench_hf.py's at the same recipe, one CPU process.

The census counts the calls that wait for a GPU (`.item()`, `bool(tensor)`, boolean masks, copies to the host)
and the collectives, at the Python line that makes them; a CPU run has the same lines as a GPU run.
"""

from __future__ import annotations

import json
import subprocess
import sys

from finetune.run.launch.commands import free_port
from finetune.train.syncs import ENV as SYNCS, summary_lines
from tests.train_fixtures import REPO, TINY_RECIPES, cache_dir, runner_env


def test_finetunes_step_waits_for_no_line_of_its_own_and_less_than_the_plain_trainers(tmp_path_factory, tmp_path):
    env = runner_env(cache_dir(tmp_path_factory))
    run_dir, counted = tmp_path / "run", tmp_path / "syncs.json"
    sets = ["training.max_steps=9", "training.micro_batch_size=1", "training.gradient_accumulation_steps=2",
            "deepspeed.enabled=false", "launch.procs_per_node=1", "training.save_steps=100",
            "training.logging_steps=20"]  # a logged step reads the loss and gathers (the Trainer's, on both sides)
    trained = subprocess.run([sys.executable, "-m", "finetune.cli", "train", str(TINY_RECIPES / "lora_zero2.yaml"),
                              "--output-dir", str(run_dir), "--master-port", str(free_port()),
                              *[a for s in sets for a in ("--set", s)]],
                             cwd=REPO, env={**env, SYNCS: str(counted)}, capture_output=True, text=True, timeout=300)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    ours = json.loads(counted.read_text())
    assert ours["steps"] == 3 and json.loads((run_dir / "summary.json").read_text())["steady"]["steps"] == 9 - 5 - 3
    sites = [s["site"] for part in ("host_syncs", "collectives") for s in ours[part]["sites"]]
    assert not [s for s in sites if s.startswith("finetune/")], ours
    assert ours["collectives"]["per_step"] == 0
    # transformers' own: its mask code checks on the host whether the position ids restart (one per forward)
    assert ours["host_syncs"]["per_step"] <= 2, ours

    bench = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_hf.py"), str(run_dir), "--out",
                            str(tmp_path / "bench"), "--no-deepspeed", "--syncs"],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert bench.returncode == 0, bench.stdout[-3000:] + bench.stderr[-3000:]
    theirs = json.loads((tmp_path / "bench" / "syncs.json").read_text())
    print("\n".join(summary_lines(ours) + summary_lines(theirs)))
    # the Trainer's NaN filter (isnan or isinf of each micro batch's loss) and the all-ones mask check
    assert theirs["host_syncs"]["per_step"] >= ours["host_syncs"]["per_step"] + 4, (ours, theirs)
    assert any(s["site"].startswith("transformers/trainer.py") for s in theirs["host_syncs"]["sites"])
