"""DeepSpeed config rules for the optimizer and scheduler blocks DeepSpeed builds itself (DS150-DS161).

Phases "optimizer" and "scheduler" (finetune.lint.deepspeed.view.PHASES).
"""

from __future__ import annotations

from typing import Generator, Iterator, Optional

from finetune.lint.deepspeed.context import RawFinding
from finetune.lint.deepspeed.schema import (
    ADAM_POPPED, DEEPSPEED_OPTIMIZERS, DEEPSPEED_SCHEDULERS, OPTIMIZER_PARAMS, TORCH_OPTIMIZERS, TORCH_SCHEDULERS,
    ZERO_TESTED_TYPES)
from finetune.lint.deepspeed.values import MISSING, as_bool, show, suggest
from finetune.lint.deepspeed.view import ConfigView, Seen, rule
from finetune.render import optimizer_class


# What a block with no `type` gets: rule, message, the note added under HF, the fix under HF, the fix without.
_NO_TYPE = {
    "optimizer": ("DS150", "the `optimizer` block has no `type`: DeepSpeed has nothing to build",
                  " (and HF has already handed the optimizer over to the config)",
                  'add "type": "AdamW", or delete the block to use the Trainer\'s optimizer', 'add "type": "AdamW"'),
    "scheduler": ("DS160", "the `scheduler` block has no `type`", "",
                  'add "type": "WarmupDecayLR", or delete the block to use the Trainer\'s scheduler',
                  'add "type": "WarmupLR"'),
}


# ------------------------------------------------------------------------------------------
# Optimizer (DS150-DS157)

def block_type(v: ConfigView, block_name: str) -> Generator[RawFinding, None, Optional[str]]:
    """The `type` of the optimizer or scheduler block, or None when nothing more is to be checked: no block,
    no type (reported here), or a type DS110 / DS170 have already reported."""
    block = v.config.get(block_name)
    if not isinstance(block, dict):
        return None
    name = block.get("type", MISSING)
    if name is MISSING:
        rule_id, message, hf_note, hf_fix, raw_fix = _NO_TYPE[block_name]
        yield RawFinding(rule_id, "error", (block_name,), message + (hf_note if v.hf else ""),
                         hf_fix if v.hf else raw_fix)
        return None
    if not isinstance(name, str) or name == "auto":
        return None  # DS110 / DS170 already
    return name


@rule("optimizer")
def optimizer(v: ConfigView, seen: Seen) -> Iterator[RawFinding]:
    name = yield from block_type(v, "optimizer")
    if name is None:
        return
    block = v.config["optimizer"]
    lower = name.lower()
    if lower in DEEPSPEED_OPTIMIZERS:
        kind = lower
    elif name in TORCH_OPTIMIZERS:
        kind = name
    else:
        choices = ["Adam", "AdamW", "Lion", "Adagrad", "Lamb", *TORCH_OPTIMIZERS]
        suggestion = suggest(name, choices, case_insensitive=True)
        yield RawFinding(
            "DS150", "error", ("optimizer", "type"), f"unknown optimizer type {show(name)}: DeepSpeed knows "
            f"{', '.join(sorted(DEEPSPEED_OPTIMIZERS))} (any case) and torch.optim classes by their exact "
            "name (SGD, RMSprop, ...)", f"did you mean {show(suggestion)}?" if suggestion else None)
        return
    params = block.get("params")
    if isinstance(params, dict):
        if "max_grad_norm" in params:
            yield RawFinding(
                "DS152", "error", ("optimizer", "params", "max_grad_norm"), "`max_grad_norm` is not an "
                "optimizer parameter for DeepSpeed: it refuses it", 'delete it and set "gradient_clipping"')
        flag = params.get("torch_adam")
        if kind in ("adam", "adamw") and not isinstance(flag, bool) and as_bool(flag) not in (None, bool(flag)):
            yield RawFinding(
                "DS157", "warning", ("optimizer", "params", "torch_adam"), f"`torch_adam` is {show(flag)}, which "
                f"DeepSpeed reads as Python does (`if torch_adam:`): {bool(flag)}, so it steps "
                f"{optimizer_class(v.config)}", f"write {str(as_bool(flag)).lower()} (a JSON/YAML boolean)")
        yield from optimizer_params(v, kind, params)
    if v.stage and kind not in ZERO_TESTED_TYPES and \
            as_bool(v.config.get("zero_allow_untested_optimizer", False)) is not True:
        yield RawFinding("DS153", "error", ("optimizer", "type"), f"ZeRO has not been tested with {name}: DeepSpeed "
                         'refuses it unless the config says "zero_allow_untested_optimizer": true',
                         'add "zero_allow_untested_optimizer": true, or use AdamW')
    if kind == "lamb":
        scale = v.get("fp16", "loss_scale")
        if isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale != 0:
            yield RawFinding("DS154", "error", ("fp16", "loss_scale"), "DeepSpeed's LAMB needs dynamic loss scaling, "
                             f"but fp16.loss_scale is {scale}", "set loss_scale to 0")


