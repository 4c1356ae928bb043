"""SIGTERM during merge and convert: it unwinds like Ctrl-C, so the partial output is removed, and the CLI
exits 143 (128 + 15; finetune.cli.common.write_errors). Imports nothing heavy."""

from __future__ import annotations

import signal
from contextlib import contextmanager
from typing import Iterator


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: unwinds like Ctrl-C (the partial output is removed); the CLI exits 143 (128 + 15)."""


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (a scheduler or `kill`) unwinds like Ctrl-C, so the partial output is removed."""
    def handler(signum, frame):
        raise Terminated

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
