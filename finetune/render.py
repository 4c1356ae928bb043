"""Recipe -> DeepSpeed JSON and the HF TrainingArguments it implies.

Values the recipe knows are written out; `"auto"` is used only where the HF DeepSpeed integration
fills it (transformers/integrations/deepspeed.py):
- `train_batch_size` when the world size is only known at launch (micro x accumulation x world),
- `zero_optimization.reduce_bucket_size` (hidden^2), `stage3_prefetch_bucket_size` (0.9 x hidden^2),
  `stage3_param_persistence_threshold` (10 x hidden): they need the model's hidden size.
Everything else is concrete, so a rendered file also means the same thing outside the Trainer.

Output is deterministic: keys are emitted in a fixed order, so a diff of a rendered file in a pull
request shows exactly what changed.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Optional

from finetune.recipe import Recipe

# DeepSpeed builds these optimizers itself (and offloads them to its CPU implementations).
DS_OPTIMIZERS = {"adamw": "AdamW", "adam": "Adam", "lion": "Lion", "adagrad": "Adagrad"}
# These come from the HF Trainer (DeepSpeed wraps a client optimizer it cannot offload).
HF_OPTIMIZERS = {"sgd": "sgd", "adamw_bnb_8bit": "adamw_bnb_8bit"}

# Without DeepSpeed (deepspeed.enabled: false), the Trainer's own optimizer names (lint R150 refuses the others).
PLAIN_OPTIMIZERS = {"adamw": "adamw_torch_fused"}

# DeepSpeed prints every N steps; the Trainer already logs, so keep DeepSpeed quiet.
STEPS_PER_PRINT = 1_000_000


def render_deepspeed(recipe: Recipe, world_size: Optional[int] = None) -> dict[str, Any]:
    """The DeepSpeed config for `recipe`. `world_size` overrides what the recipe implies."""
    t, ds = recipe.training, recipe.deepspeed
    world = world_size if world_size is not None else recipe.world_size
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "train_batch_size": _train_batch_size(recipe, world),
        "gradient_clipping": t.max_grad_norm,
        "bf16": {"enabled": recipe.model.dtype == "bfloat16"},
        "fp16": _fp16_block(recipe.model.dtype == "float16"),
    }
    optimizer = _optimizer_block(recipe)
    if optimizer is not None:
        config["optimizer"] = optimizer
    config["zero_optimization"] = _zero_block(recipe)
    if recipe.parallel.tensor > 1:
        # DeepSpeed's AutoTP for training (deepspeed/runtime/engine.py _configure_tensor_parallel); the HF
        # integration calls deepspeed.tp_model_init with it before the engine (integrations/deepspeed.py).
        config["tensor_parallel"] = {"autotp_size": recipe.parallel.tensor}
    if t.optimizer in HF_OPTIMIZERS and ds.offload_optimizer != "none":
        # DeepSpeed refuses a client optimizer with offload unless told it may (lint flags this).
        config["zero_force_ds_cpu_optimizer"] = False
    config["steps_per_print"] = STEPS_PER_PRINT
    config["wall_clock_breakdown"] = False
    return with_torch_adam(deep_merge(config, ds.overrides), ds.overrides)


# Reading a DeepSpeed config as its engine reads it (lint, the plan and the ops a launch compiles read it here).

def offload_device(config: Any, block: str) -> Optional[str]:
    """The device DeepSpeed offloads to by zero_optimization.<block> (offload_optimizer, offload_param): none, cpu or
    nvme; None for a value it refuses. No block, and accelerate's "auto", are none."""
    zero = config.get("zero_optimization") if isinstance(config, dict) else None
    node = zero.get(block) if isinstance(zero, dict) else None
    if node is None or not isinstance(node, dict):
        return "none" if node is None else None
    device = node.get("device", "none")
    if device == "auto":
        return "none"  # accelerate's default, and raw DeepSpeed's after dropping "auto"
    return device if device in ("none", "cpu", "nvme") else None


