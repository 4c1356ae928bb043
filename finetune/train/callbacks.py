"""Trainer callbacks of the runner: the training clock and the DeepSpeed config actually used."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

from transformers import TrainerCallback

from finetune.rundir.names import PLOT_FILE


class TrainClock(TrainerCallback):
    """Wall time of the training loop only (after the DeepSpeed engine is built, before saving).

    tokens_per_second divides by this, so model loading, the first-use compile of DeepSpeed's ops
    and saving do not dilute the throughput.
    """

    def __init__(self) -> None:
        self.started: Optional[float] = None
        self.ended: Optional[float] = None
        self.first_step: Optional[float] = None  # the end of the first optimizer step (the start-up split)
        self.tokens_at_start = 0  # a resumed run's state already counts the tokens trained before

    def on_train_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()
        self.tokens_at_start = int(state.num_input_tokens_seen or 0)

    def on_step_end(self, args, state, control, **kwargs):
        if self.first_step is None:
            self.first_step = time.perf_counter()

    def on_train_end(self, args, state, control, **kwargs):
        self.ended = time.perf_counter()

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

        write_atomic(self.run_dir / "deepspeed.effective.json", dumps(json_safe(hf_config.config)))


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
    """Redraws RUN/loss.png on rank 0 when the Trainer logs, at most every `interval` seconds.

    The throttle keeps plotting (tens of milliseconds, on a CPU core the ranks share) out of short
    logging intervals; the runner draws the final plot after training, with the whole history.
    """

    def __init__(self, run_dir: Path, interval: float = 10.0) -> None:
        self.path = Path(run_dir) / PLOT_FILE
        self.interval = interval
        self.last: Optional[float] = None
        self.available = True

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not self.available:
            return
        now = time.perf_counter()
        if self.last is not None and now - self.last < self.interval:
            return
        self.last = now
        from finetune.train.report import plot_loss

        self.available = plot_loss(state.log_history, self.path, title=self.path.parent.name)


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
