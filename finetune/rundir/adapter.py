"""Is this folder a PEFT adapter, and where is a run's? The one check chat, eval, merge, export, publish and
`model.adapter` make (issue 39): `adapter_weights` for a whole adapter directory (NotAnAdapter names what is
missing), `find_adapter` for RUN/adapter or the folder itself, `adapter_problem` for what training can continue.

No torch, no pydantic at import time: lint imports this.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from finetune.recipe.references import is_model_dir
from finetune.rundir.errors import RunDirError
from finetune.rundir.names import ADAPTER_CONFIG, ADAPTER_DIR, ADAPTER_WEIGHTS, MODEL_DIR


def find_adapter(path: Union[str, Path]) -> Optional[Path]:
    """The PEFT adapter in PATH/adapter (a run directory) or PATH itself (an adapter directory), or None."""
    path = Path(path).expanduser()
    for candidate in (path / ADAPTER_DIR, path):
        if (candidate / ADAPTER_CONFIG).is_file():
            return candidate
    return None


def no_adapter_message(path: Union[str, Path]) -> str:
    """Why `path` holds no adapter: the one sentence every command prints."""
    path = Path(path).expanduser()
    return f"no {ADAPTER_CONFIG} in {path} or {path / ADAPTER_DIR}"


class NotAnAdapter(RunDirError):
    """A folder given as a PEFT adapter that is not one, or not a whole one: `adapter_weights`'s message."""


def adapter_weights(path: Union[str, Path]) -> Path:
    """The weights file of the adapter directory PATH (what makes it a whole adapter), or NotAnAdapter naming what
    is missing: the one check of chat, eval, merge, export and publish."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise NotAnAdapter(f"{path}: no such adapter directory")
    if not (path / ADAPTER_CONFIG).is_file():
        raise NotAnAdapter(f"{path}: no {ADAPTER_CONFIG} (not a PEFT adapter directory)")
    for name in ADAPTER_WEIGHTS:
        if (path / name).is_file():
            return path / name
    raise NotAnAdapter(f"{path}: no {ADAPTER_WEIGHTS[0]} (or {ADAPTER_WEIGHTS[1]}): an incomplete adapter")


def adapter_problem(reference: str) -> Optional[str]:
    """Why model.adapter (an SFT run directory or an adapter directory) cannot be continued from, or None."""
    if find_adapter(reference) is not None:
        return None
    path = Path(reference).expanduser()
    if (path / MODEL_DIR).is_dir() or is_model_dir(path):
        return ("holds full weights, not an adapter: continue a full fine-tune through model.name_or_path "
                "(and method: full)")
    return f"{no_adapter_message(reference)} (give an SFT run directory or an adapter directory)"