def optimizer_class(config: Any) -> Optional[str]:
    """The class DeepSpeed's engine builds for the config's optimizer block (0.19, engine._configure_basic_optimizer):
    Adam/AdamW are torch.optim.AdamW where `torch_adam` is true as Python reads it (the engine pops it and tests `if
    torch_adam:`, so the string "false" is true there), else DeepSpeedCPUAdam with the optimizer offloaded and
    FusedAdam without; Lion FusedLion or DeepSpeedCPULion; Adagrad DeepSpeedCPUAdagrad offloaded, else torch's;
    Lamb FusedLamb. None: no block (the client's optimizer: the Trainer's), a torch.optim class named exactly, or
    a type this does not know."""
    block = config.get("optimizer") if isinstance(config, dict) else None
    name = block.get("type") if isinstance(block, dict) else None
    if not isinstance(name, str):
        return None
    kind, params = name.lower(), block.get("params")
    offloaded = offload_device(config, "offload_optimizer") in ("cpu", "nvme")
    if kind in ("adam", "adamw"):
        if isinstance(params, dict) and params.get("torch_adam", False):
            return "torch.optim.AdamW"
        return "DeepSpeedCPUAdam" if offloaded else "FusedAdam"
    return {"lion": "DeepSpeedCPULion" if offloaded else "FusedLion",
            "adagrad": "DeepSpeedCPUAdagrad" if offloaded else "torch.optim.Adagrad",
            "lamb": "FusedLamb"}.get(kind)


def with_torch_adam(config: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed's Adam/AdamW stepped by torch's fused AdamW (`torch_adam` + `fused`), not by DeepSpeed's FusedAdam,
    unless the overrides write `torch_adam` themselves.

    The same update (decoupled weight decay, bias correction; engine.get_optimizer_configuration), one fused kernel
    over the fp32 master partition either way, and what DeepSpeed gets from the Trainer in LLaMA-Factory's and axolotl's
    configs (no optimizer block: the Trainer's torch fused AdamW; finetune's full fine-tune with it matched theirs,
    1.007, docs/gpu_acceptance/2026-11-28_h200_speed_third.md). FusedAdam is JIT-compiled with nvcc on a run's first
    use: 71-78 s on the H200 before a step, no run at all on an image with only the CUDA runtime, and the build that
    failed every DeepSpeed launch of the first GPU run (docs/gpu-acceptance.md). Offloaded, the step is
    DeepSpeedCPUAdam's (a host op; DeepSpeed refuses torch's optimizer there), so the block stays as it is."""
    block = config.get("optimizer")
    params = block.get("params") if isinstance(block, dict) else None
    if not isinstance(params, dict) or optimizer_class(config) != "FusedAdam":  # offloaded: DeepSpeedCPUAdam
        return config
    written = overrides.get("optimizer")
    written = written.get("params") if isinstance(written, dict) else None
    if isinstance(written, dict) and "torch_adam" in written:
        return config  # the recipe chose: `torch_adam: false` is DeepSpeed's FusedAdam
    params["torch_adam"] = True
    params.setdefault("fused", True)
    block["params"] = dict(sorted(params.items()))
    return config


def _train_batch_size(recipe: Recipe, world: Optional[int]) -> Any:
    """DeepSpeed's identity train_batch_size = micro x accumulation x (the world DeepSpeed's config sees).

    Without Ulysses that world is every process; AutoTP ranks count in it too (DeepSpeedConfig has no mpu
    under AutoTP, so its world is dist.get_world_size()), although they see the same rows. With Ulysses two
    DeepSpeed configs are built from this file: zero.Init's (transformers, no mpu: every process) and the
    engine's (accelerate rewrites train_batch_size to micro x accumulation x world / sp in
    Accelerator._prepare_deepspeed). One number cannot be right for both, so it stays "auto"; the engine's
    value is in deepspeed.effective.json. Rows per optimizer step: finetune.render.batch_arithmetic.
    """
    t = recipe.training
    if world is None or recipe.parallel.sequence > 1:
        return "auto"
    return t.micro_batch_size * t.gradient_accumulation_steps * world


def batch_arithmetic(recipe: Recipe, world: Optional[int] = None) -> dict[str, Any]:
    """What one optimizer step consumes, with the sentence that explains it (README: Long context).

    dp = world / (sequence x tensor) groups see different rows; the processes of one Ulysses group
    process the same row, a 1/sp slice each (DeepSpeed's UlyssesSPDataLoaderAdapter gathers one batch
    from each rank of the group and feeds them to the whole group one after another); AutoTP ranks
    see the same rows. Sequences per step = micro x accumulation x dp; tokens up to that x max_length.
    """
    t, p = recipe.training, recipe.parallel
    world = world if world is not None else recipe.world_size
    out: dict[str, Any] = {"world_size": world, "sequence": p.sequence, "tensor": p.tensor,
                           "data_parallel": None, "sequences_per_step": None, "max_tokens_per_step": None,
                           "tokens_per_process": -(-recipe.data.max_length // p.sequence)}
    if world is None or world % p.model_parallel:
        out["explanation"] = (f"world size {world or 'unknown'}: data-parallel size = world / (sequence {p.sequence} x "
                              f"tensor {p.tensor}) needs a world divisible by {p.model_parallel}")
        return out
    dp = world // p.model_parallel
    seqs = t.micro_batch_size * t.gradient_accumulation_steps * dp
    out.update(data_parallel=dp, sequences_per_step=seqs, max_tokens_per_step=seqs * recipe.data.max_length)
    out["explanation"] = (f"{world} processes = {dp} data-parallel x {p.sequence} sequence x {p.tensor} tensor; "
                          f"{t.micro_batch_size} x {t.gradient_accumulation_steps} x {dp} = {seqs} sequences per step "
                          f"(up to {seqs * recipe.data.max_length:,} tokens); each process holds up to "
                          f"{out['tokens_per_process']:,} tokens of a sequence")
    return out


def render_parallelism(recipe: Recipe) -> Optional[dict[str, Any]]:
    """TrainingArguments.parallelism_config as JSON (the runner builds accelerate's ParallelismConfig from it;
    its dp_shard_size, the data-parallel size accelerate uses for the engine's train_batch_size, comes from the
    real world size there). None without sequence parallelism: AutoTP is DeepSpeed's (tensor_parallel above)."""
    p = recipe.parallel
    if p.sequence == 1:
        return None
    return {"sp_backend": "deepspeed", "sp_size": p.sequence,
            # variable: every micro batch is padded to its own longest row (a multiple of sp), not to max_length
            "sp_handler": {"sp_seq_length_is_variable": True,
                           "sp_attn_implementation": recipe.model.attn_implementation}}


