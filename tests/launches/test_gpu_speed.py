"""scripts/gpu_speed.py's plumbing on CPU (slow), and what it leaves: a finetune run without DeepSpeed, trained,
resumed at its last step without training a step more (issue 34), its steady figures beside bench_hf.py's.

    python -m pytest -m full tests/launches/test_gpu_speed.py
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from finetune.run.launch.commands import free_port
from tests.train_fixtures import REPO, cache_dir, runner_env

SCRIPT = REPO / "scripts" / "gpu_speed.py"


@pytest.mark.full  # the harness ran on an H200 (docs/gpu_acceptance/2026-11-27_*); the last-step rule: tests/test_speed.py
def test_cpu_plumbing_pairs_finetune_with_bench_hf_and_a_finished_run_trains_no_more(tmp_path_factory, tmp_path):
    out = tmp_path / "speed"
    env = runner_env(cache_dir(tmp_path_factory))
    result = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--out", str(out)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    mine, theirs = results["runs"]
    assert mine["status"] == theirs["status"] == "ok", results["runs"]
    # the plain Trainer; the warm-up and the profiled steps left out, on both sides
    assert mine["deepspeed"] is False and mine["steady"]["steps"] == theirs["steady"]["steps"] == 10 - 5 - 3
    assert theirs["steady"]["tokens_per_second"] > 0 and theirs["profile"]["top"]
    assert mine["profile"]["top"] and mine["profile"]["steps"] == 3 and mine["profile"]["gpu_busy_fraction"] is None
    assert results["ratios"]["tiny_lora_plain"]["ratio"] > 0 and "| tiny_lora_plain |" in (out / "results.md").read_text()
    same = results["ratios"]["tiny_lora_plain"]["same_steps"]  # the same rows, step by step, on both sides
    assert same["steps"] == [9, 10] and same["rows_match"] and same["ratio"] > 0
    assert mine["profile"]["operator_calls_per_step"] > 100 and "operator calls a step" in (out / "results.md").read_text()
    # both sides' host syncs per step, by line (finetune.train.syncs): none of finetune's own
    assert mine["syncs"]["steps"] == theirs["syncs"]["steps"] == 3
    assert mine["syncs"]["host_syncs"]["per_step"] < theirs["syncs"]["host_syncs"]["per_step"]
    assert not [s for s in mine["syncs"]["host_syncs"]["sites"] if s["site"].startswith("finetune/")]
    assert "Host syncs and collectives per step of tiny_lora_plain_finetune" in (out / "results.md").read_text()
    run = out / "runs" / "tiny_lora_plain_finetune"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 10 and summary["train_loss_last"] < summary["train_loss_first"]
    assert (run / "checkpoint-10" / "adapter_model.safetensors").is_file()  # the Trainer's own checkpoint format
    # issue 34: the finished run, resumed from its checkpoint at the last step, writes its outputs and trains nothing
    again = subprocess.run([sys.executable, "-m", "finetune.cli", "train", mine["recipe"], "--output-dir",
                            str(run), "--force-resume", "--master-port", str(free_port())],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "checkpoint-10 is the training's last step (step 10 of 10): nothing is left to train" in again.stdout
    resumed = json.loads((run / "summary.json").read_text())
    assert resumed["steps"] == 10 and resumed["loss_history"] == summary["loss_history"]
