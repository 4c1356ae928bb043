"""DeepSpeed config rules about how training is set up: HF Trainer + accelerate, batch sizes, precision, ZeRO.

Phases "trainer", "batch", "precision", "zero" and "misc" (finetune.lint.deepspeed.view.PHASES).
"""

from __future__ import annotations

import math
from typing import Any, Iterator

from finetune.lint.deepspeed.context import RawFinding
from finetune.lint.deepspeed.schema import BATCH_KEYS, DTYPE_NAMES, ZERO_FIELD_NAMES
from finetune.lint.deepspeed.values import MISSING, UNKNOWN, as_bool, as_int, batch_fix, dotted, parse_number, show
from finetune.lint.deepspeed.view import ConfigView, Seen, rule


# ------------------------------------------------------------------------------------------
# HF Trainer + accelerate (DS115, DS125, DS130, DS155, DS180)

@rule("trainer")
def zero_block_required(v: ConfigView, seen: Seen) -> Iterator[RawFinding]:
    if v.hf and "zero_optimization" not in v.config:
        yield RawFinding(
            "DS130", "error", (), "no `zero_optimization` block: accelerate's DeepSpeed plugin refuses the "
            "config (\"Please specify the ZeRO optimization config\")",
            'add "zero_optimization": {"stage": 0} for plain data parallelism, or the stage you want')


def offload_by_deprecated_key(v: ConfigView) -> bool:
    """Optimizer offload asked for only with the deprecated `cpu_offload` (DeepSpeed maps it to
    offload_optimizer.device cpu in DeepSpeedZeroConfig; nothing else reads it)."""
    zero = v.zero()
    return "offload_optimizer" not in zero and as_bool(zero.get("cpu_offload")) is True


@rule("trainer")
def missing_accumulation(v: ConfigView, seen: Seen) -> Iterator[RawFinding]:
    """accelerate's DeepSpeedPlugin writes gradient_accumulation_steps=1 when the config has none.

    Since accelerate 1.8 (huggingface/accelerate#3630) the Trainer's own accumulation decides DeepSpeed's
    boundaries (engine.set_gradient_accumulation_boundary), so the training is the same and only
    DeepSpeed's bookkeeping (train_batch_size, sample counts, its monitors) is off. Before 1.8 the
    engine stepped the optimizer on every micro-batch. A train_batch_size fails DeepSpeed's batch check.
    """
    if not v.hf or "gradient_accumulation_steps" in v.config:
        return
    gas = None if v.ta is None else v.ta["gradient_accumulation_steps"]
    fix = 'add "gradient_accumulation_steps": "auto"'
    if gas is not None and as_int(gas) == 1:
        return
    if gas is not None and "train_batch_size" in v.config:
        yield RawFinding(
            "DS125", "error", (), f"no `gradient_accumulation_steps`: accelerate writes 1 into the config, "
            f"while `train_batch_size` counts TrainingArguments' {gas}; DeepSpeed's check "
            "train_batch_size = micro batch x accumulation x world size fails at launch", fix)
        return
    said = "whatever TrainingArguments say" if gas is None else f"not TrainingArguments' {gas}"
    yield RawFinding("DS125", "warning", (), f"no `gradient_accumulation_steps`: accelerate writes 1 into the config, "
                     f"{said}. With accelerate >= 1.8 the Trainer still accumulates (only DeepSpeed's batch size and "
                     "sample counts are wrong); older accelerate steps the optimizer on every micro-batch", fix)


@rule("trainer")
def mismatches(v: ConfigView, seen: Seen) -> Iterator[RawFinding]:
    """HfTrainerDeepSpeedConfig.fill_match: a concrete value that differs from TrainingArguments."""
    if not v.hf or v.ta is None:
        return
    for path, (hf_value, hf_key) in v.hf_expected().items():
        parent = v.get(*path[:-1]) if len(path) > 1 else v.config
        if not isinstance(parent, dict):
            continue
        value = parent.get(path[-1])
        if value is None or value == "auto" or (isinstance(value, list) and "auto" in value):
            continue  # "auto" inside a list is DS171's
        if seen.claimed(path):
            continue  # already reported as a wrong type; one finding per mistake
        if value != hf_value:  # the same comparison HF makes (so 1 == 1.0 and true == 1)
            where = ("the recipe's training settings" if v.ctx.from_recipe else "TrainingArguments")
            yield RawFinding("DS180", "error", path, f"`{dotted(path)}` is {show(value)} but {where} give {hf_key}="
                             f"{show(hf_value)}: the HF Trainer refuses mismatches",
                             f'set it to "auto" (or {show(hf_value)})')