def _fp16_block(enabled: bool) -> dict[str, Any]:
    if not enabled:
        return {"enabled": False}
    # DeepSpeed's documented dynamic loss scaling defaults, written out so the file says what runs.
    return {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
            "hysteresis": 2, "min_loss_scale": 1}


def _optimizer_block(recipe: Recipe) -> Optional[dict[str, Any]]:
    t = recipe.training
    name = DS_OPTIMIZERS.get(t.optimizer)
    if name is None:
        return None
    params: dict[str, Any] = {"lr": t.learning_rate, "weight_decay": t.weight_decay}
    if name in ("AdamW", "Adam", "Lion"):
        params["betas"] = [t.adam_beta1, t.adam_beta2]
    if name in ("AdamW", "Adam", "Adagrad"):
        params["eps"] = t.adam_epsilon
    return {"type": name, "params": dict(sorted(params.items()))}


def _offload(device: str, nvme_path: Optional[str]) -> dict[str, Any]:
    block: dict[str, Any] = {"device": device, "pin_memory": True}
    if device == "nvme":
        block["nvme_path"] = nvme_path or "/local_nvme"
    return block


def _zero_block(recipe: Recipe) -> dict[str, Any]:
    ds = recipe.deepspeed
    zero: dict[str, Any] = {"stage": ds.stage}
    if recipe.parallel.tensor > 1:
        # AutoTP shards weights too: the Trainer saves them through accelerate's get_state_dict, which gathers
        # the AutoTP shards only when this is true (else ValueError -> a ZeRO checkpoint instead of weights).
        zero["stage3_gather_16bit_weights_on_model_save"] = ds.gather_16bit_weights_on_model_save
    if ds.stage == 0:
        return zero
    if ds.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload(ds.offload_optimizer, ds.nvme_path)
    if ds.stage == 3 and ds.offload_param != "none":
        zero["offload_param"] = _offload(ds.offload_param, ds.nvme_path)
    if ds.overlap_comm is not None:
        zero["overlap_comm"] = ds.overlap_comm
    zero["contiguous_gradients"] = ds.contiguous_gradients
    zero["reduce_bucket_size"] = ds.reduce_bucket_size
    if ds.stage in (1, 2) and ds.allgather_bucket_size is not None:
        zero["allgather_bucket_size"] = ds.allgather_bucket_size
    if ds.stage == 3:
        zero["stage3_prefetch_bucket_size"] = ds.stage3_prefetch_bucket_size
        zero["stage3_param_persistence_threshold"] = ds.stage3_param_persistence_threshold
        if ds.stage3_max_live_parameters is not None:
            zero["stage3_max_live_parameters"] = ds.stage3_max_live_parameters
        zero["stage3_gather_16bit_weights_on_model_save"] = ds.gather_16bit_weights_on_model_save
        leaf = moe_leaf_block(recipe)
        if leaf is not None:
            zero["leaf_module"] = leaf
    return zero


