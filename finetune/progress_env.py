"""How often the ranks print progress lines: every 15 s in logs, every second when `finetune train` shows its
live display (finetune.run.progress sets FINETUNE_PROGRESS_INTERVAL, the ranks inherit it). The tokenizer
(finetune.data.tokenize) and ProgressLines (finetune.train.callbacks) read it here, beside nothing else."""

from __future__ import annotations

import os

PROGRESS_ENV = "FINETUNE_PROGRESS_INTERVAL"  # seconds between rank 0's progress lines


def progress_interval() -> float:
    return float(os.environ.get(PROGRESS_ENV) or 15)
