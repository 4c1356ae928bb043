"""What is inside a checkpoint, checked before anything loads it: the pickles, the JSON, the tensor headers.

Two promises (issue 25):
- resuming never unpickles code. DeepSpeed's checkpoint engine loads `global_step<N>/*.pt` with
  torch.load(weights_only=False) (deepspeed/runtime/checkpoint_engine/torch_checkpoint_engine.py), so a
  file there that names `os.system` would run it in every rank. Every pickle of the checkpoint is read
  opcode by opcode first (torch.serialization.get_unsafe_globals_in_checkpoint executes nothing) and
  refused when it names a global outside DEEPSPEED_GLOBALS, the allow-list `finetune convert` loads with.
  The Trainer's own files (rng_state_<rank>.pth, scheduler.pt) load with weights_only=True and the
  numpy globals of transformers.trainer_pt_utils.safe_globals, so those globals are allowed there too.
- nothing is loaded through a link that leaves the checkpoint (issue 34). DeepSpeed opens
  `os.path.join(checkpoint, tag, name)` for a tag read from `latest` (or `latest_universal`), so an absolute
  tag, a `..` in it, a `global_step<N>` folder or a shard that is a link to somewhere else would make it
  unpickle a file the scan never saw. `links_outside` refuses all of them before anything is unpickled;
  the scan then reads every file the loaders can reach, since they all lie inside.
- a corrupt newest checkpoint (same-size garbage the COMPLETE marker's sizes cannot see) is found
  before launch, so `finetune train` falls back to the previous complete one instead of failing on
  every rerun (finetune.rundir.checkpoint.plan_resume).

torch is imported inside the functions (only `finetune train`, which has it, calls them).
"""

from __future__ import annotations

import json
import os
import struct
import zipfile
from pathlib import Path
from typing import Optional

from finetune.errors import FinetuneError