def moe_leaf_block(recipe: Recipe) -> Optional[dict[str, Any]]:
    """ZeRO-3's leaf modules for a mixture of experts (None for a dense model): DeepSpeed's defaults plus the
    model's sparse block, written out because a `leaf_module.classes` list replaces DeepSpeed's defaults. A leaf
    is fetched whole when entered: the experts a batch runs change with every batch (no fixed trace to prefetch),
    and with LoRA on the fused experts peft's ParamWrapper reads the parameters outside their module's hooks,
    where DeepSpeed would gather them one at a time on access (issue 37)."""
    from finetune.models.families import leaf_classes
    from finetune.models.identify import identify

    ident = identify(recipe.model.name_or_path)
    if ident is None or not ident.moe:
        return None
    return {"classes": leaf_classes(ident.family)}


def reentrant_checkpointing(recipe: Recipe) -> bool:
    """use_reentrant for gradient checkpointing: the recipe's, except LoRA/QLoRA under ZeRO-3, which is
    always reentrant. There ZeRO-3 has partitioned the frozen weights (norms) again by the time a
    non-reentrant recompute runs, and PyTorch's metadata check fails ("Recomputed values ... have different
    metadata", deepspeedai/DeepSpeed#4332, huggingface/transformers#47254) on DeepSpeed < 0.19.3 (fixed by
    #8130/#8148); TRL >= 1.x forces reentrant for this combination in its trainers anyway (trl#4951,
    #6356). Reentrant needs inputs that require grad: the runner makes the embedding output require it."""
    t = recipe.training
    return t.gradient_checkpointing_reentrant or (recipe.method != "full" and recipe.deepspeed.stage == 3)


def render_training_args(recipe: Recipe, output_dir: Optional[str] = None) -> dict[str, Any]:
    """Keyword arguments for transformers.TrainingArguments (the `deepspeed` key is filled at launch)."""
    t, d = recipe.training, recipe.data
    args: dict[str, Any] = {
        "output_dir": output_dir or resolved_output_dir(recipe),
        "per_device_train_batch_size": t.micro_batch_size,
        "per_device_eval_batch_size": t.micro_batch_size,
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "num_train_epochs": t.epochs,
        "max_steps": t.max_steps if t.max_steps is not None else -1,
        "learning_rate": t.learning_rate,
        "lr_scheduler_type": t.lr_scheduler,
        # transformers >= 5 reads a float below 1 as a ratio of the total steps (warmup_ratio is gone).
        "warmup_steps": t.warmup_steps if t.warmup_steps > 0 else t.warmup_ratio,
        "weight_decay": t.weight_decay,
        "adam_beta1": t.adam_beta1,
        "adam_beta2": t.adam_beta2,
        "adam_epsilon": t.adam_epsilon,
        "max_grad_norm": t.max_grad_norm,
        "bf16": recipe.model.dtype == "bfloat16",
        "fp16": recipe.model.dtype == "float16",
        "gradient_checkpointing": t.gradient_checkpointing,
        "gradient_checkpointing_kwargs": _checkpointing_kwargs(recipe),
        "seed": t.seed,
        "data_seed": t.seed,
        "logging_steps": t.logging_steps,
        "logging_first_step": True,
        # The Trainer's nan/inf filter reads every micro batch's loss on the host (bool of a device tensor):
        # a synchronisation per micro batch (issue 35). Without it a non-finite loss is logged as it is.
        "logging_nan_inf_filter": False,
        "eval_strategy": "steps" if d.validation_split > 0 else "no",
        "eval_steps": (t.eval_steps or t.logging_steps) if d.validation_split > 0 else None,
        "save_strategy": "steps" if t.save_steps else "no",
        "save_steps": t.save_steps,
        "save_total_limit": t.save_total_limit,
        "report_to": [r for r in t.report_to if r != "none"] or "none",
        "dataloader_num_workers": t.dataloader_num_workers,
        "remove_unused_columns": False,
        "ddp_timeout": recipe.launch.nccl_timeout,
    }
    if t.optimizer in HF_OPTIMIZERS:
        args["optim"] = HF_OPTIMIZERS[t.optimizer]
    elif not recipe.deepspeed.enabled:
        # Without DeepSpeed the Trainer builds the optimizer: torch's fused AdamW (one kernel for every tensor).
        args["optim"] = PLAIN_OPTIMIZERS.get(t.optimizer, t.optimizer)
    parallelism = render_parallelism(recipe)
    if parallelism is not None:
        args["parallelism_config"] = parallelism
    if t.loss_kernel == "liger":
        # The Trainer applies Liger's kernels to the model (transformers/integrations/liger.py),
        # fused linear cross-entropy included; the other loss kernels are the runner's.
        args["use_liger_kernel"] = True
    return args


