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

Pure Python, no torch/deepspeed import: DeepSpeed's schema is written out below as data (deepspeed
0.19). tests/test_lint_deepspeed.py compares these tables with the installed DeepSpeed and checks the
verdict against DeepSpeed + HF + accelerate on a corpus of configs, so the two cannot drift apart.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional


@dataclass
class DSContext:
    world_size: Optional[int] = None  # --world-size or the recipe's; None = unknown
    training_args: Optional[dict] = None  # TrainingArguments kwargs when a recipe is given (render_training_args)
    hf_integration: bool = True  # used through HF Trainer (auto values get filled); False = raw deepspeed.initialize
    from_recipe: bool = False  # config was rendered by finetune from a recipe
    duplicates: list = field(default_factory=list)  # [(key path, line, col)] duplicate keys found by the loader


@dataclass
class RawFinding:
    rule: str  # stable id, e.g. "DS110"
    severity: str  # "error" | "warning" | "info"
    key: tuple  # key path in the config; () for the whole file
    message: str
    fix: Optional[str] = None


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
# DeepSpeed's schema, as data (deepspeed 0.19: runtime/config.py, runtime/zero/config.py,
# runtime/zero/offload_config.py, runtime/precision_config.py, monitor/config.py, ...).


@dataclass(frozen=True)
class Field:
    kind: str  # bool int float str path list dict any enum section lenient
    optional: bool = False  # None is accepted
    choices: tuple = ()  # for kind "enum"
    gt: Optional[float] = None
    ge: Optional[float] = None
    lt: Optional[float] = None
    le: Optional[float] = None
    section: Optional[str] = None  # for kind "section"/"lenient": the table in SECTIONS / LENIENT
    deprecated: Optional[str] = None  # the replacing key, for deprecated fields


def _f(kind: str, **kw: Any) -> Field:
    return Field(kind, **kw)


B, I, FL, S, P, L, D, A = (_f("bool"), _f("int"), _f("float"), _f("str"), _f("path", optional=True),
                          _f("list"), _f("dict"), _f("any"))
I_GE0, I_GT0, OPT_S = _f("int", ge=0), _f("int", gt=0), _f("str", optional=True)
RATIO = _f("float", ge=0.0, le=1.0)
OFFLOAD_DEVICES = ("none", "cpu", "nvme")

# Strict sections: pydantic models with extra="forbid" (an unknown key is an error). Keys are what a
# user writes; for aliased fields (stage3_*) both the alias and the field name are accepted.
SECTIONS: dict[str, dict[str, Field]] = {
    "zero_optimization": {
        "stage": _f("enum", choices=(0, 1, 2, 3)),
        "contiguous_gradients": B, "reduce_scatter": B, "reduce_bucket_size": I_GT0,
        "use_multi_rank_bucket_allreduce": B, "allgather_partitions": B, "allgather_bucket_size": I_GE0,
        "overlap_comm": _f("bool", optional=True), "compute_grad_norm": B, "load_from_fp32_weights": B,
        "elastic_checkpoint": B,
        "offload_param": _f("section", optional=True, section="offload_param"),
        "offload_optimizer": _f("section", optional=True, section="offload_optimizer"),
        "zenflow": _f("section", optional=True, section="zenflow"),
        "sub_group_size": I_GE0,
        "cpu_offload_param": _f("bool", optional=True, deprecated="offload_param"),
        "cpu_offload_use_pin_memory": _f("bool", optional=True, deprecated="offload_param.pin_memory / offload_optimizer.pin_memory"),
        "cpu_offload": _f("bool", optional=True, deprecated="offload_optimizer"),
        "stage3_prefetch_bucket_size": I_GE0, "stage3_param_persistence_threshold": I_GE0,
        "stage3_model_persistence_threshold": I_GE0, "stage3_max_live_parameters": I_GE0,
        "stage3_max_reuse_distance": I_GE0, "stage3_gather_16bit_weights_on_model_save": B,
        "stage3_module_granularity_threshold": I, "stage3_use_all_reduce_for_fetch_params": B,
        "stage3_allgather_sequential": B,
        "stage3_gather_fp16_weights_on_model_save": _f("bool", deprecated="stage3_gather_16bit_weights_on_model_save"),
        "ignore_unused_parameters": B, "legacy_stage1": B, "round_robin_gradients": B, "parameter_alignment": B,
        "zero_hpz_partition_size": I_GE0, "zero_quantized_weights": B, "zero_quantized_nontrainable_weights": B,
        "zero_quantized_gradients": B, "memory_efficient_linear": B, "pipeline_loading_checkpoint": B,
        "override_module_apply": B, "log_trace_cache_warnings": B, "enable_sanity_checks": B,
        "save_muon_momentum_buffer_in_memory": B,
        "leaf_module": _f("section", optional=True, section="leaf_module"),  # its validator maps null to {}
    },
    "offload_param": {
        "device": _f("enum", choices=OFFLOAD_DEVICES), "nvme_path": P, "buffer_count": I_GE0,
        "buffer_size": I_GE0, "max_in_cpu": I_GE0, "pin_memory": B,
    },
    "offload_optimizer": {
        "device": _f("enum", choices=OFFLOAD_DEVICES), "nvme_path": P, "buffer_count": I_GE0, "pin_memory": B,
        "pipeline_read": B, "pipeline_write": B, "fast_init": B, "ratio": RATIO, "super_offload": B,
        "cpuadam_cores_perc": RATIO,
    },
    "zenflow": {
        "topk_ratio": _f("float", gt=0.0, lt=1.0), "select_strategy": S, "select_interval": A,
        "update_interval": A, "overlap_step": B, "offload": B, "auto_ratio": RATIO, "full_warm_up_rounds": I,
        "pt_reserved_cores_perc": RATIO, "steps_per_epoch": _f("int", optional=True),
    },
    "leaf_module": {"classes": A, "names": A, "name_suffixes": A},  # a string is accepted as a 1-list
    "fp16": {
        "enabled": B, "auto_cast": B, "loss_scale": FL, "initial_scale_power": I, "loss_scale_window": I,
        "hysteresis": I, "consecutive_hysteresis": B, "min_loss_scale": I, "fp16_master_weights_and_grads": B,
    },
    "bf16": {
        "enabled": B, "immediate_grad_update": B, "check_grad_overflow": B, "bf16_master_weights_and_grads": B,
        "bf16_optimizer_states": B,
    },
    "hybrid_engine": {
        "enabled": B, "max_out_tokens": I_GT0, "inference_tp_size": I, "release_inference_cache": B,
        "pin_parameters": B, "tp_gather_partition_size": I, "enable_cuda_graph": B,
    },
    "tensorboard": {"enabled": B, "output_path": S, "job_name": S},
    "wandb": {"enabled": B, "group": OPT_S, "team": OPT_S, "project": S},
    "csv_monitor": {"enabled": B, "output_path": S, "job_name": S},
    "comet": {
        "enabled": B, "samples_log_interval": I, "project": OPT_S, "workspace": OPT_S, "api_key": OPT_S,
        "experiment_name": OPT_S, "experiment_key": OPT_S, "online": _f("bool", optional=True), "mode": OPT_S,
    },
    "comms_logger": {"enabled": B, "prof_all": B, "prof_ops": L, "verbose": B, "debug": B},
    "compile": {
        "deepcompile": B, "autoep_non_moe": B, "free_activation": B, "free_activation_threshold": I,
        "offload_activation": B, "offload_activation_pin_memory": B, "offload_opt_states": B, "double_buffer": B,
        "symmetric_memory": B, "debug_log": B, "offload_parameters": B, "sync_before_reduce": B,
        "sync_after_reduce": B, "sync_before_allgather": B, "sync_after_allgather": B,
        "keep_int_input_tensors": B, "keep_all_input_tensors": B, "passes": _f("list", optional=True),
    },
    "throughput": {"enabled": B, "synchronized": B},
    # runtime/tensor_parallel/config.py TPTrainingConfig; `dtype` is a torch.dtype that JSON cannot hold.
    "tensor_parallel": {
        "dtype": _f("pyobject"), "autotp_size": I, "tp_overlap_comm": B,
        "vocab_parallel_lm_head": _f("bool", optional=True),
        "vocab_parallel_ce_backend": _f("enum", choices=("torch", "liger")),
        "tp": _f("section", section="tp"), "tensor_parallel": _f("section", section="tp"),
        "injection_policy_tuple": _f("any", optional=True), "partition_config": _f("dict", optional=True),
        "preset_model": OPT_S, "keep_module_on_host": B, "kernel_inject": B, "replace_with_kernel_inject": B,
    },
    "tp": {"tp_size": I, "tp_grain_size": I, "mpu": A, "tp_group": A},
    # inference/config.py WeightQuantConfig (read by runtime/config.py for training too)
    "weight_quantization": {
        "enabled": B, "num_bits": I, "q_type": _f("enum", choices=("symmetric", "asymmetric")), "q_groups": I,
        "quantized_initialization": D, "post_init_quant": D,
    },
}
SECTIONS["bfloat16"] = SECTIONS["bf16"]