@rule("trainer")
def client_optimizer_offload(v: ConfigView, seen: Seen) -> Iterator[RawFinding]:
    if not v.hf:
        return
    if "optimizer" in v.config:
        return
    if offload_by_deprecated_key(v) and as_bool(v.config.get("zero_force_ds_cpu_optimizer", True)) is not False:
        yield RawFinding("DS156", "error", ("zero_optimization", "cpu_offload"),
                         "`cpu_offload: true` without an `optimizer` block: DeepSpeed reads it as optimizer offload to "
                         "the CPU, but accelerate swaps the Trainer's optimizer for DeepSpeedCPUAdam only when "
                         "`offload_optimizer.device` says so, and deepspeed.initialize refuses the Trainer's optimizer "
                         "(ZeRORuntimeException: \"ZeRO-Offload with a client provided optimizer\")",
                         'replace it with "offload_optimizer": {"device": "cpu"}, or add an "optimizer" block')
        return
    if v.device("offload_optimizer") not in ("cpu", "nvme"):
        return
    if v.stage == 0:
        return  # DS131 covers it
    if as_bool(v.config.get("zero_force_ds_cpu_optimizer", True)) is False:
        return
    optim = "" if v.ta is None else str(v.ctx.training_args.get("optim", "adamw_torch"))
    # accelerate keeps AdamW semantics only for torch's AdamW (and 32-bit bitsandbytes AdamW)
    torch_adamw = optim.startswith("adamw_torch") or optim in ("adamw_hf", "")
    severity = "warning" if torch_adamw else "error"
    yield RawFinding(
        "DS155", severity, ("zero_optimization", "offload_optimizer"),
        "optimizer offload without an `optimizer` block: the HF Trainer builds its own optimizer"
        + (f" ({optim})" if optim else "") + ", and accelerate replaces it with DeepSpeedCPUAdam, keeping "
        "only lr and weight_decay (betas and eps fall back to Adam's defaults; a non-AdamW optimizer becomes Adam)",
        'add an "optimizer" block (type AdamW with "auto" params), or set "zero_force_ds_cpu_optimizer": '
        "false to keep the Trainer's optimizer (slow on CPU)")

# ------------------------------------------------------------------------------------------
# Batch sizes (DS121-DS124): runtime/config.py _set_batch_related_parameters + _batch_assertion

@rule("batch")
def batch_sizes(v: ConfigView, seen: Seen) -> Iterator[RawFinding]:
    values: dict[str, Any] = {}
    for key in BATCH_KEYS:
        value = v.resolved((key,))
        if key == "gradient_accumulation_steps" and value is MISSING and v.hf:
            value = 1  # accelerate's DeepSpeedPlugin adds it
        if value is not MISSING and value is not UNKNOWN:
            number = as_int(value) if isinstance(value, (int, float)) else None
            if number is None or isinstance(value, bool):
                value = UNKNOWN  # a type error, reported by structure()
            else:
                if number <= 0 and not seen.claimed((key,)):
                    yield RawFinding("DS123", "error", (key,), f"`{key}` is {show(value)}: DeepSpeed needs it > 0")
                value = number if number > 0 else UNKNOWN
        values[key] = value
    train, micro, gas = (values[k] for k in BATCH_KEYS)
    if train is MISSING and micro is MISSING:
        yield RawFinding(
            "DS122", "error", (), "neither `train_batch_size` nor `train_micro_batch_size_per_gpu` is set: "
            "DeepSpeed needs one of them", 'add "train_micro_batch_size_per_gpu": "auto"' if v.hf else
            'add "train_micro_batch_size_per_gpu": 1')
        return
    if UNKNOWN in (train, micro, gas):
        return
    if seen.has("DS180", keys=[(k,) for k in BATCH_KEYS]):
        return  # HF stops first, with the mismatch
    world = v.ctx.world_size
    if world:
        yield from batch_arithmetic(v, seen, train, micro, gas, world)
    elif MISSING not in (train, micro, gas) and train % (micro * gas):
        yield RawFinding(
            "DS124", "error", ("train_batch_size",), f"train_batch_size {train} is not a multiple of micro "
            f"batch {micro} x gradient accumulation {gas}: no world size satisfies train_batch_size = "
            "micro x accumulation x world size", batch_fix(v.hf))