def _checkpointing_kwargs(recipe: Recipe) -> Optional[dict[str, Any]]:
    t = recipe.training
    if not t.gradient_checkpointing:
        return None
    kwargs: dict[str, Any] = {"use_reentrant": reentrant_checkpointing(recipe)}
    if t.activation_offload:
        kwargs["offload"] = True  # the Trainer pops it for activation_checkpointing_enable(offload=...)
    return kwargs


def resolved_output_dir(recipe: Recipe) -> str:
    return recipe.output_dir.replace("{name}", recipe.name or "run")


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """`top` wins key by key; nested dicts merge. Neither input is modified."""
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def dumps(config: dict[str, Any]) -> str:
    """Stable JSON text: two-space indent, insertion order (render's order is fixed), final newline."""
    return json.dumps(config, indent=2) + "\n"


# Curated templates in ds_configs/ (for plain `Trainer(args=TrainingArguments(deepspeed=...))` users):
# rendered from the same code as recipes, with every value the HF integration fills set to "auto",
# because a template cannot know the TrainingArguments it will be used with.
TEMPLATES: dict[str, tuple[int, str, str]] = {
    "zero0": (0, "none", "none"),
    "zero1": (1, "none", "none"),
    "zero2": (2, "none", "none"),
    "zero2_offload_optimizer": (2, "cpu", "none"),
    "zero3": (3, "none", "none"),
    "zero3_offload_optimizer": (3, "cpu", "none"),
    "zero3_offload_all": (3, "cpu", "cpu"),
}

_HF_FILLED = {
    ("train_micro_batch_size_per_gpu",), ("gradient_accumulation_steps",), ("train_batch_size",),
    ("gradient_clipping",), ("bf16", "enabled"), ("fp16", "enabled"),
    ("optimizer", "params", "lr"), ("optimizer", "params", "betas"), ("optimizer", "params", "eps"),
    ("optimizer", "params", "weight_decay"),
}


def render_template(name: str) -> dict[str, Any]:
    from finetune.recipe import Recipe

    stage, offload_optimizer, offload_param = TEMPLATES[name]
    recipe = Recipe.model_validate({
        "model": {"name_or_path": "template"},
        "data": {"path": "template"},
        "deepspeed": {"stage": stage, "offload_optimizer": offload_optimizer, "offload_param": offload_param},
    })
    config = render_deepspeed(recipe)
    for key in _HF_FILLED:
        node = config
        for part in key[:-1]:
            node = node.get(part, {})
        if key[-1] in node:
            node[key[-1]] = "auto"
    config["fp16"] = {"enabled": "auto"}  # HF fills fp16.enabled from --fp16; the loss-scale defaults apply
    return config
