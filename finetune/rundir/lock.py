"""One live run per run directory: `finetune train` holds an flock on RUN/.finetune.lock for the whole run.

The kernel drops an flock when the last descriptor of it closes, so a crash or SIGKILL leaves no stale
lock. The launcher inherits the descriptor (finetune.run.launch.supervision.spawn), so the directory stays owned while
torchrun is still stopping its ranks after `finetune train` itself was killed. The file says who holds it
(PID, host, start time) for the error a second run prints; the lock, not the text, is what counts.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from finetune.errors import FinetuneError

LOCK_FILE = ".finetune.lock"
OWNER_ENV = "FINETUNE_RUN_OWNER"  # the holder's PID, for the ranks it starts (finetune.train.preemption)
LOCK_ENV = "FINETUNE_RUN_LOCK"  # the lock file's name in the run directory, for the same ranks


def lock_name(nodes: int = 1, node_rank: int = 0) -> str:
    """The nodes of one multi-node run share a run directory: each `finetune train` owns its node's part."""
    return LOCK_FILE if nodes <= 1 else f"{LOCK_FILE}.node{node_rank}"


class RunDirLocked(FinetuneError):
    """Another live run owns the run directory (message names its PID and host)."""


@dataclass
class RunLock:
    path: Path
    fd: int

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing drops the flock (with no other descriptor of it open)
            self.fd = -1


def _lock_path(run_dir: Path, name: str) -> Path:
    return Path(run_dir) / name


def _try_flock(fd: int) -> bool:
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def is_lock_file(name: str) -> bool:
    """A lock file of any node (what an otherwise empty run directory may hold)."""
    return name == LOCK_FILE or name.startswith(f"{LOCK_FILE}.node")


def acquire(run_dir: Path, name: str = LOCK_FILE) -> RunLock:
    """Own `run_dir` (it must exist), or raise RunDirLocked naming the live holder."""
    path = _lock_path(run_dir, name)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        if not _try_flock(fd):
            holder = _read_holder(fd)
            os.close(fd)
            raise RunDirLocked(_locked_message(run_dir, holder))
        if _still_there(fd, path):
            break
        # Removed or replaced between our open and our flock (a holder cleaning up the directory it created,
        # or an --overwrite swap): the lock that counts is the file at the path now.
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} host {platform.node()} since {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n".encode(), 0)
    except OSError:
        pass  # a full disk: the lock is held all the same (an escaping error left it held by a lost descriptor,
        # and the run then called itself "a live run", issue 34); the next write into the directory says what is wrong
    return RunLock(path, fd)


def _still_there(fd: int, path: Path) -> bool:
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False  # the next open creates it again, or fails when the folder itself is gone
    mine = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)


def holder(run_dir: Path, name: str = LOCK_FILE) -> Optional[str]:
    """Who owns `run_dir` now (the error message), or None when no live run does. Takes nothing."""
    text = _live_holder(run_dir, name)
    return None if text is None else _locked_message(run_dir, text)


def owned_by(run_dir: Path, pid: int, name: str = LOCK_FILE) -> bool:
    """Whether the live holder of `run_dir`'s lock is the process `pid` (as its lock file says)."""
    text = _live_holder(run_dir, name)
    return text is not None and text.split()[:2] == ["pid", str(pid)]


def _live_holder(run_dir: Path, name: str) -> Optional[str]:
    """The lock file's text while a live process holds the lock; None when nobody does."""
    try:
        fd = os.open(_lock_path(run_dir, name), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if _try_flock(fd):
            return None  # nobody held it; released again when fd closes
        return _read_holder(fd)
    finally:
        os.close(fd)


def _read_holder(fd: int, wait: float = 2.0) -> str:
    """The holder's line. A holder writes it just after its flock, so an empty file is read again for `wait` s
    (a run refused in that moment named "another process" rather than the PID to stop)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            text = os.pread(fd, 512, 0).decode("utf-8", "replace").strip()
        except OSError:
            return ""
        if text or time.monotonic() >= deadline:
            return text
        time.sleep(0.02)


def _locked_message(run_dir: Path, holder_text: str) -> str:
    fields = holder_text.split()
    info = dict(zip(fields[0::2], fields[1::2])) if len(fields) % 2 == 0 else {}
    who = f"PID {info['pid']} on {info['host']}" if "pid" in info and "host" in info else "another process"
    since = f", since {info['since']}" if "since" in info else ""
    message = f"output directory {run_dir} is in use by a live run ({who}{since}); nothing was changed there"
    if "pid" in info:
        message += f". Wait for it to end, or stop it with `kill -TERM {info['pid']}` (it saves a checkpoint)"
    return message
