"""Processes that die with the process that started them (Linux parent-death signal).

`finetune train` starts the launcher in a session of its own (terminal signals reach it only through
the supervisor), so a SIGKILL of `finetune train` or a dropped SSH session would leave torchrun and its
ranks running unwatched. The launcher is therefore started through

    python -m finetune.run.lifeline PARENT_PID SIGNAL -- torchrun-argv...

a small single-threaded process that asks the kernel (prctl PR_SET_PDEATHSIG) for SIGKILL when
`finetune train` dies, and starts the launcher as its own child with SIGNAL as the launcher's death
signal. SIGTERM lets torchrun forward it to the ranks, which save a checkpoint and stop within
launch.stop_timeout. torchrun itself starts the ranks in new sessions and does nothing for them when
it is SIGKILLed, so each rank asks for SIGKILL on its launcher's death (finetune.train.runner): with
the launcher gone nobody would wait for them or publish their checkpoint.

Why a process in between rather than exec: the death signal fires when the parent *thread* ends, and
the kernel then hands the orphan to another thread of the same process and fires again. A SIGKILLed
`finetune train` (a relay thread, a progress thread) sent torchrun two or three SIGTERMs; the second
one landed in torchrun's own shutdown, which then exited without stopping its log tailer and hung
forever at interpreter exit (seen in CI). The lifeline has one thread, so the launcher gets one signal.

Stop signals from the supervisor reach the launcher through the process group; the lifeline only
waits, and leaves with the launcher's exit status (or dies by the signal that ended it).
"""

from __future__ import annotations

import os
import signal
import sys

from finetune.parentdeath import die_with_parent

def wrap(argv: list[str], signum: int = signal.SIGTERM, python: str = sys.executable) -> list[str]:
    """`argv` started through this module, tied to the calling process."""
    return [python, "-m", "finetune.run.lifeline", str(os.getpid()), str(int(signum)), "--", *argv]


def main(argv: list[str]) -> None:
    parent, signum, sep, *command = argv
    if sep != "--" or not command:
        sys.exit("usage: python -m finetune.run.lifeline PARENT_PID SIGNAL -- COMMAND...")
    die_with_parent(signal.SIGKILL, int(parent))  # however many times it fires, once is enough
    for stop in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        # the launcher gets these through the group; a handler (not SIG_IGN) is reset by exec
        signal.signal(stop, lambda *_: None)
    me = os.getpid()
    child = os.fork()
    if child == 0:
        try:
            die_with_parent(int(signum), me)
            os.execvp(command[0], command)
        except OSError as exc:
            os.write(2, f"lifeline: cannot start {command[0]}: {exc.strerror or exc}\n".encode())
        os._exit(127)
    _, status = os.waitpid(child, 0)
    if os.WIFSIGNALED(status):
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(me, os.WTERMSIG(status))
    sys.exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main(sys.argv[1:])