def batch_arithmetic(v: ConfigView, seen: Seen, train: Any, micro: Any, gas: Any, world: int) -> Iterator[RawFinding]:
    """DeepSpeed derives the missing values with floor division, then asserts the product."""
    derived = []
    if MISSING not in (train, micro, gas):
        pass
    elif train is not MISSING and micro is not MISSING:
        gas = train // micro // world
        derived.append(f"gradient_accumulation_steps = {train} // {micro} // {world} = {gas}")
    elif train is not MISSING and gas is not MISSING:
        micro = train // world // gas
        derived.append(f"train_micro_batch_size_per_gpu = {train} // {world} // {gas} = {micro}")
    elif micro is not MISSING and gas is not MISSING:
        train = micro * gas * world
    elif train is not MISSING:
        gas, micro = 1, train // world
        derived.append(f"train_micro_batch_size_per_gpu = {train} // {world} = {micro}")
    else:
        train, gas = micro * world, 1
    how = f" (DeepSpeed derives {'; '.join(derived)})" if derived else ""
    key = ("train_batch_size",) if "train_batch_size" in v.config else ()
    if micro <= 0 or gas <= 0:
        yield RawFinding(
            "DS121", "error", key, f"with world size {world}, train_batch_size {train} leaves "
            f"{'a micro batch' if micro <= 0 else 'gradient accumulation'} of 0{how}: DeepSpeed refuses it",
            batch_fix(v.hf))
    elif train != micro * gas * world and not seen.has("DS125", "error"):  # DS125 says why
        yield RawFinding(
            "DS121", "error", key, f"train_batch_size {train} != micro batch {micro} x gradient accumulation "
            f"{gas} x world size {world} = {micro * gas * world}{how}: DeepSpeed refuses it",
            batch_fix(v.hf))

# ------------------------------------------------------------------------------------------
# Precision (DS120, DS136, DS190, DS193)

@rule("precision")
def fp16_and_bf16(v: ConfigView, seen: Seen) -> Iterator[RawFinding]:
    if v.enabled("fp16") is True and v.enabled("bf16") is True:
        key = ("fp16", "enabled") if v.get("fp16", "enabled") is not MISSING else ("fp16",)
        yield RawFinding("DS120", "error", key, "fp16 and bf16 are both enabled: DeepSpeed refuses the config "
                         "(and accelerate refuses it under the HF Trainer)",
                         'set one of them to false, or both to "auto" so TrainingArguments decide' if v.hf else
                         "set one of them to false")


@rule("precision")
def fp16_params(v: ConfigView, seen: Seen) -> Iterator[RawFinding]:
    """DeepSpeedFP16Config's validators (types and non-finite values are DS110/DS111 already)."""
    fp16_enabled = v.enabled("fp16")
    block = v.config.get("fp16")
    if not isinstance(block, dict):
        return
    loss_scale = block.get("loss_scale", 0)
    if isinstance(loss_scale, str):
        loss_scale = parse_number(loss_scale)
    if not isinstance(loss_scale, (int, float)) or isinstance(loss_scale, bool) or not math.isfinite(loss_scale):
        return
    if loss_scale < 0:
        yield RawFinding(
            "DS193", "error", ("fp16", "loss_scale"), f"`fp16.loss_scale` is {show(block['loss_scale'])}: "
            "DeepSpeed needs a number >= 0 (0 = dynamic loss scaling)", "use 0 (dynamic) or a positive scale")
        return
    if fp16_enabled is True and loss_scale == 0:
        for key in ("loss_scale_window", "min_loss_scale"):
            value = block.get(key)
            number = as_int(value)
            if number is not None and not isinstance(value, bool) and number <= 0:
                yield RawFinding("DS193", "error", ("fp16", key), f"`fp16.{key}` is {show(value)}: with dynamic loss "
                                 "scaling DeepSpeed needs it > 0", "delete it to use DeepSpeed's default")


@rule("precision")
def master_weights(v: ConfigView, seen: Seen) -> Iterator[RawFinding]:
    stage = v.stage
    checks = [("fp16", "fp16_master_weights_and_grads"), ("bf16", "bf16_master_weights_and_grads"),
              ("bf16", "bf16_optimizer_states")]
    for section, key in checks:
        if as_bool(v.get(section, key)) is True and stage == 0:
            yield RawFinding("DS136", "error", (section, key), f"`{section}.{key}` needs ZeRO stage 1, 2 or 3: "
                             "DeepSpeed refuses it at stage 0")
    if as_bool(v.get("bf16", "bf16_optimizer_states")) is True and \
            as_bool(v.get("bf16", "bf16_master_weights_and_grads")) is not True:
        yield RawFinding("DS136", "error", ("bf16", "bf16_optimizer_states"), "`bf16.bf16_optimizer_states` needs "
                         "`bf16.bf16_master_weights_and_grads`: DeepSpeed refuses it alone",
                         'add "bf16_master_weights_and_grads": true')


