"""Trainer callbacks of the runner: the training clock and the DeepSpeed config actually used."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

from transformers import TrainerCallback

from finetune.rundir.names import DEEPSPEED_EFFECTIVE_FILE, PLOT_FILE
from finetune.speed import WARMUP_STEPS
from finetune.train.profile import synchronize


class TrainClock(TrainerCallback):
    """Wall time of the training loop only (after the DeepSpeed engine is built, before saving), and the host
    clock at every optimizer step's end: the steady window of finetune.speed.

    tokens_per_second divides by the loop's time, so model loading, the first-use compile of DeepSpeed's ops
    and saving do not dilute the throughput. The stamps add no synchronisation, except one device
    synchronisation where the steady window opens (the end of step WARMUP_STEPS of this start) and one where it
    closes (the last step), so that the window holds finished work. `counter`: a CountingTrainer's host-side
    counts (finetune.train.counting), else the Trainer's own num_input_tokens_seen is read per step.
    """

    def __init__(self) -> None:
        self.started: Optional[float] = None
        self.ended: Optional[float] = None
        self.first_step: Optional[float] = None  # the end of the first optimizer step (the start-up split)
        self.tokens_at_start = 0  # a resumed run's state already counts the tokens trained before
        self.stamps: list[float] = []  # the loop's start, then each step's end (this start's steps only)
        self.step_counts: list[tuple[int, int]] = []  # this rank's (tokens, sum of squared lengths) per step
        self.counter: Optional[list[int]] = None
        self._seen = (0, 0)
        self.warmup = WARMUP_STEPS  # more where a profiler window follows the warm-up (finetune.train.profile)

    def on_train_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()
        self.stamps = [self.started]
        self.tokens_at_start = int(state.num_input_tokens_seen or 0)

    def on_step_end(self, args, state, control, **kwargs):
        if len(self.stamps) == self.warmup or (state.max_steps and state.global_step >= state.max_steps):
            synchronize()
        now = time.perf_counter()
        if self.first_step is None:
            self.first_step = now
        self.stamps.append(now)
        seen = tuple(self.counter) if self.counter is not None else \
            (int(state.num_input_tokens_seen or 0) - self.tokens_at_start, 0)
        self.step_counts.append((seen[0] - self._seen[0], seen[1] - self._seen[1]))
        self._seen = seen
        if control.should_save and self.counter is not None:
            # A checkpoint is written after this callback: the ranks' host counts go into the state it saves,
            # so a resumed run goes on counting (one collective, where the checkpoint synchronises anyway).
            state.num_input_tokens_seen = self.tokens_at_start + self.tokens_this_start()

    def on_train_end(self, args, state, control, **kwargs):
        self.ended = time.perf_counter()

    def tokens_this_start(self) -> int:
        """Tokens every rank trained since this process started (collective when counted on the host)."""
        from finetune.train.dist import all_gather

        if self.counter is None:
            return sum(c[0] for c in self.step_counts)
        return sum(all_gather(self.counter[0]))

    def steady(self, world: int, arch=None, peak_flops: Optional[float] = None) -> dict[str, Any]:
        """finetune.speed.steady over every rank's counts (collective when counted on the host)."""
        from finetune.speed import steady
        from finetune.train.dist import all_gather

        counts = self.step_counts
        if self.counter is not None:
            ranks = all_gather(self.step_counts)
            counts = [(sum(r[i][0] for r in ranks), sum(r[i][1] for r in ranks)) for i in range(len(counts))]
        squares = [c[1] for c in counts] if self.counter is not None else []
        return steady(self.stamps, [c[0] for c in counts], squares or [0] * len(counts), world,
                      arch if self.counter is not None else None, peak_flops, warmup=self.warmup)

    @property
    def seconds(self) -> float:
        if self.started is None:
            return 0.0
        return (self.ended or time.perf_counter()) - self.started


class EffectiveDeepSpeedConfig(TrainerCallback):
    """Writes deepspeed.effective.json: the config DeepSpeed ran with, every "auto" filled in.

    The HF integration fills "auto" (batch sizes, bucket sizes from the hidden size, optimizer
    hyper-parameters) inside trainer.train(), before the engine starts; on_train_begin comes after.
    """

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        hf_config = getattr(args, "hf_deepspeed_config", None)
        if hf_config is None:
            return
        from finetune.render import dumps
        from finetune.fsutil import write_atomic

        write_atomic(self.run_dir / DEEPSPEED_EFFECTIVE_FILE, dumps(json_safe(hf_config.config)))


class ProgressLines(TrainerCallback):
    """A progress line every `interval` seconds on rank 0, for output read line by line.

    `finetune train` relays rank output through log files, where a redrawn tqdm bar is one long line
    that only appears at the end; so the launcher turns tqdm off and this prints plain lines instead.
    """

    def __init__(self, interval: float = 15.0) -> None:
        self.interval = interval
        self.started = 0.0
        self.last = 0.0
        self.first_step = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.started = self.last = time.perf_counter()
        self.first_step = state.global_step  # a resumed run starts counting from its checkpoint

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        done = state.global_step >= state.max_steps
        if not state.is_world_process_zero or (now - self.last < self.interval and not done):
            return
        self.last = now
        elapsed = now - self.started
        steps = state.global_step - self.first_step
        left = (state.max_steps - state.global_step) * elapsed / steps if steps else 0.0
        percent = 100 * state.global_step / max(state.max_steps, 1)
        print(f"progress: step {state.global_step}/{state.max_steps} ({percent:.0f}%), "
              f"{elapsed:.0f} s elapsed, about {left:.0f} s left", flush=True)


class LossPlot(TrainerCallback):
    """Redraws RUN/loss.png on rank 0 at each checkpoint; the runner draws the final plot after training, with
    the whole history. Never on a training step's path (issue 35: the first draw imports matplotlib and builds its
    font cache, hundreds of milliseconds on a fresh machine, and every draw holds the GIL the step's kernel
    launches need); a checkpoint has stopped the steps anyway."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / PLOT_FILE
        self.available = True

    def on_save(self, args, state, control, **kwargs):
        if not state.is_world_process_zero or not self.available:
            return
        from finetune.train.report import plot_loss

        self.available = plot_loss(state.log_history, self.path, title=self.path.parent.name)


class LastStepLogged(TrainerCallback):
    """Logs the last step's loss, so summary.json's last loss is the last step's even when the run is shorter
    than logging_steps or stops between two of them (issue 34: '0.039 -> 0.039' was step 1's loss twice)."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.max_steps and state.global_step >= state.max_steps:
            control.should_log = True
        return control


def json_safe(value: Any) -> Any:
    """Replace inf/nan by strings: strict JSON has neither. accelerate sets steps_per_print to inf to keep DeepSpeed
    quiet; DeepSpeed crashes on the string "inf" (lint DS110, issue 34), so it gets render's own quiet count and the
    file stays a config DeepSpeed runs."""
    from finetune.render import STEPS_PER_PRINT

    if _non_finite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: STEPS_PER_PRINT if k == "steps_per_print" and _non_finite(v) else json_safe(v)
                for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value


def _non_finite(value: Any) -> bool:
    return isinstance(value, float) and (value != value or value in (float("inf"), float("-inf")))
