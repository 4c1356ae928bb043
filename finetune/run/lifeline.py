"""Processes that die with the process that started them (Linux parent-death signal).

`finetune train` starts the launcher in a session of its own (terminal signals reach it only through
the supervisor), so a SIGKILL of `finetune train` or a dropped SSH session would leave torchrun and its
ranks running unwatched. The launcher is therefore started through

    python -m finetune.run.lifeline PARENT_PID SIGNAL -- torchrun-argv...

which asks the kernel (prctl PR_SET_PDEATHSIG) to send SIGNAL when the parent dies, then execs the
launcher; the setting survives exec. SIGTERM lets torchrun forward it to the ranks, which save a
checkpoint and stop within launch.stop_timeout. torchrun itself starts the ranks in new sessions and
does nothing for them when it is SIGKILLed, so each rank asks for SIGKILL on its launcher's death
(finetune.train.runner): with the launcher gone nobody would wait for them or publish their checkpoint.

The signal fires when the parent *thread* ends: spawn the launcher from the main thread.
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


def wrap(argv: list[str], signum: int = signal.SIGTERM, python: str = sys.executable) -> list[str]:
    """`argv` started through this module, tied to the calling process."""
    return [python, "-m", "finetune.run.lifeline", str(os.getpid()), str(int(signum)), "--", *argv]


def main(argv: list[str]) -> None:
    parent, signum, sep, *command = argv
    if sep != "--" or not command:
        sys.exit("usage: python -m finetune.run.lifeline PARENT_PID SIGNAL -- COMMAND...")
    die_with_parent(int(signum), int(parent))
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
