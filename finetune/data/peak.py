"""The peak memory of the tokenize step, as scripts/bench_tokenize.py measures it: the largest sum of the resident
set sizes (RSS) of this process and all its children, sampled every 0.2 s from a thread.

The sum counts a page shared after fork once per process that maps it: an upper bound of what the step holds,
the same on every machine and comparable with the benchmark's reference. Recorded in the tokenize entry of
RUN/prepare.json (and so in summary.json's `startup`). Needs psutil (DeepSpeed's dependency); without it, None.
"""

from __future__ import annotations

import threading
from typing import Optional


class PeakRss:
    """with PeakRss() as peak: ...; peak.bytes is the largest sampled sum (None without psutil)."""

    INTERVAL = 0.2

    def __init__(self) -> None:
        self.bytes: Optional[int] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "PeakRss":
        try:
            import psutil
        except ImportError:
            return self
        self._me = psutil.Process()
        self.bytes = 0
        self._sample()
        self._thread = threading.Thread(target=self._run, name="finetune-peak-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._sample()

    def _run(self) -> None:
        while not self._stop.wait(self.INTERVAL):
            self._sample()

    def _sample(self) -> None:
        import psutil

        total = 0
        try:
            processes = [self._me] + self._me.children(recursive=True)
        except psutil.Error:
            return
        for process in processes:
            try:
                total += process.memory_info().rss
            except psutil.Error:  # ended between listing and reading
                pass
        self.bytes = max(self.bytes or 0, total)
