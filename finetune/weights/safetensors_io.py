"""Safetensors I/O shared by merge and convert: header reading, streaming shard writing, sharding, the index,
disk-space checks, tokenizer copies. Their error is finetune.weights.errors.MergeError, their SIGTERM handling
finetune.weights.sigterm."""

from __future__ import annotations

import errno
import json
import math
import mmap
import os
import re
import shutil
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

import numpy as np
import torch
from safetensors import safe_open

from finetune.fsutil import read_json as read_whole_json, remove_stale_partials, write_atomic
from finetune.recipe.references import MODEL_CONFIG
from finetune.rundir.names import ADAPTER_CONFIG, ADAPTER_WEIGHTS, MERGED_RECIPE
from finetune.vision_models import PROCESSOR_FILES
from finetune.units import human_size
from finetune.weights.errors import MergeError

INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # "5GB", save_pretrained's default

# Files copied next to the merged weights. Tokenizer files come from the adapter (or run) directory
# when training saved a tokenizer there (it may have added tokens or a chat template), else from the base.
CONFIG_FILES = (MODEL_CONFIG, "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt", "merges.txt",
    "chat_template.jinja", "chat_template.json", *PROCESSOR_FILES,  # a VLM's processor settings, as trained
)
TOKENIZER_DIRS = ("additional_chat_templates",)

# What `finetune merge` and `finetune convert` write into an output folder; --overwrite replaces only a folder
# holding nothing else (issue 34: only what finetune wrote is replaced, never a folder of the user's).
OUTPUT_FILES = frozenset((INDEX_NAME, *CONFIG_FILES, *TOKENIZER_FILES, *TOKENIZER_DIRS, MERGED_RECIPE, ADAPTER_CONFIG,
                          *ADAPTER_WEIGHTS))
_SHARD_NAME = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")


def not_replaceable(output: Path) -> Optional[str]:
    """Why --overwrite must not replace the existing folder `output` (files merge and convert never write), or None."""
    try:
        names = sorted(p.name for p in Path(output).iterdir())
    except OSError as exc:
        return f"{output}: cannot read it ({exc.strerror or exc})"
    foreign = [name for name in names if name not in OUTPUT_FILES and not _SHARD_NAME.fullmatch(name)]
    if not foreign:
        return None
    shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
    return (f"{output} holds {shown}, which merge and convert never write: --overwrite only replaces a model or "
            "adapter folder they wrote; choose another -o")


DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float32": torch.float32, "fp32": torch.float32}

# safetensors dtype names <-> torch (the subset a language model checkpoint holds).
ST_TO_TORCH = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("U16", "uint16"),
                     ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _attr):
        ST_TO_TORCH[_name] = getattr(torch, _attr)
TORCH_TO_ST = {v: k for k, v in ST_TO_TORCH.items()}


def read_json(path: Path) -> dict:
    try:
        data = read_whole_json(path)  # a FIFO or a device there is refused, not read; a file read with a cap
    except FileNotFoundError:
        raise MergeError(f"{path}: missing") from None
    except (OSError, ValueError) as exc:
        raise MergeError(f"{path}: not valid JSON ({exc})" if isinstance(exc, ValueError) else str(exc)) from None
    if not isinstance(data, dict):
        raise MergeError(f"{path}: expected a JSON object")
    return data


# ------------------------------------------------------------------------------------------------
# The base model: names, dtypes and shapes of every tensor, read from the shard headers only


@dataclass
class BaseTensor:
    name: str
    file: Path
    dtype: str  # safetensors name, e.g. BF16
    shape: tuple


@dataclass
class BaseModel:
    path: Path
    config: dict
    tensors: dict[str, BaseTensor]  # in reading order: shard by shard

    @property
    def tied_embeddings(self) -> bool:
        text = self.config.get("text_config") if isinstance(self.config.get("text_config"), dict) else {}
        return bool(self.config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))


