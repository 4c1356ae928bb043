"""The file system, both ways: what a command may read, and writing without ever leaving a file half-written.

Reading: every path a command is given (a recipe, `extends`, a model, tokenizer or adapter folder, a data file,
a reward file, a hostfile) passes `refuse_special` before anything opens it, and a file read whole goes through
`read_capped`. A FIFO blocks whoever opens it until a writer comes (forever, for `lint` in CI); a device such as
/dev/zero never ends (issue 40: `lint --set model.name_or_path=/dev/zero` grew to 24 GB).

Writing: a temporary file or folder beside the target, then a rename.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

from finetune.errors import FinetuneError
from finetune.units import human_size

# Inside every partial directory while it is written: who writes it, so that a later run can tell a
# directory whose writer was killed (SIGKILL, power cut) from one that is still being written.
OWNER_FILE = ".finetune-owner.json"
DAMAGED_SUFFIX = ".damaged"


def damaged_name(path: Path) -> Path:
    """Where something damaged that finetune wrote (a checkpoint, a cache entry) is set aside: hidden beside it,
    kept for a look; nothing resumes from it or reads it again."""
    path = Path(path)
    return path.with_name(f".{path.name}{DAMAGED_SUFFIX}")


class SpecialFile(FinetuneError, OSError):
    """A path that is a device, FIFO or socket (or a folder holding one), or a file larger than its reader takes
    whole: one line naming it. An OSError too, so that a reader's `except OSError` reports it as it would a
    file it cannot open."""


_SPECIAL = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
            (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def special_kind(path: "str | os.PathLike") -> Optional[str]:
    """What `path` is (links followed) when it exists and is neither a regular file nor a folder, else None
    (a missing or unreadable path too: whoever opens it says so). Only stat(): never opens it."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):  # ValueError: a NUL byte in the name
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    return next((name for test, name in _SPECIAL if test(mode)), "not a regular file")


def refuse_special(path: "str | os.PathLike", what: Optional[str] = None) -> None:
    """Raise SpecialFile when `path`, or an entry directly inside the folder `path`, is a device, FIFO or socket.

    Libraries open a model folder's files by name (config.json, tokenizer.json, the weights), so a FIFO
    there hangs them as surely as one given directly. `what` names the path for the user (`model.name_or_path`)."""
    problem = special_problem(path, what)
    if problem:
        raise SpecialFile(problem)


def special_problem(path: "str | os.PathLike", what: Optional[str] = None) -> Optional[str]:
    """refuse_special's one line, or None."""
    label = f"{what}: " if what else ""
    kind = special_kind(path)
    if kind:
        return f"{label}{path} is {kind}, not a regular file or folder"
    try:
        entries = os.scandir(path) if os.path.isdir(path) else None
    except (OSError, ValueError):
        return None
    if entries is None:
        return None
    with entries:
        for entry in entries:
            kind = special_kind(entry.path)
            if kind:
                return f"{label}{entry.path} is {kind}, not a regular file"
    return None


