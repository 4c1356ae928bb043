"""Recipe rules for model parallelism and long context (R140-R149): `parallel.sequence` (DeepSpeed Ulysses
through accelerate's ParallelismConfig), `parallel.tensor` (DeepSpeed AutoTP) and `model.rope_scaling`.

Each rule names the library code that fails (or silently misbehaves) with the combination it refuses;
tests/train/test_parallel.py reproduces those failures against the installed libraries.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional

from finetune import objectives
from finetune.lint.deepspeed.context import RawFinding
from finetune.lint.recipe_rules import RULES, rule
from finetune.recipe import LoadedRecipe
from finetune.recipe.references import MODEL_CONFIG

PARALLEL_RULES: dict[str, str] = {
    "R140": "The world size is not a multiple of parallel.sequence x parallel.tensor.",
    "R141": "Attention heads or kv-heads that parallel.sequence (Ulysses) cannot split; AutoTP beyond the kv-heads.",
    "R142": "An attention kernel Ulysses cannot wrap (eager).",
    "R143": "AutoTP (parallel.tensor) with ZeRO-3, or together with Ulysses.",
    "R144": "Packing or padding_free under Ulysses with sdpa: examples would attend to each other.",
    "R145": "Ulysses with a preference objective (TRL computes its own loss and never averages the sequence shards).",
    "R146": "Ulysses with gradient accumulation: micro batches weigh equally, not tokens (info).",
    "R147": "data.max_length beyond the model's positions without model.rope_scaling.",
    "R148": "AutoTP with QLoRA (4-bit weights cannot be split) or LoRA (DeepSpeed's ZeRO-1/2 optimizer fails on them).",
    "R149": "Ulysses with ZeRO 0-2: gradients (and their logged norm) come out sequence times larger; clipping acts earlier.",
}
RULES.update(PARALLEL_RULES)

# Version floors, where the installed sources refuse or ignore the feature below them (finetune doctor checks them):
# accelerate's Accelerator._prepare_deepspeed raises for Ulysses below deepspeed 0.18.2 and for AutoTP below
# 0.16.4; transformers' Trainer refuses a parallelism_config below accelerate 1.12.0; the Trainer's Ulysses loss
# (integrations/deepspeed.py deepspeed_sp_compute_loss) and SP-aware step counting are transformers 5 code
# (issue 22 reports 4.57 ignoring parallelism_config; not re-checked here, only 5.23 is installed).
ULYSSES_FLOORS = {"deepspeed": ">=0.18.2", "accelerate": ">=1.12.0", "transformers": ">=5.0.0"}
AUTOTP_FLOORS = {"deepspeed": ">=0.16.4", "accelerate": ">=1.12.0", "transformers": ">=5.0.0"}

# max_position_embeddings of the architectures in finetune.plan.archs (public config.json values; Llama 3.1's
# 131072 already includes its llama3 rope scaling). Local and built-in models are read from their config.
KNOWN_POSITIONS = {
    "llama-2-7b": 4096, "llama-2-13b": 4096, "llama-2-70b": 4096, "llama-3-8b": 8192, "llama-3-70b": 8192,
    "llama-3.1-8b": 131072, "llama-3.1-70b": 131072, "qwen2.5-0.5b": 32768, "qwen2.5-1.5b": 32768,
    "qwen2.5-3b": 32768, "qwen2.5-7b": 32768, "qwen2.5-14b": 32768, "qwen2.5-32b": 32768, "qwen2.5-72b": 32768,
    "mistral-7b-v0.3": 32768, "mistral-7b": 32768, "gemma-2-2b": 8192, "gemma-2-9b": 8192, "gemma-2-27b": 8192,
    "mixtral-8x7b": 32768, "qwen1.5-moe-a2.7b": 8192,
    # this year's (finetune.plan.archs.THIS_YEAR, the same config.json copies)
    **dict.fromkeys(("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b", "qwen3-30b-a3b",
                     "qwen3-235b-a22b"), 40960),
    "llama-3.2-1b": 131072, "llama-3.2-3b": 131072, "llama-3.3-70b": 131072, "gemma-3-1b": 32768,
    "gemma-3-4b": 131072, "gemma-3-12b": 131072, "gemma-3-27b": 131072, "phi-4": 16384,
    "gpt-oss-20b": 131072, "gpt-oss-120b": 131072,
}


def model_shape(name: str) -> Optional[tuple[int, int, Optional[int]]]:
    """(heads, kv_heads, max positions or None) of a built-in, local or table model; None when unknown."""
    from finetune.plan.from_recipe import resolve_model
    from finetune.plan.setup import PlanError

    try:
        arch, _, _ = resolve_model(name)
    except PlanError:
        return None
    if arch is None:
        return None
    return arch.heads, arch.kv_heads, _positions(name, arch.name)


def _positions(name: str, arch_name: str) -> Optional[int]:
    from finetune.builtin import BuiltinModelError, builtin_config, is_builtin

    config: dict = {}
    if is_builtin(name):
        try:
            config = builtin_config(name)
        except BuiltinModelError:
            return None
    else:
        path = Path(name).expanduser()
        path = path / MODEL_CONFIG if path.is_dir() else path
        if path.is_file():
            from finetune.fsutil import read_json

            try:
                config = read_json(path)
            except (OSError, ValueError):
                return None
            config = config.get("text_config", config) if isinstance(config, dict) else {}
        else:
            return KNOWN_POSITIONS.get(arch_name)
    value = config.get("max_position_embeddings") if isinstance(config, dict) else None
    return value if isinstance(value, int) else None


@rule
def world_divisible(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    r = loaded.recipe
    p, world = r.parallel, r.world_size
    if p.model_parallel == 1:
        return
    key = ("parallel", "sequence" if p.sequence > 1 else "tensor")
    if world is not None and world % p.model_parallel:
        yield RawFinding("R140", "error", key,
                         f"{world} processes are not a multiple of parallel.sequence x parallel.tensor = {p.model_parallel}: "
                         "DeepSpeed needs whole groups (data-parallel size = world / (sequence x tensor))",
                         f"use a world size that is a multiple of {p.model_parallel}, or change parallel.*")


@rule
def heads_divisible(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    r = loaded.recipe
    p = r.parallel
    if p.model_parallel == 1:
        return
    shape = model_shape(r.model.name_or_path)
    if shape is None:
        return
    heads, kv, _ = shape
    sp = p.sequence
    # deepspeed/runtime/sequence_parallel/ulysses_sp.py UlyssesSPAttentionHF.__init__ raises on both.
    if sp > 1 and heads % sp:
        yield RawFinding("R141", "error", ("parallel", "sequence"),
                         f"the model has {heads} attention heads, not divisible by parallel.sequence: {sp} (Ulysses gives "
                         "each process heads / sequence of them)", "choose a divisor of the head count")
    if sp > 1 and kv % sp and sp % kv:
        yield RawFinding("R141", "error", ("parallel", "sequence"),
                         f"the model has {kv} kv-heads: parallel.sequence {sp} must divide them or be a multiple of them",
                         "choose a divisor or a multiple of the kv-head count")
    if p.tensor > kv:
        # deepspeed/runtime/engine.py _apply_autotp_partitioning logs this and trains on.
        yield RawFinding("R141", "warning", ("parallel", "tensor"),
                         f"parallel.tensor {p.tensor} exceeds the model's {kv} kv-heads: DeepSpeed gives the extra ranks no "
                         "attention shard, so attention stops scaling", f"use parallel.tensor <= {kv}")


@rule
def attention_kernel(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    r = loaded.recipe
    if r.parallel.sequence > 1 and r.model.attn_implementation == "eager":
        # UlyssesSPAttentionHF.register_with_transformers: "eager attn_implementation isn't currently supported".
        yield RawFinding("R142", "error", ("model", "attn_implementation"),
                         "Ulysses sequence parallelism cannot wrap eager attention (it needs the 4-D mask Ulysses drops; "
                         "DeepSpeed refuses it)", "set model.attn_implementation: sdpa (or flash_attention_2)")


@rule
def autotp_combinations(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    r = loaded.recipe
    if r.parallel.tensor == 1:
        return
    if r.deepspeed.stage == 3:
        # transformers 5.23 from_pretrained under ZeRO-3 raises NotImplementedError("Weight conversions ... with
        # DeepSpeed Tensor Parallelism are not yet implemented") (integrations/deepspeed.py), although DeepSpeed's
        # engine itself accepts AutoTP with ZeRO-3.
        yield RawFinding("R143", "error", ("parallel", "tensor"),
                         "AutoTP with ZeRO-3: transformers' ZeRO-3 model loading refuses a tensor-parallel DeepSpeed config "
                         "(NotImplementedError: weight conversions with DeepSpeed Tensor Parallelism)",
                         "use deepspeed.stage 0, 1 or 2 with parallel.tensor, or parallel.tensor: 1")
    if r.parallel.sequence > 1:
        # DeepSpeedEngine._configure_tensor_parallel_states replaces the mpu (Ulysses' groups) by its TP groups.
        yield RawFinding("R143", "error", ("parallel", "tensor"),
                         "AutoTP and Ulysses together: DeepSpeed's engine replaces the Ulysses process groups with its "
                         "tensor-parallel ones", "use one of parallel.sequence and parallel.tensor")


@rule
def autotp_adapters(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    r = loaded.recipe
    if r.parallel.tensor == 1 or r.method == "full":
        return
    if r.method == "qlora":
        yield RawFinding("R148", "error", ("parallel", "tensor"),
                         "AutoTP splits the weight matrices of nn.Linear layers; bitsandbytes' packed 4-bit weights "
                         "are not split", "use method: full with parallel.tensor, or parallel.tensor: 1")
        return
    # Measured here (deepspeed 0.19.8, 2 CPU processes, the tiny recipe with method lora): ZeRO-1 and ZeRO-2 fail in
    # Stage1And2ZeroOptimizer._create_param_mapping with KeyError on a parameter AutoTP replaced under PEFT's
    # LoRA layers. ZeRO-0 was not tried.
    stage = r.deepspeed.stage
    yield RawFinding("R148", "error" if stage in (1, 2) else "warning", ("parallel", "tensor"),
                     "AutoTP with LoRA: DeepSpeed's ZeRO-1/2 optimizer fails on the parameters AutoTP replaces under "
                     "the LoRA layers (KeyError in _create_param_mapping)" + ("" if stage in (1, 2) else
                                                                             "; untested at ZeRO-0"),
                     "use method: full with parallel.tensor, or parallel.tensor: 1")


@rule
def packed_under_ulysses(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    r = loaded.recipe
    d = r.data
    if r.parallel.sequence == 1 or not (d.packing or d.padding_free):
        return
    if not r.model.attn_implementation.startswith("flash_attention"):
        # Ulysses drops every 4-D mask (ulysses_sp.py uattn_wrapper); sdpa without a mask runs is_causal over
        # the whole row, across the examples' boundaries. Flash attention finds them from position_ids.
        mode = "packing" if d.packing else "padding_free"
        yield RawFinding("R144", "error", ("data", mode),
                         f"data.{mode} under Ulysses with {r.model.attn_implementation}: Ulysses drops the attention mask "
                         "that keeps packed examples apart, so they would attend to each other",
                         f"set model.attn_implementation: flash_attention_2, or data.{mode}: false")


@rule
def ulysses_objective(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    r = loaded.recipe
    if r.parallel.sequence > 1 and not objectives.get(r.objective).sequence_parallel:
        yield RawFinding("R145", "error", ("parallel", "sequence"),
                         f"objective {r.objective} with Ulysses: TRL's trainer computes its own loss on the 1/sp slice each "
                         "process holds; only the Trainer's sft loss averages the slices (deepspeed_sp_compute_loss)",
                         "use parallel.sequence: 1 for preference objectives")


@rule
def ulysses_accumulation(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    r = loaded.recipe
    if r.parallel.sequence > 1 and r.training.gradient_accumulation_steps > 1:
        yield RawFinding("R146", "info", ("training", "gradient_accumulation_steps"),
                         "under Ulysses the Trainer averages each micro batch's loss on its own (model_accepts_loss_kwargs "
                         "is off), so micro batches weigh equally rather than tokens; without Ulysses tokens weigh equally",
                         "raise training.micro_batch_size instead where memory allows")


@rule
def positions(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    r = loaded.recipe
    shape = model_shape(r.model.name_or_path)
    limit = shape[2] if shape else None
    length = r.data.max_length * (r.training.micro_batch_size if r.data.padding_free else 1)
    scaling = r.model.rope_scaling
    if scaling is not None and limit is not None:
        scaled = int((scaling.original_max_position_embeddings or limit) * scaling.factor)
        if length > scaled:
            yield RawFinding("R147", "warning", ("model", "rope_scaling", "factor"),
                             f"sequences of up to {length:,} tokens exceed the {scaled:,} positions rope_scaling covers",
                             f"raise model.rope_scaling.factor to {-(-length // (scaling.original_max_position_embeddings or limit))}")
        return
    if limit is not None and length > limit:
        yield RawFinding("R147", "warning", ("data", "max_length"),
                         f"sequences of up to {length:,} tokens exceed the model's {limit:,} positions "
                         "(max_position_embeddings); beyond them RoPE extrapolates untrained",
                         f"set model.rope_scaling (e.g. {{rope_type: yarn, factor: {-(-length // limit)}}}) or data.max_length <= {limit}")


@rule
def ulysses_gradient_scale(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    r = loaded.recipe
    sp = r.parallel.sequence
    if sp == 1 or r.deepspeed.stage == 3:
        return
    # DeepSpeed ZeRO 0-2 divide the all-reduced gradients by dp / sp (zero/stage_1_and_2.py, engine.py), treating
    # each rank's loss as its shard's; the Trainer's Ulysses loss is already the group's mean, whose backward sums
    # the shards' contributions. ZeRO-3 comes out right. tests/launches/test_parallel.py measures the factor.
    clip = r.training.max_grad_norm
    yield RawFinding("R149", "warning", ("parallel", "sequence"),
                     f"Ulysses with ZeRO-{r.deepspeed.stage}: the gradients come out {sp}x too large (DeepSpeed averages them over "
                     f"dp / sp), so the logged grad_norm is {sp}x and clipping at {clip} acts at a true norm of {clip / sp:g}; "
                     "Adam's update is otherwise scale-free", "use deepspeed.stage: 3 with parallel.sequence, or accept the scale "
                     f"(training.max_grad_norm: {clip * sp:g} clips where the recipe means {clip})")
