"""Preemption and resume for real: the real CLI on the tiny LoRA + ZeRO-2 recipe (2 CPU processes, fp32, dropout 0,
12 steps, checkpoint every 4 steps), compared with one uninterrupted run of the same recipe (the session's shared
SFT run), in one chain:
- SIGKILL of every process while checkpoint-8 is being written: the next run ignores the half-written
  checkpoint and resumes from checkpoint-4;
- SIGHUP of that run mid-run: exit 75, a complete checkpoint at the step it stopped;
- `kill -9` of the next run's `finetune train`: its launcher and ranks save, stop and are gone;
- the last run resumes and ends with the same adapter (within 1e-5) and a loss log without gaps or repeats.
The checkpoint rules, the resume decision and the signal handling without training: tests/train/test_resume.py.

    python -m pytest tests/launches/test_resume.py            # about 2-3 minutes on 2 cores
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from finetune.rundir import checkpoint as ckpt
from finetune.run.launch.commands import free_port
from tests.conftest import SHARED_SFT_RECIPE, SHARED_SFT_SETS
from tests.train.test_resume import running
from tests.train_fixtures import REPO, assert_run_report, runner_env

RECIPE, SETS = SHARED_SFT_RECIPE, SHARED_SFT_SETS  # the reference is the session's shared run of exactly these
STEPS = 12


def train_argv(out: Path, *extra: str) -> list[str]:
    # A port of the OS's choosing: never 29500, where a real run on this machine may be starting.
    return [sys.executable, "-m", "finetune.cli", "train", str(RECIPE), "--output-dir", str(out), *SETS,
            "--master-port", str(free_port()), *extra]


class Run:
    """`finetune train` in the background, its output in a file the test can watch."""

    def __init__(self, argv: list[str], tiny_cache: Path, log: Path, own_group: bool = False):
        self.log = log
        self.handle = open(log, "wb")
        # own_group: `finetune train` leads a process group, as in a shell, so the test can kill the group
        self.proc = subprocess.Popen(argv, cwd=REPO, env=runner_env(tiny_cache), stdout=self.handle,
                                     stderr=subprocess.STDOUT, start_new_session=own_group)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, ready, timeout: float = 300, poll: float = 0.05) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"finetune train exited with {self.proc.returncode}:\n{self.text()[-4000:]}")
            if time.monotonic() > deadline:
                self.kill_all()
                raise AssertionError(f"timed out:\n{self.text()[-4000:]}")
            time.sleep(poll)

    def steps_logged(self) -> int:
        return self.text().count("{'loss':")

    def finish(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.handle.close()

    def kill_all(self) -> None:
        """SIGKILL `finetune train`, the launcher and every rank at once: the machine went away."""
        import psutil

        try:
            tree = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            tree = []
        for process in [psutil.Process(self.proc.pid), *tree]:
            try:
                process.kill()
            except psutil.Error:
                pass
        self.finish()


@pytest.fixture(scope="module")
def reference(shared_sft_run):
    """One uninterrupted run: what every interrupted and resumed run must end with (the session's shared SFT
    run: the same recipe and --set as train_argv)."""
    return shared_sft_run[0]


def adapter(run_dir: Path):
    from safetensors.torch import load_file

    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


def assert_same_training(run_dir: Path, reference: Path) -> None:
    """Same adapter, and a loss log of steps 1..12 (no gap, no repeat) equal to the reference's."""
    import torch

    summary = json.loads((run_dir / "summary.json").read_text())
    expected = json.loads((reference / "summary.json").read_text())
    assert summary["steps"] == STEPS
    assert [e["step"] for e in summary["loss_history"]] == list(range(1, STEPS + 1))
    for got, want in zip(summary["loss_history"], expected["loss_history"]):
        assert got["loss"] == pytest.approx(want["loss"], abs=1e-5), (got, want)
        assert got["learning_rate"] == pytest.approx(want["learning_rate"], rel=1e-9)
    resumed, uninterrupted = adapter(run_dir), adapter(reference)
    assert resumed.keys() == uninterrupted.keys()
    for name, tensor in uninterrupted.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=0, atol=1e-5, msg=name)


