"""Streaming LoRA merge: base safetensors + PEFT LoRA adapter -> merged, sharded safetensors.

PEFT's `merge_and_unload` (and the tools built on it) needs the whole model in memory. This merge
reads the base shards tensor by tensor with safetensors (memory-mapped: file pages, not allocations),
computes W + scale * B @ A the way PEFT does, and streams each result into an output shard whose
header was written up front (every name, dtype and shape is known before the first byte of data, so
nothing is buffered), with direct I/O where the file system allows it (safetensors_io.OutputFile says
why). What it allocates is scratch space for the largest adapted layer (float32 B @ A, two output
buffers) and a 1 MiB write block; a float32 adapter (as PEFT saves it) stays memory-mapped. Peak
anonymous memory of the whole process (torch included), measured by scripts/bench_merge.py: 0.24 GiB
for a 1.1B model, 0.59 GiB for an 8B one (Llama-3-8B's shape); about 3 GiB estimated for a 70B one
with a rank-16 adapter on every linear layer (140 GB of weights). The output is bit-identical to PEFT's
`merge_and_unload()` followed by `save_pretrained()`; tests/weights/test_merge.py checks that with torch.equal.

    $ finetune merge runs/llama3-8b-qlora -o merged/llama3-8b-qlora
    $ finetune merge --base ~/models/Meta-Llama-3-8B-Instruct --adapter runs/x/adapter -o merged/x --verify

Only torch and safetensors are imported here (transformers and peft only for --verify), so the
merge process stays small: see scripts/bench_merge.py for time and memory against PEFT.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from finetune.fsutil import atomic_dir, write_atomic
from finetune.rundir.names import FORMAT_FILE, MERGED_FORMAT
from finetune.rundir.names import MERGED_RECIPE
from finetune.rundir.run_dir import RunDir
from finetune.weights.experts import expert_slices
from finetune.weights.lora_math import (Adapter, LoraUpdate, Workspace, orient_update, output_tensor, read_adapter, target_name,
                                tied_embedding)
from finetune.weights.errors import MergeError
from finetune.weights.safetensors_io import (CONFIG_FILES, DEFAULT_MAX_SHARD_SIZE, DTYPES, TORCH_TO_ST, BaseModel,
                                     ITEMSIZE, OnWrite, OutTensor, Plan, ShardWriter, TensorReader, WriteCounter,
                                     copy_tokenizer, not_replaceable, prepare_shards, read_base, write_index)
from finetune.weights.sigterm import sigterm_as_interrupt
from finetune.units import human_size
from finetune.recipe.references import MODEL_CONFIG


# ------------------------------------------------------------------------------------------------
# Planning: every output tensor, its dtype and what happens to it, checked before anything is written


def plan_merge(base: BaseModel, adapter: Adapter, dtype: Optional[torch.dtype]) -> Plan:
    """Match every adapter tensor to a base tensor, check shapes, and fix each output's dtype and size."""
    problems: list[str] = []
    warnings: list[str] = []
    targets: dict = {}  # base tensor name -> LoraUpdate, or experts.ExpertSlice (LoRA on fused experts)
    fam = _family(base)
    for update in adapter.experts.values():
        slices, trouble = expert_slices(update, base.tensors, fam)
        targets.update(slices)
        problems += trouble
    for module, update in adapter.updates.items():
        name = target_name(base, (fam.checkpoint_path(module) if fam else module) + ".weight")
        if name is None:
            problems.append(f"LoRA layer {module} matches no base tensor ({module}.weight)")
            continue
        if not orient_update(update, base.tensors[name].shape, adapter.config):
            problems.append(f"LoRA layer {module} makes a {update.delta_shape()} update but the base "
                            f"{name} is {base.tensors[name].shape}")
            continue
        if name in targets:
            problems.append(f"LoRA layers {targets[name].module} and {module} both update {name} "
                            "(tied embeddings: untie them before training)")
            continue
        if name == tied_embedding(base):
            # PEFT merges into the shared tensor too (with its own warning): the update reaches both the input
            # embeddings and the output head, while training applied it to one of them only.
            warnings.append(f"LoRA layer {module} updates {name}, which the base shares between the input "
                            "embeddings and the output head: the merged update changes both (as PEFT's merge does)")
        targets[name] = update
    biases: dict[str, LoraUpdate] = {}
    for update in adapter.updates.values():
        if update.bias is not None:
            name = update.module + ".bias"
            if name not in base.tensors:
                problems.append(f"LoRA layer {update.module} has lora_B.bias but the base has no {name}")
            elif tuple(base.tensors[name].shape) != tuple(update.bias.shape):
                problems.append(f"lora_B.bias of {update.module} is {tuple(update.bias.shape)}, "
                                f"base {name} is {base.tensors[name].shape}")
            else:
                biases[name] = update
    replacements: dict[str, torch.Tensor] = {}
    tied = tied_embedding(base)
    for key, (tensor, whole_module) in adapter.replacements.items():
        name = target_name(base, key)
        if name is None:
            problems.append(f"adapter tensor {key} matches no base tensor")
        elif name == tied and whole_module:
            # modules_to_save trains a copy, so the head and the embeddings were untied during training;
            # a tied checkpoint cannot hold that (PEFT's save writes both and keeps tie_word_embeddings=true).
            problems.append(f"adapter trains {key} as a whole module, but the base ties the input embeddings "
                            "and the output head; untie them (tie_word_embeddings=false) before training")
        elif tuple(tensor.shape) != base.tensors[name].shape:
            problems.append(f"adapter tensor {key} is {tuple(tensor.shape)} but the base has "
                            f"{base.tensors[name].shape} (a resized vocabulary? resize the base first)")
        elif name in replacements and not torch.equal(replacements[name], tensor):
            # e.g. a tied head and embedding both saved, with different values: one would silently win
            problems.append(f"adapter holds two different values for {name}")
        else:
            replacements[name] = tensor
    if problems:
        arch = _architecture_hint(base, adapter)
        shown = problems[:5] + ([f"... and {len(problems) - 5} more"] if len(problems) > 5 else [])
        raise MergeError(f"adapter {adapter.path} does not fit base {base.path}{arch}:\n  " + "\n  ".join(shown))

    tensors = []
    for name, info in base.tensors.items():
        if info.dtype not in ITEMSIZE:
            raise MergeError(f"{info.file}: tensor {name} has dtype {info.dtype}, which merge does not handle")
        out_dtype = info.dtype
        if dtype is not None and info.dtype in ("F32", "F16", "BF16"):
            out_dtype = TORCH_TO_ST[dtype]
        nbytes = math.prod(info.shape) * ITEMSIZE[out_dtype]
        tensors.append(OutTensor(name, info, out_dtype, nbytes, targets.get(name), biases.get(name),
                                 replacements.get(name)))
    for t in tensors:
        if (t.update or t.bias_of or t.replacement is not None) and t.source.dtype not in ("F32", "F16", "BF16"):
            raise MergeError(f"{t.source.file}: {t.name} is {t.source.dtype}; merge needs a float base "
                             "(a quantized checkpoint cannot take a LoRA update)")
    return Plan(tensors, warnings=warnings)


