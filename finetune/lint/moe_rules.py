"""Recipe rules for mixtures of experts and the model families of finetune.models (R160-R168), torch-free: the model is known to be a MoE from a local
config.json (model_type, num_experts...), a built-in model, or its hub id's family (finetune.models).

Each refuses what fails after launch, with the library's own words where it has some: peft 0.21's
ParamWrapper (LoRA on the fused experts and the router) raises on dropout, DoRA and lora_bias; DeepSpeed 0.19.8
replaces its default ZeRO-3 leaf classes with a user's list. Without a leaf, ZeRO-3 still trains LoRA on the
experts correctly (DeepSpeed gathers a partitioned parameter read during forward: tests/launches/test_moe.py
trained one so and matched one process), but fetches the expert stacks one by one, so it is a warning.
"""

from __future__ import annotations

from typing import Iterator, Optional

from finetune.lint.deepspeed.context import RawFinding
from finetune.lint.recipe_rules import RULES, rule
from finetune.recipe import LoadedRecipe

MOE_RULES: dict[str, str] = {
    "R160": "LoRA on the experts or the router (peft's ParamWrapper) with dropout, DoRA or a trained bias.",
    "R161": "LoRA on the experts or the router of a model that is not a mixture of experts finetune knows.",
    "R162": "Target names peft would turn into LoRA on the fused experts (use lora.target_experts).",
    "R163": "A mixture of experts finetune has no layout for, with lora.target_modules: all-linear.",
    "R164": "ZeRO-3 with LoRA on the experts, without the model's sparse block as a leaf module (fetched per parameter).",
    "R165": "A deepspeed leaf_module.classes list that drops DeepSpeed's default leaf classes.",
    "R166": "A mixture of experts under ZeRO-3: the figures peers report, and ZeRO-2 when it fits (info).",
    "R167": "A `moe` section on a model that is not a mixture of experts (ignored).",
    "R168": "An attention kernel the model's family does not run (Gemma 2 and gpt-oss have no sdpa in transformers 5.24).",
}
RULES.update(MOE_RULES)

# Reported by peers for MoE under DeepSpeed ZeRO-3 (issue 37): ms-swift, Qwen3-30B-A3B, 91.2 s/it under ZeRO-3
# against 9.6 s/it with Megatron; LLaMA-Factory #8038, minutes per step.
ZERO3_FIGURES = ("peers report MoE under ZeRO-3 at a tenth of the speed (ms-swift, Qwen3-30B-A3B: 91.2 s/it "
                 "against 9.6 with Megatron; LLaMA-Factory #8038: minutes per step)")


def _identity(loaded: LoadedRecipe):
    from finetune.models.identify import identify

    return identify(loaded.recipe.model.name_or_path)


def _adapts_experts(loaded: LoadedRecipe) -> bool:
    lora = loaded.recipe.lora
    return loaded.recipe.method != "full" and (lora.target_experts or lora.target_router)