def optimizer_params(v: ConfigView, kind: str, params: dict) -> Iterator[RawFinding]:
    cls = optimizer_class(v.config)
    if cls not in OPTIMIZER_PARAMS:
        return  # torch.optim classes and mu* optimizers: their signatures are not tracked here
    offload = v.device("offload_optimizer") in ("cpu", "nvme")
    popped: set = set()
    if kind in ("adam", "adamw"):
        popped = ADAM_POPPED | ({"foreach"} if cls == "torch.optim.AdamW" else set())
    allowed = OPTIMIZER_PARAMS[cls] | popped
    for key in params:
        if key in allowed or key == "max_grad_norm":
            continue
        suggestion = suggest(str(key), sorted(allowed))
        yield RawFinding(
            "DS151", "error", ("optimizer", "params", key), f"`{key}` is not a parameter of {cls}, which "
            f"DeepSpeed builds for type {show(v.config['optimizer'].get('type'))}"
            + (" with optimizer offload" if offload and cls.startswith("DeepSpeedCPU") else "")
            + ": the optimizer refuses it (TypeError at deepspeed.initialize)",
            f"did you mean `{suggestion}`?" if suggestion else f"valid: {', '.join(sorted(allowed - popped))}")

# ------------------------------------------------------------------------------------------
# Scheduler (DS160, DS161)

@rule("scheduler")
def scheduler(v: ConfigView, seen: Seen) -> Iterator[RawFinding]:
    name = yield from block_type(v, "scheduler")
    if name is None:
        return
    block = v.config["scheduler"]
    if name not in DEEPSPEED_SCHEDULERS and name not in TORCH_SCHEDULERS:
        suggestion = suggest(name, [*DEEPSPEED_SCHEDULERS, *TORCH_SCHEDULERS], case_insensitive=True)
        yield RawFinding("DS160", "error", ("scheduler", "type"), f"unknown scheduler type {show(name)}: DeepSpeed "
                         f"knows {', '.join(DEEPSPEED_SCHEDULERS)} and torch.optim.lr_scheduler classes (exact name)",
                         f"did you mean {show(suggestion)}?" if suggestion else None)
        return
    params = block.get("params")
    if params is None:
        # engine._scheduler_from_config calls scheduler(optimizer, **params): None is a TypeError
        yield RawFinding("DS161", "error", ("scheduler",), f"the `scheduler` block has no `params`: DeepSpeed calls "
                         f"{name}(optimizer, **params) and fails on the missing object",
                         'add "params": {} (or the parameters you want)')
    elif name in DEEPSPEED_SCHEDULERS and isinstance(params, dict):
        yield from scheduler_params(v, name, params)


def scheduler_params(v: ConfigView, name: str, params: dict) -> Iterator[RawFinding]:
    signature = DEEPSPEED_SCHEDULERS[name]
    for key in params:
        if key not in signature:
            suggestion = suggest(str(key), list(signature))
            why = (" (HF fills warmup_min_lr/warmup_max_lr, but WarmupCosineLR takes ratios)"
                   if name == "WarmupCosineLR" and key in ("warmup_min_lr", "warmup_max_lr") else "")
            yield RawFinding(
                "DS161", "error", ("scheduler", "params", key), f"{name} has no parameter `{key}`{why}: it "
                "refuses it (TypeError at deepspeed.initialize)",
                f"did you mean `{suggestion}`?" if suggestion else f"valid: {', '.join(signature)}")
    for key, required in signature.items():
        if required and key not in params:
            yield RawFinding("DS161", "error", ("scheduler", "params"), f"{name} needs `{key}`",
                             f'add "{key}": "auto"' if v.hf else f'add "{key}"')
    steps = params.get("warmup_num_steps", MISSING)
    if steps is not MISSING and steps != "auto" and "warmup_num_steps" in signature:
        if not isinstance(steps, int) or isinstance(steps, bool) or steps <= 0:
            yield RawFinding("DS161", "error", ("scheduler", "params", "warmup_num_steps"), f"warmup_num_steps is "
                             f"{show(steps)}: {name} needs a positive integer", '"auto", or a whole number >= 1')
    warmup_type = params.get("warmup_type", MISSING)
    if warmup_type is not MISSING and warmup_type != "auto" and "warmup_type" in signature and \
            warmup_type not in ("log", "linear"):
        yield RawFinding("DS161", "warning", ("scheduler", "params", "warmup_type"), f"warmup_type {show(warmup_type)} "
                         "is unknown: DeepSpeed falls back to log", 'use "linear" or "log"')
