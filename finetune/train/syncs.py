"""Host syncs and collectives per training step, and the line of code that makes each (issue 35).

A step on a GPU is fast while the host queues kernels ahead of the device; every call that needs a device value
on the host (`.item()`, `bool(tensor)`, `.tolist()`, a copy to the CPU, a boolean mask...) makes the host wait
for everything queued before it, and a collective adds the other ranks' wait. Which of these a step makes is a
property of the code, not of the card: the census counts them at the Python calls, so a CPU run shows the same
sites a GPU run has, and finetune's step can be held to the plain Trainer's (tests/launches/test_gpu_speed.py,
scripts/bench_overhead.py --syncs).

What it counts: inside `Census` (a torch function mode, this thread; the profiler window of
finetune.train.profile runs one over its steps):
- host syncs: the calls in ALWAYS on any tensor, and those in OFF_DEVICE (copies to the host) on a tensor that is
  not on the CPU. On a CPU run "would wait on a GPU": the ALWAYS calls on a host-side tensor (a batch before it
  moved) count too, on both sides of a comparison alike.
- collectives: the torch.distributed calls in finetune.train.dist.COLLECTIVES (what DeepSpeed, accelerate and
  transformers call), counted at world size 1 too, where they cost a launch and nothing else.
- apart, as host_side: both kinds on a tensor that lives on the host by design (a CPU tensor on a GPU run; on a CPU
  run one marked with finetune.train.dist.host_side, as finetune's stop flag is): they make no device wait.
Not seen: syncs inside C++ (an operator that waits internally) and Python hooks that autograd runs on its own
threads (a GPU's backward: DeepSpeed's gradient hooks under ZeRO); the profile's GPU-busy share shows their cost.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional

from finetune.train import dist
from finetune.train.dist import marked_host_side, watch_collectives
from finetune.train.memory_trace import STDLIB_PLUMBING, short_path

ALWAYS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "masked_select",
                    "unique", "unique_consecutive", "_local_scalar_dense", "equal", "allclose"})
OFF_DEVICE = frozenset({"cpu", "numpy", "to"})
TOP = 12
ENV = "FINETUNE_SYNCS"  # =PATH: rank 0 counts over the profiler's window of steps and writes Census.result there


def _watching(code) -> bool:
    """The frame of finetune.train.dist.watch_collectives' wrapper, between a collective and its caller."""
    return code.co_name == "watched" and code.co_filename == dist.__file__


def _is_host_side(tensor, device_run: bool) -> bool:
    if tensor is None or not hasattr(tensor, "device"):
        return False
    if device_run and tensor.device.type == "cpu":
        return True
    base = getattr(tensor, "_base", None)
    return marked_host_side(tensor) or (base is not None and marked_host_side(base))


def _first_tensor(args: tuple, kwargs: dict[str, Any]):
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)) and value:
            value = value[0]
        if hasattr(value, "device") and hasattr(value, "dtype"):
            return value
    return None


