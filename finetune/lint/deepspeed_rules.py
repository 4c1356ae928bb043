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
ds_values.py, the semantic rules in ds_setup_rules.py (HF, batch, precision, ZeRO) and
ds_optimizer_rules.py (optimizer, scheduler); the rest (misc, "auto") and the checker's state are here.
tests/test_lint_deepspeed.py compares those tables with the installed DeepSpeed and checks the verdict
against DeepSpeed + HF + accelerate on a corpus of configs, so the two cannot drift apart.
"""

from __future__ import annotations

from typing import Any, Optional

from finetune.lint.ds_context import DSContext, RawFinding
from finetune.lint.ds_optimizer_rules import OptimizerRules
from finetune.lint.ds_schema import ACCELERATE_DEFAULTS, HF_FILLED, OFFLOAD_DEVICES
from finetune.lint.ds_setup_rules import SetupRules
from finetune.lint.ds_structure import StructureChecks
from finetune.lint.ds_values import (
    MISSING, UNKNOWN, as_bool, as_int, auto_leaves, dotted, json_type, read_by_pydantic, show, with_ta_defaults,
    hf_warmup_steps)


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


def check_config(config: object, ctx: Optional[DSContext] = None) -> list[RawFinding]:
    """Every problem in one DeepSpeed config, as DeepSpeed + HF + accelerate would see them (and more)."""
    ctx = ctx or DSContext()
    if not isinstance(config, dict):
        kind = "empty" if config is None else f"a JSON {json_type(config)}"
        return [RawFinding("DS100", "error", (), f"a DeepSpeed config must be a JSON object, this file is {kind}",
                           'start from {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"}')]
    return _Checker(config, ctx).run()


class _Checker(StructureChecks, SetupRules, OptimizerRules):
    def __init__(self, config: dict, ctx: DSContext):
        self.config = config
        self.ctx = ctx
        self.hf = ctx.hf_integration
        self.ta = with_ta_defaults(ctx.training_args) if (ctx.training_args is not None and self.hf) else None
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
        value = as_int(raw, allow_bool=True)
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
        coerced = as_bool(value)
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
        micro, gas = as_int(ta["per_device_train_batch_size"]), as_int(ta["gradient_accumulation_steps"])
        if world and micro is not None and gas is not None:
            expected[("train_batch_size",)] = (world * micro * gas, "train_batch_size (calculated)")
        steps = as_int(ta["max_steps"])
        if steps is not None and steps > 0:  # the Trainer's num_training_steps is max_steps when that is set
            expected[("scheduler", "params", "total_num_steps")] = (steps, "num_training_steps (calculated)")
            warmup = hf_warmup_steps(ta["warmup_steps"], steps)
            if warmup is not None:  # HF keeps it >= 1: deepspeed >= 0.19.6 refuses 0
                expected[("scheduler", "params", "warmup_num_steps")] = (max(1, warmup), "warmup_steps")
        return expected

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
        for path, in_list in auto_leaves(self.config, ()):
            if path in self.claimed or (in_list and path[:-1] in self.claimed):
                continue
            if any(path[:n] in self.unknown_paths for n in range(1, len(path))):
                continue
            if in_list:
                parent = path[:-1]
                self.add("DS171", "error", parent, f"`{dotted(parent)}` holds \"auto\" inside a list: HF and "
                         "accelerate only fill a whole value, so DeepSpeed gets the string \"auto\"",
                         f'write "{dotted(parent)}": "auto" (the whole value) or the numbers')
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
            self.add("DS172", "warning", path, f"`{dotted(path)}` \"auto\" is not taken from TrainingArguments: "
                     f"accelerate fills it with its own default {show(default)} (or ${env})",
                     f"write the value you want, e.g. {show(default)}")
            return
        if path == ("data_types", "keep_in_fp32_modules"):
            self.add("DS170", "error", path, "`data_types.keep_in_fp32_modules` \"auto\" is DeepSpeed's own default, "
                     "but under the HF Trainer accelerate treats every \"auto\" as a placeholder and stops "
                     "(\"`data_types.keep_in_fp32_modules` not found in kwargs\")",
                     "delete the key: DeepSpeed's default is already \"auto\"")
            return
        self.add("DS170", "error", path, f"`{dotted(path)}` is \"auto\", but neither HF nor accelerate fills this "
                 "key: accelerate stops with \"`" + dotted(path) + "` not found in kwargs\"",
                 "write a concrete value (\"auto\" works for batch sizes, gradient_clipping, fp16/bf16.enabled, "
                 "optimizer lr/betas/eps/weight_decay, scheduler warmup/total steps and the ZeRO bucket sizes)")

    def raw_auto(self, path: tuple) -> None:
        fix = "write a concrete value: without the HF Trainer nothing replaces \"auto\""
        if not read_by_pydantic(path):
            self.add("DS175", "error", path, f"`{dotted(path)}` is \"auto\", but without the HF integration nothing "
                     "fills it in: DeepSpeed gets the string \"auto\" and fails or misbehaves with it", fix)
        elif path[-1] in ("enabled", "stage", "device"):
            meaning = {"enabled": "disabled", "stage": "stage 0 (no ZeRO)", "device": "no offload"}[path[-1]]
            self.add("DS175", "error", path, f"`{dotted(path)}` is \"auto\": without the HF integration DeepSpeed "
                     f"drops it, which means {meaning}", fix)
        else:
            self.add("DS175", "warning", path, f"`{dotted(path)}` is \"auto\": without the HF integration DeepSpeed "
                     "drops it and uses its default", fix)
