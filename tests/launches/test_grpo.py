"""GRPO and reward-model training for real (slow): the tiny model, CPU processes, `finetune train`.

- GRPO, LoRA + ZeRO-3 (2 processes, 20 steps), stopped by SIGTERM and resumed: the mean reward of
  recipes/tiny/grpo_rewards.py rises clearly; summary.json has the first/last mean reward, report.html the plot.
- GRPO, full fine-tune + ZeRO-2 with a reference model (beta > 0; 2 processes, 4 steps): trains, logs a KL.
- A reward model (full + ZeRO-2, 2 processes): `finetune eval`'s pairwise accuracy on its pairs is far above chance.

    python -m pytest tests/launches/test_grpo.py        # a few minutes on 2 cores
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from finetune.run.launch.commands import free_port
from tests.train_fixtures import REPO, TINY_RECIPES, cache_dir, runner_env

# every tiny grpo/reward recipe and the test that trains it (tests/train/test_grpo.py could check the list)
TRAINED = {
    "grpo_lora_zero3": "test_grpo_lora_zero3_mean_reward_rises",
    "grpo_full_zero2": "test_grpo_full_zero2_with_a_reference_model",
    "reward_full_zero2": "test_reward_model_ranks_its_pairs_above_chance",
}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    from finetune.builtin import ensure_builtin_model

    root = cache_dir(tmp_path_factory)
    ensure_builtin_model("builtin:tiny-llama", root)
    return root


def train_argv(recipe: str, out: Path, *sets: str) -> list[str]:
    argv = [sys.executable, "-m", "finetune.cli", "train", str(TINY_RECIPES / f"{recipe}.yaml"), "--output-dir",
            str(out), "--master-port", str(free_port())]
    for item in sets:
        argv += ["--set", item]
    return argv


def train(recipe: str, out: Path, cache: Path, *sets: str) -> subprocess.CompletedProcess:
    done = subprocess.run(train_argv(recipe, out, *sets), cwd=REPO, env=runner_env(cache), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def logged(run_dir: Path, step: int) -> list[dict]:
    return json.loads((run_dir / f"checkpoint-{step}" / "trainer_state.json").read_text())["log_history"]


def test_grpo_lora_zero3_mean_reward_rises(tmp_path, cache):
    """One run, stopped by SIGTERM after 8 steps and resumed to 20 like an SFT run; then the rise."""
    from finetune.rundir import checkpoint as ckpt

    run = tmp_path / "grpo"
    argv = train_argv("grpo_lora_zero3", run, "training.save_steps=6")
    log = tmp_path / "grpo.log"
    with open(log, "wb") as handle:
        first = subprocess.Popen(argv, cwd=REPO, env=runner_env(cache), stdout=handle, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 400
        while log.read_text(errors="replace").count("{'loss':") < 8:
            assert first.poll() is None, log.read_text(errors="replace")[-4000:]
            assert time.monotonic() < deadline, "no 8 GRPO steps in time"
            time.sleep(0.1)
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=300) == ckpt.EXIT_PREEMPTED, log.read_text(errors="replace")[-4000:]
    step = ckpt.latest_complete(run).step
    assert 8 <= step < 20 and not (run / "adapter").exists()
    done = subprocess.run(argv, cwd=REPO, env=runner_env(cache), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"resuming from checkpoint-{step} (step {step})" in done.stderr

    rewards = [e["reward"] for e in logged(run, 20) if "reward" in e]
    assert len(rewards) == 20  # the resumed run's history holds the steps before the stop too
    first_mean, last_mean = sum(rewards[:6]) / 6, sum(rewards[-6:]) / 6
    # ~0.25 at the start (a quarter of the vocabulary); one step's mean over 16 completions has a std of ~0.03
    assert last_mean > first_mean + 0.06, (first_mean, last_mean, rewards)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["objective"] == "grpo" and summary["mean_reward"]["first"] == rewards[0]
    assert {"rewards/low_id_share/mean", "rewards/exact_match/mean", "kl", "completions/mean_length"} \
        <= set(summary["preference_metrics"])
    report = (run / "report.html").read_text()
    assert (run / "rewards.png").is_file() and "Rewards, KL and completion length" in report
    samples = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} >= {1, 20} and "Sample completions" in report
    assert all(set(s["rewards"]) == {"low_id_share", "exact_match"} for s in samples)
    assert "[finetune] reward " in done.stdout + done.stderr and (run / "adapter" / "adapter_config.json").is_file()


@pytest.mark.full  # a reference model in the default tier: tests/launches/test_preference.py (DPO, full ZeRO-2)
def test_grpo_full_zero2_with_a_reference_model(tmp_path, cache):
    run = tmp_path / "grpo-full"
    train("grpo_full_zero2", run, cache)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["output"] == "model"
    assert summary["preference_metrics"]["kl"]["last"] > 0  # the policy moved away from the frozen reference


def test_reward_model_ranks_its_pairs_above_chance(tmp_path, cache):
    run = tmp_path / "reward"
    done = train("reward_full_zero2", run, cache)
    assert f"finetune eval {run}" in done.stdout + done.stderr  # the next steps it offers
    evaluated = subprocess.run([sys.executable, "-m", "finetune.cli", "eval", str(run)], cwd=REPO,
                               env=runner_env(cache), capture_output=True, text=True, timeout=300)
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    result = json.loads((run / "eval.json").read_text())
    assert result["pairs"] == 160 and result["accuracy"] > 0.8, result  # chance: 0.5
    assert "pairwise accuracy:" in evaluated.stdout
