"""DeepSpeed ZeRO checkpoint -> PEFT adapter (LoRA/QLoRA runs) or sharded safetensors (full fine-tunes).

The HF Trainer under DeepSpeed writes `checkpoint-N/global_stepN/` with one optimizer-state file per
rank: the float32 master weights, cut into ZeRO partitions. With ZeRO-3 and
`stage3_gather_16bit_weights_on_model_save: false` (or after a crash between saves) that is the only
copy of the trained weights. This module stitches them back with DeepSpeed's own
`zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint` (lazy mode: one tensor at a time, the
partition files memory-mapped), casts them to the model's training dtype (what trainer.save_model
would have written) and saves them in the format the next step reads:

    $ finetune convert runs/x/checkpoint-500 -o runs/x/adapter-500        # LoRA: adapter_model.safetensors
    $ finetune merge --base BASE --adapter runs/x/adapter-500 -o merged/x
    $ finetune convert runs/full/checkpoint-500 -o exported/full          # full: model-0000N-of-0000M.safetensors

CPU only; nothing here needs a GPU.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import os
import pickle
import re
import shutil
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import torch

from finetune.rundir.checkpoint import Checkpoint, checkpoint_dirs, checkpoint_step, inspect_checkpoint
from finetune.rundir import verify
from finetune.rundir.names import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from finetune.rundir.adapter import find_adapter, no_adapter_message
from finetune.rundir.run_dir import RunDir
from finetune.fsutil import atomic_dir, write_atomic
from finetune.weights.experts import checkpoint_names
from finetune.weights.lora_math import PEFT_PREFIX, lora_scaling
from finetune.weights.errors import MergeError
from finetune.weights.safetensors_io import (INDEX_NAME, CONFIG_FILES, DEFAULT_MAX_SHARD_SIZE, DTYPES, ST_TO_TORCH, TORCH_TO_ST,
                                     BaseTensor, OnWrite, OutTensor, Plan, ShardWriter, WriteCounter,
                                     copy_tokenizer, not_replaceable,
                                     prepare_output, prepare_shards, write_index)
from finetune.weights.sigterm import sigterm_as_interrupt
from finetune.units import human_size
from finetune.recipe.references import MODEL_CONFIG

# Parameter names PEFT gives LoRA weights in the model (before the adapter name is stripped for saving).
_LORA_PARAM = re.compile(r"\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)\.([^.]+)(\.|$)")
_STEP_DIR = re.compile(r"^global_step(\d+)$")


class ConvertError(MergeError):
    """A problem with the checkpoint or the output, worded for the user."""


def trainable_shapes(ckpt: Checkpoint) -> dict[str, tuple]:
    """name -> shape of every parameter the optimizer trained, in the model's order."""
    return {name: tuple(shape) for group in ckpt.model_states["param_shapes"] for name, shape in group.items()}