def read_base(path: Path) -> BaseModel:
    config = read_json(path / MODEL_CONFIG)
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?")
        raise MergeError(f"{path}: the base is quantized ({method}); merge needs the 16/32-bit base "
                         "(for QLoRA: the original model the 4-bit one was made from)")
    index = path / INDEX_NAME
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise MergeError(f"{index}: no weight_map")
        files = sorted(set(weight_map.values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        other = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        hint = f" (found {', '.join(sorted(other)[:3])}: save it with safetensors first)" if other else ""
        raise MergeError(f"{path}: no model.safetensors or {INDEX_NAME}{hint}")
    tensors: dict[str, BaseTensor] = {}
    for name in files:
        file = path / name
        if not file.is_file():
            raise MergeError(f"{file}: listed in {INDEX_NAME} but missing")
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for key in handle.keys():
                    info = handle.get_slice(key)
                    tensors[key] = BaseTensor(key, file, info.get_dtype(), tuple(info.get_shape()))
        except MergeError:
            raise
        except Exception as exc:  # safetensors raises its own error types for truncated or corrupt files
            raise MergeError(f"{file}: not a readable safetensors file ({exc})") from None
    if not tensors:
        raise MergeError(f"{path}: the safetensors files hold no tensors")
    return BaseModel(path, config, tensors)


@dataclass
class OutTensor:
    name: str
    source: BaseTensor
    dtype: str  # output dtype (safetensors name)
    nbytes: int
    # finetune.weights.lora_math.LoraUpdate: typed loosely so that this I/O layer, which lora_math builds on, never imports it.
    update: Optional[Any] = None  # LoRA delta added to this weight
    bias_of: Optional[Any] = None  # lora_B.bias added to this bias
    replacement: Optional[torch.Tensor] = None


@dataclass
class Plan:
    tensors: list[OutTensor]
    shards: list[list[OutTensor]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
             "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def assign_shards(plan: Plan, max_shard_size: int) -> None:
    """Greedy split in reading order, like huggingface_hub's split_torch_state_dict_into_shards:
    a shard closes when the next tensor would push it past max_shard_size; a bigger tensor stands alone."""
    shards: list[list[OutTensor]] = [[]]
    size = 0
    for t in plan.tensors:
        if shards[-1] and size + t.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    plan.shards = shards


def shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


# ------------------------------------------------------------------------------------------------
# Writing safetensors one tensor at a time


_WRITEBACK_BYTES = 1 << 20

# Direct I/O (O_DIRECT) needs buffer addresses, file offsets and lengths that are multiples of the device's
# logical block size: 4096 covers 512- and 4096-byte blocks. 1 MiB per write: as fast as 2-8 MiB on the
# development box (dd oflag=direct: 1.2-1.4 GB/s at 1-8 MiB; a 1.1B merge's writer thread: 1.7-2.0 s
# with 1 MiB, 2.0-2.2 s with 8 MiB), and the smallest addition to the merge's anonymous memory.
_DIRECT_ALIGN = 4096
_DIRECT_BLOCK = 1 << 20


class OutputFile:
    """A file written front to back, through the page cache or, where the file system allows it, with
    direct I/O (O_DIRECT: the kernel copies straight from our buffer to the device).

    Why direct: a merge writes every byte once and never reads it back, and putting gigabytes into the page
    cache is what the merge spent most of its time on (on the 2-core development box, 1 GB of buffered
    writes cost 0.3-2.6 s of system time, varying from run to run; with O_DIRECT 0.1 s). It also keeps a
    70B merge from filling RAM with dirty pages (which evicts the base's cached pages and throttles every
    writer on the machine). DeepSpeed's FastPersist writes checkpoints the same way (aligned buffer, O_DIRECT).
    Bytes are gathered in an aligned block (1 MiB of anonymous memory) and written a block at a time; the
    last block is padded to the alignment and the file truncated to its real length. Where O_DIRECT is
    refused (tmpfs on older kernels, some FUSE and network file systems, macOS), at open or at the first
    write, the same bytes go through ordinary buffered writes."""

    def __init__(self, path: Path, direct: bool = False) -> None:
        self.path = path
        self.size = 0  # bytes handed to write() so far
        self.fd = -1
        self.block: Optional[mmap.mmap] = None
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(path, flags | os.O_DIRECT, 0o666)
                self.block = mmap.mmap(-1, _DIRECT_BLOCK)  # page-aligned anonymous memory
                self.view = np.frombuffer(self.block, dtype=np.uint8)
                self.filled = 0
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.fd = -1
        if self.fd < 0:
            self.fd = os.open(path, flags, 0o666)

    @property
    def direct(self) -> bool:
        return self.block is not None

    def write(self, data) -> None:
        """Append `data` (bytes or any contiguous buffer)."""
        source = np.frombuffer(data, dtype=np.uint8)
        self.size += source.size
        if not self.direct:
            self._write_all(memoryview(source))
            return
        done = 0
        while done < source.size:
            n = min(_DIRECT_BLOCK - self.filled, source.size - done)
            np.copyto(self.view[self.filled:self.filled + n], source[done:done + n])  # releases the GIL
            self.filled += n
            done += n
            if self.filled == _DIRECT_BLOCK:
                self._write_block(_DIRECT_BLOCK)
                if not self.direct:  # fell back while writing the block: the rest goes straight through
                    self.size -= source.size - done
                    self.write(source[done:])
                    return

    def _write_block(self, length: int) -> None:
        """Write the first `length` bytes of the block (a multiple of the alignment) with direct I/O."""
        failed: Optional[tuple[int, str]] = None
        try:
            self._write_all(memoryview(self.block)[:length])
        except OSError as exc:
            failed = (exc.errno, exc.strerror)
        # Out of the except clause: its traceback holds views of the block, which closing it needs gone (a full
        # disk raised here, then BufferError from close() replaced the one line with a traceback, issue 34).
        if failed is not None and failed[0] == errno.EINVAL:
            self._fall_back(length)
            return
        if failed is not None:
            raise OSError(failed[0], failed[1], str(self.path))
        self.filled = 0

    def _fall_back(self, length: int) -> None:
        """Direct writes refused (an alignment this device does not take): reopen buffered at the end of what
        was written (always a whole number of blocks), and write the block's bytes there."""
        written = os.lseek(self.fd, 0, os.SEEK_CUR)
        os.close(self.fd)
        self.fd = os.open(self.path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
        os.lseek(self.fd, written, os.SEEK_SET)
        block, self.block = self.block, None
        self._write_all(memoryview(block)[:min(length, self.filled)])
        del self.view
        block.close()

    def _write_all(self, data: memoryview) -> None:
        while len(data):
            data = data[os.write(self.fd, data):]

    def finish(self, sync: bool) -> None:
        """Write what is gathered (padded to the alignment, then truncated away), optionally fsync, and close."""
        if self.direct and self.filled:
            tail = self.filled
            padded = tail + (-tail % _DIRECT_ALIGN)
            self.view[tail:padded] = 0
            self._write_block(padded)
            if self.direct:
                os.ftruncate(self.fd, self.size)
        if sync:
            os.fsync(self.fd)
        self.close()

    def writeback(self, nbytes: int) -> None:
        """Start writing the last `nbytes` written to disk, and drop them from the page cache once clean
        (buffered files only: direct writes never enter the page cache)."""
        if not self.direct and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, self.size - nbytes, nbytes, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        """Close without writing what is gathered (on errors: the partial file is removed by the caller)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.block is not None:
            del self.view
            self.block.close()
            self.block = None


class ShardWriter:
    """Writes a safetensors file whose header (names, dtypes, shapes, offsets) is known up front, then
    each tensor's bytes as it is produced. The format: 8-byte little-endian header length, the JSON
    header padded with spaces to a multiple of 8, then the tensors' bytes back to back.
    direct: write with direct I/O where the file system allows it (OutputFile)."""

    def __init__(self, path: Path, tensors: list[OutTensor], early_writeback: bool = False, direct: bool = False):
        if sys.byteorder != "little":
            raise MergeError("safetensors files are little-endian; this machine is not")
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for t in tensors:
            header[t.name] = {"dtype": t.dtype, "shape": list(t.source.shape), "data_offsets": [offset, offset + t.nbytes]}
            offset += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        self.path = path
        self.expected = [(t.name, t.nbytes) for t in tensors]
        self.position = 0
        self.early_writeback = early_writeback
        self.file = OutputFile(path, direct=direct)
        self.file.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want_name, want_bytes = self.expected[self.position]
        data = tensor.contiguous().reshape(-1).view(torch.uint8)
        if name != want_name or data.numel() != want_bytes:
            raise RuntimeError(f"internal error: wrote {name} ({data.numel()} bytes), header says {want_name} ({want_bytes})")
        self.file.write(data.numpy())  # the tensor's own memory, no bytes copy
        self.position += 1
        if self.early_writeback and want_bytes >= _WRITEBACK_BYTES:
            # Start writing this tensor to disk now (Linux starts writeback of dirty pages on DONTNEED, and
            # drops them from the page cache once clean), so that the disk works while the next tensors are
            # computed and the fsync at the end has little left to wait for.
            self.file.writeback(want_bytes)

    def close(self, sync: bool = True) -> None:
        if self.position != len(self.expected):
            raise RuntimeError(f"internal error: {self.path} got {self.position} of {len(self.expected)} tensors")
        self.file.finish(sync)

    def abort(self) -> None:
        """Close the file without finishing it (the caller removes the partial output)."""
        self.file.close()


class TensorReader:
    """One base shard open at a time (safe_open maps the file; tensors come out as views of the mapping)."""

    def __init__(self) -> None:
        self.file: Optional[Path] = None
        self.handle = None

    def get(self, file: Path, name: str) -> torch.Tensor:
        if file != self.file:
            self.close()
            self.handle = safe_open(str(file), framework="pt", device="cpu").__enter__()
            self.file = file
        return self.handle.get_tensor(name)

    def close(self) -> None:
        if self.handle is not None:
            self.handle.__exit__(None, None, None)
        self.handle, self.file = None, None


class Written(NamedTuple):
    """How far a merge or convert is: bytes and tensors written so far, out of the totals."""
    bytes: int
    tensors: int
    total_bytes: int
    total_tensors: int


OnWrite = Callable[[Written], None]


class WriteCounter:
    """Counts the tensors written and reports the running totals to an optional callback."""

    def __init__(self, total_bytes: int, total_tensors: int, on_write: Optional[OnWrite]) -> None:
        self.done = Written(0, 0, total_bytes, total_tensors)
        self.on_write = on_write

    def add(self, nbytes: int, tensors: int = 1) -> None:
        self.done = self.done._replace(bytes=self.done.bytes + nbytes, tensors=self.done.tensors + tensors)
        if self.on_write is not None:
            self.on_write(self.done)


def check_disk_space(output: Path, need: int) -> None:
    """Refuse before writing when the output's filesystem cannot hold the merged model."""
    probe = output.parent.resolve()
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    need = int(need * 1.01) + 64 * 2**20  # headers, config and tokenizer files, some slack
    if free < need:
        raise MergeError(f"not enough disk space in {probe}: the merged model needs {human_size(need)}, {human_size(free)} free")


def prepare_output(output: Path, need: int, log: Callable[[str], None]) -> None:
    """Before writing about `need` bytes into `output`: refuse when its disk cannot take them, and clear
    what an interrupted earlier write of this host left beside it (fsutil.remove_stale_partials)."""
    for line in remove_stale_partials(output):  # first: what it frees counts for the space check
        log(line)
    check_disk_space(output, need)


def prepare_shards(plan: Plan, output: Path, max_shard_size: int, log: Callable[[str], None]) -> list[str]:
    """Cut `plan` into shards of at most `max_shard_size` bytes and prepare_output for them; the shard file names."""
    assign_shards(plan, max_shard_size)
    prepare_output(output, plan.total_bytes, log)
    return shard_names(len(plan.shards))


def write_index(tmp: Path, plan: Plan, names: list[str]) -> None:
    weight_map = {t.name: name for name, shard in zip(names, plan.shards) for t in shard}
    index = {
        "metadata": {"total_parameters": sum(math.prod(t.source.shape) for t in plan.tensors),
                     "total_size": plan.total_bytes},
        "weight_map": dict(sorted(weight_map.items())),
    }
    write_atomic(tmp / INDEX_NAME, json.dumps(index, indent=2) + "\n")


def copy_tokenizer(sources: list[Path], out: Path) -> bool:
    """Tokenizer files and chat template from the first of `sources` that holds a tokenizer."""
    for source in sources:
        if (source / "tokenizer_config.json").is_file() or (source / "tokenizer.json").is_file():
            for name in TOKENIZER_FILES:
                if (source / name).is_file():
                    shutil.copy2(source / name, out / name)
            for name in TOKENIZER_DIRS:
                if (source / name).is_dir():
                    shutil.copytree(source / name, out / name)
            return True
    return False
