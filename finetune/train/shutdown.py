"""How a rank's process ends: its exit code must be the launcher's verdict, nothing else.

A rank that trained and saved everything could still die with SIGABRT (exit -6, "terminate called
without an active exception") during interpreter finalization, about one run in fifteen with two CPU
processes. A core dump shows why: a gloo worker thread (ProcessGroupGloo::runLoop) frees the work object
of the last collective (~AsyncBarrierWork -> TensorImpl::decref_pyobject) after the collective has
returned; that needs the GIL; a thread that asks for the GIL while the interpreter finalizes is made to
exit (pthread_exit), and unwinding through a noexcept destructor calls std::terminate.
`destroy_process_group()` does not prevent it: it only drops torch.distributed's own references, and
DeepSpeed's engines and groups keep the ProcessGroupGloo (and its threads) alive until finalization.
The same failure is described in pytorch/pytorch#179291 (an atexit hook, abandoned).

So a rank ends here: the process group is torn down, non-daemon threads are joined and atexit handlers
run while the interpreter is whole, streams and log handlers are flushed, then `os._exit(code)`
skips the finalization in which the abort happens. A preempted rank's 75 stays 75.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from typing import NoReturn


def close_process_group() -> None:
    """Destroy the default process group if this process started one."""
    if "torch" not in sys.modules:
        return
    from finetune.train.dist import process_group

    dist = process_group()
    if dist is not None:
        dist.destroy_process_group()


def exit_rank(code: int) -> NoReturn:
    """End the process with `code`, doing the interpreter's own shutdown work except finalization."""
    try:
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
        logging.shutdown()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # closed or broken pipe: nothing left to save
                pass
        os._exit(code)


def run_as_rank(main) -> NoReturn:
    """`exit_rank(main())`, with an uncaught exception printed as Python would and exit code 1."""
    try:
        code = main()
    except SystemExit as exc:  # as Python treats it: None is 0, a message is printed and exits 1
        code = exc.code
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    except BaseException as exc:
        import traceback

        traceback.print_exc()
        code = 130 if isinstance(exc, KeyboardInterrupt) else 1
    exit_rank(code or 0)
