"""What every command shares: one-line errors with exit codes, loading a recipe, checking a path argument.

Every command runs inside `handled`: a finetune.errors.FinetuneError raised anywhere below it ends the
command with its own lines on stderr and its exit code, so commands do not catch them one by one.

Heavy libraries (torch, deepspeed, transformers) are imported inside the commands that need them,
so `finetune --help`, `lint`, `render`, `schema` and `plan` start in a fraction of a second.
"""

from __future__ import annotations

import errno
import functools
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import List, Optional

import typer

from finetune.errors import FinetuneError

SET_HELP = "Override a recipe key, e.g. --set deepspeed.stage=3 (repeatable; the value is read as YAML)."


def fail(message: str, code: int = 1) -> "typer.Exit":
    """Print `error: message`; the exit to raise."""
    return exit_for(FinetuneError(message, exit_code=code))


def exit_for(exc: FinetuneError) -> "typer.Exit":
    for line in exc.lines():
        typer.echo(line, err=True)
    return typer.Exit(exc.exit_code)


def handled(command):
    """The command, with finetune's own errors mapped to their lines and exit code (the one place that does)."""
    @functools.wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except FinetuneError as exc:
            raise exit_for(exc) from None
    return run


def path_exists(path: Path, test=Path.exists) -> bool:
    """pathlib's exists()/is_file() raise on a name too long to stat; such a path is no file."""
    try:
        return test(path)
    except (OSError, ValueError):
        return False


def usable_path(option: str, path: Optional[Path]) -> None:
    """Exit 2 on a path no file system can hold (a component over 255 bytes), before anything stats it."""
    from finetune.recipe import plain_path

    if path is not None:
        try:
            plain_path(str(path))
        except ValueError as exc:
            raise fail(f"{option}: {exc}", 2) from None


def input_path(option: str, path: Path) -> None:
    """Exit 1 when `path`, or a file directly in the folder `path`, is a device, FIFO or socket (finetune.fsutil):
    the libraries a command hands a folder to open its files by name, and a FIFO would hold them forever."""
    from finetune.fsutil import special_problem

    problem = special_problem(path, option)
    if problem:
        raise fail(problem)


def input_file(option: str, path: Path) -> None:
    """Exit 1 unless `path` is a regular file: a device, FIFO or socket is named as such (finetune.fsutil), before
    anything opens it."""
    from finetune.fsutil import special_kind

    kind = special_kind(path)
    if kind:
        raise fail(f"{option} {path}: {kind}, not a regular file")
    if not path_exists(path, Path.is_file):
        raise fail(f"{option} {path}: no such file")


def load_or_exit(recipe: Path, overrides: Optional[List[str]]):
    """Load a recipe; its RecipeProblem (every problem, file:line:col) ends the command with exit 1."""
    from finetune.models.attention import default_attention
    from finetune.recipe import load_recipe

    return default_attention(load_recipe(recipe, overrides or []))


def shard_size_or_exit(text: str) -> int:
    """--max-shard-size in bytes ("5GB", "500MB", a number); exit 2 on anything else."""
    from finetune.recipe import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise fail(f"--max-shard-size: {exc}", 2) from None


@contextmanager
def write_errors(command: str, output: Path):
    """The one-line failures of merge and convert: SIGTERM (exit 143, the partial output already removed),
    bad input, and a write that fails."""
    from finetune.weights.sigterm import Terminated

    try:
        yield
    except Terminated:
        raise fail(f"{command} stopped by SIGTERM; the partial output was removed and {output} was not touched", 143) from None
    except FileExistsError as exc:
        raise fail(str(exc)) from None
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):  # the partial output is already removed: one line, which mount
            from finetune.rundir.checkpoint import disk_full_message

            raise fail(disk_full_message(Path(exc.filename or output), f"free some space, then run {command} again "
                                         f"({output} was not changed)")) from None
        raise fail(f"cannot write {output}: {exc.strerror or exc}") from None


@contextmanager
def write_progress(description: str):
    """(log, on_write) for merge and convert: a live bar of bytes written when stderr (where their lines
    go) is a terminal, the plain lines on stderr and no bar otherwise."""
    from finetune.run import progress
    if not progress.wanted(sys.stderr):
        yield (lambda line: typer.echo(line, err=True)), None
        return
    with progress.WriteDisplay(description) as display:
        yield display.log, display.update
