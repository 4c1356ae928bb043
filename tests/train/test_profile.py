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
    # 3 x (aten::matmul, its aten::mm, aten::tanh) a step, nested calls counted, and what torch adds around them
    assert 9 <= result["operator_calls_per_step"] <= 30


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


def test_on_a_gpu_each_kernel_counts_once_under_its_operator_and_in_the_kernel_table():
    from types import SimpleNamespace as Event

    def avg(key, device, self_device, count=1):
        return Event(key=key, device_type=f"DeviceType.{device}", self_device_time_total=self_device, count=count)

    def kernel(start, end):
        return Event(device_type="DeviceType.CUDA", time_range=Event(start=start, end=end))

    class Profiler:  # torch.profiler's averages for aten::linear -> aten::mm -> one GEMM kernel, and one copy
        def key_averages(self):
            return [avg("aten::linear", "CPU", 0), avg("aten::mm", "CPU", 300_000, 4), avg("aten::copy_", "CPU", 100_000),
                    avg("nvjet_gemm", "CUDA", 300_000, 4), avg("copy_kernel", "CUDA", 100_000)]

        def events(self):  # two streams overlapping for 0.05 s: busy 0.35 s of the 0.5 s wall
            return [kernel(0, 300_000), kernel(250_000, 350_000), Event(device_type="DeviceType.CPU")]

    result = profile.summary(Profiler(), seconds=0.5, on_gpu=True)
    assert [(r["name"], r["share"]) for r in result["top"]] == [("aten::mm", 0.75), ("aten::copy_", 0.25)]
    assert [(r["name"], r["share"]) for r in result["kernels"]] == [("nvjet_gemm", 0.75), ("copy_kernel", 0.25)]
    assert result["kernel_seconds"] == 0.4 and result["shares_of"] == "kernel time"
    assert abs(result["gpu_busy_fraction"] - 0.7) < 1e-9
    assert result["operator_calls_per_step"] == 6 / 3 and result["kernels_per_step"] == 5 / 3  # of PROFILE_STEPS
