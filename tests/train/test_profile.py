"""finetune.train.profile: the profiler window after the warm-up (the harness's profiled pairs, issue 35), on CPU."""

from __future__ import annotations

import json

import torch

from finetune.train import profile


def test_the_window_profiles_the_steps_after_the_warm_up_and_names_the_largest_operators():
    window = profile.Window(on_gpu=False, warmup=2)
    a = torch.randn(96, 96)
    for step in range(1, 8):
        for _ in range(3):
            a = torch.tanh(a @ a)  # the step's work
        window.at_step_end(step, last=step == 7)
        if step in (2, 3, 4):
            assert window.profiler is not None  # open after step 2 (the warm-up), closed after step 5
    result = window.result
    assert window.profiler is None and result["steps"] == profile.PROFILE_STEPS == 3
    names = [row["name"] for row in result["top"]]
    assert "aten::mm" in names and "aten::tanh" in names
    assert result["gpu_busy_fraction"] is None and result["wall_seconds"] > 0
    assert result["note"].startswith("steps 3-5")


def test_a_run_that_ends_inside_the_window_closes_it_at_its_last_step():
    window = profile.Window(on_gpu=False, warmup=2)
    for step in (1, 2, 3):
        torch.randn(8, 8) @ torch.randn(8, 8)
        window.at_step_end(step, last=step == 3)
    assert window.profiler is None and window.result["steps"] == 1


def test_only_rank_0_profiles_and_the_callback_writes_the_summary(monkeypatch, tmp_path):
    path = tmp_path / "profile.json"
    monkeypatch.setenv(profile.ENV, str(path))
    monkeypatch.setenv("RANK", "1")
    assert profile.wanted() is None
    monkeypatch.setenv("RANK", "0")
    assert profile.wanted() == path
    callback = profile.callback(path)

    class State:
        max_steps, global_step = 20, 0

    state = State()
    for _ in range(9):
        state.global_step += 1
        torch.randn(16, 16).sum()
        callback.on_step_end(None, state, None)
    written = json.loads(path.read_text())
    assert written["steps"] == 3 and written["top"]


def test_the_census_window_counts_only_its_steps_and_the_callback_writes_it(tmp_path):
    window = profile.Window(on_gpu=False, warmup=2, profile=False, census=True)
    x = torch.ones(4)
    for step in range(1, 8):
        x.sum().item()  # one host read per step, the step's own
        if step == 3:
            x.tolist()
        window.at_step_end(step, last=step == 7)
    assert window.result is None and window.profiler is None  # the census alone
    counted = window.syncs
    assert counted["steps"] == 3 and counted["host_syncs"]["per_step"] == 4 / 3
    assert {s["call"] for s in counted["host_syncs"]["sites"]} == {"item", "tolist"}

    path = tmp_path / "syncs.json"
    callback = profile.callback(None, path)

    class State:
        max_steps, global_step = 20, 0

    state = State()
    for _ in range(9):
        state.global_step += 1
        bool(torch.ones(1))
        callback.on_step_end(None, state, None)
    written = json.loads(path.read_text())
    assert written["steps"] == 3 and written["host_syncs"]["per_step"] == 1
