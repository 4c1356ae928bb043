"""From a recipe (or command-line flags) to a `Setup`: its sections, DeepSpeed's rendered values, model lookup."""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from finetune.plan.allocator import expandable_in_training
from finetune.plan.archs import LAYER_LINEARS, Arch, ArchError, load_config_json, match_hub_id, names
from finetune.plan.constants import (
    DS_MAX_LIVE_PARAMETERS, DS_MAX_REUSE_DISTANCE, DS_PARAM_PERSISTENCE_THRESHOLD, DS_PREFETCH_BUCKET_SIZE,
    DS_REDUCE_BUCKET_SIZE, DS_SUB_GROUP_SIZE,
)
from finetune.plan.planner import plan
from finetune import objectives
from finetune.plan.preference import has_reference_model, rows_per_example
from finetune.plan.result import PlanResult
from finetune.plan.setup import PlanError, Setup, overflow_as_plan_error
from finetune.builtin import is_builtin
from finetune.recipe.references import MODEL_CONFIG


def plan_recipe(recipe, gpus: Optional[int] = None, gpu_memory_bytes: Optional[int] = None,
                nodes: Optional[int] = None, cpu_memory_bytes: Optional[int] = None,
                deepspeed: Optional[bool] = None, data_lengths: bool = False) -> PlanResult:
    """Plan a validated `finetune.recipe.Recipe`. Missing hardware comes from the recipe's `hardware`
    and `launch` sections. Raises PlanError (for example: a hub id the table does not know)."""
    return plan(setup_from_recipe(recipe, gpus, gpu_memory_bytes, nodes, cpu_memory_bytes, deepspeed, data_lengths))


@overflow_as_plan_error
def setup_from_recipe(recipe, gpus: Optional[int] = None, gpu_memory_bytes: Optional[int] = None,
                      nodes: Optional[int] = None, cpu_memory_bytes: Optional[int] = None,
                      deepspeed: Optional[bool] = None, data_lengths: bool = False, parallel: bool = True) -> Setup:
    """`deepspeed`: plan DeepSpeed's engine or the plain Trainer (None: the recipe's deepspeed.enabled).
    `data_lengths`: read the recipe's local data for its longest example (finetune.plan.data_lengths);
    off for lint, which must stay fast on recipes whose data is large. `parallel`: one process of the recipe's
    parallel.sequence / parallel.tensor (finetune.plan.parallel); False gives the Setup before them."""
    if deepspeed is None:
        deepspeed = bool(recipe.deepspeed.enabled)
    setup = _setup_from_recipe(recipe, gpus, gpu_memory_bytes, nodes, cpu_memory_bytes, deepspeed, data_lengths)
    if not parallel:
        return setup
    from finetune.plan.parallel import apply_parallel

    t = recipe.training
    return apply_parallel(setup, recipe.parallel.sequence, recipe.parallel.tensor,
                          activation_offload=t.activation_offload, tiled_mlp=t.tiled_mlp, tiled_mlp_shards=t.tiled_mlp_shards)


