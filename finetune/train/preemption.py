"""Stopping cleanly and starting again: the runner's side of preemption and resume.

    resilience = setup(run_dir, recipe, ds_config, args_kwargs, resume)   # after init_distributed
    trainer = Trainer(..., callbacks=[..., resilience.callback])
    trainer.train(resume_from_checkpoint=resilience.checkpoint)
    resilience.raise_if_stopped()                                        # Preempted -> exit 75

What happens on SIGTERM or SIGINT (sent by `finetune train`, torchrun, DeepSpeed's launcher,
SLURM or systemd, to one rank or to all):
1. the rank's handler only sets a flag; the step in progress finishes;
2. at agreed step ends the ranks start a non-blocking all-reduce (MAX) of their flags on a gloo group (a CPU
   tensor: no device tensor, no synchronisation on the training path, issue 35); each reads it at the next step
   end, when its peers, which started it at the same step, have long completed it: every rank makes the same
   decision at the same step, even when only one rank was signalled (StopAgreement). The exchange is every
   step for the first WARMUP_STEPS steps of a process, then about every EXCHANGE_SECONDS, in steps the ranks
   agreed from their measured step times: a stop comes at most that much and one step after the signal
   (preemption notices give 30 s and more), and a fast step (a small model, processes sharing cores) does not
   pay for a collective every time;
3. the Trainer saves `checkpoint-<step>` (control.should_save) and stops (should_training_stop); a
   decision that falls on the last step is no stop: training ends there anyway, the final outputs are
   written and the run has finished (a checkpoint at the last step would be resumed into one step more:
   issue 34). While the outputs are written a signal changes nothing (they are written, then the rank exits 0);
4. after a barrier (every rank's shards written) the checkpoint is published with its COMPLETE
   marker (finetune.rundir.checkpoint), older ones are rotated out, `stopped.json` is written;
5. the ranks exit with 75 and no final outputs; the next `finetune train` resumes.
Launchers relay a signal that the system often also sent to every process itself (systemd, SLURM
step cgroups), so a second signal within DUPLICATE_WINDOW seconds is the same request; a later one
aborts at once.

Before each checkpoint the ranks also check the free space (estimate: the previous checkpoint's
size, or the model's for the first one) and stop with one clear error rather than crash half-way; that
agreement is a blocking collective, made only at the steps that write a checkpoint.

A resumed run whose checkpoint is the last step (a crash while the final outputs were written) trains no
step: the Trainer loads the checkpoint, AlreadyTrained stops it before its first step, and the runner writes
the outputs.

Run directories on disks the nodes do not share (each machine its own local disk) are found by a
probe file at start; then DeepSpeed writes model states per node (checkpoint.use_node_local_storage)
and the Trainer its state on each node (save_on_each_node), so every node can resume on its own.
"""

from __future__ import annotations

import os
import platform
import secrets
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

from transformers import TrainerCallback

from finetune.errors import FinetuneError
from finetune.rundir import checkpoint as ckpt
from finetune.rundir import resume_key
from finetune.recipe import Recipe
from finetune.train.dist import (
    all_gather, barrier, cpu_group, finish_max, local_rank, max_now, process_group, rank, start_max,
)
from finetune.speed import WARMUP_STEPS
from finetune.units import human_size

DUPLICATE_WINDOW = ckpt.SECOND_SIGNAL_WINDOW  # the same rule as `finetune train`'s (finetune.run.launch)
EXCHANGE_SECONDS = 0.5  # the ranks' stop flags are exchanged about this often after the warm-up (StopAgreement)
EXCHANGE_MAX_GAP = 100  # ... and at least every this many steps
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class AlreadyTrained(FinetuneError):
    """Raised at the start of training when the resumed checkpoint is the last step: the runner catches it and writes
    the outputs (transformers' loop would train one step before it looks at max_steps). Not a failure: exit 0."""

    exit_code = 0