def test_four_interrupted_runs_end_as_the_uninterrupted_one(reference, tmp_path, tiny_cache):
    """Four runs into one directory, one interruption each (the runs are ~90% start-up, so one chain):
    1. every process SIGKILLed while checkpoint-8 is being written (the machine went away);
    2. the next run ignores the half-written checkpoint-8, resumes from checkpoint-4, and is stopped by
       SIGHUP (a dropped SSH session): exit 75 and a complete checkpoint at the step it stopped, not at the
       last save_steps;
    3. the next run resumes there and its `finetune train` is killed with `kill -9` of its process group:
       no launcher or rank outlives it (finetune.run.lifeline: torchrun gets one SIGTERM, the ranks save and
       stop) and no lock is left;
    4. the next run resumes from that checkpoint and ends with the uninterrupted run's adapter and loss log."""
    import psutil

    out = tmp_path / "run"
    first = Run(train_argv(out), tiny_cache, tmp_path / "first.log")
    first.wait_for(lambda: (out / "checkpoint-8").is_dir(), poll=0.002)
    first.kill_all()
    half = out / "checkpoint-8"
    if (half / ckpt.MARKER).exists():
        # The save outran the poll: make it what a kill during the save leaves, a folder without
        # its marker and with a file cut short.
        (half / ckpt.MARKER).unlink()
        state = half / "trainer_state.json"
        state.write_bytes(state.read_bytes()[:10])
    assert [(c.step, c.complete) for c in ckpt.list_checkpoints(out)] == [(4, True), (8, False)]

    second = Run(train_argv(out), tiny_cache, tmp_path / "second.log")
    # step 5: before the next save_steps (8), and early, so that the third run has steps left to be killed in
    second.wait_for(lambda: second.steps_logged() >= 1, poll=0.002)
    second.proc.send_signal(signal.SIGHUP)
    assert second.finish() == ckpt.EXIT_PREEMPTED, second.text()[-4000:]
    assert "resuming from checkpoint-4 (step 4)" in second.text()
    assert "checkpoint-8 is incomplete" in second.text()
    stopped = json.loads((out / ckpt.STOP_RECORD).read_text())
    step = stopped["step"]
    assert 5 <= step < STEPS and stopped["signal"] == "SIGTERM"  # what the ranks are sent for a SIGHUP
    assert ckpt.latest_complete(out).step == step  # saved where it stopped, not at the last save_steps
    assert f"stopped: SIGHUP at step {step}: checkpoint-{step} is complete" in second.text()
    assert "SignalException" not in second.text() and "death signal" not in second.text()  # torchrun's (issue 34)
    assert not (out / "adapter").exists() and not (out / "summary.json").exists()  # no final outputs
    assert all(c.complete for c in ckpt.list_checkpoints(out))

    third = Run(train_argv(out), tiny_cache, tmp_path / "third.log", own_group=True)

    def rank_tree() -> list:
        """`finetune train`'s processes once torchrun and both ranks are there, else []."""
        try:
            tree = psutil.Process(third.proc.pid).children(recursive=True)
            lines = [" ".join(p.cmdline()) for p in tree]
        except psutil.Error:  # a process of the tree exited while it was read
            return []
        ranks = [line for line in lines if "finetune.train.runner" in line and "torch.distributed.run" not in line]
        return tree if len(ranks) == 2 and any("torch.distributed.run" in line for line in lines) else []

    # The tree is read before the ranks train: on an idle box a step takes ~40 ms and only ~5 are left, so the
    # kill must follow the first logged step at once, or the run ends before its SIGTERM arrives.
    third.wait_for(lambda: bool(rank_tree()))
    tree = rank_tree()
    assert tree, "torchrun or a rank exited before training"
    third.wait_for(lambda: third.steps_logged() >= 1, poll=0.002)
    killed = time.monotonic()
    os.killpg(third.proc.pid, signal.SIGKILL)
    third.finish()
    alive = running(tree, timeout=60)
    took = time.monotonic() - killed
    assert not alive, [p.pid for p in alive]
    assert took < 30, took
    print(f"launcher and 2 ranks gone {took:.1f} s after kill -9 of finetune train")
    from finetune.rundir import lock as runlock

    assert runlock.holder(out) is None
    assert f"resuming from checkpoint-{step} (step {step})" in third.text()
    saved = ckpt.latest_complete(out).step  # the ranks' checkpoint at the step they stopped
    if saved == STEPS:
        # The ranks agree on a stop a step or more after the signal (issue 35: no blocking collective per step;
        # past the warm-up they exchange their flags about every 0.5 s), and a stop that falls on the last step is
        # no stop: with ~4 steps of ~40 ms left the SIGTERM the lifeline relays can come too late for a checkpoint
        # before the end. Then the run finished, whole and equal.
        assert (out / "adapter").is_dir() and not (out / ckpt.STOP_RECORD).exists()
        assert_same_training(out, reference)
        return
    assert step < saved < STEPS and not (out / "adapter").exists()

    fourth = subprocess.run(train_argv(out), cwd=REPO, env=runner_env(tiny_cache), capture_output=True, text=True,
                            timeout=600)
    assert fourth.returncode == 0, fourth.stderr[-4000:]
    assert f"resuming from checkpoint-{saved} (step {saved})" in fourth.stderr
    assert not (out / ckpt.STOP_RECORD).exists()
    assert json.loads((out / "summary.json").read_text())["resumed_from"].endswith(f"checkpoint-{saved}")
    assert_same_training(out, reference)
    assert_run_report(out, STEPS)  # the plot and the report of a resumed run cover the whole run
    # save_total_limit: 2 -> the two newest complete checkpoints are kept
    assert [c.step for c in ckpt.list_checkpoints(out)] == ([8, 12] if saved < 8 else [saved, 12])
