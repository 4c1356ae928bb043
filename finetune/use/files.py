"""The files of a model or adapter directory, checked before transformers and PEFT load them, so that
`finetune chat` and `finetune eval` on a corrupt or foreign directory print one line naming the file
(as `finetune merge` does, with the same readers: finetune.weights.safetensors_io.read_json, the
safetensors headers, finetune.rundir.verify's pickle scan) instead of a library's traceback.

Only what is cheap is read: the JSON files whole, the safetensors headers, the pickles' opcodes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, TypeVar

from finetune.errors import FinetuneError
from finetune.recipe.references import MODEL_CONFIG, require_model_dir
from finetune.rundir.names import ADAPTER_CONFIG
from finetune.rundir.adapter import adapter_weights

T = TypeVar("T")


class FileProblem(FinetuneError):
    """A file of a model or adapter directory that cannot be loaded (the message names it)."""


def check_model_dir(path: Path) -> None:
    """A local model directory: no device, FIFO or socket among its files, config.json a JSON object, weights
    readable (headers), pickles plain."""
    _regular_files(path)
    require_model_dir(path)
    _json_object(path / MODEL_CONFIG)
    _check_weights(sorted(path.glob("*.safetensors")), sorted(p for p in path.glob("*.bin") if p.name.startswith(("pytorch_model", "model"))))


def check_adapter_dir(path: Path) -> None:
    """A whole adapter directory (finetune.rundir.adapter.adapter_weights), then its files as check_model_dir."""
    _regular_files(path)
    weights = adapter_weights(path)
    config = _json_object(path / ADAPTER_CONFIG)
    if not isinstance(config.get("peft_type"), str):
        raise FileProblem(f"{path / ADAPTER_CONFIG}: peft_type {config.get('peft_type')!r} is not a PEFT adapter type")
    _check_weights(*(([weights], []) if weights.suffix == ".safetensors" else ([], [weights])))


def check_tokenizer_dir(path: Path, error: Callable[[str], Exception]) -> None:
    """No device, FIFO or socket among a tokenizer folder's files (AutoTokenizer would open it and wait)."""
    try:
        _regular_files(path)
    except FileProblem as exc:
        raise error(str(exc)) from None


def _regular_files(path: Path) -> None:
    from finetune.fsutil import SpecialFile, refuse_special

    try:
        refuse_special(path)
    except SpecialFile as exc:
        raise FileProblem(str(exc)) from None


def _json_object(path: Path) -> dict:
    from finetune.weights.errors import MergeError
    from finetune.weights.safetensors_io import read_json

    try:
        return read_json(path)
    except MergeError as exc:
        raise FileProblem(str(exc)) from None


def _check_weights(safetensors: list[Path], pickles: list[Path]) -> None:
    from finetune.rundir.verify import foreign_globals, safetensors_damage

    for file in safetensors:
        problem = safetensors_damage(file)
        if problem:
            raise FileProblem(f"{file}: {problem}")
    if safetensors:
        return  # transformers and PEFT prefer the safetensors files and never open the pickles
    for file in pickles:
        try:
            foreign = foreign_globals(file, allowed=())
        except ValueError as exc:
            raise FileProblem(str(exc)) from None
        if foreign:
            raise FileProblem(f"{file}: refused to load: it pickles {', '.join(foreign)}, which model weights never "
                              "hold; unpickling it could run code")


def loading(what: str, action: Callable[[], T], error: Callable[[str], Exception]) -> T:
    """Run a library's loader; any exception becomes one line naming `what` (the file checks above name
    the common cases precisely; this is the net for the rest: a config with values of the wrong type, ...)."""
    try:
        return action()
    except Exception as exc:  # transformers/PEFT/safetensors raise dozens of types for bad files
        raise error(f"cannot load {what}: {_one_line(exc)}") from None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    name = type(exc).__name__
    text = text if text.startswith(name) or isinstance(exc, (OSError, ValueError)) else f"{name}: {text}"
    return text[:400] + ("..." if len(text) > 400 else "")