class Preempted(FinetuneError):
    """Training stopped on a signal after saving a checkpoint: exit EXIT_PREEMPTED."""

    exit_code = ckpt.EXIT_PREEMPTED

    def __init__(self, step: int, checkpoint: Optional[str], signal_name: str):
        super().__init__(f"stopped by {signal_name} at step {step}; {checkpoint} is complete: "
                         f"run the same command again to resume")
        self.step, self.checkpoint, self.signal_name = step, checkpoint, signal_name


def nccl_timeout(recipe: Recipe) -> timedelta:
    """How long a collective may wait before the process group gives up (launch.nccl_timeout)."""
    return timedelta(seconds=recipe.launch.nccl_timeout)


# ------------------------------------------------------------------------------------------------
# Output from the ranks


def _say(message: str) -> None:
    """One line to stderr from a signal handler: os.write, since print() there can interrupt a print
    of the main thread and fail with "reentrant call" inside the buffered writer."""
    try:
        os.write(2, (message + "\n").encode("utf-8", "replace"))
    except OSError:
        pass


def _log(message: str) -> None:
    if rank() == 0:
        print(f"[finetune] {message}", flush=True)


# ------------------------------------------------------------------------------------------------
# Setup before the Trainer exists


@dataclass
class Resilience:
    ds_config: dict[str, Any]
    args_kwargs: dict[str, Any]
    checkpoint: Optional[str]  # what to pass as resume_from_checkpoint
    callback: "PreemptionCallback"

    def raise_if_stopped(self) -> None:
        if self.callback.stopped_at is not None:
            raise Preempted(self.callback.stopped_at, self.callback.saved, self.callback.signal_name or "a signal")


def setup(run_dir: Path, recipe: Recipe, ds_config: dict[str, Any], args_kwargs: dict[str, Any],
          resume: bool) -> Resilience:
    """Adjust the configs for checkpointing and choose the checkpoint to resume from (collective)."""
    run_dir = Path(run_dir)
    ds_config = dict(ds_config)
    args_kwargs = dict(args_kwargs)
    # Rotation is ours (finetune.rundir.checkpoint.rotate): HF's deletes old checkpoints before the new one is complete.
    args_kwargs["save_total_limit"] = None
    args_kwargs["ddp_timeout"] = recipe.launch.nccl_timeout
    shared = run_dir_is_shared(run_dir)
    if not shared:
        ds_config["checkpoint"] = {**ds_config.get("checkpoint", {}), "use_node_local_storage": True}
        args_kwargs["save_on_each_node"] = True
        _log("the nodes do not share the run directory: each node keeps its own copy of the checkpoints")
    checkpoint = agreed_checkpoint(run_dir, resume)
    key = resume_key.read_resume_key(run_dir)
    callback = PreemptionCallback(run_dir, keep=recipe.training.save_total_limit,
                                  dtype_bytes=_DTYPE_BYTES.get(recipe.model.dtype, 4), full=recipe.method == "full",
                                  resume_hash=resume_key.resume_hash(key) if key else None, node_local=not shared,
                                  group=flag_group(recipe))
    return Resilience(ds_config, args_kwargs, checkpoint, callback)


def flag_group(recipe: Recipe):
    """The process group of the ranks' stop flags (finetune.train.dist.cpu_group), or None for one process."""
    return cpu_group(nccl_timeout(recipe))


def run_dir_is_shared(run_dir: Path) -> bool:
    """Whether every rank sees the same run directory: rank 0 writes a probe file, all look for it."""
    dist = process_group()
    if dist is None or dist.get_world_size() == 1:
        return True
    # Probed even on one machine (two collectives, once): cheaper than trusting launcher variables.
    token = all_gather(secrets.token_hex(8) if rank() == 0 else None)[0]
    probe = run_dir / f".probe-{token}"
    if rank() == 0:
        probe.write_text(platform.node(), encoding="utf-8")
    barrier()
    seen = all_gather(probe.exists())
    barrier()
    if rank() == 0:
        probe.unlink(missing_ok=True)
    return all(seen)


