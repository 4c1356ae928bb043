"""Commands we print for the user to type next, spelled so that they run as printed (issue 24).

The README's set-up installs into `.venv` without activating it, so `finetune` and `tensorboard` are
often not on PATH; and `open` is macOS only. Each hint names the program the way this shell can find
it: the bare name when PATH finds this environment's copy, else the path of the copy beside the
running interpreter, else `python -m`.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path
from typing import Optional


def _same_file(a: str, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def program(name: str, module: Optional[str] = None) -> str:
    """How to call console script `name` of this environment from the user's shell.

    `name` when PATH finds this environment's script (an activated venv, a global install); the
    script's absolute path when it sits beside sys.executable but PATH does not reach it (or reaches
    another install); `python -m module` when there is no script at all (a source checkout).
    """
    # sys.executable is not resolved: a venv's python is a symlink, and resolving it leaves the venv.
    own = Path(sys.executable).absolute().parent / name
    found = shutil.which(name)
    if found and (not own.is_file() or _same_file(found, own)):
        return name
    if own.is_file() and os.access(own, os.X_OK):
        return str(own)
    if found:
        return name
    return f"{sys.executable} -m {module or name}"


def finetune() -> str:
    """`finetune`, or the path that runs it here (see program)."""
    return program("finetune", "finetune.cli")


def tensorboard() -> str:
    """`tensorboard`, or the path that runs it here (see program)."""
    return program("tensorboard", "tensorboard.main")


def open_file(path: Path) -> Optional[str]:
    """The command that opens `path` in the desktop's viewer, or None where there is none (a server:
    print the path itself). `open` is macOS's; Linux desktops have xdg-open, which on a server without a
    display (no DISPLAY, no WAYLAND_DISPLAY: an ssh session) is installed but opens nothing (issue 34)."""
    from finetune.rundir.run_dir import command_line  # the path shell-quoted (a run named `$(...)`, issue 25)

    if sys.platform == "darwin":
        return command_line("open", path)
    if sys.platform.startswith("win"):
        return f'start "" "{path}"'
    has_display = bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))
    return command_line("xdg-open", path) if has_display and shutil.which("xdg-open") else None


def runnable(text: str) -> str:
    """`text` (a fix line) with its `pip install` spelled as this environment's pip: the system's
    pip would install into another Python."""
    pip = program("pip")
    return text if pip == "pip" else re.sub(r"(?<![\w/.-])pip install\b", f"{pip} install", text)
