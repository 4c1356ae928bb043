"""Peak memory of a process tree, sampled from a thread: the one sampler of the tokenize step (recorded in the
tokenize entry of RUN/prepare.json, and so in summary.json's `startup`) and of the benchmarks that compare memory
(scripts/bench_tokenize.py, scripts/bench_merge.py).

Each sample sums, over the process and all its descendants, each of the `measures` asked for:
- `rss`: the resident set size. A page shared after fork counts once per process that maps it: an upper bound of
  what the tree holds, the same on every machine (the tokenize step records this one);
- `pss`, `pss_anon`: Pss and Pss_Anon of /proc/PID/smaps_rollup: a page shared by k processes counts 1/k in each;
  Pss_Anon leaves out memory-mapped files (Arrow data, safetensors shards, libraries: page cache the kernel drops
  under pressure, which RSS and Pss count while they stay mapped);
- `rss_anon`: RssAnon of /proc/PID/status, the memory the process allocated itself (tensors, Python objects).
Needs psutil (DeepSpeed's dependency) to find the descendants; without it every peak is None.
"""

from __future__ import annotations

import threading
from typing import Optional, Sequence

MEASURES = ("rss", "pss", "pss_anon", "rss_anon")
# /proc file -> {its field: our measure}; the values there are in KiB.
_PROC_FIELDS = {"smaps_rollup": {"Pss": "pss", "Pss_Anon": "pss_anon"}, "status": {"RssAnon": "rss_anon"}}


class PeakMemory:
    """with PeakMemory() as peak: ...; then peak.bytes is the largest sampled sum of the first measure and
    peak.peaks[m] that of each measure m (None without psutil). `pid`: another process (default: this one)."""

    def __init__(self, pid: Optional[int] = None, measures: Sequence[str] = ("rss",), interval: float = 0.2) -> None:
        unknown = [m for m in measures if m not in MEASURES]
        if unknown or not measures:
            raise ValueError(f"measures must be some of {', '.join(MEASURES)}, got {list(measures)}")
        self.pid, self.measures, self.interval = pid, tuple(measures), interval
        self.peaks: dict[str, Optional[int]] = {m: None for m in self.measures}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def bytes(self) -> Optional[int]:
        return self.peaks[self.measures[0]]

    def __enter__(self) -> "PeakMemory":
        try:
            import psutil
        except ImportError:
            return self
        try:
            self._root = psutil.Process(self.pid)
        except psutil.Error:  # the process ended before it could be watched
            return self
        self.peaks = {m: 0 for m in self.measures}
        self._sample()
        self._thread = threading.Thread(target=self._run, name="finetune-peak-memory", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _sample(self) -> None:
        import psutil

        try:
            processes = [self._root] + self._root.children(recursive=True)
        except psutil.Error:  # the watched process has ended
            return
        totals = dict.fromkeys(self.measures, 0)
        for process in processes:
            for measure, value in _values(process, self.measures).items():
                totals[measure] += value
        for measure, total in totals.items():
            self.peaks[measure] = max(self.peaks[measure] or 0, total)


def _values(process, measures: tuple[str, ...]) -> dict[str, int]:
    """The measures of one process; a process that ended between listing and reading counts 0."""
    import psutil

    values: dict[str, int] = {}
    if "rss" in measures:
        try:
            values["rss"] = process.memory_info().rss
        except psutil.Error:
            pass
    for name, fields in _PROC_FIELDS.items():
        if any(fields[f] in measures for f in fields):
            read = _proc_kib(f"/proc/{process.pid}/{name}", fields)
            values.update((measure, value) for measure, value in read.items() if measure in measures)
    return values


def _proc_kib(path: str, fields: dict[str, str]) -> dict[str, int]:
    values = {}
    try:
        with open(path, encoding="ascii") as handle:
            for line in handle:
                name, _, rest = line.partition(":")
                if name in fields:
                    values[fields[name]] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return values