def agreed_checkpoint(run_dir: Path, resume: bool) -> Optional[str]:
    """The newest checkpoint complete on every rank's view of the run directory, or None.

    Each node may have its own disk; every rank must load the same step."""
    mine = {"host": platform.node(), "resume": resume,
            "steps": [c.step for c in ckpt.complete_checkpoints(run_dir)] if resume else []}
    views = all_gather(mine)
    if not any(v["resume"] for v in views):
        return None
    common = set(views[0]["steps"]).intersection(*(set(v["steps"]) for v in views[1:]))
    if not common:
        shown = "; ".join(f"rank {i} on {v['host']}: {v['steps'] or 'none'}" for i, v in enumerate(views))
        raise ckpt.CheckpointError(f"no checkpoint is complete on every node, cannot resume ({shown}); "
                                   f"copy the newest checkpoint-N to every node's run directory, or start over with --overwrite")
    step = max(common)
    path = run_dir / f"{ckpt.CHECKPOINT_PREFIX}{step}"
    from finetune.rundir.verify import links_outside

    # `finetune train` refused these before launch (verify.inspect); checked again here, where DeepSpeed's loader
    # is about to follow them, since a node's own copy or a change since then would otherwise go unseen (issue 34).
    escape = links_outside(path)
    if escape:
        raise ckpt.CheckpointError(f"{path} cannot be resumed from: {escape}; nothing is loaded through a link "
                                   "that leaves the checkpoint")
    _log(f"resuming from {path.name} (step {step})")
    return str(path)


# ------------------------------------------------------------------------------------------------
# The callback