# pydantic field name -> the alias users write; both are accepted, but not together.
ZERO_FIELD_NAMES = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "model_persistence_threshold": "stage3_model_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "module_granularity_threshold": "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
    "allgather_sequential": "stage3_allgather_sequential",
}
for _name, _alias in ZERO_FIELD_NAMES.items():
    SECTIONS["zero_optimization"][_name] = SECTIONS["zero_optimization"][_alias]

# Lenient sections: DeepSpeed reads these keys with dict.get and ignores anything else.
LENIENT: dict[str, dict[str, Field]] = {
    "activation_checkpointing": {
        "partition_activations": B, "number_checkpoints": _f("int", optional=True),
        "contiguous_memory_optimization": B, "synchronize_checkpoint_boundary": B, "profile": B,
        "cpu_checkpointing": B,
    },
    "flops_profiler": {
        "enabled": B, "recompute_fwd_factor": FL, "profile_step": I, "module_depth": I, "top_modules": I,
        "detailed": B, "output_file": OPT_S,
    },
    "aio": {
        "block_size": I_GT0, "queue_depth": I_GT0, "intra_op_parallelism": I_GT0, "single_submit": B,
        "overlap_events": B, "use_gds": B,
    },
    "checkpoint": {
        "tag_validation": _f("enum", choices=("WARN", "IGNORE", "FAIL")), "load_universal": B,
        "use_node_local_storage": B, "parallel_write": _f("lenient", section="parallel_write"),
        "checkpoint_serialization": B, "writer": _f("dict", optional=True),
    },
    "parallel_write": {"pipeline_stage": B},
    "data_types": {"grad_accum_dtype": _f("enum", optional=True), "param_dtype": _f("enum", optional=True),
                   "buffer_dtype": _f("enum", optional=True), "keep_in_fp32_modules": A},
    "optimizer": {"type": S, "params": _f("dict", optional=True), "legacy_fusion": B},
    "scheduler": {"type": S, "params": _f("dict", optional=True)},
    "timers": {"throughput": _f("section", section="throughput")},
    "torch_autocast": {"enabled": B, "dtype": _f("enum", optional=True), "lower_precision_safe_modules": A},
}

