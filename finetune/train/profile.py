"""A torch.profiler window over a few steady steps of a run: how much of the wall time the GPU was busy, and the
kernels (on a CPU: the operators) that took the most time (issue 35: "if full fine-tuning at 4 x 2,048 is under
30% MFU, the profile names the three largest costs and says which are ours").

With FINETUNE_PROFILE=PATH in its environment, rank 0 of a run profiles the PROFILE_STEPS steps after the warm-up
(finetune.speed.WARMUP_STEPS) and writes PATH: the summary below. The steady window of that run then starts after
the profiled steps (the profiler slows them down); the harness's full fine-tune at 4 x 2,048 sets it on both sides
of its pair (scripts/gpu_speed.py), and scripts/bench_hf.py --profile uses the same window and summary.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

from finetune.train.dist import rank0_path

ENV = "FINETUNE_PROFILE"
PROFILE_STEPS = 3  # steady steps under torch.profiler (after the warm-up)
TOP_KERNELS = 12


def wanted() -> Optional[Path]:
    """PATH from the environment on rank 0, else None."""
    return rank0_path(ENV)


def start(on_gpu: bool):
    """A started torch.profiler over the CPU and, on a GPU, CUDA."""
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_gpu else [])
    profiler = torch.profiler.profile(activities=activities)
    profiler.start()
    return profiler


def _on_device(event) -> bool:
    return str(getattr(event, "device_type", "")).endswith("CUDA")


def _rows(events, attr: str, total: float) -> list[dict[str, Any]]:
    ranked = sorted(((e.key, getattr(e, attr, 0) or 0, e.count) for e in events), key=lambda r: -r[1])
    return [{"name": name[:120], "seconds": t / 1e6, "share": t / (total or 1), "calls": n}
            for name, t, n in ranked[:TOP_KERNELS] if t > 0]


def summary(profiler, seconds: float, on_gpu: bool, steps: int = PROFILE_STEPS) -> dict[str, Any]:
    """GPU-busy over wall time of the profiled steps, the operators that took longest and, on a GPU, the kernels.

    Each time is counted once. On a GPU an operator's time is that of the kernels it launched itself (torch's
    self device time: aten::linear's matmul counts under aten::mm); `top` ranks the operators and `kernels` the
    kernels, each as a share of all kernel time. On a CPU `top` ranks the operators by their own CPU time."""
    events = profiler.key_averages()
    busy = 0.0
    # the host's work per step: every operator call (nested ones too: aten::linear and its aten::mm), and on a GPU
    # every kernel launched; at a host-bound shape (micro batch 1 on an H200) fewer calls is a shorter step
    host = [e for e in events if not _on_device(e)]
    result: dict[str, Any] = {"steps": steps, "wall_seconds": seconds,
                              "operator_calls_per_step": sum(e.count for e in host) / steps if steps else None}
    if on_gpu:
        intervals = sorted((k.time_range.start, k.time_range.end) for k in profiler.events() if _on_device(k))
        end = None
        for first, last in intervals:  # the union of kernel intervals: overlapping streams count once
            if end is None or first > end:
                busy += last - first
                end = last
            elif last > end:
                busy += last - end
                end = last
        busy /= 1e6  # microseconds
        kernels = [e for e in events if _on_device(e)]
        total = sum(e.self_device_time_total for e in kernels)
        result.update(gpu_busy_seconds=busy, gpu_busy_fraction=busy / seconds if seconds > 0 else None,
                      shares_of="kernel time", kernel_seconds=total / 1e6,
                      kernels_per_step=sum(e.count for e in kernels) / steps if steps else None,
                      top=_rows(host, "self_device_time_total", total),
                      kernels=_rows(kernels, "self_device_time_total", total))
    else:
        total = sum(e.self_cpu_time_total for e in events)
        result.update(gpu_busy_seconds=None, gpu_busy_fraction=None, shares_of="operator CPU time",
                      top=_rows(events, "self_cpu_time_total", total))
    return result


def synchronize() -> None:
    """Wait for the GPU's queued work (the edges of a timed window); nothing to wait for on a CPU."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class Window:
    """The profiler (and, with census=True, finetune.train.syncs' census) over steps WARMUP_STEPS + 1 ..
    WARMUP_STEPS + PROFILE_STEPS of this start, driven by the step count; `at_step_end(n)` is called at the end of
    step n, before the step's clock stamp (so that stopping the profiler, which processes its events, falls inside
    the last profiled step and not in the steady window). Both at once: the census's per-operator Python call
    slows the host, which the profile's GPU-busy share then shows; the counts are the same either way."""

    def __init__(self, on_gpu: bool, warmup: int, profile: bool = True, census: bool = False):
        self.on_gpu = on_gpu
        self.warmup = warmup
        self.profile, self.census = profile, census
        self.profiler = None
        self.counting = None
        self.opened: Optional[float] = None
        self.result: Optional[dict[str, Any]] = None  # the profile's summary
        self.syncs: Optional[dict[str, Any]] = None  # the census's (finetune.train.syncs.Census.result)

    def at_step_end(self, step: int, last: bool) -> None:
        if step == self.warmup and not last:
            synchronize()
            self.opened = time.perf_counter()
            if self.census:
                from finetune.train.syncs import Census

                self.counting = Census().open()
            if self.profile:
                self.profiler = start(self.on_gpu)
        elif self.opened is not None and (step == self.warmup + PROFILE_STEPS or last):
            synchronize()
            seconds = time.perf_counter() - self.opened
            self.opened = None
            steps = step - self.warmup
            if self.counting is not None:
                self.counting.close()
                self.syncs = self.counting.result(steps)
                self.counting = None
            if self.profiler is not None:
                self.profiler.stop()
                self.result = summary(self.profiler, seconds, self.on_gpu, steps)
                self.result["note"] = (f"steps {self.warmup + 1}-{step}, under the profiler (slower than without); "
                                       "the steady window starts after them")
                self.profiler = None


def callback(path: Optional[Path], syncs_path: Optional[Path] = None):
    """A TrainerCallback that runs a Window and writes the profile's summary to `path` and the census to
    `syncs_path` (either may be None). Put it before the run's clock."""
    import torch
    from transformers import TrainerCallback

    from finetune.speed import WARMUP_STEPS

    class ProfileWindow(TrainerCallback):
        def __init__(self):
            self.window = Window(torch.cuda.is_available(), WARMUP_STEPS, profile=path is not None,
                                 census=syncs_path is not None)
            self.steps = 0

        def on_step_end(self, args, state, control, **kwargs):
            self.steps += 1
            self.window.at_step_end(self.steps, bool(state.max_steps and state.global_step >= state.max_steps))
            for target, attr in ((path, "result"), (syncs_path, "syncs")):
                if getattr(self.window, attr) is not None and target is not None:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_text(json.dumps(getattr(self.window, attr), indent=1) + "\n", encoding="utf-8")
                    setattr(self.window, attr, None)

    return ProfileWindow()
