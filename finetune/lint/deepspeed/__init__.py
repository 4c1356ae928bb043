"""DeepSpeed config rules (DS100-DS193): the verdict DeepSpeed, HF and accelerate would give, before launch.

A config is judged the way `finetune train` uses it (ctx.hf_integration=True):

1. transformers and accelerate read the file with `json.load` (duplicate keys: the last one wins),
2. `HfTrainerDeepSpeedConfig.trainer_config_process/finalize` fill `"auto"` values from
   TrainingArguments and record mismatches between concrete values and TrainingArguments (ValueError),
3. accelerate's `DeepSpeedPlugin` requires a `zero_optimization` block, defaults a few keys
   (`gradient_accumulation_steps` -> 1 when absent, `"auto"` stage -> 2) and, in `_prepare_deepspeed`,
   raises for every `"auto"` that nobody filled,
4. `deepspeed.initialize` validates the dict: `DeepSpeedConfig` (pydantic models with extra="forbid"
   for zero_optimization/fp16/bf16/...; asserts on batch sizes) and the engine, which builds the
   optimizer and scheduler named in the file.

With ctx.hf_integration=False the file goes straight to `deepspeed.initialize`: nobody fills "auto",
and DeepSpeed's pydantic sections silently drop "auto" values (config_utils.DeepSpeedConfigModel).

The rules also flag what those libraries accept silently but is almost always a mistake: a misspelled
key (DeepSpeed ignores unknown top-level keys, and drops misspelled zero keys whose value is "auto"),
offload at a ZeRO stage that ignores it, `"stage": "3"` (ZeRO-3 for DeepSpeed, not for the HF model
loader), duplicate keys, NVMe offload without a path, a negative gradient_clipping, ...

Pure Python, no torch/deepspeed import: DeepSpeed's schema is written out as data (deepspeed 0.19) in
schema.py. Each rule is a function registered for one phase (view.PHASES) that reads a read-only ConfigView
and yields findings: structure.py (duplicate, removed and unknown keys, types), setup.py (HF Trainer +
accelerate, batch sizes, precision, ZeRO and offload, misc), optimizer.py (optimizer, scheduler) and auto.py
("auto" values, last); values.py holds the value parsing and message helpers.
tests/lint/test_deepspeed.py compares the schema tables with the installed DeepSpeed and checks the verdict
against DeepSpeed + HF + accelerate on a corpus of configs, so the two cannot drift apart.
"""

from __future__ import annotations

from typing import Optional

# The rule modules register their rules on import (view.rule); the phases fix the order they run in.
from finetune.lint.deepspeed import auto, optimizer, setup, structure  # noqa: F401
from finetune.lint.deepspeed.context import DSContext, RawFinding
from finetune.lint.deepspeed.values import json_type
from finetune.lint.deepspeed.view import run

__all__ = ["DSContext", "RULES", "RawFinding", "check_config"]

