"""DeepSpeed config rules (DS1xx-DS1xx): the verdict DeepSpeed, HF and accelerate would give, before launch.

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
ds_schema.py; the structural checks (keys, types, sections) are in ds_structure.py, the value helpers in
ds_values.py, and the semantic rules here. tests/test_lint_deepspeed.py compares those tables with the
installed DeepSpeed and checks the verdict against DeepSpeed + HF + accelerate on a corpus of configs, so
the two cannot drift apart.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from finetune.lint.ds_context import DSContext, RawFinding
from finetune.lint.ds_schema import (
    ACCELERATE_DEFAULTS, BATCH_KEYS, DEEPSPEED_OPTIMIZERS, DEEPSPEED_SCHEDULERS, DTYPE_NAMES, HF_FILLED,
    OFFLOAD_DEVICES, OPTIMIZER_PARAMS, TORCH_OPTIMIZERS, TORCH_SCHEDULERS, ZERO_FIELD_NAMES,
    ZERO_TESTED_TYPES, _ADAM_POPPED)
from finetune.lint.ds_structure import StructureChecks
from finetune.lint.ds_values import (
    MISSING, UNKNOWN, _as_bool, _as_int, _auto_leaves, _batch_fix, _dotted, _json_type, _parse_number,
    _pydantic, _show, _suggest, _training_args, _warmup_steps)


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


# ----------------------------------------------------------------------------------------------
# Entry point


# What a block with no `type` gets: rule, message, the note added under HF, the fix under HF, the fix without.
_NO_TYPE = {
    "optimizer": ("DS150", "the `optimizer` block has no `type`: DeepSpeed has nothing to build",
                  " (and HF has already handed the optimizer over to the config)",
                  'add "type": "AdamW", or delete the block to use the Trainer\'s optimizer', 'add "type": "AdamW"'),
    "scheduler": ("DS160", "the `scheduler` block has no `type`", "",
                  'add "type": "WarmupDecayLR", or delete the block to use the Trainer\'s scheduler',
                  'add "type": "WarmupLR"'),
}


def check_config(config: object, ctx: Optional[DSContext] = None) -> list[RawFinding]:
    """Every problem in one DeepSpeed config, as DeepSpeed + HF + accelerate would see them (and more)."""
    ctx = ctx or DSContext()
    if not isinstance(config, dict):
        kind = "empty" if config is None else f"a JSON {_json_type(config)}"
        return [RawFinding("DS100", "error", (), f"a DeepSpeed config must be a JSON object, this file is {kind}",
                           'start from {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"}')]
    return _Checker(config, ctx).run()


class _Checker(StructureChecks):
    def __init__(self, config: dict, ctx: DSContext):
        self.config = config
        self.ctx = ctx
        self.hf = ctx.hf_integration
        self.ta = _training_args(ctx.training_args) if (ctx.training_args is not None and self.hf) else None
        self.findings: list[RawFinding] = []
        self.claimed: set[tuple] = set()  # key paths already reported (the "auto" pass skips them)
        self.accumulation_missing = False  # DS125 error: the batch check fails because of it
        self.unknown_paths: set[tuple] = set()  # unknown keys: nothing below them is judged again

    def add(self, rule: str, severity: str, key: tuple, message: str, fix: Optional[str] = None) -> None:
        self.findings.append(RawFinding(rule, severity, tuple(key), message, fix))
        self.claimed.add(tuple(key))

    def run(self) -> list[RawFinding]:
        self.duplicates()
        self.structure()
        self.stage = self.effective_stage()
        self.hf_rules()
        self.batch_rules()
        self.precision_rules()
        self.zero_rules()
        self.optimizer_rules()
        self.scheduler_rules()
        self.misc_rules()
        self.auto_rules()
        return self.findings

    # ------------------------------------------------------------------------------------------
    # Reading values

    def get(self, *path: Any, node: Any = MISSING) -> Any:
        node = self.config if node is MISSING else node
        for part in path:
            if not isinstance(node, dict) or part not in node:
                return MISSING
            node = node[part]
        return node

    def zero(self) -> dict:
        zero = self.config.get("zero_optimization")
        return zero if isinstance(zero, dict) else {}

    def effective_stage(self) -> Optional[int]:
        """The ZeRO stage DeepSpeed will run, or None when the value is invalid."""
        zero = self.config.get("zero_optimization", MISSING)
        if zero is MISSING or zero is None:
            return 0
        if isinstance(zero, bool):  # the deprecated `"zero_optimization": true` means stage 1
            return int(zero)
        if not isinstance(zero, dict):
            return None
        raw = zero.get("stage", 0)
        if raw == "auto":
            return 2 if self.hf else 0  # accelerate's default; raw DeepSpeed drops "auto" -> 0
        value = _as_int(raw, allow_bool=True)
        return value if value in (0, 1, 2, 3) else None

    def device(self, block: str) -> Optional[str]:
        """Effective offload device of zero_optimization.<block>: none, cpu, nvme, or None if invalid."""
        node = self.zero().get(block)
        if node is None or (not isinstance(node, dict)):
            return "none" if node is None else None
        device = node.get("device", "none")
        if device == "auto":
            return "none"  # accelerate's default, and raw DeepSpeed's after dropping "auto"
        return device if device in OFFLOAD_DEVICES else None

    def enabled(self, section: str) -> Any:
        """Whether fp16/bf16 ends up enabled: True, False or UNKNOWN."""
        block = self.config.get(section, MISSING)
        if section == "bf16" and block is MISSING and not self.hf:
            block = self.config.get("bfloat16", MISSING)  # DeepSpeed's legacy spelling
        if block is MISSING or (isinstance(block, dict) and "enabled" not in block):
            if self.hf and block is MISSING:
                # accelerate's set_mixed_precision adds the block from TrainingArguments
                return UNKNOWN if self.ta is None else bool(self.ta[section])
            return False
        if not isinstance(block, dict):
            return UNKNOWN
        value = block["enabled"]
        if value == "auto":
            if not self.hf:
                return False  # dropped by DeepSpeed -> disabled
            return UNKNOWN if self.ta is None else bool(self.ta[section] or self.ta[f"{section}_full_eval"])
        coerced = _as_bool(value)
        return UNKNOWN if coerced is None else coerced

    def resolved(self, path: tuple) -> Any:
        """A value after HF's fill (when TrainingArguments are known): MISSING, UNKNOWN or the value."""
        value = self.get(*path)
        if value != "auto":
            return value
        if not self.hf or self.ta is None:
            return UNKNOWN
        return self.hf_expected().get(path, (UNKNOWN, ""))[0]

    def hf_expected(self) -> dict[tuple, tuple[Any, str]]:
        """What HF's trainer_config_process/finalize fill "auto" with and compare concrete values against:
        key path -> (value, the TrainingArguments name HF shows in its mismatch message)."""
        ta, world = self.ta, self.ctx.world_size
        assert ta is not None
        expected: dict[tuple, tuple[Any, str]] = {
            ("train_micro_batch_size_per_gpu",): (ta["per_device_train_batch_size"], "per_device_train_batch_size"),
            ("gradient_accumulation_steps",): (ta["gradient_accumulation_steps"], "gradient_accumulation_steps"),
            ("gradient_clipping",): (ta["max_grad_norm"], "max_grad_norm"),
            ("optimizer", "params", "lr"): (ta["learning_rate"], "learning_rate"),
            ("optimizer", "params", "betas"): ([ta["adam_beta1"], ta["adam_beta2"]], "adam_beta1+adam_beta2"),
            ("optimizer", "params", "eps"): (ta["adam_epsilon"], "adam_epsilon"),
            ("optimizer", "params", "weight_decay"): (ta["weight_decay"], "weight_decay"),
            ("scheduler", "params", "warmup_max_lr"): (ta["learning_rate"], "learning_rate"),
            ("fp16", "enabled"): (bool(ta["fp16"] or ta["fp16_full_eval"]), "fp16|fp16_full_eval"),
            ("bf16", "enabled"): (bool(ta["bf16"] or ta["bf16_full_eval"]), "bf16|bf16_full_eval"),
        }
        micro, gas = _as_int(ta["per_device_train_batch_size"]), _as_int(ta["gradient_accumulation_steps"])
        if world and micro is not None and gas is not None:
            expected[("train_batch_size",)] = (world * micro * gas, "train_batch_size (calculated)")
        steps = _as_int(ta["max_steps"])
        if steps is not None and steps > 0:  # the Trainer's num_training_steps is max_steps when that is set
            expected[("scheduler", "params", "total_num_steps")] = (steps, "num_training_steps (calculated)")
            warmup = _warmup_steps(ta["warmup_steps"], steps)
            if warmup is not None:  # HF keeps it >= 1: deepspeed >= 0.19.6 refuses 0
                expected[("scheduler", "params", "warmup_num_steps")] = (max(1, warmup), "warmup_steps")
        return expected

    # ------------------------------------------------------------------------------------------
    # HF Trainer + accelerate (DS115, DS125, DS130, DS155, DS180)

    def hf_rules(self) -> None:
        if not self.hf:
            return
        if "zero_optimization" not in self.config:
            self.add("DS130", "error", (), "no `zero_optimization` block: accelerate's DeepSpeed plugin refuses the "
                     "config (\"Please specify the ZeRO optimization config\")",
                     'add "zero_optimization": {"stage": 0} for plain data parallelism, or the stage you want')
        if "gradient_accumulation_steps" not in self.config:
            self.missing_accumulation()
        if self.ta is not None:
            self.mismatches()
        self.client_optimizer_offload()

    def offload_by_deprecated_key(self) -> bool:
        """Optimizer offload asked for only with the deprecated `cpu_offload` (DeepSpeed maps it to
        offload_optimizer.device cpu in DeepSpeedZeroConfig; nothing else reads it)."""
        zero = self.zero()
        return "offload_optimizer" not in zero and _as_bool(zero.get("cpu_offload")) is True

    def missing_accumulation(self) -> None:
        """accelerate's DeepSpeedPlugin writes gradient_accumulation_steps=1 when the config has none.

        Since accelerate 1.8 (huggingface/accelerate#3630) the Trainer's own accumulation decides DeepSpeed's
        boundaries (engine.set_gradient_accumulation_boundary), so the training is the same and only
        DeepSpeed's bookkeeping (train_batch_size, sample counts, its monitors) is off. Before 1.8 the
        engine stepped the optimizer on every micro-batch. A train_batch_size fails DeepSpeed's batch check.
        """
        gas = None if self.ta is None else self.ta["gradient_accumulation_steps"]
        fix = 'add "gradient_accumulation_steps": "auto"'
        if gas is not None and _as_int(gas) == 1:
            return
        if gas is not None and "train_batch_size" in self.config:
            self.add("DS125", "error", (), f"no `gradient_accumulation_steps`: accelerate writes 1 into the config, "
                     f"while `train_batch_size` counts TrainingArguments' {gas}; DeepSpeed's check "
                     "train_batch_size = micro batch x accumulation x world size fails at launch", fix)
            self.accumulation_missing = True
            return
        said = "whatever TrainingArguments say" if gas is None else f"not TrainingArguments' {gas}"
        self.add("DS125", "warning", (), f"no `gradient_accumulation_steps`: accelerate writes 1 into the config, "
                 f"{said}. With accelerate >= 1.8 the Trainer still accumulates (only DeepSpeed's batch size and "
                 "sample counts are wrong); older accelerate steps the optimizer on every micro-batch", fix)

    def mismatches(self) -> None:
        """HfTrainerDeepSpeedConfig.fill_match: a concrete value that differs from TrainingArguments."""
        for path, (hf_value, hf_key) in self.hf_expected().items():
            parent = self.get(*path[:-1]) if len(path) > 1 else self.config
            if not isinstance(parent, dict):
                continue
            value = parent.get(path[-1])
            if value is None or value == "auto" or (isinstance(value, list) and "auto" in value):
                continue  # "auto" inside a list is DS171's
            if path in self.claimed:
                continue  # already reported as a wrong type; one finding per mistake
            if value != hf_value:  # the same comparison HF makes (so 1 == 1.0 and true == 1)
                where = ("the recipe's training settings" if self.ctx.from_recipe else "TrainingArguments")
                self.add("DS180", "error", path, f"`{_dotted(path)}` is {_show(value)} but {where} give {hf_key}="
                         f"{_show(hf_value)}: the HF Trainer refuses mismatches",
                         f'set it to "auto" (or {_show(hf_value)})')

    def client_optimizer_offload(self) -> None:
        if "optimizer" in self.config:
            return
        if self.offload_by_deprecated_key() and _as_bool(self.config.get("zero_force_ds_cpu_optimizer", True)) is not False:
            self.add("DS156", "error", ("zero_optimization", "cpu_offload"),
                     "`cpu_offload: true` without an `optimizer` block: DeepSpeed reads it as optimizer offload to "
                     "the CPU, but accelerate swaps the Trainer's optimizer for DeepSpeedCPUAdam only when "
                     "`offload_optimizer.device` says so, and deepspeed.initialize refuses the Trainer's optimizer "
                     "(ZeRORuntimeException: \"ZeRO-Offload with a client provided optimizer\")",
                     'replace it with "offload_optimizer": {"device": "cpu"}, or add an "optimizer" block')
            return
        if self.device("offload_optimizer") not in ("cpu", "nvme"):
            return
        if self.stage == 0:
            return  # DS131 covers it
        if _as_bool(self.config.get("zero_force_ds_cpu_optimizer", True)) is False:
            return
        optim = "" if self.ta is None else str(self.ctx.training_args.get("optim", "adamw_torch"))
        # accelerate keeps AdamW semantics only for torch's AdamW (and 32-bit bitsandbytes AdamW)
        torch_adamw = optim.startswith("adamw_torch") or optim in ("adamw_hf", "")
        severity = "warning" if torch_adamw else "error"
        self.add("DS155", severity, ("zero_optimization", "offload_optimizer"),
                 "optimizer offload without an `optimizer` block: the HF Trainer builds its own optimizer"
                 + (f" ({optim})" if optim else "") + ", and accelerate replaces it with DeepSpeedCPUAdam, keeping "
                 "only lr and weight_decay (betas and eps fall back to Adam's defaults; a non-AdamW optimizer becomes Adam)",
                 'add an "optimizer" block (type AdamW with "auto" params), or set "zero_force_ds_cpu_optimizer": '
                 "false to keep the Trainer's optimizer (slow on CPU)")

    # ------------------------------------------------------------------------------------------
    # Batch sizes (DS121-DS124): runtime/config.py _set_batch_related_parameters + _batch_assertion

    def batch_rules(self) -> None:
        values: dict[str, Any] = {}
        for key in BATCH_KEYS:
            value = self.resolved((key,))
            if key == "gradient_accumulation_steps" and value is MISSING and self.hf:
                value = 1  # accelerate's DeepSpeedPlugin adds it
            if value is not MISSING and value is not UNKNOWN:
                number = _as_int(value) if isinstance(value, (int, float)) else None
                if number is None or isinstance(value, bool):
                    value = UNKNOWN  # a type error, reported by structure()
                else:
                    if number <= 0 and (key,) not in self.claimed:
                        self.add("DS123", "error", (key,), f"`{key}` is {_show(value)}: DeepSpeed needs it > 0")
                    value = number if number > 0 else UNKNOWN
            values[key] = value
        train, micro, gas = (values[k] for k in BATCH_KEYS)
        if train is MISSING and micro is MISSING:
            self.add("DS122", "error", (), "neither `train_batch_size` nor `train_micro_batch_size_per_gpu` is set: "
                     "DeepSpeed needs one of them", 'add "train_micro_batch_size_per_gpu": "auto"' if self.hf else
                     'add "train_micro_batch_size_per_gpu": 1')
            return
        if UNKNOWN in (train, micro, gas):
            return
        if any(f.rule == "DS180" and f.key in {(k,) for k in BATCH_KEYS} for f in self.findings):
            return  # HF stops first, with the mismatch
        world = self.ctx.world_size
        if world:
            self.batch_arithmetic(train, micro, gas, world)
        elif MISSING not in (train, micro, gas) and train % (micro * gas):
            self.add("DS124", "error", ("train_batch_size",), f"train_batch_size {train} is not a multiple of micro "
                     f"batch {micro} x gradient accumulation {gas}: no world size satisfies train_batch_size = "
                     "micro x accumulation x world size", _batch_fix(self.hf))

    def batch_arithmetic(self, train: Any, micro: Any, gas: Any, world: int) -> None:
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
        key = ("train_batch_size",) if "train_batch_size" in self.config else ()
        if micro <= 0 or gas <= 0:
            self.add("DS121", "error", key, f"with world size {world}, train_batch_size {train} leaves "
                     f"{'a micro batch' if micro <= 0 else 'gradient accumulation'} of 0{how}: DeepSpeed refuses it",
                     _batch_fix(self.hf))
        elif train != micro * gas * world and not self.accumulation_missing:  # DS125 says why
            self.add("DS121", "error", key, f"train_batch_size {train} != micro batch {micro} x gradient accumulation "
                     f"{gas} x world size {world} = {micro * gas * world}{how}: DeepSpeed refuses it",
                     _batch_fix(self.hf))

    # ------------------------------------------------------------------------------------------
    # Precision (DS120, DS136, DS190, DS193)

    def precision_rules(self) -> None:
        fp16, bf16 = self.enabled("fp16"), self.enabled("bf16")
        if fp16 is True and bf16 is True:
            key = ("fp16", "enabled") if self.get("fp16", "enabled") is not MISSING else ("fp16",)
            self.add("DS120", "error", key, "fp16 and bf16 are both enabled: DeepSpeed refuses the config "
                     "(and accelerate refuses it under the HF Trainer)",
                     'set one of them to false, or both to "auto" so TrainingArguments decide' if self.hf else
                     "set one of them to false")
        self.fp16_params(fp16)
        self.master_weights()
        self.param_dtype(fp16, bf16)
        self.grad_accum_dtype(fp16, bf16)

    def fp16_params(self, fp16_enabled: Any) -> None:
        """DeepSpeedFP16Config's validators (types and non-finite values are DS110/DS111 already)."""
        block = self.config.get("fp16")
        if not isinstance(block, dict):
            return
        loss_scale = block.get("loss_scale", 0)
        if isinstance(loss_scale, str):
            loss_scale = _parse_number(loss_scale)
        if not isinstance(loss_scale, (int, float)) or isinstance(loss_scale, bool) or not math.isfinite(loss_scale):
            return
        if loss_scale < 0:
            self.add("DS193", "error", ("fp16", "loss_scale"), f"`fp16.loss_scale` is {_show(block['loss_scale'])}: "
                     "DeepSpeed needs a number >= 0 (0 = dynamic loss scaling)", "use 0 (dynamic) or a positive scale")
            return
        if fp16_enabled is True and loss_scale == 0:
            for key in ("loss_scale_window", "min_loss_scale"):
                value = block.get(key)
                number = _as_int(value)
                if number is not None and not isinstance(value, bool) and number <= 0:
                    self.add("DS193", "error", ("fp16", key), f"`fp16.{key}` is {_show(value)}: with dynamic loss "
                             "scaling DeepSpeed needs it > 0", "delete it to use DeepSpeed's default")

    def master_weights(self) -> None:
        stage = self.stage
        checks = [("fp16", "fp16_master_weights_and_grads"), ("bf16", "bf16_master_weights_and_grads"),
                  ("bf16", "bf16_optimizer_states")]
        for section, key in checks:
            if _as_bool(self.get(section, key)) is True and stage == 0:
                self.add("DS136", "error", (section, key), f"`{section}.{key}` needs ZeRO stage 1, 2 or 3: "
                         "DeepSpeed refuses it at stage 0")
        if _as_bool(self.get("bf16", "bf16_optimizer_states")) is True and \
                _as_bool(self.get("bf16", "bf16_master_weights_and_grads")) is not True:
            self.add("DS136", "error", ("bf16", "bf16_optimizer_states"), "`bf16.bf16_optimizer_states` needs "
                     "`bf16.bf16_master_weights_and_grads`: DeepSpeed refuses it alone",
                     'add "bf16_master_weights_and_grads": true')

    def param_dtype(self, fp16: Any, bf16: Any) -> None:
        value = self.get("data_types", "param_dtype")
        if not isinstance(value, str) or value not in DTYPE_NAMES or UNKNOWN in (fp16, bf16):
            return
        mode = "fp16" if fp16 else "bf16" if bf16 else "fp32"
        if DTYPE_NAMES[value] != mode:
            self.add("DS190", "error", ("data_types", "param_dtype"), f"`data_types.param_dtype` is {_show(value)} "
                     f"but the enabled precision is {mode}: DeepSpeed refuses the combination",
                     "delete param_dtype (it follows the fp16/bf16 setting)")

    def grad_accum_dtype(self, fp16: Any, bf16: Any) -> None:
        """engine._do_optimizer_sanity_check: without ZeRO, only the model's own dtype can accumulate."""
        value = self.get("data_types", "grad_accum_dtype")
        if not isinstance(value, str) or value not in DTYPE_NAMES or UNKNOWN in (fp16, bf16) or self.stage != 0:
            return
        mode = "fp16" if fp16 else "bf16" if bf16 else "fp32"
        if DTYPE_NAMES[value] != mode:
            self.add("DS191", "error", ("data_types", "grad_accum_dtype"), f"`data_types.grad_accum_dtype` is "
                     f"{_show(value)} but the model trains in {mode} at ZeRO stage 0: deepspeed.initialize raises "
                     "NotImplementedError (\"unsupported mix of model_dtype and grad_accum_dtype\")",
                     "delete grad_accum_dtype, or use ZeRO stage 1 or higher (which accumulates in fp32)")

    # ------------------------------------------------------------------------------------------
    # ZeRO and offload (DS131-DS140)

    def zero_rules(self) -> None:
        zero, stage = self.zero(), self.stage
        if not zero or stage is None:
            return
        opt_device, param_device = self.device("offload_optimizer"), self.device("offload_param")
        if opt_device in ("cpu", "nvme") and stage == 0:
            self.add("DS131", "error", ("zero_optimization", "offload_optimizer"), "optimizer offload at ZeRO stage 0: "
                     "DeepSpeed builds its CPU optimizer for parameters that stay on the GPU, and the first "
                     "optimizer step fails (\"CPUAdam param is on cuda and must be 'cpu'\")",
                     "use stage 1 or higher, or remove offload_optimizer")
        if param_device in ("cpu", "nvme") and stage in (0, 1, 2):
            self.add("DS132", "error", ("zero_optimization", "offload_param"), f"parameter offload at ZeRO stage "
                     f"{stage} is silently ignored: only stage 3 partitions and offloads parameters, so they stay "
                     "on the GPU", "use stage 3, or remove offload_param")
        for block, device in (("offload_optimizer", opt_device), ("offload_param", param_device)):
            if device == "nvme":
                self.nvme_path(block)
        ratio = self.get("zero_optimization", "offload_optimizer", "ratio")
        if isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and ratio < 1 and stage != 3:
            self.add("DS134", "error", ("zero_optimization", "offload_optimizer", "ratio"), "partial optimizer offload "
                     f"(ratio {ratio}) works only with ZeRO stage 3: DeepSpeed refuses it at stage {stage}",
                     "delete ratio, or use stage 3")
        if _as_bool(zero.get("compute_grad_norm", True)) is False and stage not in (1, 2):
            self.add("DS135", "error", ("zero_optimization", "compute_grad_norm"), "compute_grad_norm=false is "
                     f"supported only with ZeRO stage 1 or 2: DeepSpeed refuses it at stage {stage}",
                     "delete compute_grad_norm")
        self.allgather_bucket(stage)
        if stage in (1, 2):
            for key, value in zero.items():
                if (str(key).startswith("stage3_") or key in ZERO_FIELD_NAMES) and value != "auto" and \
                        (("zero_optimization", key)) not in self.claimed:
                    self.add("DS139", "info", ("zero_optimization", key), f"`{key}` only affects ZeRO stage 3; at "
                             f"stage {stage} it does nothing")

    def nvme_path(self, block: str) -> None:
        path = self.get("zero_optimization", block, "nvme_path")
        key = ("zero_optimization", block, "nvme_path")
        if path is MISSING or path is None:
            self.add("DS133", "error", ("zero_optimization", block, "device"), f"NVMe offload of {block[8:]} without "
                     "`nvme_path`: DeepSpeed has no directory to swap to and fails when it sets up offloading",
                     'add "nvme_path": "/local_nvme" (a directory on a fast local NVMe disk)')
        elif path == "auto" and self.hf:
            self.add("DS133", "error", key, "`nvme_path` \"auto\" is filled by accelerate with the string \"none\": "
                     "DeepSpeed would swap into a directory named `none` under the working directory",
                     "write the directory of a fast local NVMe disk")
        elif path == "auto":
            self.add("DS133", "error", key, "`nvme_path` \"auto\" is dropped by DeepSpeed, leaving no swap directory",
                     "write the directory of a fast local NVMe disk")
        elif isinstance(path, str) and path.strip().lower() in ("none", ""):
            self.add("DS133", "error", key, f"`nvme_path` is {_show(path)}: DeepSpeed would swap into the current "
                     "directory" + (" (a directory named `none`)" if path.strip() else ""),
                     "write the directory of a fast local NVMe disk")

    def allgather_bucket(self, stage: int) -> None:
        value = self.zero().get("allgather_bucket_size")
        number = _as_int(value)
        if stage not in (1, 2) or number is None or isinstance(value, bool) or number < 0:
            return
        if number == 0:
            self.add("DS140", "error", ("zero_optimization", "allgather_bucket_size"), "allgather_bucket_size 0: the "
                     "ZeRO stage 1/2 optimizer divides by it and fails when it starts", "delete it (default 5e8)")
        elif number % 2:
            self.add("DS140", "error", ("zero_optimization", "allgather_bucket_size"), f"allgather_bucket_size "
                     f"{number} is odd: the ZeRO stage 1/2 optimizer asserts it is a multiple of 2 (4-byte "
                     "aligned fp16 buffers)", f"use {number + 1}")

    # ------------------------------------------------------------------------------------------
    # Optimizer (DS150-DS154)

    def block_type(self, block_name: str) -> Optional[str]:
        """The `type` of the optimizer or scheduler block, or None when nothing more is to be checked: no block,
        no type (reported here), or a type DS110 / DS170 have already reported."""
        block = self.config.get(block_name)
        if not isinstance(block, dict):
            return None
        name = block.get("type", MISSING)
        if name is MISSING:
            rule, message, hf_note, hf_fix, raw_fix = _NO_TYPE[block_name]
            self.add(rule, "error", (block_name,), message + (hf_note if self.hf else ""),
                     hf_fix if self.hf else raw_fix)
            return None
        if not isinstance(name, str) or name == "auto":
            return None  # DS110 / DS170 already
        return name

    def optimizer_rules(self) -> None:
        name = self.block_type("optimizer")
        if name is None:
            return
        block = self.config["optimizer"]
        lower = name.lower()
        if lower in DEEPSPEED_OPTIMIZERS:
            kind = lower
        elif name in TORCH_OPTIMIZERS:
            kind = name
        else:
            choices = ["Adam", "AdamW", "Lion", "Adagrad", "Lamb", *TORCH_OPTIMIZERS]
            suggestion = _suggest(name, choices, case_insensitive=True)
            self.add("DS150", "error", ("optimizer", "type"), f"unknown optimizer type {_show(name)}: DeepSpeed knows "
                     f"{', '.join(sorted(DEEPSPEED_OPTIMIZERS))} (any case) and torch.optim classes by their exact "
                     "name (SGD, RMSprop, ...)", f"did you mean {_show(suggestion)}?" if suggestion else None)
            return
        params = block.get("params")
        if isinstance(params, dict):
            if "max_grad_norm" in params:
                self.add("DS152", "error", ("optimizer", "params", "max_grad_norm"), "`max_grad_norm` is not an "
                         "optimizer parameter for DeepSpeed: it refuses it", 'delete it and set "gradient_clipping"')
            self.optimizer_params(kind, params)
        if self.stage and kind not in ZERO_TESTED_TYPES and \
                _as_bool(self.config.get("zero_allow_untested_optimizer", False)) is not True:
            self.add("DS153", "error", ("optimizer", "type"), f"ZeRO has not been tested with {name}: DeepSpeed "
                     'refuses it unless the config says "zero_allow_untested_optimizer": true',
                     'add "zero_allow_untested_optimizer": true, or use AdamW')
        if kind == "lamb":
            scale = self.get("fp16", "loss_scale")
            if isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale != 0:
                self.add("DS154", "error", ("fp16", "loss_scale"), "DeepSpeed's LAMB needs dynamic loss scaling, "
                         f"but fp16.loss_scale is {scale}", "set loss_scale to 0")

    def optimizer_params(self, kind: str, params: dict) -> None:
        offload = self.device("offload_optimizer") in ("cpu", "nvme")
        popped: set = set()
        if kind in ("adam", "adamw"):
            popped = _ADAM_POPPED
            if _as_bool(params.get("torch_adam", False)) is True:
                cls = "torch.optim.AdamW"
                popped = popped | {"foreach"}
            else:
                cls = "DeepSpeedCPUAdam" if offload else "FusedAdam"
        elif kind == "lion":
            cls = "DeepSpeedCPULion" if offload else "FusedLion"
        elif kind == "adagrad":
            cls = "DeepSpeedCPUAdagrad" if offload else "torch.optim.Adagrad"
        elif kind == "lamb":
            cls = "FusedLamb"
        else:
            return  # torch.optim classes and mu* optimizers: their signatures are not tracked here
        allowed = OPTIMIZER_PARAMS[cls] | popped
        for key in params:
            if key in allowed or key == "max_grad_norm":
                continue
            suggestion = _suggest(str(key), sorted(allowed))
            self.add("DS151", "error", ("optimizer", "params", key), f"`{key}` is not a parameter of {cls}, which "
                     f"DeepSpeed builds for type {_show(self.config['optimizer'].get('type'))}"
                     + (" with optimizer offload" if offload and cls.startswith("DeepSpeedCPU") else "")
                     + ": the optimizer refuses it (TypeError at deepspeed.initialize)",
                     f"did you mean `{suggestion}`?" if suggestion else f"valid: {', '.join(sorted(allowed - popped))}")

    # ------------------------------------------------------------------------------------------
    # Scheduler (DS160, DS161)

    def scheduler_rules(self) -> None:
        name = self.block_type("scheduler")
        if name is None:
            return
        block = self.config["scheduler"]
        if name not in DEEPSPEED_SCHEDULERS and name not in TORCH_SCHEDULERS:
            suggestion = _suggest(name, [*DEEPSPEED_SCHEDULERS, *TORCH_SCHEDULERS], case_insensitive=True)
            self.add("DS160", "error", ("scheduler", "type"), f"unknown scheduler type {_show(name)}: DeepSpeed "
                     f"knows {', '.join(DEEPSPEED_SCHEDULERS)} and torch.optim.lr_scheduler classes (exact name)",
                     f"did you mean {_show(suggestion)}?" if suggestion else None)
            return
        params = block.get("params")
        if params is None:
            # engine._scheduler_from_config calls scheduler(optimizer, **params): None is a TypeError
            self.add("DS161", "error", ("scheduler",), f"the `scheduler` block has no `params`: DeepSpeed calls "
                     f"{name}(optimizer, **params) and fails on the missing object",
                     'add "params": {} (or the parameters you want)')
        elif name in DEEPSPEED_SCHEDULERS and isinstance(params, dict):
            self.scheduler_params(name, params)

    def scheduler_params(self, name: str, params: dict) -> None:
        signature = DEEPSPEED_SCHEDULERS[name]
        for key in params:
            if key not in signature:
                suggestion = _suggest(str(key), list(signature))
                why = (" (HF fills warmup_min_lr/warmup_max_lr, but WarmupCosineLR takes ratios)"
                       if name == "WarmupCosineLR" and key in ("warmup_min_lr", "warmup_max_lr") else "")
                self.add("DS161", "error", ("scheduler", "params", key), f"{name} has no parameter `{key}`{why}: it "
                         "refuses it (TypeError at deepspeed.initialize)",
                         f"did you mean `{suggestion}`?" if suggestion else f"valid: {', '.join(signature)}")
        for key, required in signature.items():
            if required and key not in params:
                self.add("DS161", "error", ("scheduler", "params"), f"{name} needs `{key}`",
                         f'add "{key}": "auto"' if self.hf else f'add "{key}"')
        steps = params.get("warmup_num_steps", MISSING)
        if steps is not MISSING and steps != "auto" and "warmup_num_steps" in signature:
            if not isinstance(steps, int) or isinstance(steps, bool) or steps <= 0:
                self.add("DS161", "error", ("scheduler", "params", "warmup_num_steps"), f"warmup_num_steps is "
                         f"{_show(steps)}: {name} needs a positive integer", '"auto", or a whole number >= 1')
        warmup_type = params.get("warmup_type", MISSING)
        if warmup_type is not MISSING and warmup_type != "auto" and "warmup_type" in signature and \
                warmup_type not in ("log", "linear"):
            self.add("DS161", "warning", ("scheduler", "params", "warmup_type"), f"warmup_type {_show(warmup_type)} "
                     "is unknown: DeepSpeed falls back to log", 'use "linear" or "log"')

    # ------------------------------------------------------------------------------------------
    # Other DeepSpeed checks (DS137, DS192, keep_in_fp32_modules)

    def misc_rules(self) -> None:
        op = self.config.get("gradient_allreduce_op")
        if isinstance(op, str) and op.lower() == "sum" and self.stage == 3:
            self.add("DS137", "error", ("gradient_allreduce_op",), "gradient_allreduce_op 'sum' is not supported with "
                     "ZeRO stage 3: DeepSpeed refuses it", 'use "mean"')
        clip = self.config.get("gradient_clipping")
        if isinstance(clip, (int, float)) and not isinstance(clip, bool) and clip < 0 and \
                ("gradient_clipping",) not in self.claimed:
            self.add("DS192", "error", ("gradient_clipping",), f"gradient_clipping is {clip}: DeepSpeed clips only "
                     "when it is > 0, so a negative value silently turns clipping off", "use 0 to disable clipping "
                     "explicitly, or a positive norm such as 1.0")
        keep = self.get("data_types", "keep_in_fp32_modules")
        if keep is not MISSING and keep != "auto" and not (isinstance(keep, list) and all(isinstance(n, str) for n in keep)):
            self.add("DS110", "error", ("data_types", "keep_in_fp32_modules"), "`data_types.keep_in_fp32_modules` must "
                     "be \"auto\" or a list of name patterns: DeepSpeed refuses anything else")

    # ------------------------------------------------------------------------------------------
    # "auto" (DS170-DS175)

    def auto_rules(self) -> None:
        for path, in_list in _auto_leaves(self.config, ()):
            if path in self.claimed or (in_list and path[:-1] in self.claimed):
                continue
            if any(path[:n] in self.unknown_paths for n in range(1, len(path))):
                continue
            if in_list:
                parent = path[:-1]
                self.add("DS171", "error", parent, f"`{_dotted(parent)}` holds \"auto\" inside a list: HF and "
                         "accelerate only fill a whole value, so DeepSpeed gets the string \"auto\"",
                         f'write "{_dotted(parent)}": "auto" (the whole value) or the numbers')
                continue
            if self.hf:
                self.hf_auto(path)
            else:
                self.raw_auto(path)

    def hf_auto(self, path: tuple) -> None:
        if path in HF_FILLED:
            return
        if path in ACCELERATE_DEFAULTS:
            default, env = ACCELERATE_DEFAULTS[path]
            if path[-1] == "nvme_path":
                return  # DS133 judges it when the device is nvme; otherwise it is unused
            if path[-1] == "stage3_gather_16bit_weights_on_model_save":
                if self.stage == 3:
                    self.add("DS172", "warning", path, "`stage3_gather_16bit_weights_on_model_save` \"auto\" becomes "
                             f"accelerate's default false (or ${env}): at ZeRO-3 the Trainer then saves no "
                             "usable model weights, only the sharded checkpoint", "write true")
                return
            self.add("DS172", "warning", path, f"`{_dotted(path)}` \"auto\" is not taken from TrainingArguments: "
                     f"accelerate fills it with its own default {_show(default)} (or ${env})",
                     f"write the value you want, e.g. {_show(default)}")
            return
        if path == ("data_types", "keep_in_fp32_modules"):
            self.add("DS170", "error", path, "`data_types.keep_in_fp32_modules` \"auto\" is DeepSpeed's own default, "
                     "but under the HF Trainer accelerate treats every \"auto\" as a placeholder and stops "
                     "(\"`data_types.keep_in_fp32_modules` not found in kwargs\")",
                     "delete the key: DeepSpeed's default is already \"auto\"")
            return
        self.add("DS170", "error", path, f"`{_dotted(path)}` is \"auto\", but neither HF nor accelerate fills this "
                 "key: accelerate stops with \"`" + _dotted(path) + "` not found in kwargs\"",
                 "write a concrete value (\"auto\" works for batch sizes, gradient_clipping, fp16/bf16.enabled, "
                 "optimizer lr/betas/eps/weight_decay, scheduler warmup/total steps and the ZeRO bucket sizes)")

    def raw_auto(self, path: tuple) -> None:
        fix = "write a concrete value: without the HF Trainer nothing replaces \"auto\""
        if not _pydantic(path):
            self.add("DS175", "error", path, f"`{_dotted(path)}` is \"auto\", but without the HF integration nothing "
                     "fills it in: DeepSpeed gets the string \"auto\" and fails or misbehaves with it", fix)
        elif path[-1] in ("enabled", "stage", "device"):
            meaning = {"enabled": "disabled", "stage": "stage 0 (no ZeRO)", "device": "no offload"}[path[-1]]
            self.add("DS175", "error", path, f"`{_dotted(path)}` is \"auto\": without the HF integration DeepSpeed "
                     f"drops it, which means {meaning}", fix)
        else:
            self.add("DS175", "warning", path, f"`{_dotted(path)}` is \"auto\": without the HF integration DeepSpeed "
                     "drops it and uses its default", fix)