def _family(base: BaseModel):
    """The base's model family (finetune.models): where its checkpoint keeps experts and routers."""
    from finetune.models.families import family

    return family(base.config.get("model_type"))


def _architecture_hint(base: BaseModel, adapter: Adapter) -> str:
    want = (adapter.config.get("auto_mapping") or {}).get("base_model_class")
    have = base.config.get("architectures") or []
    if want and have and want not in have:
        return f" (the adapter was trained on a {want}, the base is a {', '.join(have)})"
    return ""


def write_shards(plan: Plan, names: list[str], folder: Path, log: Callable[[str], None], fsync: bool = False,
                 on_write: Optional[OnWrite] = None) -> None:
    """Compute each output tensor and write it, the arithmetic of one tensor overlapping the write of the
    previous one (a second thread; torch and file writes release the GIL). With fsync, each shard is
    flushed to disk on a third thread while the next one is produced, and all of them before returning.
    on_write gets the running totals after each tensor's bytes are written (from the writer thread)."""
    from concurrent.futures import Future, ThreadPoolExecutor

    ws = Workspace()
    reader = TensorReader()
    threads = torch.get_num_threads()
    # One core stays free for the writer thread. On a 2-core box that leaves one compute thread, which
    # measured faster than two (their OpenMP barriers wait on the core the writer holds); B @ A gives the
    # same bits with any thread count (the sum over the rank is never split between threads).
    torch.set_num_threads(max(1, _cpu_count() - 1))
    writes = ThreadPoolExecutor(max_workers=1, thread_name_prefix="merge-write")
    syncs = ThreadPoolExecutor(max_workers=1, thread_name_prefix="merge-fsync")
    pending: Optional[Future] = None
    closing: list[Future] = []
    writers: list[ShardWriter] = []
    counter = WriteCounter(plan.total_bytes, len(plan.tensors), on_write)

    def write(writer: ShardWriter, t: OutTensor, tensor: torch.Tensor) -> None:
        writer.write(t.name, tensor)
        counter.add(t.nbytes)

    slot = 0
    try:
        for shard_name, shard in zip(names, plan.shards):
            writer = ShardWriter(folder / shard_name, shard, early_writeback=fsync, direct=True)
            writers.append(writer)
            for t in shard:
                if t.source.file != reader.file and pending is not None:
                    pending.result()  # the last write may still read from the mapping about to be closed
                tensor = output_tensor(t, reader.get(t.source.file, t.name), ws, f"out{slot}")
                if pending is not None:
                    pending.result()  # at most one write in flight: its buffer is the other slot
                pending = writes.submit(write, writer, t, tensor)
                slot ^= 1
            pending.result()
            pending = None
            writer.close(sync=False)
            if fsync:
                closing.append(syncs.submit(_fsync, writer.path))
            log(f"wrote {shard_name} ({human_size(sum(t.nbytes for t in shard))})")
        for future in closing:
            future.result()
    finally:
        torch.set_num_threads(threads)
        writes.shutdown(wait=True)  # never remove the folder under a running write
        syncs.shutdown(wait=True)
        reader.close()
        for writer in writers:
            writer.abort()


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------------
# The merge