@rule("precision")
def param_dtype(v: ConfigView, seen: Seen) -> Iterator[RawFinding]:
    fp16, bf16 = v.enabled("fp16"), v.enabled("bf16")
    value = v.get("data_types", "param_dtype")
    if not isinstance(value, str) or value not in DTYPE_NAMES or UNKNOWN in (fp16, bf16):
        return
    mode = "fp16" if fp16 else "bf16" if bf16 else "fp32"
    if DTYPE_NAMES[value] != mode:
        yield RawFinding("DS190", "error", ("data_types", "param_dtype"), f"`data_types.param_dtype` is {show(value)} "
                         f"but the enabled precision is {mode}: DeepSpeed refuses the combination",
                         "delete param_dtype (it follows the fp16/bf16 setting)")


@rule("precision")
def grad_accum_dtype(v: ConfigView, seen: Seen) -> Iterator[RawFinding]:
    """engine._do_optimizer_sanity_check: without ZeRO, only the model's own dtype can accumulate."""
    fp16, bf16 = v.enabled("fp16"), v.enabled("bf16")
    value = v.get("data_types", "grad_accum_dtype")
    if not isinstance(value, str) or value not in DTYPE_NAMES or UNKNOWN in (fp16, bf16) or v.stage != 0:
        return
    mode = "fp16" if fp16 else "bf16" if bf16 else "fp32"
    if DTYPE_NAMES[value] != mode:
        yield RawFinding("DS191", "error", ("data_types", "grad_accum_dtype"), f"`data_types.grad_accum_dtype` is "
                         f"{show(value)} but the model trains in {mode} at ZeRO stage 0: deepspeed.initialize raises "
                         "NotImplementedError (\"unsupported mix of model_dtype and grad_accum_dtype\")",
                         "delete grad_accum_dtype, or use ZeRO stage 1 or higher (which accumulates in fp32)")

# ------------------------------------------------------------------------------------------
# ZeRO and offload (DS131-DS140)

@rule("zero")
def zero_and_offload(v: ConfigView, seen: Seen) -> Iterator[RawFinding]:
    zero, stage = v.zero(), v.stage
    if not zero or stage is None:
        return
    opt_device, param_device = v.device("offload_optimizer"), v.device("offload_param")
    if opt_device in ("cpu", "nvme") and stage == 0:
        yield RawFinding(
            "DS131", "error", ("zero_optimization", "offload_optimizer"), "optimizer offload at ZeRO stage 0: "
            "DeepSpeed builds its CPU optimizer for parameters that stay on the GPU, and the first "
            "optimizer step fails (\"CPUAdam param is on cuda and must be 'cpu'\")",
            "use stage 1 or higher, or remove offload_optimizer")
    if param_device in ("cpu", "nvme") and stage in (0, 1, 2):
        yield RawFinding("DS132", "error", ("zero_optimization", "offload_param"), f"parameter offload at ZeRO stage "
                         f"{stage} is silently ignored: only stage 3 partitions and offloads parameters, so they stay "
                         "on the GPU", "use stage 3, or remove offload_param")
    for block, device in (("offload_optimizer", opt_device), ("offload_param", param_device)):
        if device == "nvme":
            yield from nvme_path(v, block)
    ratio = v.get("zero_optimization", "offload_optimizer", "ratio")
    if isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and ratio < 1 and stage != 3:
        yield RawFinding(
            "DS134", "error", ("zero_optimization", "offload_optimizer", "ratio"), "partial optimizer offload "
            f"(ratio {ratio}) works only with ZeRO stage 3: DeepSpeed refuses it at stage {stage}",
            "delete ratio, or use stage 3")
    if as_bool(zero.get("compute_grad_norm", True)) is False and stage not in (1, 2):
        yield RawFinding("DS135", "error", ("zero_optimization", "compute_grad_norm"), "compute_grad_norm=false is "
                         f"supported only with ZeRO stage 1 or 2: DeepSpeed refuses it at stage {stage}",
                         "delete compute_grad_norm")
    yield from allgather_bucket(v, stage)
    if stage in (1, 2):
        for key, value in zero.items():
            if (str(key).startswith("stage3_") or key in ZERO_FIELD_NAMES) and value != "auto" and \
                    not seen.claimed(("zero_optimization", key)):
                yield RawFinding("DS139", "info", ("zero_optimization", key), f"`{key}` only affects ZeRO stage 3; at "
                                 f"stage {stage} it does nothing")