# Top-level keys DeepSpeed reads (runtime/constants.py, runtime/config.py and the section configs).
TOP: dict[str, Field] = {
    # > 0 is checked after DeepSpeed's derivation (DS123), like DeepSpeed does
    "train_batch_size": _f("int", optional=True),
    "train_micro_batch_size_per_gpu": _f("int", optional=True),
    "gradient_accumulation_steps": _f("int", optional=True),
    "gradient_clipping": FL,
    "steps_per_print": _f("float", optional=True),  # accelerate writes float("inf") here
    "prescale_gradients": B, "gradient_predivide_factor": FL, "disable_allgather": B, "dump_state": B,
    "disable_python_gc": B, "wall_clock_breakdown": B, "memory_breakdown": B,
    "zero_allow_untested_optimizer": B, "zero_force_ds_cpu_optimizer": B, "managed_gradient_accumulation": B,
    "dataloader_drop_last": B, "vocabulary_size": _f("int", optional=True), "log_level": A,
    "use_data_before_expert_parallelism": B, "sequence_parallel_size": _f("int", gt=0),
    "data_parallel_size": _f("int", gt=0),
    "gradient_allreduce_op": _f("enum", choices=("mean", "sum")),
    "communication_data_type": _f("enum", optional=True, choices=("fp16", "bf16", "fp32")),
    "seq_parallel_communication_data_type": _f("enum", optional=True, choices=("fp16", "bf16", "fp32")),
    "allgather_size": _f("int", deprecated="zero_optimization.allgather_bucket_size"),
    "bfloat16": _f("section", section="bfloat16", deprecated="bf16"),
    # Sections whose inside DeepSpeed parses in many ways (only "is an object" is checked here).
    **{name: _f("dict") for name in ("pipeline", "autotuning", "data_efficiency", "expert_parallel",
                                    "datastates_ckpt", "msamp")},
}
for _name in ("zero_optimization", "fp16", "bf16", "hybrid_engine", "tensorboard", "wandb", "csv_monitor",
              "comet", "comms_logger", "compile", "tensor_parallel", "weight_quantization"):
    TOP[_name] = _f("section", section=_name)
for _name in ("activation_checkpointing", "flops_profiler", "checkpoint", "data_types", "optimizer",
              "scheduler", "timers", "torch_autocast"):
    TOP[_name] = _f("lenient", section=_name)
TOP["aio"] = _f("lenient", section="aio", optional=True)
# Top-level keys read through a pydantic model: strings convert, and "auto" values are dropped.
PYDANTIC_TOP = {name for name, spec in TOP.items() if spec.kind == "section"}

# runtime/config.py _REMOVED_TOP_LEVEL_CONFIG_KEYS / _REMOVED_ZERO_CONFIG_KEYS: DeepSpeedConfigError.
REMOVED_TOP = {
    "nebula": "Nebula checkpointing", "compression_training": "the compression library",
    "amp": "NVIDIA Apex AMP (use bf16, fp16 or torch_autocast)", "quantize_training": "Mixture-of-Quantization",
    "sparse_gradients": "sparse embedding-gradient compression", "eigenvalue": "eigenvalue-based MoQ",
    "sparse_attention": "Sparse Attention", "elasticity": "elastic training (set the batch sizes directly)",
    "graph_harvesting": "graph harvesting",
    "curriculum_learning": "top-level curriculum_learning (use data_efficiency.data_sampling.curriculum_learning)",
    "progressive_layer_drop": "Progressive Layer Dropping",
}
REMOVED_ZERO = {"mics_shard_size": "MiCS sharding", "mics_hierarchical_params_gather": "MiCS sharding",
                "zeropp_loco_param": "LoCo-ZeRO++"}

# Names people write for a key that difflib would not find.
COMMON_MISNAMES = {
    "zero": "zero_optimization", "zero_config": "zero_optimization", "zero_stage": "zero_optimization.stage",
    "micro_batch_size": "train_micro_batch_size_per_gpu", "micro_batch_size_per_gpu": "train_micro_batch_size_per_gpu",
    "per_device_train_batch_size": "train_micro_batch_size_per_gpu", "batch_size": "train_batch_size",
    "global_batch_size": "train_batch_size", "grad_accum": "gradient_accumulation_steps",
    "gradient_accumulation": "gradient_accumulation_steps", "max_grad_norm": "gradient_clipping",
    "grad_clip": "gradient_clipping", "lr_scheduler": "scheduler", "optim": "optimizer", "half": "fp16",
    "mixed_precision": "bf16 / fp16", "bfloat": "bf16",
}
# Names of DeepSpeed's internal config classes that people write as keys: ignored, and only a warning
# (what they would configure is logging, not the training).
INTERNAL_NAMES = {"comms_config": "comms_logger", "monitor_config": "tensorboard, wandb, csv_monitor or comet"}

# DtypeEnum spellings (runtime/config.py) accepted in data_types / torch_autocast.dtype.
DTYPE_NAMES = {
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16", "int8": "int8", "torch.int8": "int8",
}

# Optimizer types: DeepSpeed's own (case-insensitive) and torch.optim classes (exact name).
DEEPSPEED_OPTIMIZERS = ("adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd", "lion", "muon")
TORCH_OPTIMIZERS = ("ASGD", "Adadelta", "Adafactor", "Adagrad", "Adam", "AdamW", "Adamax", "LBFGS", "Muon",
                    "NAdam", "RAdam", "RMSprop", "Rprop", "SGD", "SparseAdam")
# runtime/zero/utils.py ZERO_SUPPORTED_OPTIMIZERS, by the config type that produces each.
ZERO_TESTED_TYPES = {"adam", "adamw", "adagrad", "lion", "muon", "Adam", "AdamW", "Adagrad"}

# Keyword arguments of the optimizer class DeepSpeed builds for each type (engine._configure_basic_optimizer).
_ADAM_POPPED = {"torch_adam", "adam_w_mode", "fp32_optimizer_states"}  # taken out before the call
OPTIMIZER_PARAMS = {
    "FusedAdam": {"lr", "bias_correction", "betas", "eps", "weight_decay", "amsgrad", "set_grad_none"},
    "DeepSpeedCPUAdam": {"lr", "bias_correction", "betas", "eps", "weight_decay", "amsgrad"},
    "torch.optim.AdamW": {"lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable",
                          "differentiable", "fused"},
    "FusedLion": {"lr", "betas", "weight_decay", "set_grad_none"},
    "DeepSpeedCPULion": {"lr", "betas", "weight_decay", "fp32_optimizer_states"},
    "torch.optim.Adagrad": {"lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps", "foreach",
                            "maximize", "differentiable", "fused"},
    "DeepSpeedCPUAdagrad": {"lr", "eps", "weight_decay", "amsgrad", "fp32_optimizer_states"},
    "FusedLamb": {"lr", "bias_correction", "betas", "eps", "eps_inside_sqrt", "weight_decay", "max_grad_norm",
                  "max_coeff", "min_coeff", "amsgrad"},
}