RULES: dict[str, str] = {
    "DS100": "The config is not a JSON object.",
    "DS101": "Duplicate key: DeepSpeed rejects it when it reads the file, HF/accelerate (json.load) keep the last value.",
    "DS102": "A key for a feature DeepSpeed has removed (DeepSpeed refuses the file).",
    "DS103": "Unknown key in a section DeepSpeed validates strictly (zero_optimization, offload_*, fp16, bf16, ...).",
    "DS104": "Misspelled key whose value is \"auto\": DeepSpeed drops it unvalidated (accelerate fails on it under HF).",
    "DS105": "Unknown key that DeepSpeed ignores (error when it is a likely misspelling of a real key).",
    "DS110": "Wrong type for a key (DeepSpeed or HF refuses it, crashes on it, or reads it differently).",
    "DS111": "Number out of the range DeepSpeed accepts.",
    "DS112": "Value not among the choices DeepSpeed accepts (stage, offload device, dtype names, ...).",
    "DS113": "A value DeepSpeed converts silently (a string or 0/1 where a number or boolean belongs).",
    "DS115": "`zero_optimization.stage` is not an integer: DeepSpeed converts it, HF's ZeRO-3 detection does not.",
    "DS120": "fp16 and bf16 both enabled.",
    "DS121": "Batch sizes that break train_batch_size = micro batch x gradient accumulation x world size.",
    "DS122": "Neither train_batch_size nor train_micro_batch_size_per_gpu given.",
    "DS123": "A batch size or gradient_accumulation_steps that is not positive.",
    "DS124": "train_batch_size is not a multiple of micro batch x gradient accumulation (no world size fits).",
    "DS125": "gradient_accumulation_steps missing: accelerate writes 1 into DeepSpeed's config.",
    "DS130": "No zero_optimization block: HF/accelerate refuse the config.",
    "DS131": "offload_optimizer at ZeRO stage 0: DeepSpeed builds a CPU optimizer for GPU parameters and fails at the first step.",
    "DS132": "offload_param below ZeRO stage 3: silently ignored, parameters stay on the GPU.",
    "DS133": "NVMe offload without a usable nvme_path.",
    "DS134": "Partial optimizer offload (ratio < 1) below ZeRO stage 3.",
    "DS135": "compute_grad_norm=false outside ZeRO stage 1/2.",
    "DS136": "fp16/bf16 master weights or bf16 optimizer states without the ZeRO stage or flag they need.",
    "DS137": "gradient_allreduce_op 'sum' with ZeRO stage 3.",
    "DS138": "Deprecated key (error when given together with its replacement).",
    "DS139": "A stage-3-only setting at a lower ZeRO stage (no effect).",
    "DS140": "allgather_bucket_size that the ZeRO stage 1/2 optimizer refuses (zero or odd).",
    "DS150": "Unknown optimizer type.",
    "DS151": "Optimizer parameter the optimizer DeepSpeed builds does not take.",
    "DS152": "max_grad_norm as an optimizer parameter (DeepSpeed refuses it; use gradient_clipping).",
    "DS153": "Optimizer ZeRO has not been tested with, without zero_allow_untested_optimizer.",
    "DS154": "LAMB with a static fp16 loss scale.",
    "DS155": "Optimizer offload with the Trainer's optimizer: accelerate swaps in DeepSpeedCPUAdam.",
    "DS156": "Deprecated `cpu_offload` with the Trainer's optimizer: accelerate does not swap it, DeepSpeed refuses it.",
    "DS157": "`torch_adam` that DeepSpeed reads the other way (the string \"false\" is true to `if torch_adam:`).",
    "DS160": "Unknown scheduler type.",
    "DS161": "Scheduler parameters the scheduler refuses (unknown or missing parameter, bad warmup).",
    "DS170": "\"auto\" where neither HF nor accelerate fills it in (accelerate stops with `not found in kwargs`).",
    "DS171": "\"auto\" inside a list: only a whole value can be \"auto\".",
    "DS172": "\"auto\" that accelerate fills with its own default, not from TrainingArguments.",
    "DS175": "\"auto\" in a config used without the HF integration (nothing fills it in).",
    "DS180": "Value that disagrees with TrainingArguments (HF refuses the config).",
    "DS190": "data_types.param_dtype that conflicts with the enabled fp16/bf16 mode.",
    "DS191": "data_types.grad_accum_dtype other than the model's dtype without ZeRO (stage 0).",
    "DS192": "Negative gradient_clipping (DeepSpeed silently disables clipping).",
    "DS193": "fp16 loss-scaling parameters DeepSpeed refuses.",
}


def check_config(config: object, ctx: Optional[DSContext] = None) -> list[RawFinding]:
    """Every problem in one DeepSpeed config, as DeepSpeed + HF + accelerate would see them (and more)."""
    ctx = ctx or DSContext()
    if not isinstance(config, dict):
        kind = "empty" if config is None else f"a JSON {json_type(config)}"
        return [RawFinding("DS100", "error", (), f"a DeepSpeed config must be a JSON object, this file is {kind}",
                           'start from {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"}')]
    return run(config, ctx)
