"""The live training display of `finetune train` when its output is a terminal.

Rank 0's output reaches `finetune train` line by line through the launcher (finetune.run.launch.supervision.Relay
writes whole lines to a console stream). This module is such a stream: it reads the lines the
runner prints anyway (the Trainer's `{'loss': ...}` dicts and finetune.train.callbacks.ProgressLines'
`progress: step N/M` lines) and keeps one progress bar (step, loss, tokens/s, ETA) at the bottom
of the terminal, every other line printed above it. Nothing changes on the ranks except that
ProgressLines and the tokenizer report every second instead of every 15 (PROGRESS_ENV), and nothing changes when
the output is not a terminal: CI and log files get the plain lines, as before.
"""

from __future__ import annotations

import ast
import re
import sys
from typing import Optional

LIVE_INTERVAL = "1"
_RANK_PREFIX = re.compile(r"^\[(?:rank|default)\d+\]:\s?")
_PROGRESS = re.compile(r"^progress: step (\d+)/(\d+)")
_TOKENIZING = re.compile(r"^\[finetune\] tokenizing: (\d+)/(\d+) rows(?: \((.*)\))?")  # (rate, time left)
_TOKENIZED = re.compile(r"^\[finetune\] (tokenized data|parameters):")


def wanted(stream=None) -> bool:
    """A live display only for a terminal (and not for TERM=dumb)."""
    import os

    stream = stream if stream is not None else sys.stdout
    return bool(getattr(stream, "isatty", lambda: False)()) and os.environ.get("TERM") != "dumb"


class TrainingDisplay:
    """A binary console stream for launch.supervise that draws a progress bar under the relayed lines."""

    def __init__(self, console=None) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
        from rich.text import Text

        class Steps(ProgressColumn):  # nothing until the first progress line says how many steps
            def render(self, task) -> Text:
                return Text(f"step {task.completed:.0f}/{task.total:.0f}" if task.total else "")

        self.console = console or Console()
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), Steps(),
            TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[speed]} tokens/s"),
            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
            console=self.console, transient=False)
        self.task: Optional[int] = None
        self._pending = b""
        self.status = "starting"

    # -- a stream --------------------------------------------------------------------------------

    def write(self, data: bytes) -> int:
        self._pending += data
        *lines, self._pending = self._pending.split(b"\n")
        for line in lines:
            self.line(line.decode("utf-8", "replace").rstrip("\r"))
        return len(data)

    def flush(self) -> None:
        pass

    def __enter__(self) -> "TrainingDisplay":
        self.progress.start()
        self.task = self.progress.add_task("starting ranks", total=None, loss="-", speed="-")
        return self

    def __exit__(self, *exc) -> None:
        if self._pending:
            self.line(self._pending.decode("utf-8", "replace"))
            self._pending = b""
        self.progress.stop()

    # -- the lines -------------------------------------------------------------------------------

    def line(self, text: str) -> None:
        body = _RANK_PREFIX.sub("", text)
        match = _PROGRESS.match(body)
        if match:  # the bar shows it
            self.progress.update(self.task, description="training", completed=int(match[1]), total=int(match[2]))
            return
        match = _TOKENIZING.match(body)
        if match:  # the status text shows it
            self.progress.update(self.task, description=f"tokenizing {match[1]}/{match[2]} rows"
                                 + (f" ({match[3]})" if match[3] else ""))
            return
        logged = parse_log_line(body)
        if logged is not None:
            fields = {}
            if "loss" in logged:
                fields["loss"] = f"{float(logged['loss']):.3f}"
            if "train_tokens_per_second" in logged:
                fields["speed"] = f"{float(logged['train_tokens_per_second']):.0f}"
            if fields:
                self.progress.update(self.task, **fields)
            text = compact_log_line(logged)
            if text is None:
                return
        elif _TOKENIZED.match(body):
            self.progress.update(self.task, description="loading model")
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)


# What one logging step shows on the terminal, in this order; the whole dict (and every other metric) is in
# RUN/logs and TensorBoard. A ~500-character DPO dict per step scrolled over the bar (issue 24).
_SHOWN = (("loss", "loss", ".4f"), ("eval_loss", "eval loss", ".4f"), ("learning_rate", "lr", ".3g"),
          ("grad_norm", "grad norm", ".3g"), ("rewards/margins", "margins", ".3f"),
          ("rewards/accuracies", "accuracy", ".2f"))


def compact_log_line(logged: dict) -> Optional[str]:
    """`epoch 0.25: loss 0.5928, lr 0.005, grad norm 1.01, margins 0.227, accuracy 0.75` for a Trainer log
    dict (the bar shows the step); None for the end-of-training totals (train_runtime...), which the
    `done:` line states."""
    parts = [f"{label} {format(logged[key], spec)}" for key, label, spec in _SHOWN if key in logged]
    if not parts:
        return None
    return (f"epoch {logged['epoch']:.2f}: " if "epoch" in logged else "") + ", ".join(parts)


def parse_log_line(text: str) -> Optional[dict]:
    """The dict of a Trainer log line (`{'loss': '2.3', ...}`, values printed as strings), else None."""
    if not (text.startswith("{") and text.endswith("}")):
        return None
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return None
    if not isinstance(value, dict):
        return None
    try:
        return {k: float(v) for k, v in value.items() if isinstance(v, (int, float, str)) and _is_number(v)}
    except ValueError:
        return None


def _is_number(value) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


class WriteDisplay:
    """The live display of `finetune merge` and `finetune convert` on a terminal: the log lines they print
    anyway, above one bar of bytes written (done/total, rate, ETA) and tensors written."""

    def __init__(self, description: str, console=None) -> None:
        from rich.console import Console
        from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                   TransferSpeedColumn)

        # stderr, beside the log lines: stdout keeps only the one-line summary, redirectable as before
        self.console = console or Console(stderr=True)
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(),
            TextColumn("{task.fields[tensors]}"), TransferSpeedColumn(), TextColumn("ETA"),
            TimeRemainingColumn(), console=self.console, transient=False)
        self.description = description
        self.task: Optional[int] = None

    def __enter__(self) -> "WriteDisplay":
        self.progress.start()
        self.task = self.progress.add_task(self.description, total=None, tensors="")
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def log(self, line: str) -> None:
        # The bar redrawn under the line is the last one drawn: draw the current one first (a fast
        # merge writes a shard between two of rich's 10 refreshes a second).
        self.progress.refresh()
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def update(self, written) -> None:
        """An on_write callback of finetune.weights.merge (a Written); called from the writer thread (rich locks)."""
        self.progress.update(self.task, completed=written.bytes, total=written.total_bytes,
                             tensors=f"{written.tensors}/{written.total_tensors} tensors")
