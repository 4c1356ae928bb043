"""Trainer callbacks of the runner: the training clock and the DeepSpeed config actually used."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

from transformers import TrainerCallback


class TrainClock(TrainerCallback):
    """Wall time of the training loop only (after the DeepSpeed engine is built, before saving).

    tokens_per_second divides by this, so model loading, the first-use compile of DeepSpeed's ops
    and saving do not dilute the throughput.
    """

    def __init__(self) -> None:
        self.started: Optional[float] = None
        self.ended: Optional[float] = None
        self.tokens_at_start = 0  # a resumed run's state already counts the tokens trained before

    def on_train_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()
        self.tokens_at_start = int(state.num_input_tokens_seen or 0)

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
        from finetune.dsconfig import dumps
        from finetune.fsutil import write_atomic
        from finetune.train.runner import json_safe

        write_atomic(self.run_dir / "deepspeed.effective.json", dumps(json_safe(hf_config.config)))