# DeepSpeed's schedulers (runtime/lr_schedules.py): parameter -> required?
DEEPSPEED_SCHEDULERS = {
    "LRRangeTest": {"lr_range_test_min_lr": False, "lr_range_test_step_size": False,
                    "lr_range_test_step_rate": False, "lr_range_test_staircase": False,
                    "last_batch_iteration": False},
    "OneCycle": {"cycle_min_lr": True, "cycle_max_lr": True, "decay_lr_rate": False, "cycle_first_step_size": False,
                 "cycle_second_step_size": False, "cycle_first_stair_count": False,
                 "cycle_second_stair_count": False, "decay_step_size": False, "cycle_momentum": False,
                 "cycle_min_mom": False, "cycle_max_mom": False, "decay_mom_rate": False,
                 "last_batch_iteration": False},
    "WarmupLR": {"warmup_min_lr": False, "warmup_max_lr": False, "warmup_num_steps": False, "warmup_type": False,
                 "last_batch_iteration": False},
    "WarmupDecayLR": {"total_num_steps": True, "warmup_min_lr": False, "warmup_max_lr": False,
                      "warmup_num_steps": False, "warmup_type": False, "last_batch_iteration": False},
    "WarmupCosineLR": {"total_num_steps": True, "warmup_min_ratio": False, "warmup_num_steps": False,
                       "cos_min_ratio": False, "warmup_type": False, "last_batch_iteration": False},
}
TORCH_SCHEDULERS = ("ChainedScheduler", "ConstantLR", "CosineAnnealingLR", "CosineAnnealingWarmRestarts",
                    "CyclicLR", "ExponentialLR", "LRScheduler", "LambdaLR", "LinearLR", "MultiStepLR",
                    "MultiplicativeLR", "OneCycleLR", "PolynomialLR", "ReduceLROnPlateau", "SequentialLR", "StepLR")

