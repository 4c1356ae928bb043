"""Checkpoints a run can be resumed from, and the rules that keep resuming safe.

The HF Trainer writes `RUN/checkpoint-<step>/` in place (adapter or weights, DeepSpeed's
`global_step<N>/` shards from every rank, optimizer and scheduler, one `rng_state_<rank>.pth` per
rank, trainer_state.json); it has no notion of "finished writing". A process killed half-way leaves
a folder that looks like a checkpoint and crashes (or silently corrupts) the next resume. So:

- publish: once every rank has written its part (a barrier in finetune.train.preemption), the
  files are flushed to disk and a `COMPLETE` marker is written last, atomically. It lists every
  file with its size and the step.
- discover: only a folder whose marker parses, names the folder's step and whose listed files are
  all there with those sizes counts. Anything else is ignored, and removed at the next start.
- rotate: the newest `training.save_total_limit` complete checkpoints are kept; older ones are
  removed only after a newer one is published (HF's own rotation deletes before the new
  checkpoint is complete, which can leave nothing to resume from).

A run directory also keeps `resume_key.json` (finetune.rundir.resume_key): the parts of the resolved
recipe that a resumed run must share with the run that wrote the checkpoints. `finetune train`
refuses to resume when they changed, naming each change, unless --force-resume.

Exit code 75 (EX_TEMPFAIL in sysexits.h, "try again later") means: stopped by a signal, a
checkpoint was saved, run the same command again to resume. `stopped.json` records which.

No torch here: `finetune train` reads all of this before anything heavy is imported.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from finetune.errors import FinetuneError
from finetune.fsutil import damaged_name, remove_path, write_atomic
from finetune.rundir.names import CHECKPOINT_PREFIX, RECIPE_FILE, STOP_RECORD, SUMMARY_FILE
from finetune.rundir.resume_key import RESUME_KEY_FILE, process_count_change, read_resume_key, resume_fields
from finetune.units import gib_text

MARKER = "COMPLETE"
EXIT_PREEMPTED = 75  # EX_TEMPFAIL
# The one rule for a second stop signal, in `finetune train` (finetune.run.launch) and in every rank
# (finetune.train.preemption): within this many seconds of the first it is the same request (systemd,
# SLURM and launchers often signal every process and also relay it); a later one aborts at once.
SECOND_SIGNAL_WINDOW = 5.0
_CHECKPOINT_RE = re.compile(rf"^{re.escape(CHECKPOINT_PREFIX)}(\d+)$")
MIB = 2**20
# Headroom on top of the estimate: the estimate is the previous checkpoint's size (or the model's),
# and ZeRO shards, RNG files and trainer_state.json vary a little from one save to the next.
SPACE_FACTOR = 1.2
SPACE_MARGIN = 256 * MIB


class CheckpointError(FinetuneError):
    """A checkpoint cannot be written or read (disk full, read-only, not enough space)."""


@dataclass(frozen=True)
class Checkpoint:
    """A `checkpoint-<step>` folder: what resuming judges it by, and (once `finetune convert` opened it)
    the DeepSpeed states inside, so both read one description of the same folder."""

    step: Optional[int]  # None only for a DeepSpeed folder given to convert whose tag names no step
    path: Path  # the folder holding DeepSpeed's `latest` and `global_step<N>/`
    complete: bool
    problem: Optional[str] = None  # why it does not count (no marker, a file missing, ...)
    tag: Optional[str] = None  # DeepSpeed's step folder inside `path` (`global_step<N>`), set by convert
    # Rank 0's *_model_states.pt, memory-mapped (finetune.weights.convert.find_checkpoint; needs torch to load).
    model_states: Optional[dict] = field(default=None, compare=False, repr=False)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def step_dir(self) -> Path:
        if self.tag is None:
            raise ValueError(f"{self.path}: DeepSpeed's step folder is not known until the checkpoint is opened")
        return self.path / self.tag


# ----------------------------------------------------------------------------------------------
# Discovery


def checkpoint_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every `checkpoint-<step>` folder, oldest first."""
    run_dir = Path(run_dir)
    try:
        entries = list(run_dir.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for entry in entries:
        step = checkpoint_step(entry.name)
        if step is not None and entry.is_dir():
            found.append((step, entry))
    return sorted(found)


def checkpoint_step(folder_name: str) -> Optional[int]:
    """'checkpoint-500' -> 500; None for any other name."""
    match = _CHECKPOINT_RE.match(folder_name)
    return int(match.group(1)) if match else None


def inspect_checkpoint(path: Path, step: int) -> Checkpoint:
    return Checkpoint(step, Path(path), *_verify(Path(path), step))


def _verify(path: Path, step: int) -> tuple[bool, Optional[str]]:
    try:
        marker = json.loads((path / MARKER).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return False, f"no {MARKER} marker (the save did not finish)"
    except (OSError, ValueError) as exc:
        return False, f"unreadable {MARKER} marker ({exc})"
    if not isinstance(marker, dict) or marker.get("step") != step or not isinstance(marker.get("files"), dict):
        return False, f"{MARKER} marker does not describe step {step}"
    for name, size in marker["files"].items():
        try:
            actual = (path / name).stat().st_size
        except OSError:
            return False, f"{name} is missing"
        if actual != size:
            return False, f"{name} has {actual} bytes, the marker says {size}"
    return True, None


def list_checkpoints(run_dir: Path) -> list[Checkpoint]:
    return [inspect_checkpoint(path, step) for step, path in checkpoint_dirs(run_dir)]


def complete_checkpoints(run_dir: Path) -> list[Checkpoint]:
    return [c for c in list_checkpoints(run_dir) if c.complete]


def latest_complete(run_dir: Path) -> Optional[Checkpoint]:
    complete = complete_checkpoints(run_dir)
    return complete[-1] if complete else None


# ----------------------------------------------------------------------------------------------
# Publishing, rotation, clean-up


def manifest(path: Path) -> dict[str, int]:
    """Relative path -> size of every file under `path` except the marker."""
    files = {}
    for file in sorted(p for p in Path(path).rglob("*") if p.is_file()):
        name = file.relative_to(path).as_posix()
        if name != MARKER:
            files[name] = file.stat().st_size
    return files


def _fsync_tree(path: Path) -> None:
    """Flush every file and folder under `path`: the marker must never reach the disk before them.

    Files written by the other ranks of this machine share the page cache, so one process can
    flush them all; on a network file system each writer flushed its files when closing them."""
    for root, dirs, files in os.walk(path):
        for name in files:
            _fsync(Path(root) / name, os.O_RDONLY)
        _fsync(Path(root), os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))


def _fsync(path: Path, flags: int) -> None:
    try:
        fd = os.open(path, flags)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems do not support fsync on directories
    finally:
        os.close(fd)


def publish(path: Path, step: int, extra: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Mark the checkpoint at `path` complete (call after every rank finished writing it)."""
    path = Path(path)
    _fsync_tree(path)
    record = {"step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **(extra or {}), "files": manifest(path)}
    write_atomic(path / MARKER, json.dumps(record, indent=1) + "\n")
    _fsync(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    return record


def remove_checkpoint(path: Path) -> None:
    """Rename first, then delete: an interrupted delete never leaves a `checkpoint-N` with files missing."""
    path = Path(path)
    doomed = path.with_name(f".{path.name}.deleting-{os.getpid()}")
    try:
        os.replace(path, doomed)
    except FileNotFoundError:
        return  # another node sharing this folder got there first
    remove_path(doomed)


def rotate(run_dir: Path, keep: Optional[int]) -> list[Path]:
    """Keep the newest `keep` complete checkpoints (all when None); drop incomplete ones older than
    the newest complete one. Returns the folders removed."""
    checkpoints = list_checkpoints(run_dir)
    complete = [c for c in checkpoints if c.complete]
    if not complete:
        return []
    kept = {c.path for c in complete[-keep:]} if keep else {c.path for c in complete}
    newest = complete[-1].step
    removed = []
    for checkpoint in checkpoints:
        if checkpoint.path in kept or checkpoint.step > newest:
            continue
        remove_checkpoint(checkpoint.path)
        removed.append(checkpoint.path)
    return removed


def discard_incomplete(run_dir: Path) -> list[Path]:
    """Remove every checkpoint folder that is not complete (left by a crash during a save), and
    leftovers of interrupted removals. Returns the checkpoint folders removed."""
    removed = []
    for checkpoint in list_checkpoints(run_dir):
        if not checkpoint.complete:
            remove_checkpoint(checkpoint.path)
            removed.append(checkpoint.path)
    for leftover in Path(run_dir).glob(".checkpoint-*.deleting-*"):
        remove_path(leftover)
    return removed


# ----------------------------------------------------------------------------------------------
# Stop record: what `finetune train` reads to say "preempted, checkpoint saved"


def write_stop_record(run_dir: Path, step: int, checkpoint: Optional[str], signal_name: str) -> None:
    record = {"step": step, "checkpoint": checkpoint, "signal": signal_name,
              "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    write_atomic(Path(run_dir) / STOP_RECORD, json.dumps(record, indent=1) + "\n")


def read_stop_record(run_dir: Path) -> Optional[dict[str, Any]]:
    try:
        record = json.loads((Path(run_dir) / STOP_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def clear_stop_record(run_dir: Path) -> None:
    try:
        (Path(run_dir) / STOP_RECORD).unlink()
    except OSError:
        pass


# ----------------------------------------------------------------------------------------------
# Resume or refuse: what `finetune train` decides about a run directory that is not empty


@dataclass
class ResumePlan:
    checkpoint: Optional[Checkpoint] = None  # resume from it
    join: bool = False  # another node of this multi-node run wrote the run directory: use it as it is
    error: Optional[str] = None
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    damaged: list[Checkpoint] = field(default_factory=list)  # newer than `checkpoint`, set aside before launch


def set_aside(checkpoint: Checkpoint) -> Path:
    """Move a damaged checkpoint out of the way (kept, hidden, for a look): nothing resumes from it or rotates it."""
    aside = damaged_name(checkpoint.path)
    remove_path(aside)  # a link there is removed, not followed (a rename onto it failed: "Not a directory")
    os.replace(checkpoint.path, aside)
    return aside


def plan_resume(run_dir: Path, resolved: dict[str, Any], world_size: Optional[int], nodes: int,
                resume: bool, force: bool, inspect=None) -> ResumePlan:
    """For a run directory holding a previous run of the same name (recipe.yaml), not --overwrite.

    `inspect(path)` (finetune.rundir.verify.inspect; None: the marker's file sizes only) looks inside the
    newest complete checkpoint: a damaged one is passed over for the previous one, saying so; one that
    pickles code is refused."""
    from finetune.rundir.format import FormatProblem, recorded_version

    run_dir = Path(run_dir)
    try:
        recorded_version(run_dir / RECIPE_FILE)  # a newer finetune's run directory: its files may mean other things
    except FormatProblem as exc:
        return ResumePlan(error=str(exc))
    checkpoints = list_checkpoints(run_dir)
    complete = [c for c in checkpoints if c.complete]
    damaged: list[Checkpoint] = []
    while inspect is not None and resume and complete:
        found = inspect(complete[-1].path)
        if found is None:
            break
        kind, why = found
        if kind == "unsafe":
            return ResumePlan(error=f"{complete[-1].path} cannot be resumed from: {why}. Remove that checkpoint "
                                    f"(or pass --overwrite to start over) if you did not put that there")
        damaged.append(replace(complete.pop(), problem=why))
    if damaged and not complete:
        shown = "; ".join(f"{c.name}: {c.problem}" for c in damaged)
        return ResumePlan(error=f"output directory {run_dir}: every complete checkpoint is damaged ({shown}); "
                                f"pass --overwrite to start over")
    old = read_resume_key(run_dir)
    changes, count_note = process_count_change(old, resume_fields(resolved, world_size)) if old is not None and world_size \
        else ([], None)
    finished = (run_dir / SUMMARY_FILE).is_file()
    where = f"output directory {run_dir}"
    plan = ResumePlan()
    if not complete:
        if nodes > 1 and old is not None and not changes and not finished and not checkpoints:
            plan.join = True
            plan.notes.append(f"{where}: written by another node of this run (same recipe); using it")
            return plan
        broken = "; ".join(f"{c.name}: {c.problem}" for c in checkpoints)
        if checkpoints:
            what = f"holds only incomplete checkpoints ({broken}), nothing to resume from"
        elif finished:
            what = f"holds a finished run ({SUMMARY_FILE}) and no checkpoint to continue from"
        else:
            what = "holds a previous run that saved no checkpoint"
        plan.error = f"{where} is not empty: it {what}; pass --overwrite to start over, or choose another --output-dir"
        return plan
    latest = complete[-1]
    if not resume:
        plan.error = (f"{where} holds checkpoints (newest: {latest.name}); run without --no-resume "
                      f"(training.resume: true) to continue from it, or pass --overwrite to start over")
        return plan
    if finished and not force:
        plan.error = (f"{where} holds a finished run ({SUMMARY_FILE}); pass --overwrite to train again from scratch, "
                      f"or --force-resume to continue training from {latest.name}")
        return plan
    if changes and not force:
        plan.error = (f"the recipe changed since {latest.name} in {run_dir} was written, so resuming would not "
                      f"continue the same run: {'; '.join(changes)}. "
                      + (f"{count_note[0].upper()}{count_note[1:]}; or pass" if count_note else "Pass")
                      + " --force-resume to resume anyway, or --overwrite to start over")
        return plan
    if count_note and not changes:
        plan.notes.append(count_note)
    plan.damaged = damaged
    for bad in damaged:
        plan.warnings.append(f"{bad.name} is damaged ({bad.problem}): it is set aside as "
                             f"{damaged_name(bad.path).name} and the run resumes from {latest.name}")
    if changes:
        plan.warnings.append(f"resuming from {latest.name} although the recipe changed (--force-resume): {'; '.join(changes)}")
    if old is None:
        plan.warnings.append(f"{where} has no {RESUME_KEY_FILE}: cannot check that the recipe is unchanged")
    for checkpoint in checkpoints:
        if not checkpoint.complete:
            plan.notes.append(f"{checkpoint.name} is incomplete ({checkpoint.problem}); it is ignored and removed")
    plan.checkpoint = latest
    plan.notes.append(f"resuming from {latest.name} (step {latest.step}) in {run_dir}")
    return plan


# ----------------------------------------------------------------------------------------------
# Disk space and disk errors


def folder_size(path: Path) -> int:
    total = 0
    for file in Path(path).rglob("*"):
        try:
            if file.is_file():
                total += file.stat().st_size
        except OSError:
            pass
    return total


def model_checkpoint_bytes(saved_parameters: int, trainable_parameters: int, dtype_bytes: int) -> int:
    """A first checkpoint's size before any exists: the saved weights twice (the adapter or model
    files, and the module states in DeepSpeed's shards) plus 12 bytes per trainable parameter
    (fp32 master copy, Adam's two moments)."""
    return 2 * saved_parameters * dtype_bytes + 12 * trainable_parameters


def space_needed(estimate: int) -> int:
    return int(estimate * SPACE_FACTOR) + SPACE_MARGIN


def free_bytes(path: Path) -> int:
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def space_problem(run_dir: Path, estimate: int, free: Optional[int] = None) -> Optional[str]:
    """A message when the disk under `run_dir` cannot take a checkpoint of about `estimate` bytes."""
    need = space_needed(estimate)
    free = free_bytes(run_dir) if free is None else free
    if free >= need:
        return None
    return (f"not enough free space for the next checkpoint in {run_dir}: about {gib_text(need)} needed "
            f"(checkpoint ~{gib_text(estimate)} + headroom), {gib_text(free)} free; free some space or point "
            f"--output-dir at a larger disk, then run the same command again to resume")


def mount_point(path: Path) -> str:
    """The mount point of the file system holding `path` (what a user frees space on)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        device = path.stat().st_dev
        while path != path.parent and path.parent.stat().st_dev == device:
            path = path.parent
    except OSError:
        pass
    return str(path)


_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


def disk_full_message(where: Path, then: str = "free some space, then run the same command again to resume") -> str:
    """The one line for a full disk: its mount point (what to free space on), the file being written, what next."""
    return f"no space left on {mount_point(Path(where))}: the output disk is full (writing {where}); {then}"


# How a full disk reads in a launcher's output (Python's OSError, C++'s strerror) when nobody could write more.
_FULL_TEXT = re.compile(r"No space left on device|Disk quota exceeded|\[Errno (28|122)\]")
_FULL_FILE = re.compile(r"(?:No space left on device|Disk quota exceeded): '([^']+)'")


def disk_full_in(text: str, run_dir: Path) -> Optional[str]:
    """disk_full_message when `text` (a launcher's output) says a write found the disk full, else None: the
    ranks' own one-line errors may not have reached their logs, which are on that disk too (issue 34)."""
    if not _FULL_TEXT.search(text):
        return None
    named = _FULL_FILE.findall(text)
    return disk_full_message(Path(named[-1]) if named else Path(run_dir))


def disk_error_message(exc: BaseException, run_dir: Path) -> Optional[str]:
    """One line for an error that means the output disk is full or read-only, else None.

    torch.save reports a full disk as RuntimeError ("... file write failed"), not as OSError."""
    code = getattr(exc, "errno", None)
    where = getattr(exc, "filename", None) or run_dir
    if code in _FULL:
        return disk_full_message(Path(where))
    if code == errno.EROFS:
        return f"the output disk is read-only (writing {where}): remount it read-write or choose another --output-dir"
    if code == errno.EACCES and isinstance(exc, OSError):
        return f"no permission to write {where}"
    if isinstance(exc, RuntimeError) and re.search(r"file write failed|unexpected pos|No space left", str(exc)):
        try:
            free = free_bytes(run_dir)
        except OSError:
            free = None
        if free is not None and free < SPACE_MARGIN:
            return (f"no space left on {mount_point(run_dir)}: the output disk is full ({gib_text(free)} free under "
                    f"{run_dir}); free some space, then run the same command again to resume")
        return f"writing a checkpoint under {run_dir} failed: {str(exc).splitlines()[0]}"
    return None
