"""How many examples each fuzz test draws (a fifth in CI, the full count with FINETUNE_FUZZ=full), and the time
limit each in-process invocation runs under.

    FINETUNE_FUZZ=full python -m pytest tests/lint/test_fuzz.py tests/cli/test_fuzz.py   # the full counts

The examples are derandomized, so a CI run draws the first fifth of the full run's examples.
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Iterator

from hypothesis import HealthCheck, settings

FULL = os.environ.get("FINETUNE_FUZZ") == "full"


def fuzz(examples: int):
    """Hypothesis settings for a test whose full count is `examples`."""
    count = examples if FULL else max(examples // 5, 10)
    return settings(max_examples=count, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


class TooLong(Exception):
    """Raised into an in-process invocation that ran past its time_limit."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Stop the block after `seconds` with TooLong (SIGALRM, main thread): a hang in-process becomes a failed
    assertion naming the input, not a stuck test run. An open() of a FIFO is interrupted too (PEP 475 retries
    a system call only when the handler returns)."""
    def expire(signum, frame):
        raise TooLong(f"ran past {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