def nvme_path(v: ConfigView, block: str) -> Iterator[RawFinding]:
    path = v.get("zero_optimization", block, "nvme_path")
    key = ("zero_optimization", block, "nvme_path")
    if path is MISSING or path is None:
        yield RawFinding(
            "DS133", "error", ("zero_optimization", block, "device"), f"NVMe offload of {block[8:]} without "
            "`nvme_path`: DeepSpeed has no directory to swap to and fails when it sets up offloading",
            'add "nvme_path": "/local_nvme" (a directory on a fast local NVMe disk)')
    elif path == "auto" and v.hf:
        yield RawFinding(
            "DS133", "error", key, "`nvme_path` \"auto\" is filled by accelerate with the string \"none\": "
            "DeepSpeed would swap into a directory named `none` under the working directory",
            "write the directory of a fast local NVMe disk")
    elif path == "auto":
        yield RawFinding(
            "DS133", "error", key, "`nvme_path` \"auto\" is dropped by DeepSpeed, leaving no swap directory",
            "write the directory of a fast local NVMe disk")
    elif isinstance(path, str) and path.strip().lower() in ("none", ""):
        yield RawFinding("DS133", "error", key, f"`nvme_path` is {show(path)}: DeepSpeed would swap into the current "
                         "directory" + (" (a directory named `none`)" if path.strip() else ""),
                         "write the directory of a fast local NVMe disk")


def allgather_bucket(v: ConfigView, stage: int) -> Iterator[RawFinding]:
    value = v.zero().get("allgather_bucket_size")
    number = as_int(value)
    if stage not in (1, 2) or number is None or isinstance(value, bool) or number < 0:
        return
    if number == 0:
        yield RawFinding(
            "DS140", "error", ("zero_optimization", "allgather_bucket_size"), "allgather_bucket_size 0: the "
            "ZeRO stage 1/2 optimizer divides by it and fails when it starts", "delete it (default 5e8)")
    elif number % 2:
        yield RawFinding("DS140", "error", ("zero_optimization", "allgather_bucket_size"), f"allgather_bucket_size "
                         f"{number} is odd: the ZeRO stage 1/2 optimizer asserts it is a multiple of 2 (4-byte "
                         "aligned fp16 buffers)", f"use {number + 1}")


# ------------------------------------------------------------------------------------------
# Other DeepSpeed checks (DS137, DS192, keep_in_fp32_modules)

@rule("misc")
def misc(v: ConfigView, seen: Seen) -> Iterator[RawFinding]:
    """gradient_allreduce_op at ZeRO-3, a negative gradient_clipping, data_types.keep_in_fp32_modules."""
    op = v.config.get("gradient_allreduce_op")
    if isinstance(op, str) and op.lower() == "sum" and v.stage == 3:
        yield RawFinding(
            "DS137", "error", ("gradient_allreduce_op",), "gradient_allreduce_op 'sum' is not supported with "
            "ZeRO stage 3: DeepSpeed refuses it", 'use "mean"')
    clip = v.config.get("gradient_clipping")
    if isinstance(clip, (int, float)) and not isinstance(clip, bool) and clip < 0 and \
            not seen.claimed(("gradient_clipping",)):
        yield RawFinding("DS192", "error", ("gradient_clipping",), f"gradient_clipping is {clip}: DeepSpeed clips only "
                         "when it is > 0, so a negative value silently turns clipping off", "use 0 to disable clipping "
                         "explicitly, or a positive norm such as 1.0")
    keep = v.get("data_types", "keep_in_fp32_modules")
    patterns = isinstance(keep, list) and all(isinstance(n, str) for n in keep)
    if keep is not MISSING and keep != "auto" and not patterns:
        yield RawFinding(
            "DS110", "error", ("data_types", "keep_in_fp32_modules"), "`data_types.keep_in_fp32_modules` must "
            "be \"auto\" or a list of name patterns: DeepSpeed refuses anything else")