class PreemptionCallback(TrainerCallback):
    """Signal -> checkpoint at the next step end on every rank -> publish -> stop (module docstring)."""

    def __init__(self, run_dir: Path, keep: Optional[int], dtype_bytes: int, full: bool,
                 resume_hash: Optional[str] = None, node_local: bool = False, group=None):
        self.run_dir = Path(run_dir)
        self.keep, self.dtype_bytes, self.full = keep, dtype_bytes, full
        self.resume_hash, self.node_local = resume_hash, node_local
        self.signal_at: Optional[float] = None
        self.signal_name: Optional[str] = None
        self.stopped_at: Optional[int] = None  # the step we stopped at, after a signal
        self.saved: Optional[str] = None  # the last checkpoint published
        self.first_estimate = 0
        self.finishing = False  # training has ended: a signal now waits for the outputs (the runner's last stage)
        self._previous: dict[int, Any] = {}
        # flag_group(): None with one process, whose own flag decides at once
        self.agreement = StopAgreement(group) if group is not None else None

    # -- signals

    def install(self) -> None:
        if self._previous:
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _on_signal(self, signum: int, _frame) -> None:
        now = time.monotonic()
        name = signal.Signals(signum).name
        if self.signal_at is None:
            self.signal_at, self.signal_name = now, name
            if self.finishing:
                _say(f"[finetune] rank {rank()}: {name}: training has finished; writing its outputs, then exiting "
                     f"(a second signal aborts)")
            else:
                _say(f"[finetune] rank {rank()}: {name}: saving a checkpoint at the end of the next step, then "
                     f"stopping (a second signal aborts)")
        elif now - self.signal_at > DUPLICATE_WINDOW:
            _say(f"[finetune] rank {rank()}: second {name}: aborting without a checkpoint")
            self.uninstall()
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    # -- the Trainer's hooks

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.install()
        if local_rank() == 0:
            discard_incomplete_if_owned(self.run_dir)
        if model is not None:
            self.first_estimate = self._model_estimate(model)
        if state.max_steps and state.global_step >= state.max_steps:
            raise AlreadyTrained(f"step {state.global_step} of {state.max_steps}")

    def on_step_end(self, args, state, control, **kwargs):
        requested = self.signal_at is not None
        stop = self.agreement.at_step_end(state.global_step, requested) if self.agreement else requested
        if stop and state.max_steps and state.global_step >= state.max_steps:
            stop = False  # the last step: training ends here anyway, with its final outputs (issue 34)
        if stop or control.should_save:
            short = ckpt.space_problem(self.run_dir, self._estimate()) if local_rank() == 0 else None
            if self._agree_now(short is not None):  # blocking, and only where a checkpoint is written
                reason = short or "another node has not enough free space for the next checkpoint"
                raise ckpt.CheckpointError(f"{reason} (host {platform.node()}, step {state.global_step})")
        if stop:
            control.should_save = True
            control.should_training_stop = True
            self.stopped_at = state.global_step
            if self.signal_name is None:
                self.signal_name = "a signal to another rank"
        return control

    def on_save(self, args, state, control, **kwargs):
        step = state.global_step
        path = self.run_dir / f"{ckpt.CHECKPOINT_PREFIX}{step}"
        barrier()  # every rank's shards, RNG state and (rank 0) trainer state are written
        if local_rank() == 0 and (self.node_local or rank() == 0):
            if self.node_local:
                write_deepspeed_latest(path)
            record = ckpt.publish(path, step, {"world_size": args.world_size, "resume_hash": self.resume_hash,
                                               "host": platform.node()})
            ckpt.rotate(self.run_dir, self.keep)
            size = sum(record["files"].values())
            _log(f"{path.name} complete ({human_size(size)})")
            if self.stopped_at is not None:
                ckpt.write_stop_record(self.run_dir, step, path.name, self.signal_name or "a signal")
        barrier()  # nobody stops (or writes more) before the marker is down
        self.saved = path.name
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.agreement is not None:
            self.agreement.drain()
        if self.stopped_at is None:
            # Training has finished: the handlers stay until the runner has written the outputs (finished()).
            self.finishing = True
            if self.signal_at is not None:
                _log(f"{self.signal_name} came at the last step: training has finished; writing its outputs "
                     "instead of a checkpoint")
        else:
            self.uninstall()
        # The final adapter/ or model/ is written once, by rank 0 (finetune.train.runner.save_weights).
        args.save_on_each_node = False

    def finished(self) -> None:
        """The outputs are written: signals are the process's own again."""
        self.uninstall()

    # -- helpers

    def _agree_now(self, short: bool) -> bool:
        """Whether any rank is short of space for the checkpoint about to be written (a blocking all-reduce on the
        flag group: every rank writes it, so every rank is here)."""
        if self.agreement is None:
            return short
        return bool(max_now(int(short), self.agreement.group))

    def _estimate(self) -> int:
        latest = ckpt.latest_complete(self.run_dir)
        return ckpt.folder_size(latest.path) if latest is not None else self.first_estimate

    def _model_estimate(self, model) -> int:
        def numel(p) -> int:
            return int(getattr(p, "ds_numel", 0) or p.numel())  # ZeRO-3 leaves empty tensors behind

        params = list(model.parameters())
        trainable = sum(numel(p) for p in params if p.requires_grad)
        total = sum(numel(p) for p in params)
        return ckpt.model_checkpoint_bytes(total if self.full else trainable, trainable, self.dtype_bytes)