@dataclass
class MergeResult:
    output: Path
    shards: int
    total_bytes: int
    merged_layers: int
    replaced: int
    seconds: float


def merge(base_path: Path, adapter_path: Path, output: Path, *, dtype: Optional[str] = None, overwrite: bool = False,
          max_shard_size: int = DEFAULT_MAX_SHARD_SIZE, log: Callable[[str], None] = lambda s: None,
          source_dirs: tuple = (), fsync: bool = False, on_write: Optional[OnWrite] = None,
          check: Optional[Callable[[Path], None]] = None) -> MergeResult:
    """Merge `adapter_path` into `base_path`, writing `output`. Raises MergeError for bad inputs.

    source_dirs: extra directories (e.g. the run directory) searched for tokenizer files after the adapter's.
    fsync: wait until the shards are on disk before publishing `output` (a power cut then cannot leave a
    truncated model behind). Off by default, like save_pretrained. With direct I/O the bytes have already
    gone to the device, and fsync adds the flush of its cache and of the file system's metadata (1.1B
    model on the shared development box: 3.3-8.3 s with, 4.8-5.0 s without, inside its noise); where
    writes are buffered it makes the merge as slow as the disk.
    on_write: called with the running Written totals after each tensor is written (a progress bar).
    check: called with the finished, not yet published directory (--verify); when it raises, nothing is
    published and `output` keeps what it held."""
    start = time.perf_counter()
    base_path, adapter_path, output = Path(base_path), Path(adapter_path), Path(output)
    out_dtype = _parse_dtype(dtype)
    _check_output_location(output, [base_path, adapter_path], overwrite)
    base = read_base(base_path)
    adapter = read_adapter(adapter_path)
    plan = plan_merge(base, adapter, out_dtype)
    for line in plan.warnings:
        log(f"warning: {line}")
    names = prepare_shards(plan, output, max_shard_size, log)
    with sigterm_as_interrupt(), atomic_dir(output, overwrite=overwrite) as tmp:
        write_shards(plan, names, tmp, log, fsync=fsync, on_write=on_write)
        if len(names) > 1:
            write_index(tmp, plan, names)
        copy_side_files(base_path, [adapter_path, *source_dirs], tmp, out_dtype)
        if check is not None:
            check(tmp)
    merged = sum(1 for t in plan.tensors if t.update is not None)
    replaced = sum(1 for t in plan.tensors if t.replacement is not None)
    return MergeResult(output, len(names), plan.total_bytes, merged, replaced, time.perf_counter() - start)


def _parse_dtype(dtype: Optional[str]) -> Optional[torch.dtype]:
    if dtype is None:
        return None
    if dtype not in DTYPES:
        raise MergeError(f"--dtype must be one of bfloat16, float16, float32, got {dtype!r}")
    return DTYPES[dtype]


def _check_output_location(output: Path, inputs: list[Path], overwrite: bool) -> None:
    out = output.resolve()
    for path in inputs:
        src = path.resolve()
        if out == src or src in out.parents:
            raise MergeError(f"-o {output} is inside the input {path}; merge never writes into its inputs")
        if out in src.parents:
            raise MergeError(f"the input {path} is inside -o {output}, which merge would replace")
    if output.exists() and not overwrite:
        raise MergeError(f"{output} already exists (use --overwrite to replace it)")
    if output.exists() and not output.is_dir():
        raise MergeError(f"{output} exists and is not a directory")
    if output.exists():
        problem = not_replaceable(output)
        if problem:
            raise MergeError(problem)


def copy_side_files(base: Path, tokenizer_sources: list[Path], out: Path, dtype: Optional[torch.dtype]) -> None:
    """config.json and generation_config.json from the base; tokenizer files and chat template from the first
    of the adapter / run / base directories that has a tokenizer."""
    for name in CONFIG_FILES:
        if (base / name).is_file():
            shutil.copy2(base / name, out / name)
    if dtype is not None:
        config = json.loads((out / MODEL_CONFIG).read_text(encoding="utf-8"))
        name = str(dtype).removeprefix("torch.")
        for key in ("dtype", "torch_dtype"):
            if key in config:
                config[key] = name
        if "dtype" not in config and "torch_dtype" not in config:
            config["dtype"] = name
        write_atomic(out / MODEL_CONFIG, json.dumps(config, indent=2) + "\n")
    copy_tokenizer([*tokenizer_sources, base], out)
    for source in tokenizer_sources:
        if RunDir(source).is_run():  # the run's data format: `finetune chat MERGED` prompts the same way
            shutil.copy2(RunDir(source).recipe_path, out / MERGED_RECIPE)
            if RunDir(source).file(FORMAT_FILE).is_file():  # how to read that recipe (finetune.rundir.format)
                shutil.copy2(RunDir(source).file(FORMAT_FILE), out / MERGED_FORMAT)
            break