def read_capped(path: "str | os.PathLike", limit: int, what: Optional[str] = None) -> bytes:
    """The bytes of the regular file `path`, refused (SpecialFile) when it is anything else or holds more than
    `limit` bytes. Opened without blocking, so a FIFO is refused rather than waited on, and read with at most
    `limit` + 1 bytes in memory whatever stat() said (/proc files and links to devices report size 0).
    Other OSErrors (missing, permission) pass through."""
    label = f"{what}: {path}" if what else str(path)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = "a folder" if stat.S_ISDIR(info.st_mode) else \
                next((name for test, name in _SPECIAL if test(info.st_mode)), "not a regular file")
            raise SpecialFile(f"{label} is {kind}, not a regular file")
        chunks, size = [], 0
        while info.st_size <= limit and size <= limit:
            chunk = os.read(fd, min(limit + 1 - size, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if info.st_size > limit or size > limit:
        raise SpecialFile(f"{label} is larger than {human_size(limit)}, too large to be read whole "
                          "(is it the right file?)")
    return b"".join(chunks)


# The most a JSON file finetune reads whole may hold (a model's config.json, adapter_config.json, a safetensors
# index, tokenizer_config.json): the largest on the hub are a few MB (the index of a 1T-parameter MoE, a
# tokenizer_config.json with a long chat template).
JSON_LIMIT = 64 * 2**20


def read_json(path: "str | os.PathLike", what: Optional[str] = None, limit: int = JSON_LIMIT) -> Any:
    """A JSON file read whole through read_capped. Raises OSError (SpecialFile included) or ValueError (not UTF-8,
    not JSON, nested deeper than the json module recurses)."""
    raw = read_capped(path, limit, what)
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("nested too deeply to read") from None


def write_atomic(path: Path, text: "str | bytes") -> None:
    """Write `text` (or bytes) to `path` through a temporary file in the same folder and an atomic rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        give_usual_mode(tmp)  # mkstemp makes 0600
        with os.fdopen(fd, "wb") as handle:
            if isinstance(text, str):
                text = text.encode("utf-8")
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def give_usual_mode(path) -> None:
    """The mode a file created with open() would have (mkstemp and safetensors create files 0600)."""
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def remove_path(path: Path) -> None:
    """Remove `path` whatever it is: a folder's tree, or a link or file itself (never what a link points at).

    shutil.rmtree refuses a link to a folder (and ignore_errors hides that), which left links that finetune had
    renamed aside in place forever, and a later rename onto them failed with "Not a directory" (issue 34)."""
    path = Path(path)
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def replace_dir(tmp: Path, target: Path, old: Path) -> None:
    """Move the finished directory `tmp` to `target`; an existing `target` is moved aside to `old` and removed after.

    Where the kernel can (Linux renameat2 RENAME_EXCHANGE) the two directories trade places in one step, so
    `target` never stops existing: a run directory's lock (finetune.rundir.lock) taken in `tmp` guards it
    from the moment it appears, and nobody can create an empty `target` in between."""
    if target.exists() or target.is_symlink():
        remove_path(old)
        if exchange_dirs(tmp, target):
            os.replace(tmp, old)  # tmp now holds the previous target
        else:
            os.replace(target, old)
            os.replace(tmp, target)
        remove_path(old)
    else:
        os.replace(tmp, target)


_RENAME_EXCHANGE = 2  # linux/fs.h


def exchange_dirs(a: Path, b: Path) -> bool:
    """Swap `a` and `b` atomically (renameat2 RENAME_EXCHANGE); False where the system cannot (then nothing moved)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False  # not glibc >= 2.28, or not Linux
    at_fdcwd = -100
    result = renameat2(at_fdcwd, os.fsencode(str(a)), at_fdcwd, os.fsencode(str(b)), _RENAME_EXCHANGE)
    return result == 0  # EINVAL / ENOSYS (a file system without it): the caller falls back


@contextmanager
def atomic_dir(target: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory beside `target`; on success it replaces `target`.

    On any error (or Ctrl-C) the temporary directory is removed and `target` is untouched.
    """
    target = Path(target)
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} already exists (use --overwrite to replace it)")
    if target.is_symlink():
        # A link (merged/ -> a larger disk) is written at its target and stays: the temporary directory then
        # lies beside the target, on the same disk, and nothing is left beside the link (issue 34).
        target = Path(os.path.realpath(target))
    target.parent.mkdir(parents=True, exist_ok=True)
    # The PID in the name too: the owner file is removed just before the swap, and a kill there must still
    # leave a partial that remove_stale_partials can tell is orphaned.
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.{os.getpid()}.", suffix=".partial", dir=target.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700
    try:
        (tmp / OWNER_FILE).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
        yield tmp
        (tmp / OWNER_FILE).unlink(missing_ok=True)
        replace_dir(tmp, target, target.with_name(f".{target.name}.old-{os.getpid()}"))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextmanager
def publish_once(target: Path, complete: str, mode: Optional[int] = None) -> Iterator[Path]:
    """Yield a temporary directory beside `target` to fill; on success it is renamed to `target`.

    For caches whose every build is the same (a built-in model, tokenized data): when processes race,
    the first rename wins and the others discard their copy, once `complete` (a file the finished
    directory holds) shows the winner's copy is whole. Unlike atomic_dir, `target` is never replaced.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    try:
        if mode is not None:
            os.chmod(tmp, mode)  # mkdtemp makes 0700
        yield tmp
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race (a non-empty `target`)
            if not (target / complete).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_stale_partials(target: Path) -> list[str]:
    """Remove what writers of `target` that are gone left beside it: partial directories (`.NAME.PID.*.partial`,
    killed while writing or between the swap's renames) and replaced outputs (`.NAME.old-PID`, killed while
    deleting them). Returns one line per directory removed.

    A directory whose writer is alive, or on another host (shared storage; the owner file says), is left
    alone: it may still be written. Without an owner file (removed just before the swap) the PID in the
    name is the writer's on this host."""
    target = Path(os.path.realpath(target)) if Path(target).is_symlink() else Path(target)  # as atomic_dir writes it
    removed = []
    name = glob.escape(target.name)
    for leftover in sorted([*target.parent.glob(f".{name}.*.partial"), *target.parent.glob(f".{name}.old-*")]):
        owner = _owner(leftover, target.name)
        if owner is None or owner[1] != socket.gethostname() or _alive(owner[0]):
            continue
        size = 0 if leftover.is_symlink() else sum(f.stat().st_size for f in leftover.rglob("*") if f.is_file())
        remove_path(leftover)
        if not leftover.exists() and not leftover.is_symlink():
            removed.append(f"removed {leftover} ({human_size(size)}), left by process {owner[0]} which is gone")
    return removed


def _owner(leftover: Path, target_name: str) -> Optional[tuple[int, str]]:
    try:
        data = json.loads((leftover / OWNER_FILE).read_text())
        return int(data["pid"]), str(data["host"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    rest = leftover.name[len(target_name) + 2:]  # after ".NAME."
    pid = rest[len("old-"):] if leftover.name.startswith(f".{target_name}.old-") else rest.split(".", 1)[0]
    return (int(pid), socket.gethostname()) if pid.isdigit() else None


def _alive(pid: int) -> bool:
    if pid <= 0:
        return True  # not a process id we can check: leave the directory alone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    """A process that has exited but was not yet reaped by its parent (Linux: state Z in /proc/PID/stat):
    signal 0 still reaches it, but it writes nothing any more."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False  # no procfs (macOS) or gone meanwhile: signal 0 decided
    return stat[stat.rfind(")") + 2:].startswith("Z")  # after "PID (comm) ": the state