def _setup_from_recipe(recipe, gpus, gpu_memory_bytes, nodes, cpu_memory_bytes, deepspeed, data_lengths) -> Setup:
    from finetune.render import offload_device, optimizer_class, render_deepspeed
    from finetune.recipe import parse_size

    arch, params, label = resolve_model(recipe.model.name_or_path)
    hw = recipe.hardware
    launch_note = ""
    if gpus is None:
        if isinstance(recipe.launch.procs_per_node, int):
            gpus = recipe.launch.procs_per_node
        else:
            gpus = hw.gpus if hw is not None else 1
            cpu = recipe.launch.cpu_procs
            launch_note = (f"procs_per_node: auto starts one process per visible GPU (planned for {gpus} GPU"
                           f"{'s' if gpus != 1 else ''}{' from hardware.gpus' if hw is not None else ''}; "
                           f"--gpus N to change); without a GPU it starts {cpu} CPU process{'es' if cpu != 1 else ''}"
                           " (launch.cpu_procs), where GPU memory does not apply")
    nodes = nodes if nodes is not None else recipe.launch.nodes
    if gpu_memory_bytes is None and hw is not None and hw.gpu_memory:
        gpu_memory_bytes = parse_size(hw.gpu_memory)
    if cpu_memory_bytes is None and hw is not None and hw.cpu_memory:
        cpu_memory_bytes = parse_size(hw.cpu_memory)
    rendered = render_deepspeed(recipe, gpus * nodes)
    zero = rendered.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise PlanError("deepspeed.overrides.zero_optimization must be a mapping")
    # The rendered block leaves out what its stage does not use; --recommend tries other stages, which
    # would get the recipe's own values (or "auto").
    section = recipe.deepspeed
    unused = {"reduce_bucket_size": section.reduce_bucket_size,
              "stage3_prefetch_bucket_size": section.stage3_prefetch_bucket_size,
              "stage3_param_persistence_threshold": section.stage3_param_persistence_threshold,
              "contiguous_gradients": section.contiguous_gradients}
    if section.stage3_max_live_parameters is not None:
        unused["stage3_max_live_parameters"] = section.stage3_max_live_parameters
    zero = {**unused, **zero}
    stage = _int_value(zero, "stage", 0)
    if stage not in (0, 1, 2, 3):
        raise PlanError(f"zero_optimization.stage must be 0-3, got {stage}")
    hidden = arch.hidden if arch else None
    lora = recipe.lora
    targets, lora_experts, lora_router = lora_targets(arch, lora)
    overlap = zero.get("overlap_comm")
    seq_len, data_note, cut = recipe.data.max_length, "", False
    if data_lengths:
        from finetune.plan.data_lengths import data_seq_len

        seq_len, data_note, cut = data_seq_len(recipe)
    if objectives.get(recipe.objective).generates:  # a trained row is a prompt (data.max_length: its budget) + its completion
        seq_len += recipe.grpo.max_completion_length
    vision = _vision(recipe, seq_len, data_lengths)
    if vision is not None:  # the language model's Arch, and the tower and projector beside it
        extra = vision.tower.tower_params() + vision.tower.projector_params()
        size = f"{extra / 1e9:.2f}B" if extra >= 1e8 else f"{extra / 1e6:.2f}M"
        params, label = params + extra, f"{label} + vision tower and projector ({size} params)"
    micro_batch = recipe.training.micro_batch_size * rows_per_example(recipe.objective)
    # One SFT row per micro batch, cut to max_length (a multiple of 8, what the collator rounds a batch up to):
    # the longest batch has no padding, so transformers builds no 4D mask for it (masking_utils.
    # _ignore_causal_mask_sdpa on an all-ones mask) and sdpa runs is_causal, sharing the key/value heads
    # (sdpa_attention.use_gqa_in_sdpa); not where a sliding window reaches that far. docs/plan.md, "Ninth pass".
    # data.pad_to_multiple_of (as a GPU decides `auto`) pads such a row at its end to max_length rounded up to 8,
    # without a mask but for a mixture of experts (finetune.data.packing.Collator)
    one_row = cut and micro_batch == 1 and vision is None and objectives.get(recipe.objective).pretokenized
    widened = False
    if one_row:
        from finetune.data.packing import padded_width, planned_pad_multiple, width_limit

        padded = padded_width(seq_len, planned_pad_multiple(recipe), width_limit(seq_len))
        seq_len, widened = padded, padded > seq_len
    masked = widened and arch is not None and arch.experts > 0
    full_rows = (one_row and not masked and seq_len % 8 == 0 and recipe.parallel.sequence == 1
                 and not (arch is not None and arch.sliding_window and seq_len >= arch.sliding_window))
    if full_rows:
        data_note += (f"; one row per micro batch, padded at its end to {seq_len}: no attention mask" if widened else
                      "; one row per micro batch: no padding, no attention mask")
    return Setup(
        arch=arch, params=params, model_label=label,
        method=recipe.method, dtype=recipe.model.dtype, attn=recipe.model.attn_implementation,
        lora_r=lora.r, lora_targets=tuple(targets), lora_dropout=lora.dropout,
        lora_experts=lora_experts, lora_router=lora_router,
        router_logits=router_logits(recipe, arch), moe_leaf=moe_leaf(zero, arch),
        modules_to_save=tuple(lora.modules_to_save or ()),
        double_quant=recipe.quantization.double_quant,
        optimizer=recipe.training.optimizer, ds_fused_adam=optimizer_class(rendered) == "FusedAdam",
        deepspeed=deepspeed,
        stage=stage,
        offload_optimizer=(offload_device(rendered, "offload_optimizer") or "none") if stage >= 1 else "none",
        offload_param=(offload_device(rendered, "offload_param") or "none") if stage == 3 else "none",
        gpus_per_node=gpus, nodes=nodes,
        micro_batch=micro_batch, seq_len=seq_len,
        packing=recipe.data.packing, padding_free=recipe.data.padding_free,
        full_rows=full_rows,
        # The collator pads a batch to its longest row (finetune/data/tokenize.py); packed rows are max_length.
        shapes_vary=not recipe.data.packing,
        expandable_segments=expandable_in_training(os.environ),
        gradient_checkpointing=recipe.training.gradient_checkpointing,
        gradient_accumulation=recipe.training.gradient_accumulation_steps,
        loss_kernel=recipe.training.loss_kernel, loss_chunk_tokens=recipe.training.loss_chunk_tokens,
        overlap_comm=bool(overlap) if overlap is not None else None,
        contiguous_gradients=bool(zero.get("contiguous_gradients", True)),
        # "auto" values are filled by transformers/integrations/deepspeed.py from hidden_size.
        reduce_bucket_size=_size_value(zero, "reduce_bucket_size", DS_REDUCE_BUCKET_SIZE,
                                       hidden * hidden if hidden else None),
        prefetch_bucket_size=_size_value(zero, "stage3_prefetch_bucket_size", DS_PREFETCH_BUCKET_SIZE,
                                         int(0.9 * hidden * hidden) if hidden else None),
        param_persistence_threshold=_size_value(zero, "stage3_param_persistence_threshold",
                                                DS_PARAM_PERSISTENCE_THRESHOLD, 10 * hidden if hidden else None),
        max_live_parameters=_size_value(zero, "stage3_max_live_parameters", DS_MAX_LIVE_PARAMETERS, None),
        max_reuse_distance=_size_value(zero, "stage3_max_reuse_distance", DS_MAX_REUSE_DISTANCE, None),
        sub_group_size=_size_value(zero, "sub_group_size", DS_SUB_GROUP_SIZE, None),
        gpu_memory=gpu_memory_bytes, cpu_memory=cpu_memory_bytes,
        gpu_type=hw.gpu_type if hw is not None else None,
        launch_note=launch_note, data_note=data_note,
        objective=recipe.objective,
        reference_model=has_reference_model(recipe),
        generation_sequences=(recipe.training.micro_batch_size * recipe.training.gradient_accumulation_steps
                              if objectives.get(recipe.objective).generates else 0),
        reference_adapter=(objectives.get(recipe.objective).reference == "preference" and recipe.method != "full"
                           and recipe.model.adapter is not None and recipe.preference.reference.mode == "adapter_disabled"),
        vision=vision,
    )


