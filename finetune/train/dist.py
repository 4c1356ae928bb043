"""The distributed helpers the runner and the preemption callback share: every rank calls a
collective or none does, and a single process (no process group) gets the one-rank answer.

torch and deepspeed are imported inside the functions: `python -m finetune.train.runner --help`
stays fast, and importing this module never starts CUDA or picks a DeepSpeed accelerator.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

_HOST_SIDE: dict[int, "weakref.ref[Any]"] = {}  # id -> the tensor, weakly (a WeakSet would compare tensors by `==`)

# The collectives DeepSpeed, accelerate and transformers call (watch_collectives routes them through an observer).
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "barrier", "all_to_all_single",
               "gather", "scatter")


def process_group():
    """torch.distributed when this process joined a process group, else None."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def barrier() -> None:
    dist = process_group()
    if dist is not None:
        dist.barrier()


def all_gather(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order (picklable objects; `[value]` without a process group)."""
    dist = process_group()
    if dist is None:
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def cpu_group(timeout):
    """A gloo process group of every rank, for small host-side flags whatever the training backend (no device
    tensor, no device synchronisation); None with one process. Collective: every rank creates it."""
    dist = process_group()
    if dist is None or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo", timeout=timeout)


def host_side(tensor):
    """Mark a tensor that lives on the host by design (the stop flag below, on its gloo group): reading it, or a
    collective over it, makes no device wait, on a GPU run too. finetune.train.syncs counts such calls apart; on a
    GPU run a CPU tensor needs no mark, on a CPU run the census cannot tell the two apart without it."""
    key = id(tensor)
    _HOST_SIDE[key] = weakref.ref(tensor, lambda _, key=key: _HOST_SIDE.pop(key, None))
    return tensor


def marked_host_side(tensor) -> bool:
    ref = _HOST_SIDE.get(id(tensor))
    return ref is not None and ref() is tensor


def start_max(values: Sequence[int], group) -> tuple[Any, Any]:
    """Start a non-blocking all-reduce (MAX, element-wise) of `values` over `group` (cpu_group); finish_max() reads
    it."""
    import torch
    import torch.distributed as dist

    flags = host_side(torch.tensor([int(v) for v in values], dtype=torch.int64))  # a host tensor: no device wait
    return dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group, async_op=True), flags


def finish_max(pending: tuple[Any, Any]) -> list[int]:
    """The result of start_max: waits for it (a CPU tensor: no device synchronisation)."""
    work, flags = pending
    work.wait()
    return flags.tolist()


def max_now(value: int, group) -> int:
    """The largest `value` over `group`, blocking."""
    return finish_max(start_max([value], group))[0]


def watch_collectives(observe: Callable[[str, tuple, dict], None]) -> Callable[[], None]:
    """Call `observe(name, args, kwargs)` before each of torch.distributed's COLLECTIVES until the returned undo is
    called (finetune.train.syncs counts them). Callers look the functions up on the module at each call
    (deepspeed.comm, accelerate and transformers do), so they see the wrappers."""
    import torch.distributed as dist

    originals: dict[str, Callable] = {}
    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def watched(*args, __original=original, __name=name, **kwargs):
            observe(__name, args, kwargs)
            return __original(*args, **kwargs)

        originals[name] = original
        setattr(dist, name, watched)

    def undo() -> None:
        for name, original in originals.items():
            setattr(dist, name, original)

    return undo


def world_size() -> int:
    dist = process_group()
    return dist.get_world_size() if dist is not None else 1


def rank() -> int:
    # From the launcher's environment: valid before the process group exists, and in signal handlers.
    return int(os.environ.get("RANK", "0"))


def rank0_path(env: str) -> Optional[Path]:
    """The path in environment variable `env` on rank 0, else None (the harness's profile, census and memory
    trace each write one file, from rank 0)."""
    path = os.environ.get(env)
    return Path(path) if path and rank() == 0 else None


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_cpu_accelerator() -> bool:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cpu"


def has_accelerator() -> bool:
    """Whether torch sees an accelerator (a GPU): host memory is then not where the activations live."""
    import torch

    return torch.accelerator.current_accelerator() is not None if hasattr(torch, "accelerator") else torch.cuda.is_available()
