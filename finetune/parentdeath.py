"""Processes that die with the process that started them: Linux's parent-death signal (prctl PR_SET_PDEATHSIG).

The kernel sends the signal the moment the parent (the thread that forked, strictly) ends, however it ends:
SIGKILL included, where nothing of the parent's own can run. finetune.run.lifeline ties the launcher to
`finetune train` with it, each rank asks for it (finetune.train.runner), and the tokenizing processes and
their workers too (finetune.data.prepare, finetune.data.prepare_fresh). Nothing here imports the rest of
finetune, so any layer can use it.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Optional

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def set_parent_death_signal(signum: int) -> bool:
    """Ask for `signum` when the parent dies. False where the kernel has no such thing (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(signum: int, parent: Optional[int] = None) -> None:
    """set_parent_death_signal, and exit at once if the parent already died before it took effect."""
    expected = os.getppid() if parent is None else parent
    if expected == 1 or (set_parent_death_signal(signum) and os.getppid() != expected):
        os._exit(128 + int(signum))  # adopted by init: the parent is already gone


_forks_die_with_parent = False


def forks_die_with_parent() -> None:
    """From now on every process this one forks (datasets' tokenizing workers: multiprocess forks them) gets
    SIGKILL when this process dies, so `kill -9` of `finetune prepare`, or of `finetune train` while it
    tokenizes, takes its workers along instead of leaving them at full CPU (issue 34). The parent-death signal
    is cleared by fork, so it is asked for in each child (os.register_at_fork); subprocess's fork+exec runs no
    such hook, so the launcher's torchrun keeps its own lifeline. The workers hold nothing worth saving: the
    entry they were writing is a `.partial` folder the next prepare removes."""
    global _forks_die_with_parent
    if not _forks_die_with_parent and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=lambda: die_with_parent(signal.SIGKILL))
        _forks_die_with_parent = True
