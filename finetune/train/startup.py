"""The time before the first optimizer step, split by stage, for summary.json's `startup`.

- tokenize: the launcher's step before any rank started (finetune.run.start, RUN/prepare.json): seconds,
  and whether the cache was found instead of made.
- launch: from the launcher starting torchrun to this rank entering the runner (process start, imports).
- imports (deepspeed, transformers and finetune's training modules), process_group (joined), data (the prepared
  rows memory-mapped), model (loaded, adapter added), trainer (the Trainer built): the runner's stages. Run
  directories written before `imports` was split off count the imports in process_group.
- deepspeed_init: from trainer.train() to the first callback (the engine, the optimizer, ZeRO partitioning,
  and the first-use build of DeepSpeed's ops).
- first_step: the first optimizer step.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

from finetune.rundir.names import PREPARE_FILE

STAGES = ("launch", "imports", "process_group", "data", "model", "trainer", "deepspeed_init", "first_step")


class Startup:
    def __init__(self, run_dir: Path):
        self.entered = time.time()
        self.last = time.perf_counter()
        self.seconds: dict[str, float] = {}
        try:
            self.prepared = json.loads((Path(run_dir) / PREPARE_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            self.prepared = {}  # started by hand (python -m finetune.train.runner), not by `finetune train`

    def mark(self, stage: str) -> None:
        """`stage` ended now (it began where the previous one ended)."""
        now = time.perf_counter()
        self.seconds[stage] = round(now - self.last, 3)
        self.last = now

    def split(self, clock) -> dict[str, Any]:
        """The stages, in order, in seconds (None where not measured); clock: callbacks.TrainClock."""
        launched: Optional[float] = self.prepared.get("launched_at")
        tokenize = self.prepared.get("tokenize")
        out: dict[str, Any] = {
            "tokenize": tokenize,
            "launch": round(self.entered - launched, 3) if launched else None,
            **self.seconds,
            "deepspeed_init": round(clock.started - self.last, 3) if clock.started else None,
            "first_step": round(clock.first_step - clock.started, 3) if clock.first_step and clock.started else None,
        }
        return out


def rows(startup: Optional[dict[str, Any]]) -> list[tuple[str, str]]:
    """(stage, seconds) lines of summary.json's `startup` for report.html."""
    if not startup:
        return []
    out = []
    tokenize = startup.get("tokenize")
    if tokenize:
        how = "found in the cache" if tokenize.get("cached") else \
            f"{tokenize.get('rows', 0):,} rows on {tokenize.get('num_proc')} process(es)"
        if not tokenize.get("cached") and tokenize.get("peak_rss"):
            how += f", peak RSS {tokenize['peak_rss'] / 2**30:.2f} GB (summed over the processes)"
        out.append(("tokenize (launcher)", f"{tokenize.get('seconds', 0):.1f} s, {how}"))
    for stage in STAGES:
        if isinstance(startup.get(stage), (int, float)):
            out.append((stage.replace("_", " "), f"{startup[stage]:.1f} s"))
    return out


def startup_text(startup: Optional[dict[str, Any]]) -> str:
    """The console's start-up split: 'start-up 14.2 s (launch 3.1, process group 1.0, ..., first step 0.4)'."""
    stages = [(stage, startup[stage]) for stage in STAGES if isinstance((startup or {}).get(stage), (int, float))]
    if not stages:
        return "start-up: n/a"
    total = sum(seconds for _, seconds in stages)
    return f"start-up {total:.1f} s (" + ", ".join(f"{s.replace('_', ' ')} {v:.1f}" for s, v in stages) + ")"