@rule
def param_wrapper_options(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    from finetune.models.targets import PARAM_WRAPPER_RULES

    if not _adapts_experts(loaded):
        return
    lora = loaded.recipe.lora
    what = "lora.target_experts" if lora.target_experts else "lora.target_router"
    for key, bad, fix in (("dropout", lora.dropout != 0, "set lora.dropout: 0"),
                          ("dora", lora.dora, "set lora.dora: false"),
                          ("bias", lora.bias != "none", "set lora.bias: none")):
        if bad:
            yield RawFinding("R160", "error", ("lora", key), f"{what} puts LoRA on parameters through peft's "
                             f"ParamWrapper, which refuses this: \"{PARAM_WRAPPER_RULES[key]}\"", fix)


@rule
def experts_of_a_known_moe(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    if not _adapts_experts(loaded):
        return
    ident = _identity(loaded)
    key = ("lora", "target_experts" if loaded.recipe.lora.target_experts else "target_router")
    if ident is None:
        yield RawFinding("R161", "warning", key, f"cannot tell here whether {loaded.recipe.model.name_or_path} is a "
                         "mixture of experts (no local config.json, and its name is no family finetune knows); "
                         "`finetune train` refuses the flag if it is not")
    elif not ident.moe:
        yield RawFinding("R161", "error", key, f"{ident.model_type or 'this model'} is not a mixture of experts "
                         f"(read from {ident.source}): it has no experts or router to adapt",
                         f"remove {'.'.join(key)}")
    elif ident.family is None or not ident.family.moe:
        yield RawFinding("R161", "error", key, f"finetune has no layout for the experts of model type "
                         f"`{ident.model_type}` (known: {', '.join(_moe_types())})",
                         "adapt the attention only (lora.target_modules), or train it in full")


@rule
def targets_peft_would_rename(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    from finetune.models.targets import LoraChoice, renamed_by_peft

    if loaded.recipe.method == "full":
        return
    ident = _identity(loaded)
    renamed = renamed_by_peft(LoraChoice.of(loaded.recipe.lora), ident.family if ident else None)
    if renamed:
        yield RawFinding("R162", "error", ("lora", "target_modules"),
                         f"on {ident.model_type}, peft 0.21 reads {', '.join(renamed)} as the old per-expert "
                         "projections and puts LoRA on every fused expert (and the router) instead",
                         "list the attention (and shared expert) modules only, and set lora.target_experts: true "
                         "for the experts")


@rule
def unknown_moe_all_linear(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    r = loaded.recipe
    if r.method == "full" or r.lora.target_modules != "all-linear":
        return
    ident = _identity(loaded)
    if ident is not None and ident.moe and (ident.family is None or not ident.family.moe):
        yield RawFinding("R163", "error", ("lora", "target_modules"),
                         f"`{ident.model_type}` is a mixture of experts finetune has no layout for: peft would decide "
                         "what all-linear means for its experts (LoRA on the fused experts fails with dropout)",
                         "name the attention projections in lora.target_modules (e.g. [q_proj, k_proj, v_proj, o_proj])")


def _leaf_classes(loaded: LoadedRecipe) -> Optional[list]:
    from finetune.render import render_deepspeed

    zero = render_deepspeed(loaded.recipe).get("zero_optimization")
    leaf = zero.get("leaf_module") if isinstance(zero, dict) else None
    classes = leaf.get("classes") if isinstance(leaf, dict) else None
    if isinstance(classes, str):
        classes = [classes]
    return classes if isinstance(classes, list) else None


def _user_leaf_key() -> tuple:
    return ("deepspeed", "overrides", "zero_optimization", "leaf_module", "classes")


def _written_leaf(loaded: LoadedRecipe) -> bool:
    from finetune.lint.recipe_rules import written

    return written(loaded, *_user_leaf_key())


@rule
def zero3_expert_leaf(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    r = loaded.recipe
    if r.deepspeed.stage != 3 or not (_adapts_experts(loaded) and r.lora.target_experts):
        return
    ident = _identity(loaded)
    if ident is None or ident.family is None or not ident.family.moe:
        return  # R161 says why
    block = ident.family.moe_block
    classes = _leaf_classes(loaded) or []
    if not any(c in (block, block.rsplit(".", 1)[-1]) for c in classes):
        key = _user_leaf_key() if _written_leaf(loaded) else ("deepspeed", "stage")
        yield RawFinding("R164", "warning", key,
                         f"ZeRO-3 with LoRA on the experts without {block.rsplit('.', 1)[-1]} as a leaf module: peft's "
                         "ParamWrapper reads the fused expert parameters outside their module's hooks, so ZeRO-3 "
                         "fetches them on access, one at a time and unprefetched (DeepSpeed 0.19.8's ZeROOrderedDict), "
                         "instead of the whole block at once",
                         f"add {block} to leaf_module.classes (or remove the override: finetune writes it)")


@rule
def leaf_list_drops_defaults(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    from finetune.models.families import DEEPSPEED_DEFAULT_LEAF_CLASSES

    if not _written_leaf(loaded):
        return
    classes = _leaf_classes(loaded) or []
    dropped = [c for c in DEEPSPEED_DEFAULT_LEAF_CLASSES if c not in classes and c.rsplit(".", 1)[-1] not in classes]
    if dropped:
        yield RawFinding("R165", "warning", _user_leaf_key(),
                         f"leaf_module.classes replaces DeepSpeed's default leaf classes; this list drops "
                         f"{', '.join(c.rsplit('.', 1)[-1] for c in dropped)}, whose experts ZeRO-3 then fetches one "
                         "module at a time", "keep DeepSpeed's defaults in the list (finetune renders them)")


@rule
def moe_under_zero3(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    r = loaded.recipe
    if r.deepspeed.stage != 3:
        return
    ident = _identity(loaded)
    if ident is None or not ident.moe:
        return
    yield RawFinding("R166", "info", ("deepspeed", "stage"), f"{ident.model_type} is a mixture of experts: "
                     f"{ZERO3_FIGURES}{_zero2_alternative(loaded)}")


def _zero2_alternative(loaded: LoadedRecipe) -> str:
    """'; ZeRO-2 fits: ...' when the recipe's declared hardware holds the ZeRO-2 plan, else ''."""
    r = loaded.recipe
    if r.hardware is None or not r.hardware.gpu_memory:
        return ""
    from finetune.plan import PlanError, plan_recipe
    from finetune.recipe import parse_size

    stage2 = r.model_copy(update={"deepspeed": r.deepspeed.model_copy(update={"stage": 2})})
    try:
        result = plan_recipe(stage2, gpus=r.hardware.gpus, gpu_memory_bytes=parse_size(r.hardware.gpu_memory))
    except PlanError:
        return ""
    if result.fits is False:
        return ""
    from finetune.units import human_size

    return (f"; ZeRO-2 fits this hardware ({human_size(result.per_gpu['total'])} per GPU planned of "
            f"{r.hardware.gpu_memory}): deepspeed.stage: 2 keeps every expert resident and skips ZeRO-3's fetches")


@rule
def moe_section_on_dense(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    moe = loaded.recipe.moe
    if moe.experts_implementation is None and moe.router_aux_loss_coef is None:
        return  # the defaults (a run's recipe.yaml writes them for every model)
    ident = _identity(loaded)
    if ident is not None and not ident.moe:
        yield RawFinding("R167", "warning", ("moe",), f"`moe` is ignored: {ident.model_type} is not a mixture of "
                         f"experts (read from {ident.source})", "remove the moe section")


def _moe_types() -> list[str]:
    from finetune.models.families import FAMILIES

    return sorted(t for t, f in FAMILIES.items() if f.moe)


@rule
def attention_kernel_of_the_family(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    ident = _identity(loaded)
    attn = loaded.recipe.model.attn_implementation
    if ident is not None and ident.family is not None and attn == "sdpa" and not ident.family.sdpa:
        yield RawFinding("R168", "error", ("model", "attn_implementation"),
                         f"{ident.model_type} does not run sdpa attention: transformers' model class declares no sdpa "
                         "support (Gemma 2's soft-capped scores, gpt-oss's attention sinks) and refuses it at load",
                         "set model.attn_implementation: eager (or flash_attention_2 on a GPU)")
