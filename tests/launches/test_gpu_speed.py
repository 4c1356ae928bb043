"""scripts/gpu_speed.py --cpu, the GPU check's plumbing on one CPU process (issue 35): finetune's LoRA step on the
plain Trainer path (what `auto` picks on one GPU) against scripts/bench_hf.py's at the same recipe, both under the
profiler window and the sync census, their steady figures and their ratio; and what the run leaves: a finished run
resumed at its last step trains no more (issue 34, the full tier).

The census (finetune.train.syncs) counts the calls that wait for a GPU (`.item()`, `bool(tensor)`, boolean masks,
copies to the host) and the collectives, at the Python line that makes them; a CPU run has the same lines as a GPU
run.

    python -m pytest -m full tests/launches/test_gpu_speed.py    # the resume
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.run.launch.commands import free_port
from finetune.train.syncs import summary_lines
from tests.train_fixtures import REPO, cache_dir, runner_env

SCRIPT = REPO / "scripts" / "gpu_speed.py"


@pytest.fixture(scope="module")
def cpu_check(tmp_path_factory):
    """(out folder, results.json, environment) of one `gpu_speed.py --cpu`."""
    out = tmp_path_factory.mktemp("gpu_speed") / "speed"
    env = runner_env(cache_dir(tmp_path_factory))
    result = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--out", str(out)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, json.loads((out / "results.json").read_text()), env


def test_cpu_mode_pairs_finetune_with_bench_hf_and_finetunes_step_waits_for_no_line_of_its_own(cpu_check):
    out, results, _ = cpu_check
    mine, theirs = results["runs"]
    assert mine["status"] == theirs["status"] == "ok", results["runs"]
    report = (out / "results.md").read_text()
    # the plain Trainer; the warm-up and the profiled steps left out, on both sides
    assert mine["deepspeed"] is False and mine["steady"]["steps"] == theirs["steady"]["steps"] == 10 - 5 - 3
    assert theirs["steady"]["tokens_per_second"] > 0 and theirs["profile"]["top"]
    assert mine["profile"]["top"] and mine["profile"]["steps"] == 3 and mine["profile"]["gpu_busy_fraction"] is None
    assert mine["profile"]["operator_calls_per_step"] > 100 and "operator calls a step" in report
    assert results["ratios"]["tiny_lora_plain"]["ratio"] > 0 and "| tiny_lora_plain |" in report
    same = results["ratios"]["tiny_lora_plain"]["same_steps"]  # the same rows, step by step, on both sides
    assert same["steps"] == [9, 10] and same["rows_match"] and same["ratio"] > 0
    summary = json.loads((out / "runs" / "tiny_lora_plain_finetune" / "summary.json").read_text())
    assert summary["steps"] == 10 and summary["train_loss_last"] < summary["train_loss_first"]

    # what a step waits for, by line: nothing of finetune's own
    ours, theirs = mine["syncs"], theirs["syncs"]
    print("\n".join(summary_lines(ours) + summary_lines(theirs)))
    assert ours["steps"] == theirs["steps"] == 3
    sites = [s["site"] for part in ("host_syncs", "collectives") for s in ours[part]["sites"]]
    assert not [s for s in sites if s.startswith("finetune/")], ours
    assert ours["collectives"]["per_step"] == 0
    # transformers' own: its mask code checks on the host whether the rows are padded (one per forward)
    assert ours["host_syncs"]["per_step"] <= 2, ours
    # the Trainer's NaN filter (isnan and isinf of each micro batch's loss) on top of the same mask check
    assert theirs["host_syncs"]["per_step"] >= ours["host_syncs"]["per_step"] + 4, (ours, theirs)
    assert any(s["site"].startswith("transformers/trainer.py") for s in theirs["host_syncs"]["sites"])
    assert "Host syncs and collectives per step of tiny_lora_plain_finetune" in report


@pytest.mark.full  # the last-step rule in the default tier: tests/test_speed.py
def test_a_finished_run_resumed_at_its_last_step_trains_no_more(cpu_check):
    out, results, env = cpu_check
    mine = results["runs"][0]
    run = out / "runs" / "tiny_lora_plain_finetune"
    summary = json.loads((run / "summary.json").read_text())
    assert (run / "checkpoint-10" / "adapter_model.safetensors").is_file()  # the Trainer's own checkpoint format
    # issue 34: the finished run, resumed from its checkpoint at the last step, writes its outputs and trains nothing
    again = subprocess.run([sys.executable, "-m", "finetune.cli", "train", mine["recipe"], "--output-dir",
                            str(run), "--force-resume", "--master-port", str(free_port())],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "checkpoint-10 is the training's last step (step 10 of 10): nothing is left to train" in again.stdout
    resumed = json.loads((run / "summary.json").read_text())
    assert resumed["steps"] == 10 and resumed["loss_history"] == summary["loss_history"]


def next_commands() -> list[str]:
    """The `--only` selections of docs/gpu-acceptance.md's prepared commands ("The next GPU run")."""
    import re

    text = (REPO / "docs" / "gpu-acceptance.md").read_text(encoding="utf-8")
    section = text.split("## The next GPU run", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"run\(command=\"[^\"]*gpu_speed\.py[^\"]*--only (\S+)", section)


@pytest.mark.full  # about 3 minutes: run it before a GPU command (docs/gpu-acceptance.md)
def test_the_next_gpu_commands_cases_run_on_the_cpu(tmp_path_factory):
    """--rehearse: every case of the prepared GPU commands, shrunk onto the tiny model, trains to its end on this CPU
    and gets its figures (Liger-Kernel needs CUDA and is left out), so that a GPU loan is not spent on a case that
    cannot start."""
    selections = next_commands()
    assert len(selections) == 2, selections
    env = runner_env(cache_dir(tmp_path_factory))
    for i, only in enumerate(selections):
        out = tmp_path_factory.mktemp("rehearsal") / str(i)
        listed = subprocess.run([sys.executable, str(SCRIPT), "--list", "--only", only], cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=60)
        on_gpu = [line.split("\t")[0] for line in listed.stdout.splitlines()]
        result = subprocess.run([sys.executable, str(SCRIPT), "--rehearse", "--out", str(out), "--only", only],
                                cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        results = json.loads((out / "results.json").read_text())
        assert results["rehearsal"] and "--rehearse" in (out / "results.md").read_text()
        assert [r["name"] for r in results["runs"]] == [name for name in on_gpu if "liger" not in name]
        for run in results["runs"]:
            recipe = json.loads(Path(run["recipe"]).read_text())
            assert run["status"] == "ok" and run["steps"] == recipe["training"]["max_steps"], run
            # the speed cases' steady window (after 5 steps); the memory rows train 3 steps
            assert run["steady_tokens_per_second"] or run["name"].startswith("memory_"), run
