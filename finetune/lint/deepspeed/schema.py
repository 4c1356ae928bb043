"""DeepSpeed's config schema as data (deepspeed 0.19): known keys, their types, sections, defaults.

This is what must be re-synced for each DeepSpeed release. Read the named DeepSpeed sources
(runtime/config.py, runtime/constants.py, runtime/zero/config.py, runtime/zero/offload_config.py,
runtime/precision_config.py, monitor/config.py, runtime/lr_schedules.py, engine._configure_basic_optimizer)
of the new release and update the tables here, then run tests/lint/test_deepspeed.py:
test_schema_tables_match_deepspeed and test_optimizer_and_scheduler_tables_match compare these tables with
the installed DeepSpeed and fail on drift; the tests/ds_corpus checks compare the verdicts with the real libraries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional



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
ADAM_POPPED = {"torch_adam", "adam_w_mode", "fp32_optimizer_states"}  # taken out before the call
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

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