def training_dtype(ckpt: Checkpoint, name: str) -> torch.dtype:
    """The parameter's dtype during training: ZeRO keeps a (maybe empty, partitioned) 16-bit copy in `module`."""
    tensor = (ckpt.model_states.get("module") or {}).get(name)
    if tensor is not None and tensor.is_floating_point():
        return tensor.dtype
    config = ckpt.model_states.get("ds_config") or {}
    for key, dtype in (("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("fp16", torch.float16)):
        if str((config.get(key) or {}).get("enabled", False)).lower() == "true":
            return dtype
    return torch.float32


def is_lora(ckpt: Checkpoint) -> bool:
    return any(_LORA_PARAM.search(name) for name in trainable_shapes(ckpt))


def _run_dir_hint(path: Path) -> str:
    """For a run directory given where a checkpoint belongs: its checkpoint-N directories, newest last."""
    numbered = checkpoint_dirs(path)
    if numbered:
        return f". It is a run directory; its checkpoints: {', '.join(str(p) for _, p in numbered)}"
    weights = [name for name in (*ADAPTER_WEIGHTS[:1], "model.safetensors", INDEX_NAME) if (path / name).is_file()]
    if weights:  # the Trainer's own checkpoint (a run with deepspeed.enabled: false): the weights are there already
        return (f". It is a checkpoint of a run without DeepSpeed: {path / weights[0]} already holds the "
                f"{'adapter' if weights[0].startswith('adapter') else 'weights'} (load or copy the folder; nothing to convert)")
    run = RunDir(path)
    if run.is_run():
        saved = [folder.name for folder in (run.adapter_path, run.model_path) if folder.is_dir()]
        if saved:
            return f". It is a run directory without checkpoints; its final {saved[0]}/ needs no convert"
        return ". It is a run directory without checkpoints (training.save_steps makes some)"
    return ""


def find_checkpoint(path: Path) -> Checkpoint:
    """Accept checkpoint-N/ (with `latest`), global_stepN/ itself, or a folder with exactly one global_step*."""
    if not path.is_dir():
        raise ConvertError(f"{path}: no such checkpoint directory")
    # Nothing is loaded through a link that leaves the folder given (finetune.rundir.verify, issue 34).
    escape = verify.links_outside(path)
    if escape:
        raise ConvertError(f"{escape}; convert loads nothing through a link that leaves the checkpoint")
    if _STEP_DIR.match(path.name) or any(path.glob("*_model_states.pt")):
        root, tag = path.parent, path.name
    elif (path / "latest").is_file():
        root, tag = path, verify.read_tag(path) or ""
    else:
        steps = sorted(p.name for p in path.glob("global_step*") if p.is_dir())
        if len(steps) != 1:
            found = f"several ({', '.join(steps)}): pass one of them" if steps else "no global_step* directory"
            raise ConvertError(f"{path}: not a DeepSpeed checkpoint (no `latest` file; {found}){_run_dir_hint(path)}")
        root, tag = path, steps[0]
    step_dir = root / tag
    if not step_dir.is_dir():
        raise ConvertError(f"{root / 'latest'} names {tag}, but {step_dir} does not exist")
    model_files = sorted(step_dir.glob("*_model_states.pt"))
    optim_files = sorted(step_dir.glob("*_optim_states.pt"))
    if not model_files or not optim_files:
        raise ConvertError(f"{step_dir}: no *_model_states.pt / *_optim_states.pt (an incomplete checkpoint?)")
    rank0 = next((f for f in model_files if f.name in ("mp_rank_00_model_states.pt",
                                                        "zero_pp_rank_0_mp_rank_00_model_states.pt")), model_files[0])
    for file in model_files + optim_files:
        refuse_foreign_globals(file)
    states = _load_model_states(rank0)
    step = _step_of(root.name, tag)
    # The COMPLETE marker is only reported: checkpoints written outside `finetune train` never have one.
    found = inspect_checkpoint(root, step) if step is not None else Checkpoint(None, root, False, "no step in its name")
    return replace(found, tag=tag, model_states=states)


def _step_of(folder: str, tag: str) -> Optional[int]:
    step = checkpoint_step(folder)
    match = _STEP_DIR.match(tag)
    return step if step is not None else int(match.group(1)) if match else None


def refuse_foreign_globals(path: Path) -> None:
    """Refuse a checkpoint file that pickles anything besides DeepSpeed's own classes, before loading it
    (finetune.rundir.verify: the same allow-list `finetune train` checks before resuming)."""
    try:
        verify.refuse_foreign_globals(path)
    except (verify.UnsafeCheckpoint, ValueError) as exc:
        raise ConvertError(str(exc)) from None


def _deepspeed_classes() -> list:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # importing deepspeed picks an accelerator; conversion is CPU work
    classes = []
    for dotted in verify.DEEPSPEED_GLOBALS:
        module, _, name = dotted.rpartition(".")
        classes.append(getattr(importlib.import_module(module), name))
    return classes


@contextlib.contextmanager
def weights_only_loads():
    """Every torch.load inside (ours and DeepSpeed's zero_to_fp32, which asks for weights_only=False) runs
    with weights_only=True and only DeepSpeed's checkpoint classes allowed."""
    real_load = torch.load

    def load(*args, **kwargs):
        kwargs["weights_only"] = True
        return real_load(*args, **kwargs)

    # zero_to_fp32 hard-codes weights_only=False and has no parameter for it; swapping torch.load for the
    # duration of the conversion is the one way to hold its loads to the allow-list too.
    torch.load = load
    try:
        with torch.serialization.safe_globals(_deepspeed_classes()):
            yield
    finally:
        torch.load = real_load


def _load_model_states(path: Path) -> dict:
    try:
        # mmap keeps a ZeRO-1/2 checkpoint's full 16-bit module copy on disk instead of in RAM.
        with weights_only_loads():
            states = torch.load(str(path), map_location="cpu", mmap=True)
    except Exception as exc:
        raise ConvertError(f"{path}: cannot read ({exc})") from None
    if not isinstance(states, dict) or "param_shapes" not in states:
        raise ConvertError(f"{path}: not a DeepSpeed ZeRO model-states file (no param_shapes)")
    return states


def fp32_state_dict(ckpt: Checkpoint, exclude_frozen: bool) -> dict:
    """DeepSpeed's reconstruction, lazily: values are tensors or GatheredTensor (call .contiguous())."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # conversion is CPU work even on a GPU box
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    try:
        # zero_to_fp32 prints progress to stdout; keep stdout for our own report.
        with contextlib.redirect_stdout(sys.stderr), weights_only_loads():
            return get_fp32_state_dict_from_zero_checkpoint(str(ckpt.path), tag=ckpt.tag,
                                                            exclude_frozen_parameters=exclude_frozen, lazy_mode=True)
    except (ValueError, FileNotFoundError, NotImplementedError, KeyError) as exc:
        raise ConvertError(f"{ckpt.step_dir}: DeepSpeed cannot reconstruct the weights: {exc}") from None
    except pickle.UnpicklingError as exc:  # a global the opcode scan could not see (pushed at run time)
        raise ConvertError(f"{ckpt.step_dir}: refused to load: {str(exc).splitlines()[0]}") from None


# ------------------------------------------------------------------------------------------------
# LoRA: PEFT's saved format


def adapter_name_of(names) -> str:
    found = {m.group(2) for name in names if (m := _LORA_PARAM.search(name))}
    if len(found) != 1:
        raise ConvertError(f"the checkpoint holds adapters {sorted(found)}; convert handles one adapter")
    return found.pop()


def peft_key(name: str, adapter: str) -> str:
    """The key PEFT's save_pretrained writes for a model parameter (get_peft_model_state_dict):
    modules_to_save copies lose `modules_to_save.<adapter>`, DoRA magnitudes lose `.<adapter>.weight`,
    every other key loses the adapter name before its last part (lora_A.default.weight -> lora_A.weight)."""
    if not name.startswith(PEFT_PREFIX):
        name = PEFT_PREFIX + name  # a checkpoint of the bare LoraModel rather than the PeftModel
    marker = f".modules_to_save.{adapter}."
    if marker in name:
        return name.replace(marker, ".", 1)
    dora = f".lora_magnitude_vector.{adapter}.weight"
    if name.endswith(dora):
        return name[: -len(dora)] + ".lora_magnitude_vector"
    if name.endswith(f".{adapter}"):
        return name[: -len(adapter) - 1]
    head, _, last = name.rpartition(".")
    if head.endswith(f".{adapter}"):
        head = head[: -len(adapter) - 1]
    return f"{head}.{last}"


def find_adapter_config(ckpt: Checkpoint, explicit: Optional[Path]) -> Path:
    """The HF Trainer saves adapter_config.json in checkpoint-N; a run directory has adapter/ beside it."""
    if explicit is not None:
        if explicit.is_dir():
            explicit = explicit / ADAPTER_CONFIG
        if not explicit.is_file():
            raise ConvertError(f"--adapter-config {explicit}: no such file")
        return explicit
    # The HF Trainer saves one in checkpoint-N itself; else the run's own adapter (RUN/adapter or RUN).
    if (ckpt.path / ADAPTER_CONFIG).is_file():
        return ckpt.path / ADAPTER_CONFIG
    found = find_adapter(ckpt.path.parent)
    if found is not None:
        return found / ADAPTER_CONFIG
    raise ConvertError(f"{ckpt.path}: a LoRA checkpoint, but no {ADAPTER_CONFIG} in it, and "
                       f"{no_adapter_message(ckpt.path.parent)}; pass --adapter-config")


def convert_lora(ckpt: Checkpoint, output: Path, dtype, adapter_config: Optional[Path],
                 overwrite: bool, log: Callable[[str], None], on_write: Optional[OnWrite] = None) -> "ConvertResult":
    from safetensors.torch import save_file

    config_path = find_adapter_config(ckpt, adapter_config)
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if config.get("peft_type") != "LORA":
        raise ConvertError(f"{config_path}: peft_type {config.get('peft_type')!r}, expected LORA")
    trainable = trainable_shapes(ckpt)
    adapter = adapter_name_of(trainable)
    state = fp32_state_dict(ckpt, exclude_frozen=True)
    tensors = {}
    for name in trainable:
        if name not in state:
            raise ConvertError(f"{ckpt.step_dir}: trained parameter {name} is missing from the optimizer states")
        tensor = state[name].contiguous()
        target = dtype or training_dtype(ckpt, name)
        tensors[peft_key(name, adapter)] = tensor.to(target) if tensor.is_floating_point() else tensor
    _check_rank(tensors, config, config_path)
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    prepare_output(output, size, log)
    with sigterm_as_interrupt(), atomic_dir(output, overwrite=overwrite) as tmp:
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        WriteCounter(size, len(tensors), on_write).add(size, len(tensors))  # one file, written in one call
        shutil.copy2(config_path, tmp / ADAPTER_CONFIG)
        _copy_tokenizer(ckpt, tmp)
    log(f"wrote {output / 'adapter_model.safetensors'} ({len(tensors)} tensors, {human_size(size)})")
    return ConvertResult(output, "lora", len(tensors), size, 1, str(next(iter(tensors.values())).dtype))


def _check_rank(tensors: dict, config: dict, where: Path) -> None:
    """Catch an adapter_config.json from another run: its r must match the weights' rank (LoRA on fused experts:
    lora_A holds r rows per expert)."""
    from finetune.weights.experts import parameter_of, wrapped_parameters

    wrapped = wrapped_parameters(config)
    for key, tensor in tensors.items():
        if key.endswith(".lora_A.weight"):
            module = key[len(PEFT_PREFIX):-len(".lora_A.weight")]
            param = parameter_of(module, wrapped)
            r, _ = lora_scaling(config, param or module)
            if param is not None and not param.endswith(".weight") and tensor.shape[0] % r == 0:
                continue
            if tensor.shape[0] != r:
                raise ConvertError(f"{where}: gives {module} r={r}, but the checkpoint's weights have rank "
                                   f"{tensor.shape[0]} (an {ADAPTER_CONFIG} from another run?)")


# ------------------------------------------------------------------------------------------------
# Full fine-tunes: sharded safetensors like save_pretrained


def convert_full(ckpt: Checkpoint, output: Path, dtype, overwrite: bool, max_shard_size: int,
                 log: Callable[[str], None], on_write: Optional[OnWrite] = None) -> "ConvertResult":
    if ckpt.model_states.get("frozen_param_shapes") is None:
        # save_checkpoint(exclude_frozen_parameters=True): parameters that were not trained are not in it
        log("warning: the checkpoint was saved without frozen parameters; any the model had are missing from the output")
    state = fp32_state_dict(ckpt, exclude_frozen=False)
    aliases = {alias for alias, _ in ckpt.model_states.get("shared_params", {}).items()}
    seen: set[int] = set()
    kept: dict[str, tuple] = {}
    for name, tensor in state.items():
        # Tied weights (lm_head = embed_tokens) come back under both names; save_pretrained writes one.
        if name in aliases or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        kept[name] = tuple(tensor.shape)
    # A mixture of experts' fused parameters are written per expert, as save_pretrained writes them (weights/experts.py).
    layout = checkpoint_names(kept, _checkpoint_family(ckpt))
    plan = Plan([])
    for name, (source, _, _, shape) in layout.items():
        tensor = state[source]
        target = (dtype or training_dtype(ckpt, source)) if tensor.dtype.is_floating_point else tensor.dtype
        nbytes = math.prod(shape) * torch.empty(0, dtype=target).element_size()
        plan.tensors.append(OutTensor(name, BaseTensor(name, ckpt.step_dir, TORCH_TO_ST[target], shape),
                                      TORCH_TO_ST[target], nbytes))
    names = prepare_shards(plan, output, max_shard_size, log)
    counter = WriteCounter(plan.total_bytes, len(plan.tensors), on_write)
    fused: list = [None, None]
    with sigterm_as_interrupt(), atomic_dir(output, overwrite=overwrite) as tmp:
        for shard_name, shard in zip(names, plan.shards):
            writer = ShardWriter(tmp / shard_name, shard)
            try:
                for t in shard:
                    source, expert, rows, _ = layout[t.name]
                    if expert is None:
                        tensor = state[source].contiguous()
                    else:  # one expert's slice of a fused stack, gathered once for all its slices
                        if fused[0] != source:
                            fused[:] = [source, state[source].contiguous()]
                        tensor = fused[1][expert] if rows is None else fused[1][expert][rows]
                    writer.write(t.name, tensor.contiguous().to(ST_TO_TORCH[t.dtype]))
                    del tensor
                    counter.add(t.nbytes)
                writer.close()
            finally:
                writer.abort()
            log(f"wrote {shard_name} ({human_size(sum(t.nbytes for t in shard))})")
        if len(names) > 1:
            write_index(tmp, plan, names)
        for name in CONFIG_FILES:
            # checkpoint-N/ has them when the Trainer saved the model there; a run's final model/ does too
            source = next((d / name for d in (ckpt.path, ckpt.path.parent / "model") if (d / name).is_file()), None)
            if source is not None:
                shutil.copy2(source, tmp / name)
        if dtype is not None and (tmp / MODEL_CONFIG).is_file():
            _set_config_dtype(tmp / MODEL_CONFIG, dtype)
        _copy_tokenizer(ckpt, tmp)
    if not (output / MODEL_CONFIG).is_file():
        log(f"warning: no config.json in {ckpt.path}; copy the model's config.json into {output} to load it")
    return ConvertResult(output, "full", len(plan.tensors), plan.total_bytes, len(names),
                         str(ST_TO_TORCH[plan.tensors[0].dtype]) if plan.tensors else "-")


def _checkpoint_family(ckpt: Checkpoint):
    """The model family (finetune.models) of the config.json beside the checkpoint, or None."""
    from finetune.models.families import family

    for folder in (ckpt.path, ckpt.path.parent / "model"):
        if (folder / MODEL_CONFIG).is_file():
            try:
                return family(json.loads((folder / MODEL_CONFIG).read_text(encoding="utf-8")).get("model_type"))
            except (OSError, ValueError, AttributeError):
                return None
    return None


def _set_config_dtype(path: Path, dtype: torch.dtype) -> None:
    config = json.loads(path.read_text(encoding="utf-8"))
    name = str(dtype).removeprefix("torch.")
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = name
    write_atomic(path, json.dumps(config, indent=2) + "\n")


def _copy_tokenizer(ckpt: Checkpoint, out: Path) -> None:
    """From the checkpoint (the Trainer saves its processing_class there), else the run's tokenizer/."""
    copy_tokenizer([ckpt.path, RunDir(ckpt.path.parent).tokenizer_path], out)


# ------------------------------------------------------------------------------------------------


@dataclass
class ConvertResult:
    output: Path
    kind: str  # "lora" or "full"
    tensors: int
    total_bytes: int
    shards: int
    dtype: str


def convert(checkpoint: Path, output: Path, *, dtype: Optional[str] = None, overwrite: bool = False,
            adapter_config: Optional[Path] = None, max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
            log: Callable[[str], None] = lambda s: None, on_write: Optional[OnWrite] = None) -> ConvertResult:
    """Convert a DeepSpeed checkpoint directory; LoRA or full is read from the parameter names.
    on_write: called with the running Written totals after each tensor (LoRA: the one file) is written."""
    checkpoint, output = Path(checkpoint), Path(output)
    if dtype is not None and dtype not in DTYPES:
        raise ConvertError(f"--dtype must be one of bfloat16, float16, float32, got {dtype!r}")
    if output.exists() and not overwrite:
        raise ConvertError(f"{output} already exists (use --overwrite to replace it)")
    problem = not_replaceable(output) if output.is_dir() else None
    if problem:
        raise ConvertError(problem)
    from finetune.fsutil import SpecialFile, refuse_special

    try:  # `latest`, the adapter config and the tokenizer files are read by name: none may be a FIFO or device
        refuse_special(checkpoint, "CHECKPOINT")
        if adapter_config is not None:
            refuse_special(adapter_config, "--adapter-config")
    except SpecialFile as exc:
        raise ConvertError(str(exc)) from None
    ckpt = find_checkpoint(checkpoint)
    out = output.resolve()
    if out == ckpt.path.resolve() or ckpt.path.resolve() in out.parents or out in ckpt.path.resolve().parents:
        raise ConvertError(f"-o {output} overlaps the checkpoint {ckpt.path}; write somewhere else")
    start = time.perf_counter()
    target = DTYPES[dtype] if dtype else None
    if is_lora(ckpt):
        result = convert_lora(ckpt, output, target, adapter_config, overwrite, log, on_write)
    else:
        result = convert_full(ckpt, output, target, overwrite, max_shard_size, log, on_write)
    log(f"converted in {time.perf_counter() - start:.1f} s")
    return result