class StopAgreement:
    """When the ranks exchange their stop flags, and what they agreed (module docstring, step 2).

    An exchange is one non-blocking all-reduce (MAX) of [flag, -gap] started at a step end and read at the next:
    its flag says whether every rank stops at that next step, its gap (the smallest any rank proposed) how many
    steps after its own start the next one starts. Every rank reads the same result at the same step, so the
    exchanges pair on every rank whatever its timing. A rank proposes a gap of 1 for its first `warmup` steps
    (their times hold one-time costs), later as many steps as its host clock says take `interval` seconds since
    the exchange before (a checkpoint saved in that time only shortens the gap)."""

    def __init__(self, group, interval: float = EXCHANGE_SECONDS, warmup: int = WARMUP_STEPS,
                 clock: Callable[[], float] = time.monotonic):
        self.group, self.interval, self.warmup, self.clock = group, interval, warmup, clock
        self.exchanges = 0  # started by this process
        self._seen = 0  # step ends this process has seen
        self._started: Optional[tuple[int, float]] = None  # (_seen, clock) at the last start
        self._next: Optional[int] = None  # the step whose end starts the next exchange (None: this one)
        self._pending: Optional[tuple[int, Any]] = None  # (the step it started at, start_max's handle)

    def at_step_end(self, step: int, requested: bool) -> bool:
        """Whether every rank stops at `step` (called at each step end, by every rank)."""
        self._seen += 1
        if self._pending is not None:
            started, handle = self._pending
            self._pending = None
            flag, negative_gap = finish_max(handle)
            if flag:
                return True
            self._next = started + max(1, -negative_gap)
        if self._next is None or step >= self._next:
            self._start(step, requested)
        return False

    def drain(self) -> None:
        """Wait for the exchange in flight at the end of training (started by every rank at the same step)."""
        if self._pending is not None:
            finish_max(self._pending[1])
            self._pending = None

    def _start(self, step: int, requested: bool) -> None:
        now = self.clock()
        gap = 1
        if self._seen > self.warmup and self._started is not None:
            steps, seconds = self._seen - self._started[0], now - self._started[1]
            gap = EXCHANGE_MAX_GAP if seconds <= 0 else round(self.interval * steps / seconds)
            gap = min(EXCHANGE_MAX_GAP, max(1, gap))
        self._started = (self._seen, now)
        self._pending = (step, start_max([int(requested), -gap], self.group))
        self.exchanges += 1


def discard_incomplete_if_owned(run_dir: Path) -> None:
    """Remove half-written checkpoints only while this run owns the directory (finetune.rundir.lock): an
    incomplete checkpoint of another live run is one it is writing right now."""
    from finetune.rundir import lock as runlock
    owner = os.environ.get(runlock.OWNER_ENV)
    name = os.environ.get(runlock.LOCK_ENV, runlock.LOCK_FILE)
    if owner is not None:
        owned, lock = runlock.owned_by(run_dir, int(owner), name), None
    else:  # started without `finetune train` (torchrun by hand): own it for the cleanup
        try:
            lock = runlock.acquire(run_dir, name)
            owned = True
        except (runlock.RunDirLocked, OSError):
            owned, lock = False, None
    try:
        if not owned:
            _log("incomplete checkpoints are left alone: another live run owns this run directory")
            return
        removed = ckpt.discard_incomplete(run_dir)
        if removed:
            _log(f"removed incomplete checkpoint(s) left by an interrupted save: {', '.join(p.name for p in removed)}")
    finally:
        if lock is not None:
            lock.release()


def write_deepspeed_latest(path: Path) -> None:
    """DeepSpeed writes `latest` (the tag that load_checkpoint reads) on global rank 0 only, even with
    use_node_local_storage: the other nodes' copies need it too."""
    latest = path / "latest"
    tags = sorted(p.name for p in path.glob("global_step*") if p.is_dir())
    if not latest.exists() and len(tags) == 1:
        from finetune.fsutil import write_atomic

        write_atomic(latest, tags[0])


# ------------------------------------------------------------------------------------------------
# Exit codes of the runner


def exit_code_for(exc: BaseException, run_dir: Path) -> Optional[int]:
    """The runner's exit code for `exc` after printing one line, or None to let it raise.

    Preempted -> 75 (EX_TEMPFAIL: checkpoint saved, run again); a checkpoint or disk problem -> 1."""
    if isinstance(exc, Preempted):
        _log(str(exc))
        return exc.exit_code
    message = str(exc) if isinstance(exc, ckpt.CheckpointError) else ckpt.disk_error_message(exc, run_dir)
    if message is None:
        return None
    print(f"error: rank {rank()} on {platform.node()}: {message}", file=sys.stderr, flush=True)
    return 1