class Census:
    """Counts host syncs and collectives by call site while open; `result(steps)` reads them per step."""

    def __init__(self):
        self.syncs: Counter[tuple[str, str]] = Counter()
        self.collectives: Counter[tuple[str, str]] = Counter()
        self.host_side: Counter[tuple[str, str]] = Counter()  # reads and collectives of host-side tensors
        import torch

        self._torch = os.path.dirname(torch.__file__) + os.sep
        self._device_run = torch.cuda.is_available()
        self._mode = None
        self._unwatch: Optional[Callable[[], None]] = None
        self._thread = threading.get_ident()

    # -- opening and closing -------------------------------------------------------------------------------
    def open(self) -> "Census":
        from torch.overrides import TorchFunctionMode

        census = self

        class _Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = getattr(func, "__name__", "")
                if name in ALWAYS or (name in OFF_DEVICE and _leaves_the_device(name, args, kwargs)) \
                        or (name in ("__getitem__", "__setitem__") and _boolean_mask(args)):
                    host = _is_host_side(args[0] if args else None, census._device_run)
                    (census.host_side if host else census.syncs)[(census._site(), name)] += 1
                return func(*args, **kwargs)

        self._mode = _Mode()
        self._mode.__enter__()
        self._unwatch = watch_collectives(self._collective)
        return self

    def close(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None

    def __enter__(self) -> "Census":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- counting ------------------------------------------------------------------------------------------
    def _collective(self, name: str, args: tuple, kwargs: dict[str, Any]) -> None:
        if threading.get_ident() == self._thread:
            host = _is_host_side(_first_tensor(args, kwargs), self._device_run)
            (self.host_side if host else self.collectives)[(self._site(), name)] += 1

    def _site(self) -> str:
        """`file:line function` of the innermost frame outside torch, this module and the standard library's
        plumbing, and after "via" torch's own innermost frame where the call came from inside torch (its
        optimizers, say: torch.optim.Adam's for-loop step reads each step count with `.item()`)."""
        frame = sys._getframe(1)
        while frame is not None and (frame.f_code.co_filename == __file__ or _watching(frame.f_code)):
            frame = frame.f_back
        inner = frame
        while frame is not None and self._plumbing(frame.f_code.co_filename):
            frame = frame.f_back
        if frame is None:
            return "(no Python frame)"
        site = f"{short_path(frame.f_code.co_filename)}:{frame.f_lineno} {frame.f_code.co_name}"
        if inner is not frame and inner is not None and inner.f_code.co_filename.startswith(self._torch):
            site += f" (via {short_path(inner.f_code.co_filename)}:{inner.f_lineno} {inner.f_code.co_name})"
        return site

    def _plumbing(self, filename: str) -> bool:
        return filename.startswith(self._torch) or filename == __file__ or any(p in filename for p in STDLIB_PLUMBING)

    def result(self, steps: int) -> dict[str, Any]:
        """Per step: the totals, and the sites that make the most, each with the call it makes."""
        steps = max(steps, 1)

        def table(counts: Counter) -> dict[str, Any]:
            return {"per_step": sum(counts.values()) / steps,
                    "sites": [{"site": site, "call": call, "per_step": n / steps}
                              for (site, call), n in counts.most_common(TOP)]}

        return {"steps": steps, "host_syncs": table(self.syncs), "collectives": table(self.collectives),
                "host_side": table(self.host_side)}


def _leaves_the_device(name: str, args: tuple, kwargs: dict[str, Any]) -> bool:
    """A copy of a tensor that is not on the CPU to the host (`.cpu()`, `.numpy()`, `.to("cpu")` without
    non_blocking)."""
    tensor = args[0] if args else None
    device = getattr(tensor, "device", None)
    if device is None or device.type == "cpu":
        return False
    if name != "to":
        return True
    if kwargs.get("non_blocking"):
        return False
    target = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str,)) or type(a).__name__ == "device"),
                                       None))
    return target is not None and str(target).startswith("cpu")


def _boolean_mask(args: tuple) -> bool:
    """x[mask] with a boolean tensor mask: the result's size is a device value."""
    index = args[1] if len(args) > 1 else None
    items = index if isinstance(index, tuple) else (index,)
    return any(getattr(i, "dtype", None) is not None and str(i.dtype) == "torch.bool" for i in items)


def wanted() -> Optional[Path]:
    """PATH from the environment on rank 0, else None."""
    return dist.rank0_path(ENV)


def summary_lines(census: Optional[dict[str, Any]], top: int = 5) -> list[str]:
    """A census (Census.result) as a few lines of text."""
    if not census:
        return []
    lines = []
    for key, label in (("host_syncs", "host syncs"), ("collectives", "collectives"),
                       ("host_side", "host-side reads and collectives (no device wait)")):
        part = census.get(key) or {"per_step": 0, "sites": []}
        lines.append(f"{label} per step: {part['per_step']:g}")
        lines += [f"  {s['per_step']:g} x {s['call']}  {s['site']}" for s in part["sites"][:top]]
    return lines