def lora_targets(arch: Optional[Arch], lora) -> tuple[tuple[str, ...], bool, bool]:
    """(the layer linears LoRA adapts, LoRA on the fused experts, on the router) as the runner resolves them
    (finetune.models.targets): a dense model's all-linear is its own linears (Phi-3's fused qkv_proj and
    gate_up_proj too); a mixture of experts' is its attention and shared expert."""
    from finetune.models.families import family
    from finetune.models.targets import LoraChoice, resolve

    resolved = resolve(LoraChoice.of(lora), family(arch.model_type) if arch else None)
    if resolved.modules == "all-linear":
        names = arch.linear_names() if arch else LAYER_LINEARS
    else:
        names = tuple(name.rsplit(".", 1)[-1] for name in resolved.modules)
    return names, resolved.experts, resolved.router


def router_logits(recipe, arch: Optional[Arch]) -> bool:
    """Whether every layer's router logits are returned for the auxiliary loss (finetune.train.moe: unless the
    recipe's router_aux_loss_coef is 0)."""
    return bool(arch and arch.experts) and recipe.moe.router_aux_loss_coef != 0


def moe_leaf(zero: dict, arch: Optional[Arch]) -> bool:
    """Whether ZeRO-3 fetches the model's sparse block whole: its class is among the rendered leaf classes."""
    from finetune.models.families import DEEPSPEED_DEFAULT_LEAF_CLASSES, family

    fam = family(arch.model_type) if arch and arch.experts else None
    if fam is None or not fam.moe:
        return False
    leaf = zero.get("leaf_module")
    classes = leaf.get("classes", DEEPSPEED_DEFAULT_LEAF_CLASSES) if isinstance(leaf, dict) else DEEPSPEED_DEFAULT_LEAF_CLASSES
    if isinstance(classes, str):
        classes = [classes]
    return any(c in (fam.moe_block, fam.moe_block.rsplit(".", 1)[-1]) for c in classes or ())


