"""What is live on the GPU at the peak of a training step, and who allocated it (issue 35, docs/plan.md "Ninth pass").

The planner and `plan --trace` agree within 0.4% on the 8,192-token rows of the H200 run, yet the GPU held 5-7 GiB
less: some tensor the CPU-side model keeps is not kept by the CUDA path. `max_memory_allocated` says how much, not
which. With FINETUNE_CUDA_MEMORY_TRACE=PATH in its environment, rank 0 of a CUDA run records the caching
allocator's history (torch.cuda.memory._record_memory_history, Python stacks) over the first TRACE_STEPS steps,
then writes PATH: a small JSON of the allocations live at the highest point of that window, grouped by the line of
model, peft, TRL or finetune code that made them (torch's own frames skipped), with the baseline that was live
before the first step. The history is read back in this process (`torch.cuda.memory._snapshot()`), not pickled to
disk: a whole snapshot of a 1B step is tens of MB, the summary a few kB.

Recording costs host time on every allocation (the stacks), so only the harness's memory rows set it
(scripts/gpu_speed.py); it allocates nothing on the GPU, so the measured peak is the same.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Optional

from finetune.train.dist import rank0_path

ENV = "FINETUNE_CUDA_MEMORY_TRACE"
TRACE_STEPS = 2  # step 1 creates the optimizer's states; step 2 is a step like every later one
MAX_ENTRIES = 2_000_000  # allocator events kept (a 1B step at 8k tokens makes well under a million)
TOP = 40  # groups written
# Frames that say how, not who: the first frame outside these names the allocation's owner. Matched on the path
# below site-packages (_short): a whole environment may live under a folder named torch (the GPU image's
# /opt/torch/.venv, where matching the full path called every library plumbing and the 2026-11-28 run's groups
# named only the Trainer's caller).
PLUMBING = ("torch/", "torch_", "accelerate/")
STDLIB_PLUMBING = ("<frozen", "/contextlib.py", "/functools.py")


def _plumbing(filename: str) -> bool:
    return short_path(filename).startswith(PLUMBING) or any(part in filename for part in STDLIB_PLUMBING)


def owner(frames: Iterable[dict[str, Any]]) -> str:
    """`file:line function` of the innermost frame outside torch's plumbing, or what the stack says instead."""
    frames = list(frames)
    for frame in frames:
        filename = frame.get("filename", "")
        if not _plumbing(filename):
            return f"{short_path(filename)}:{frame.get('line')} {frame.get('name')}"
    if frames:
        first = frames[0]
        return f"{short_path(first.get('filename', ''))}:{first.get('line')} {first.get('name')}"
    return "(no Python frame: autograd's engine, in backward)"


def short_path(filename: str) -> str:
    """site-packages/transformers/models/llama/modeling_llama.py -> transformers/models/llama/modeling_llama.py"""
    for marker in ("site-packages/", "dist-packages/"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    parts = Path(filename).parts
    return "/".join(parts[-3:]) if len(parts) > 3 else filename


def peak_summary(events: list[dict[str, Any]], baseline_bytes: int = 0, top: int = TOP) -> dict[str, Any]:
    """Replays the allocator's events (`alloc` adds a block, `free_requested` removes it: the moment
    torch.cuda.max_memory_allocated stops counting it) to the highest point, then groups what was live there.
    Blocks allocated before the history began are `baseline_bytes`, not in the groups."""
    live, total, peak, peak_at = {}, 0, 0, -1
    for index, event in enumerate(events):
        action = event.get("action")
        if action == "alloc":
            live[event["addr"]] = event["size"]
            total += event["size"]
            if total > peak:
                peak, peak_at = total, index
        elif action == "free_requested":
            total -= live.pop(event["addr"], 0)
    at_peak: dict[int, dict[str, Any]] = {}
    for event in events[:peak_at + 1]:  # again, keeping the stacks of the blocks live at the peak only
        if event.get("action") == "alloc":
            at_peak[event["addr"]] = event
        elif event.get("action") == "free_requested":
            at_peak.pop(event["addr"], None)
    groups: dict[str, list[int]] = {}
    for event in at_peak.values():
        bytes_count = groups.setdefault(owner(event.get("frames") or ()), [0, 0])
        bytes_count[0] += event["size"]
        bytes_count[1] += 1
    ranked = sorted(groups.items(), key=lambda item: -item[1][0])
    return {
        "baseline_bytes": baseline_bytes,
        "peak_above_baseline_bytes": peak,
        "peak_bytes": baseline_bytes + peak,
        "events": len(events),
        "live_at_peak": len(at_peak),
        "groups": [{"owner": name, "bytes": size, "blocks": count} for name, (size, count) in ranked[:top]],
        "other_bytes": sum(size for _, (size, _count) in ranked[top:]),
        "truncated": len(events) >= MAX_ENTRIES,  # the oldest events fell out of the history: the replay is short
    }


def wanted() -> Optional[Path]:
    """Where to write the summary, when this rank should record one (rank 0 of a CUDA run with ENV set)."""
    path = rank0_path(ENV)
    if path is None:
        return None
    import torch

    return path if torch.cuda.is_available() else None


def callback(path: Path):
    """A TrainerCallback that records from the first step to the end of step TRACE_STEPS, then writes `path`."""
    import torch
    from transformers import TrainerCallback

    class PeakTrace(TrainerCallback):
        def __init__(self):
            self.baseline = None

        # A private torch API (it has moved between releases): whatever goes wrong is written to `path` instead of
        # the summary, and the run trains on; the measurement it rides on matters more than the breakdown.
        def on_train_begin(self, args, state, control, **kwargs):
            try:
                torch.cuda.synchronize()
                baseline = torch.cuda.memory_allocated()
                torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                                         max_entries=MAX_ENTRIES)
                self.baseline = baseline
            except Exception as exc:  # noqa: BLE001 (see above)
                _write(path, {"error": f"recording did not start: {type(exc).__name__}: {exc}"})

        def on_step_end(self, args, state, control, **kwargs):
            if self.baseline is None or state.global_step < TRACE_STEPS:
                return
            baseline, self.baseline = self.baseline, None
            try:
                torch.cuda.synchronize()
                snapshot = torch.cuda.memory._snapshot()
                torch.cuda.memory._record_memory_history(enabled=None)
                summary = peak_summary(snapshot["device_traces"][torch.cuda.current_device()], baseline)
                summary.update(steps=state.global_step, max_memory_allocated_bytes=torch.cuda.max_memory_allocated())
            except Exception as exc:  # noqa: BLE001 (see above)
                summary = {"error": f"no summary: {type(exc).__name__}: {exc}"}
            _write(path, summary)

    return PeakTrace()


def _write(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
