"""Training state that is not finite is never trained on, published or reported as done (issue 34 item 8).

A checkpoint whose optimizer state was overwritten with bytes that still unpickle (the archive intact, the
COMPLETE marker's sizes right) resumed into steps of loss 0 and grad norm inf: DeepSpeed skipped every step,
the Trainer's logging_nan_inf_filter turned the NaN losses into 0, and the run ended "done: loss 7.148 ->
0.000" with half the adapter NaN. So every rank looks at its own share of the state (the trainable weights,
the optimizer's fp32 master copy and its moments, as DeepSpeed's optimizers hold them) at three moments:

- after the checkpoint is loaded (on_train_begin): a resumed state that is not finite is refused, and the
  checkpoint is set aside as `.checkpoint-N.damaged` (finetune.rundir.checkpoint.set_aside), so that the
  same command resumes from the previous one;
- before a checkpoint is published (on_save, ahead of finetune.train.preemption's callback): a state that is
  not finite is never marked COMPLETE (the folder is discarded at the next start);
- when training ends: not finite, or every optimizer step of this run skipped by DeepSpeed (overflow), is an
  error naming the checkpoint the run resumed from; no adapter, no summary, no "done".

One pass over the rank's partition each time (on a GPU a few ms per GB; with offload, host memory speed):
less than writing the same bytes into a checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Optional

from transformers import TrainerCallback

from finetune.fsutil import damaged_name
from finetune.rundir import checkpoint as ckpt
from finetune.train.dist import all_gather, local_rank, rank

_MAX_DEPTH = 4  # accelerate's wrapper -> DeepSpeed's ZeRO / BF16 optimizer -> the torch optimizer


class NonFiniteState(ckpt.CheckpointError):
    """The training state holds NaN or inf (one line naming the checkpoint)."""


def base_optimizer(optimizer: Any) -> Any:
    """The torch optimizer holding the fp32 master weights and moments: DeepSpeed's optimizers (ZeRO stages,
    BF16_Optimizer) and accelerate's wrapper each keep the one they wrap in `.optimizer`."""
    for _ in range(_MAX_DEPTH):
        inner = getattr(optimizer, "optimizer", None)
        if inner is None:
            break
        optimizer = inner
    return optimizer


def state_tensors(model: Any, optimizer: Any) -> Iterator[tuple[str, Any]]:
    """(what, tensor) for this rank's share of the trainable state."""
    import torch

    if model is not None:
        for name, param in model.named_parameters():
            if param.requires_grad:
                yield f"weight {name}", getattr(param, "ds_tensor", param)  # ZeRO-3: this rank's partition
    inner = base_optimizer(optimizer) if optimizer is not None else None
    if inner is None or not hasattr(inner, "param_groups"):
        return
    # ZeRO-3 empties its param_groups between steps (each sub-group's fp32 partition is put in only for its
    # step); the state stays keyed by those partitions, so both are read.
    params = {id(param): param for group in inner.param_groups for param in group["params"]}
    state = getattr(inner, "state", {})
    params.update((id(param), param) for param in state if isinstance(param, torch.Tensor))
    for p, param in enumerate(params.values()):
        yield f"optimizer master weights {p}", param
        for key, value in state.get(param, {}).items():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                yield f"optimizer state {key} of master weights {p}", value


def nonfinite(model: Any, optimizer: Any) -> Optional[str]:
    """The first tensor of this rank's state holding NaN or inf, worded, or None.

    A sum per tensor, accumulated in fp32: NaN and inf reach it, and unlike isfinite() it allocates nothing the
    size of a ZeRO partition. The sums are all queued before the first is read (one wait on a GPU)."""
    import torch

    with torch.no_grad():
        sums = [(what, tensor.sum(dtype=torch.float32)) for what, tensor in state_tensors(model, optimizer)
                if tensor.numel()]
        for what, total in sums:
            if not bool(torch.isfinite(total)):
                return f"{what} holds {'NaN' if bool(torch.isnan(total)) else 'inf'}"
    return None


def agreed(problem: Optional[str]) -> Optional[str]:
    """The first rank's problem, the same on every rank (they all raise together, none waits in a collective)."""
    found = [(r, p) for r, p in enumerate(all_gather(problem)) if p]
    return f"rank {found[0][0]}: {found[0][1]}" if found else None


class FiniteGuard(TrainerCallback):
    """The three checks of the module docstring. Goes before PreemptionCallback, whose on_save publishes."""

    def __init__(self, run_dir: Path, resumed_from: Optional[str], node_local: bool = False):
        self.run_dir, self.node_local = Path(run_dir), node_local
        self.resumed_from = Path(resumed_from) if resumed_from else None
        self.steps = 0
        self.skipped = 0

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.resumed_from is None:
            return
        problem = agreed(nonfinite(model, optimizer))
        if problem is None:
            return
        name = self.resumed_from.name
        earlier = [c for c in ckpt.complete_checkpoints(self.run_dir) if c.path.name != name and c.step < state.global_step]
        if self._writes():
            ckpt.set_aside(ckpt.Checkpoint(state.global_step, self.resumed_from, True, problem))
        previous = earlier[-1] if earlier else None
        then = (f"run the same command again to resume from {previous.name}" if previous is not None
                else "no earlier checkpoint is left: start over with --overwrite")
        raise NonFiniteState(f"{name} holds values that are not finite ({problem}): it cannot be resumed from; set "
                             f"aside as {damaged_name(self.resumed_from).name}; {then}")

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        self.steps += 1
        self.skipped += bool(getattr(optimizer, "step_was_skipped", False))  # accelerate's: DeepSpeed's overflow

    def on_save(self, args, state, control, model=None, optimizer=None, **kwargs):
        problem = agreed(nonfinite(model, optimizer))
        if problem is not None:
            raise NonFiniteState(f"training diverged by step {state.global_step} ({problem}): checkpoint-"
                                 f"{state.global_step} is not published; {self._last_good()}")

    def on_train_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        if state.max_steps and state.global_step < state.max_steps:
            return  # stopped by a signal: the checkpoint just saved was checked in on_save
        problem = agreed(nonfinite(model, optimizer))
        if problem is None and self.steps and self.skipped == self.steps:
            problem = (f"DeepSpeed skipped every one of the {self.steps} optimizer steps of this run (gradients not "
                       "finite), so nothing was trained")
        if problem is not None:
            source = f" after resuming from {self.resumed_from.name}, which may be damaged" if self.resumed_from else ""
            raise NonFiniteState(f"training ended with a state that is not finite{source} ({problem}); no adapter or "
                                 f"model was written; {self._last_good()}")

    def _writes(self) -> bool:
        return local_rank() == 0 and (self.node_local or rank() == 0)

    def _last_good(self) -> str:
        latest = ckpt.latest_complete(self.run_dir)
        return (f"the newest complete checkpoint is {latest.name}" if latest is not None
                else "no checkpoint was published")