def _vision(recipe, seq_len: int, data_lengths: bool):
    """A VLM's tower and projector (finetune.plan.vision), sized for the data's image tokens when read."""
    from finetune.plan.vision import vision_setup
    from finetune.vision_models import VisionModelError, recipe_vision

    try:
        vm = recipe_vision(recipe)
    except VisionModelError as exc:
        raise PlanError(str(exc)) from None
    tokens = None
    if vm is not None and data_lengths:
        from finetune.plan.data_lengths import data_image_tokens

        tokens = data_image_tokens(recipe)
    return vision_setup(recipe, vm, seq_len, tokens)


def _int_value(zero: dict, key: str, default: int) -> int:
    value = zero.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PlanError(f"zero_optimization.{key} must be a number, got {value!r}")
    return int(value)


def _size_value(zero: dict, key: str, default: int, auto: Optional[int]) -> int:
    value = zero.get(key, default)
    if value == "auto":
        # Without the model's hidden size "auto" cannot be resolved; DeepSpeed's default is the
        # closest guess (and an over-estimate for small models).
        return auto if auto is not None else default
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise PlanError(f"zero_optimization.{key} must be a number or \"auto\", got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise PlanError(f"zero_optimization.{key} must be a non-negative number, got {value!r}")
    return int(value)


_COUNT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMBT])\s*$", re.IGNORECASE)
_COUNT_UNITS = {"k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


def resolve_model(name: str) -> tuple[Optional[Arch], int, str]:
    """(architecture or None, total parameters, label) for a model reference.

    Accepts a local directory with config.json (or the file itself), a `builtin:` tiny model, a
    hub id or table name the built-in table knows, or a bare parameter count such as `7.5B`.
    """
    text = str(name).strip()
    count = _COUNT_RE.match(text)
    if count:
        params = int(float(count.group(1)) * _COUNT_UNITS[count.group(2).lower()])
        return None, params, f"{text} parameters (model states only)"
    if is_builtin(text):
        from finetune.plan.archs import arch_from_config
        from finetune.builtin import BuiltinModelError, builtin_config

        try:
            config = builtin_config(text)
        except BuiltinModelError as exc:
            raise PlanError(str(exc)) from None
        arch = replace(arch_from_config(config, text), name=text)
        return arch, arch.total_params, arch.describe()
    path = Path(text).expanduser()
    if path.exists():
        from finetune.fsutil import SpecialFile, refuse_special

        try:
            refuse_special(path)
        except SpecialFile as exc:
            raise PlanError(str(exc)) from None
        if path.is_dir() and not (path / MODEL_CONFIG).is_file():
            raise PlanError(f"{path} has no config.json: pass --model with a config.json, an architecture "
                            f"name ({', '.join(names()[:4])}, ...) or a parameter count such as 7.5B")
        try:
            arch = load_config_json(path)
        except ArchError as exc:
            raise PlanError(str(exc)) from None
        return arch, arch.total_params, f"{arch.describe()} [from {path}]"
    arch = match_hub_id(text)
    if arch is not None:
        label = arch.describe() + ("" if text.lower() == arch.name else f" [table match for {text}]")
        return arch, arch.total_params, label
    published = _published_vlm(text)
    if published is not None:
        return published
    raise PlanError(f"model {text!r} is neither a local directory with config.json nor a known architecture: "
                    f"pass --model with a config.json path, an architecture name ({', '.join(names())}) "
                    "or a parameter count such as 7.5B")


def _published_vlm(name: str) -> Optional[tuple[Arch, int, str]]:
    """A vision-language model whose published config finetune.vision_models holds: its language model's Arch."""
    from finetune.plan.archs import arch_from_config
    from finetune.vision_models import PUBLISHED, model_files

    files = model_files(name)
    if files is None or not any(files[0] is entry["config"] for entry in PUBLISHED.values()):
        return None
    arch = replace(arch_from_config(files[0], files[3]), name=name)
    return arch, arch.total_params, f"{arch.describe()} [{files[3]}]"


# ----------------------------------------------------------------------------------------------
# Command-line what-ifs: flags become `--set` overrides, so a recipe and a bare model plan alike.

_ZERO_CHOICES = ("none", "0", "1", "2", "3")


def flag_overrides(*, model: Optional[str] = None, method: Optional[str] = None, zero: Optional[str] = None,
                   offload_optimizer: Optional[str] = None, offload_param: Optional[str] = None,
                   micro_batch: Optional[int] = None, seq_len: Optional[int] = None,
                   gradient_checkpointing: Optional[bool] = None, lora_r: Optional[int] = None,
                   lora_targets: Optional[str] = None, attn: Optional[str] = None,
                   dtype: Optional[str] = None) -> list[str]:
    """`--zero 3` -> `deepspeed.stage=3`, and so on (`--zero none` is handled by the caller)."""
    out = []

    def add(key: str, value: Any) -> None:
        if value is not None:
            out.append(f"{key}={json.dumps(value) if isinstance(value, str) else _yaml_scalar(value)}")

    if zero is not None and zero not in _ZERO_CHOICES:
        raise PlanError(f"--zero must be one of {', '.join(_ZERO_CHOICES)}, got {zero!r}")
    add("model.name_or_path", model)
    add("method", method)
    add("deepspeed.stage", int(zero) if zero not in (None, "none") else None)
    add("deepspeed.enabled", True if zero not in (None, "none") else None)  # --zero N asks for DeepSpeed (none: the caller)
    add("deepspeed.offload_optimizer", offload_optimizer)
    add("deepspeed.offload_param", offload_param)
    add("training.micro_batch_size", micro_batch)
    add("data.max_length", seq_len)
    add("training.gradient_checkpointing", gradient_checkpointing)
    add("lora.r", lora_r)
    if lora_targets is not None:
        targets = [t.strip() for t in lora_targets.split(",") if t.strip()]
        out.append("lora.target_modules=" + ("all-linear" if targets == ["all-linear"] else json.dumps(targets)))
    add("model.attn_implementation", attn)
    add("model.dtype", dtype)
    return out


def _yaml_scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def recipe_without_file(overrides: list[str]):
    """A recipe for `finetune plan --model ...`: defaults plus the flags (RecipeProblem on bad values)."""
    from finetune.recipe import RecipeProblem, apply_set, validate

    raw: dict[str, Any] = {"model": {"name_or_path": ""}, "data": {"path": "-"}}
    origin: dict = {}
    for item in overrides:
        apply_set(raw, origin, item)
    if not raw["model"].get("name_or_path"):
        raise PlanError("without a recipe, --model is required (a config.json, an architecture name such as "
                        "llama-3-8b, or a parameter count such as 7.5B)")
    try:
        recipe = validate(raw, origin, "<command line>")
    except RecipeProblem:
        raise
    recipe.name = "command-line"
    return recipe