# "auto" values the HF Trainer (HfTrainerDeepSpeedConfig) or accelerate (DeepSpeedPlugin, _prepare_deepspeed)
# fill in. Every other "auto" makes accelerate's deepspeed_config_process raise.
HF_FILLED = {
    ("train_micro_batch_size_per_gpu",), ("gradient_accumulation_steps",), ("train_batch_size",),
    ("gradient_clipping",), ("fp16", "enabled"), ("bf16", "enabled"), ("steps_per_print",),
    ("optimizer", "params", "lr"), ("optimizer", "params", "betas"), ("optimizer", "params", "eps"),
    ("optimizer", "params", "weight_decay"),
    ("scheduler", "params", "warmup_min_lr"), ("scheduler", "params", "warmup_max_lr"),
    ("scheduler", "params", "total_num_steps"), ("scheduler", "params", "warmup_num_steps"),
    # hidden_size based (HF for stage 3, accelerate for any stage)
    ("zero_optimization", "reduce_bucket_size"), ("zero_optimization", "stage3_prefetch_bucket_size"),
    ("zero_optimization", "stage3_param_persistence_threshold"),
}
# Filled by accelerate's DeepSpeedPlugin from its own defaults (ACCELERATE_* environment variables).
ACCELERATE_DEFAULTS = {
    ("zero_optimization", "stage"): (2, "ACCELERATE_DEEPSPEED_ZERO_STAGE"),
    ("zero_optimization", "offload_optimizer", "device"): ("none", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"),
    ("zero_optimization", "offload_param", "device"): ("none", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"),
    ("zero_optimization", "offload_optimizer", "nvme_path"): ("none", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH"),
    ("zero_optimization", "offload_param", "nvme_path"): ("none", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH"),
    ("zero_optimization", "stage3_gather_16bit_weights_on_model_save"): (False, "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL"),
}

# TrainingArguments defaults (transformers 5) for keys a partial training_args dict may lack.
TA_DEFAULTS = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "max_grad_norm": 1.0,
               "learning_rate": 5e-5, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8,
               "weight_decay": 0.0, "fp16": False, "bf16": False, "fp16_full_eval": False,
               "bf16_full_eval": False, "warmup_steps": 0, "max_steps": -1}

_BOOL_STRINGS = {"0", "off", "f", "false", "n", "no", "1", "on", "t", "true", "y", "yes"}
_TRUE_STRINGS = {"1", "on", "t", "true", "y", "yes"}
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


class _Unknown:
    """A value that depends on something lint does not know (an unfilled "auto", a bad type)."""

    def __repr__(self) -> str:
        return "<unknown>"


UNKNOWN = _Unknown()
MISSING = object()


# ----------------------------------------------------------------------------------------------
# Entry point


def check_config(config: object, ctx: Optional[DSContext] = None) -> list[RawFinding]:
    """Every problem in one DeepSpeed config, as DeepSpeed + HF + accelerate would see them (and more)."""
    ctx = ctx or DSContext()
    if not isinstance(config, dict):
        kind = "empty" if config is None else f"a JSON {_json_type(config)}"
        return [RawFinding("DS100", "error", (), f"a DeepSpeed config must be a JSON object, this file is {kind}",
                           'start from {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"}')]
    return _Checker(config, ctx).run()


class _Checker:
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
    # DS101 duplicates

    def duplicates(self) -> None:
        for entry in self.ctx.duplicates or ():
            first = entry[0] if isinstance(entry, (tuple, list)) and entry else ()
            path = tuple(first) if isinstance(first, (tuple, list)) else ()
            shown = _dotted(path)
            self.findings.append(RawFinding(
                "DS101", "error", path,
                f"duplicate key `{shown}`: DeepSpeed refuses the file when it reads it itself, while HF and "
                "accelerate (json.load) silently keep the last value",
                "keep one of the two entries"))

    # ------------------------------------------------------------------------------------------
    # Structure: keys and types (DS102-DS115, DS138)

    def structure(self) -> None:
        for key, value in self.config.items():
            path = (key,)
            if key in REMOVED_TOP:
                self.add("DS102", "error", path, f"`{key}` configures {REMOVED_TOP[key]}, which DeepSpeed has removed: "
                         "DeepSpeed refuses a config that still has it", f"delete `{key}`")
                continue
            spec = TOP.get(key)
            if spec is None:
                self.unknown(path, value, list(TOP), strict=False)
                continue
            if spec.deprecated:
                self.deprecated_top(key, spec)
            if value == "auto":
                continue  # judged by auto_rules
            self.check_value(path, value, spec)

    def deprecated_top(self, key: str, spec: Field) -> None:
        if key == "bfloat16":
            if "bf16" in self.config:
                self.add("DS138", "warning", (key,), "`bfloat16` is DeepSpeed's old name for `bf16`; with both present "
                         "DeepSpeed reads only `bf16`", "delete `bfloat16`")
            elif self.hf:
                self.add("DS138", "warning", (key,), "`bfloat16` is DeepSpeed's old name for `bf16`; under the HF "
                         "Trainer accelerate adds a `bf16` block from TrainingArguments, and DeepSpeed then ignores "
                         "`bfloat16`", "rename it to `bf16`")
            else:
                self.add("DS138", "warning", (key,), "`bfloat16` is deprecated", "rename it to `bf16`")
        elif key == "allgather_size":
            self.add("DS138", "warning", (key,), "`allgather_size` is only read with the deprecated "
                     '`"zero_optimization": true` form', "use zero_optimization.allgather_bucket_size")

    def unknown(self, path: tuple, value: Any, candidates: list, strict: bool, section: str = "") -> None:
        self.unknown_paths.add(tuple(path))
        key = str(path[-1])
        suggestion = _suggest(key, candidates)
        fix = f"did you mean `{suggestion}`?" if suggestion else None
        where = f"`{_dotted(path)}`"
        if strict and value == "auto":
            tail = ("; under the HF Trainer accelerate then stops with \"`...` not found in kwargs\"" if self.hf
                    else ", and the setting you meant keeps DeepSpeed's default")
            self.add("DS104", "error", path, f"{where} is not a {section} setting: DeepSpeed drops \"auto\" values "
                     f"before validating, so DeepSpeed itself lets the misspelling pass{tail}", fix or "delete it")
        elif strict:
            self.add("DS103", "error", path, f"{where} is not a {section} setting: DeepSpeed refuses the config",
                     fix or f"delete it (valid keys: {', '.join(sorted(candidates)[:8])}, ...)")
        elif value == "auto" and self.hf:
            self.add("DS104", "error", path, f"{where} is not a DeepSpeed setting, and its \"auto\" is never filled "
                     "in: accelerate stops with \"`...` not found in kwargs\"", fix or "delete it")
        elif suggestion:
            self.add("DS105", "error", path, f"{where} is not a DeepSpeed setting: DeepSpeed ignores it, so the "
                     "setting you meant keeps its default", fix)
        elif key.startswith("_"):  # "_comment": the usual way to annotate a JSON file
            self.add("DS105", "info", path, f"{where} is not a DeepSpeed setting (taken as a comment); DeepSpeed "
                     "ignores it")
        elif len(path) == 1 and key in INTERNAL_NAMES:
            self.add("DS105", "warning", path, f"{where} is not a DeepSpeed setting (it names one of DeepSpeed's "
                     "internal config classes); DeepSpeed ignores it", f"use `{INTERNAL_NAMES[key]}`")
        else:
            self.add("DS105", "warning", path, f"{where} is not a DeepSpeed setting; DeepSpeed ignores it",
                     "delete it, or check DeepSpeed's config reference")

    def check_value(self, path: tuple, value: Any, spec: Field) -> None:
        """Type, choices and range of one value, the way pydantic (lax mode) or DeepSpeed's code reads it."""
        if value is None:
            if not spec.optional and spec.kind not in ("any",):
                crash = spec.kind in ("section", "lenient")
                self.add("DS110", "error", path, f"`{_dotted(path)}` is null" +
                         (": DeepSpeed expects an object and crashes on null" if crash else
                          f", DeepSpeed expects {_KIND_WORDS.get(spec.kind, spec.kind)}"),
                         "delete the key to get DeepSpeed's default")
            return
        kind = spec.kind
        if kind == "section":
            self.check_section(path, value, spec.section or "")
        elif kind == "lenient":
            self.check_lenient(path, value, spec.section or "")
        elif kind == "bool":
            self.check_bool(path, value)
        elif kind in ("int", "float"):
            self.check_number(path, value, spec)
        elif kind == "str":
            if not isinstance(value, str):
                self.add("DS110", "error", path, f"`{_dotted(path)}` must be a string, not {_json_type(value)} "
                         f"{_show(value)}", "quote it")
        elif kind == "path":
            if not isinstance(value, str):
                self.add("DS110", "error", path, f"`{_dotted(path)}` must be a directory path (a string)",
                         "write the path in quotes")
            elif value.strip() == "":
                self.add("DS113", "warning", path, f"`{_dotted(path)}` is empty: DeepSpeed reads it as the current "
                         "directory", "set a directory on a fast local disk")
        elif kind == "list":
            if not isinstance(value, list):
                self.add("DS110", "error", path, f"`{_dotted(path)}` must be a list, not {_json_type(value)}")
        elif kind == "dict":
            if not isinstance(value, dict):
                self.add("DS110", "error", path, f"`{_dotted(path)}` must be an object, not {_json_type(value)}: "
                         "DeepSpeed crashes reading it")
        elif kind == "enum":
            self.check_enum(path, value, spec)
        elif kind == "pyobject":
            self.add("DS110", "error", path, f"`{_dotted(path)}` takes a Python object (a torch.dtype), which JSON "
                     f"cannot hold: DeepSpeed refuses {_show(value)}", "delete it")

    def check_section(self, path: tuple, value: Any, section: str) -> None:
        fields = SECTIONS[section]
        if path == ("zero_optimization",) and isinstance(value, bool):
            if self.hf:
                self.add("DS110", "error", path, '`"zero_optimization": true/false` is DeepSpeed\'s deprecated form; '
                         "HF and accelerate expect an object and crash on it (`'bool' object has no attribute 'get'`)",
                         'write {"stage": 1} (true) or {"stage": 0} (false)')
            else:
                self.add("DS138", "warning", path, '`"zero_optimization": true/false` is deprecated (DeepSpeed reads '
                         "it as stage 1 or 0)", 'write {"stage": 1} or {"stage": 0}')
            return
        if not isinstance(value, dict):
            self.add("DS110", "error", path, f"`{_dotted(path)}` must be an object, not {_json_type(value)}: "
                     "DeepSpeed crashes reading it", _section_example(section))
            return
        shown = _SECTION_WORDS.get(section, f"`{_dotted(path)}`")
        for key, item in value.items():
            child = path + (key,)
            if section == "zero_optimization" and key in REMOVED_ZERO:
                self.add("DS102", "error", child, f"`{_dotted(child)}` configures {REMOVED_ZERO[key]}, which DeepSpeed "
                         "has removed: DeepSpeed refuses a config that still has it", "delete it")
                continue
            spec = fields.get(key)
            if spec is None:
                self.unknown(child, item, [k for k in fields if k not in ZERO_FIELD_NAMES], strict=True, section=shown)
                continue
            if spec.deprecated:
                self.deprecated_field(value, child, spec)
            if item == "auto":
                continue
            if section == "zero_optimization" and key == "stage":
                self.check_stage(child, item)
                continue
            self.check_value(child, item, spec)
        if section == "zero_optimization":
            for name, alias in ZERO_FIELD_NAMES.items():
                if name in value and alias in value:
                    self.add("DS103", "error", path + (name,), f"`{alias}` is given twice, also as `{name}`: "
                             f"DeepSpeed refuses `{name}` as an unknown key", f"delete `{name}`")

    def deprecated_field(self, block: dict, path: tuple, spec: Field) -> None:
        replacement = spec.deprecated or ""
        direct = replacement.split(" ")[0].split(".")[0]
        if direct in block:
            self.add("DS138", "error", path, f"`{_dotted(path)}` is the deprecated form of `{direct}`, and both are "
                     "given: DeepSpeed refuses the pair", f"delete `{path[-1]}`")
        else:
            self.add("DS138", "warning", path, f"`{_dotted(path)}` is deprecated", f"use `{replacement}`")

    def check_lenient(self, path: tuple, value: Any, section: str) -> None:
        fields = LENIENT[section]
        if not isinstance(value, dict):
            self.add("DS110", "error", path, f"`{_dotted(path)}` must be an object, not {_json_type(value)}: "
                     "DeepSpeed crashes reading it")
            return
        for key, item in value.items():
            child = path + (key,)
            spec = fields.get(key)
            if spec is None:
                if section in ("optimizer", "scheduler") and key in ("lr", "betas", "eps", "weight_decay",
                                                                     "warmup_num_steps", "total_num_steps"):
                    self.add("DS105", "error", child, f"`{_dotted(child)}` belongs inside `{section}.params`: "
                             "DeepSpeed ignores it here", f"move it into `{section}.params`")
                else:
                    self.unknown(child, item, list(fields), strict=False)
                continue
            if item == "auto":
                continue
            if section == "checkpoint" and key == "tag_validation":
                self.check_tag_validation(child, item)
            elif section in ("data_types", "torch_autocast") and spec.kind == "enum":
                self.check_dtype(child, item)
            elif section == "parallel_write" and key == "pipeline_stage":
                if item not in (True, False):  # DeepSpeed: `in [True, False]` (so 0/1 pass too)
                    self.add("DS110", "error", child, "`checkpoint.parallel_write.pipeline_stage` must be true or "
                             "false: DeepSpeed refuses anything else", "write true or false")
            else:
                self.check_value(child, item, spec)

    def check_bool(self, path: tuple, value: Any) -> None:
        if isinstance(value, bool):
            return
        shown = _dotted(path)
        if isinstance(value, str) and value.strip().lower() in _BOOL_STRINGS:
            read_by_hf = path[-1] == "enabled" and path[0] in ("fp16", "bf16", "bfloat16")
            if read_by_hf:
                self.add("DS110", "error", path, f"`{shown}` is the string {_show(value)}: DeepSpeed converts it, but "
                         "HF and accelerate test it with Python truthiness (so \"false\" counts as enabled)",
                         f"write {str(value.strip().lower() in _TRUE_STRINGS).lower()} without quotes")
            elif _pydantic(path):
                self.add("DS113", "warning", path, f"`{shown}` is the string {_show(value)}; DeepSpeed converts it",
                         f"write {str(value.strip().lower() in _TRUE_STRINGS).lower()} without quotes")
            else:
                # dict.get readers (top-level keys, lenient sections) keep the string: "false" is truthy
                self.add("DS110", "error", path, f"`{shown}` is the string {_show(value)}: DeepSpeed keeps it as a "
                         "string, and any non-empty string counts as true", f"write {str(value.strip().lower() in _TRUE_STRINGS).lower()} without quotes")
            return
        if isinstance(value, (int, float)) and value in (0, 1):
            self.add("DS113", "warning", path, f"`{shown}` is the number {_show(value)}; DeepSpeed reads it as "
                     f"{str(bool(value)).lower()}", f"write {str(bool(value)).lower()}")
            return
        self.add("DS110", "error", path, f"`{shown}` must be true or false, not {_json_type(value)} {_show(value)}",
                 "write true or false")

    def check_number(self, path: tuple, value: Any, spec: Field) -> None:
        shown = _dotted(path)
        want = "an integer" if spec.kind == "int" else "a number"
        strict_reader = _pydantic(path)  # pydantic converts strings; dict.get readers keep them
        number: Any = None
        if isinstance(value, bool):
            self.add("DS110", "error", path, f"`{shown}` must be {want}, not {str(value).lower()}",
                     f"write {want[2:] if want.startswith('a ') else want}")
            return
        if isinstance(value, (int, float)):
            if isinstance(value, float) and not math.isfinite(value) and path != ("steps_per_print",):
                self.add("DS111", "error", path, f"`{shown}` is {value}: DeepSpeed needs a finite number")
                return
            number = value
        elif isinstance(value, str) and strict_reader and _pydantic_number(value, spec.kind) is not None:
            number = _pydantic_number(value, spec.kind)
            self.add("DS113", "warning", path, f"`{shown}` is the string {_show(value)}; DeepSpeed converts it",
                     "write the number without quotes")
        else:
            self.add("DS110", "error", path, f"`{shown}` must be {want}, not {_json_type(value)} {_show(value)}"
                     + ("" if strict_reader else ": DeepSpeed does arithmetic with it and crashes"),
                     "write the number without quotes" if isinstance(value, str) else None)
            return
        if spec.kind == "int" and isinstance(number, float) and math.isfinite(number) and not number.is_integer():
            self.add("DS110", "error", path, f"`{shown}` must be a whole number, not {_show(value)}",
                     f"use {math.floor(number)} or {math.ceil(number)}")
            return
        bound = _violated_bound(number, spec)
        if bound:
            self.add("DS111", "error", path, f"`{shown}` is {_show(value)}, DeepSpeed needs a value {bound}",
                     f"use a value {bound}, or delete the key for DeepSpeed's default")

    def check_enum(self, path: tuple, value: Any, spec: Field) -> None:
        shown = _dotted(path)
        choices = spec.choices
        if path[-1] in ("communication_data_type", "seq_parallel_communication_data_type", "gradient_allreduce_op"):
            if not isinstance(value, str):
                self.add("DS110", "error", path, f"`{shown}` must be a string, one of {', '.join(map(str, choices))}: "
                         "DeepSpeed crashes on anything else")
            elif value.lower() not in choices:
                self.add("DS112", "error", path, f"`{shown}` is {_show(value)}, DeepSpeed accepts "
                         f"{', '.join(map(str, choices))}", _did_you_mean(value, list(choices)))
            return
        if value in choices and not isinstance(value, bool):
            return
        suggestion = _did_you_mean(str(value), [str(c) for c in choices])
        if isinstance(value, str) and value.lower() in choices:
            suggestion = f"write {_show(value.lower())}"
        self.add("DS112", "error", path, f"`{shown}` is {_show(value)}, DeepSpeed accepts "
                 f"{', '.join(_show(c) for c in choices)}", suggestion)

    def check_stage(self, path: tuple, value: Any) -> None:
        if isinstance(value, int) and not isinstance(value, bool):
            if value not in (0, 1, 2, 3):
                self.add("DS112", "error", path, f"ZeRO stage {value} does not exist: DeepSpeed accepts 0, 1, 2, 3",
                         "use 3 for the most memory savings")
            return
        as_int = _as_int(value, allow_bool=True)
        if as_int not in (0, 1, 2, 3):
            self.add("DS112", "error", path, f"`zero_optimization.stage` is {_show(value)}: DeepSpeed accepts 0, 1, 2, 3",
                     "write the stage as a number, e.g. 2")
            return
        if isinstance(value, float):
            self.add("DS113", "warning", path, f"the ZeRO stage is the float {value}", f"write {as_int}")
            return
        if isinstance(value, bool):
            why = f"DeepSpeed reads {str(value).lower()} as stage {as_int}, HF's stage checks see no ZeRO-2/3"
        elif self.hf:
            why = (f"DeepSpeed converts it to stage {as_int}, but HF compares the raw value with the number "
                   f"{as_int}" + (": `is_deepspeed_zero3_enabled()` is false, so the model is loaded whole on every "
                                  "GPU instead of being partitioned while it loads (zero.Init), and ZeRO-3's "
                                  "\"auto\" bucket sizes are not filled by HF" if as_int == 3 else ""))
        else:
            self.add("DS113", "warning", path, f"the ZeRO stage is the string {_show(value)}; DeepSpeed converts it",
                     f"write {as_int} without quotes")
            return
        self.add("DS115", "error", path, f"`zero_optimization.stage` is {_show(value)}, not an integer: {why}",
                 f"write {as_int}" + (" without quotes" if isinstance(value, str) else ""))

    def check_dtype(self, path: tuple, value: Any) -> None:
        if path[-1] == "keep_in_fp32_modules":
            return
        if not isinstance(value, str) or value not in DTYPE_NAMES:
            self.add("DS112", "error", path, f"`{_dotted(path)}` is {_show(value)}, not a dtype DeepSpeed knows",
                     _did_you_mean(str(value), ["bf16", "fp16", "fp32"]) or "use bf16, fp16 or fp32")

    def check_tag_validation(self, path: tuple, value: Any) -> None:
        if not isinstance(value, str):
            self.add("DS110", "error", path, "`checkpoint.tag_validation` must be a string: DeepSpeed calls .upper() "
                     "on it and crashes", 'use "Warn", "Ignore" or "Fail"')
        elif value.upper() not in ("WARN", "IGNORE", "FAIL"):
            self.add("DS112", "error", path, f"`checkpoint.tag_validation` is {_show(value)}: DeepSpeed accepts "
                     "Warn, Ignore, Fail", _did_you_mean(value.upper(), ["WARN", "IGNORE", "FAIL"])
                     or 'use "Fail" to refuse checkpoints whose tags differ across ranks')

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

    def optimizer_rules(self) -> None:
        block = self.config.get("optimizer")
        if not isinstance(block, dict):
            return
        name = block.get("type", MISSING)
        if name is MISSING:
            self.add("DS150", "error", ("optimizer",), "the `optimizer` block has no `type`: DeepSpeed has nothing "
                     "to build" + (" (and HF has already handed the optimizer over to the config)" if self.hf else ""),
                     'add "type": "AdamW", or delete the block to use the Trainer\'s optimizer' if self.hf else
                     'add "type": "AdamW"')
            return
        if not isinstance(name, str) or name == "auto":
            return  # DS110 / DS170 already
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
        block = self.config.get("scheduler")
        if not isinstance(block, dict):
            return
        name = block.get("type", MISSING)
        if name is MISSING:
            self.add("DS160", "error", ("scheduler",), "the `scheduler` block has no `type`",
                     'add "type": "WarmupDecayLR", or delete the block to use the Trainer\'s scheduler' if self.hf else
                     'add "type": "WarmupLR"')
            return
        if not isinstance(name, str) or name == "auto":
            return  # DS110 / DS170 already
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


# ----------------------------------------------------------------------------------------------
# Helpers


_KIND_WORDS = {"bool": "true or false", "int": "an integer", "float": "a number", "str": "a string",
               "path": "a directory path", "list": "a list", "dict": "an object", "enum": "one of its choices",
               "section": "an object", "lenient": "an object", "pyobject": "a Python object"}
_SECTION_WORDS = {"zero_optimization": "ZeRO", "offload_param": "offload_param", "offload_optimizer": "offload_optimizer",
                  "fp16": "fp16", "bf16": "bf16", "bfloat16": "bf16"}


def _training_args(args: dict) -> dict:
    merged = dict(TA_DEFAULTS)
    merged.update({k: v for k, v in dict(args).items() if v is not None or k not in TA_DEFAULTS})
    return merged


def _warmup_steps(warmup: Any, steps: int) -> Optional[int]:
    """TrainingArguments.get_warmup_steps: >= 1 is a step count, below 1 a ratio of the total."""
    if isinstance(warmup, bool) or not isinstance(warmup, (int, float)):
        return None
    return int(warmup) if warmup >= 1 else math.ceil(steps * warmup)


def _auto_leaves(node: Any, path: tuple, in_list: bool = False) -> Iterator[tuple[tuple, bool]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _auto_leaves(value, path + (key,), False)
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _auto_leaves(value, path + (index,), True)
    elif node == "auto":
        yield path, in_list


def _as_int(value: Any, allow_bool: bool = False) -> Optional[int]:
    """The integer pydantic/DeepSpeed arithmetic would get from `value`, or None."""
    if isinstance(value, bool):
        return int(value) if allow_bool else None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if math.isfinite(value) and value.is_integer() else None
    if isinstance(value, str):
        number = _parse_number(value)
        if number is not None and math.isfinite(number) and float(number).is_integer():
            return int(number)
    return None


def _as_bool(value: Any) -> Optional[bool]:
    """pydantic's lax bool: true/false, 0/1, and the usual strings; None when it would refuse."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _BOOL_STRINGS:
        return value.strip().lower() in _TRUE_STRINGS
    return None


def _parse_number(text: str) -> Optional[float]:
    try:
        number = float(text.strip())
    except (ValueError, AttributeError):
        return None
    return int(number) if number.is_integer() and "e" not in text.lower() and "." not in text else number


def _pydantic(path: tuple) -> bool:
    """Whether DeepSpeed reads `path` through a pydantic model (lax conversion, "auto" dropped)."""
    return path[0] in PYDANTIC_TOP or tuple(path[:2]) == ("timers", "throughput")


def _pydantic_number(text: str, kind: str) -> Optional[float]:
    """The number pydantic's lax mode makes of a string: ints accept "12" and "2.0" but not "5e8"."""
    number = _parse_number(text)
    if number is None or kind != "int":
        return number
    stripped = text.strip().lstrip("+-")
    digits, _, fraction = stripped.partition(".")
    if digits.isdigit() and (not fraction or set(fraction) == {"0"}):
        return int(number)
    return None


def _violated_bound(number: Any, spec: Field) -> Optional[str]:
    if spec.gt is not None and not number > spec.gt:
        return f"> {_num(spec.gt)}"
    if spec.ge is not None and not number >= spec.ge:
        return f">= {_num(spec.ge)}"
    if spec.lt is not None and not number < spec.lt:
        return f"< {_num(spec.lt)}"
    if spec.le is not None and not number <= spec.le:
        return f"<= {_num(spec.le)}"
    return None


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _suggest(name: str, candidates: list, case_insensitive: bool = False) -> Optional[str]:
    """The closest real key (difflib), or a known confusion (micro_batch_size -> train_micro_...)."""
    if name in COMMON_MISNAMES and COMMON_MISNAMES[name] != name:
        target = COMMON_MISNAMES[name]
        if target.split(".")[0] in candidates or " " in target:
            return target
    words = [str(c) for c in candidates]
    if case_insensitive:
        lowered = {w.lower(): w for w in words}
        match = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.75)
        return lowered[match[0]] if match else None
    match = difflib.get_close_matches(name, words, n=1, cutoff=0.8)
    if not match:  # a prefix/suffix slip such as `stage3_` on a key that has none
        stripped = name[7:] if name.startswith("stage3_") else f"stage3_{name}"
        match = [stripped] if stripped in words else []
    return match[0] if match else None


def _did_you_mean(value: str, choices: list) -> Optional[str]:
    match = difflib.get_close_matches(str(value).lower(), [str(c).lower() for c in choices], n=1, cutoff=0.6)
    return f"did you mean {_show(match[0])}?" if match else None


def _dotted(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "list"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, str):
        return '"' + (value if len(value) <= 40 else value[:37] + "...") + '"'
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _section_example(section: str) -> Optional[str]:
    return {"zero_optimization": 'e.g. "zero_optimization": {"stage": 2}', "fp16": 'e.g. "fp16": {"enabled": true}',
            "bf16": 'e.g. "bf16": {"enabled": true}'}.get(section)


def _batch_fix(hf: bool) -> str:
    if hf:
        return 'set train_batch_size, train_micro_batch_size_per_gpu and gradient_accumulation_steps to "auto"'
    return "make train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size"