# The classes DeepSpeed pickles into ZeRO checkpoints beside tensors and plain containers. Found by
# listing the globals of the ZeRO-1/2/3 LoRA and full checkpoints tests/weights/merge_fixtures.py trains
# (torch.serialization.get_unsafe_globals_in_checkpoint); DynamicLossScaler is what fp16 runs store
# where bf16 runs store LossScaler (the optimizers' state_dict saves `self.loss_scaler`).
DEEPSPEED_GLOBALS = (
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
# What the Trainer's RNG states hold (numpy's random state: an ndarray of uint32), allowed by
# transformers.trainer_pt_utils.safe_globals for its weights_only loads. Spelled for numpy 1 and 2.
NUMPY_GLOBALS = tuple(f"{core}.{name}" for core in ("numpy.core.multiarray", "numpy._core.multiarray")
                      for name in ("_reconstruct", "scalar")) + (
    "numpy.ndarray", "numpy.dtype", "numpy.dtypes.UInt32DType", "numpy.dtypes.Float64DType",
    "numpy.dtypes.Int64DType",
)
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl")
# Pickles in a checkpoint that nothing loads when resuming (the Trainer writes its arguments beside the
# weights; finetune reads training_args.json instead): never unpickled, so not refused, but still named
# when they hold code.
NEVER_LOADED = ("training_args.bin",)


class UnsafeCheckpoint(FinetuneError):
    """A checkpoint file pickles a global outside the allow-list (the message names the file and the global)."""


def foreign_globals(path: Path, allowed: tuple[str, ...] = DEEPSPEED_GLOBALS) -> list[str]:
    """The globals `path` (a torch.save zip) names that `allowed` does not list; ValueError when unreadable."""
    import torch

    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except Exception as exc:  # not a torch.save zip, truncated, unreadable
        raise ValueError(f"{path}: cannot read ({' '.join(str(exc).split())[:300]})") from None
    return [name for name in unsafe if name not in allowed]


def refuse_foreign_globals(path: Path, allowed: tuple[str, ...] = DEEPSPEED_GLOBALS) -> None:
    foreign = foreign_globals(path, allowed)
    if foreign:
        raise UnsafeCheckpoint(f"{path}: refused to load: it pickles {', '.join(foreign)}, which DeepSpeed "
                               "checkpoints never hold; unpickling it could run code")


LATEST_FILES = ("latest", "latest_universal")  # where DeepSpeed's load_checkpoint reads its tag (engine.py)


def inside(path: Path, folder: Path) -> bool:
    """Whether `path`, every link followed, lies in `folder` (itself followed)."""
    real, root = os.path.realpath(path), os.path.realpath(folder)
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


def links_outside(folder: Path) -> Optional[str]:
    """Why a loader opening files under `folder` could read one outside it, or None: a link (a folder, a
    shard, `latest` itself) leading out, or a `latest` naming a tag outside (absolute, `..`, a link)."""
    folder = Path(folder)
    for root, dirs, files in os.walk(folder):  # links to folders are listed, not descended into
        for name in dirs + files:
            path = Path(root) / name
            if path.is_symlink() and not inside(path, folder):
                return f"{path} is a link to {os.path.realpath(path)}, outside {folder}"
    for name in LATEST_FILES:
        try:
            read_tag(folder, name)
        except UnsafeCheckpoint as exc:
            return str(exc)
    return None


def read_tag(folder: Path, name: str = "latest") -> Optional[str]:
    """The tag DeepSpeed reads from `folder/name` (None without that file); UnsafeCheckpoint when the folder
    it names is not inside `folder`."""
    latest = Path(folder) / name
    if not latest.is_file():
        return None
    tag = latest.read_text(encoding="utf-8", errors="replace").strip()
    if tag and not inside(Path(folder) / tag, folder):
        raise UnsafeCheckpoint(f"{latest} names {tag[:200]!r}, which is outside {folder}; DeepSpeed would load "
                               "whatever is there")
    return tag


def pickle_files(checkpoint: Path) -> list[Path]:
    return sorted(p for p in Path(checkpoint).rglob("*") if p.suffix in PICKLE_SUFFIXES and p.is_file())


def scan_pickles(checkpoint: Path) -> None:
    """UnsafeCheckpoint for the first pickle that names a foreign global; ValueError for an unreadable one."""
    for path in pickle_files(checkpoint):
        if path.name in NEVER_LOADED:
            continue
        in_deepspeed_dir = path.parent != Path(checkpoint)
        refuse_foreign_globals(path, DEEPSPEED_GLOBALS if in_deepspeed_dir else DEEPSPEED_GLOBALS + NUMPY_GLOBALS)


def damage(checkpoint: Path) -> Optional[str]:
    """Why a complete-looking checkpoint cannot be loaded (a file that does not parse), or None.

    Reads what is cheap to read: every JSON file whole, the header of every safetensors file, the zip
    directory of every torch.save file, DeepSpeed's `latest`. The tensors' bytes are not read."""
    checkpoint = Path(checkpoint)
    for path in sorted(checkpoint.rglob("*")):
        if not path.is_file():
            continue
        try:
            problem = _file_damage(path)
        except OSError as exc:
            problem = exc.strerror or str(exc)
        if problem:
            return f"{path.relative_to(checkpoint)}: {problem}"
    tag = read_tag(checkpoint)
    if tag is not None and not (checkpoint / tag).is_dir():
        return f"latest names {tag[:80]!r}, which is not a folder there"
    return None


def _file_damage(path: Path) -> Optional[str]:
    if path.suffix == ".json":
        try:
            json.loads(path.read_bytes())
        except ValueError as exc:
            return f"not valid JSON ({exc})"
    elif path.suffix == ".safetensors":
        return safetensors_damage(path)
    elif path.suffix in PICKLE_SUFFIXES:
        try:
            with zipfile.ZipFile(path) as archive:
                if not any(name.endswith("data.pkl") for name in archive.namelist()):
                    return "not a torch.save file (no data.pkl)"
        except zipfile.BadZipFile as exc:
            return f"not a torch.save file ({exc})"
    return None


def safetensors_damage(path: Path) -> Optional[str]:
    """Why a safetensors file cannot be opened (header length, header JSON, data shorter than it says), or None."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            return "truncated safetensors file (no header)"
        (length,) = struct.unpack("<Q", head)
        if length > size - 8 or length > 100 * 2**20:
            return f"safetensors header of {length} bytes in a {size}-byte file"
        try:
            header = json.loads(handle.read(length))
        except ValueError as exc:
            return f"unreadable safetensors header ({exc})"
    if not isinstance(header, dict):
        return "unreadable safetensors header (not an object)"
    end = max((v["data_offsets"][1] for k, v in header.items()
               if k != "__metadata__" and isinstance(v, dict) and isinstance(v.get("data_offsets"), list)
               and len(v["data_offsets"]) == 2 and isinstance(v["data_offsets"][1], int)), default=0)
    if 8 + length + end > size:
        return f"truncated safetensors file ({size} bytes, its header needs {8 + length + end})"
    return None


def inspect(checkpoint: Path) -> Optional[tuple[str, str]]:
    """("unsafe" | "damaged", why) for a complete-looking checkpoint that must not be resumed from, or None.

    `checkpoint` is a run directory's `checkpoint-<N>`: it may not lead out of the run directory either."""
    checkpoint = Path(checkpoint)
    if checkpoint.is_symlink() and not inside(checkpoint, checkpoint.parent):
        return "unsafe", f"{checkpoint} is a link to {os.path.realpath(checkpoint)}, outside the run directory {checkpoint.parent}"
    escape = links_outside(checkpoint)
    if escape:
        return "unsafe", f"{escape} (nothing is loaded through a link that leaves the checkpoint)"
    problem = damage(checkpoint)
    if problem:
        return "damaged", problem
    try:
        scan_pickles(checkpoint)
    except UnsafeCheckpoint as exc:
        return "unsafe", str(exc)
    except ValueError as exc:
        return "damaged", str(exc)
    except ImportError:
        return None  # no torch here: training cannot start either, and the environment check says why
    return None
