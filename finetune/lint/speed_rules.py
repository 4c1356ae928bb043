"""Recipe rules for the engine and the `auto` speed keys (R150-R153, issue 35): what the plain Trainer
(`deepspeed.enabled: false`) cannot run, and what an `auto` key will not do with the values written beside it.
finetune.plan.auto decides the auto keys; these rules only read the recipe.
"""

from __future__ import annotations

from typing import Iterator

from finetune import objectives
from finetune.lint.deepspeed.context import RawFinding
from finetune.lint.recipe_rules import RULES, rule
from finetune.recipe import LoadedRecipe

SPEED_RULES: dict[str, str] = {
    "R150": "deepspeed.enabled: false with what only DeepSpeed's engine runs (offload, ZeRO-3, sequence or tensor "
            "parallelism, TiledMLP, DeepSpeed's own optimizers, more than one process, TRL's objectives).",
    "R151": "deepspeed.enabled: false for a full fine-tune in 16-bit: the plain Trainer steps the 16-bit weights (no fp32 master copy).",
    "R152": "DeepSpeed settings (stage, buckets, overrides) that the plain Trainer path ignores.",
    "R153": "An `auto` key that keeps its memory-safe value whatever the GPU (objectives other than sft, Ulysses) (info).",
}
RULES.update(SPEED_RULES)

PLAIN_TRAINER_OPTIMIZERS = ("adamw", "sgd", "adamw_bnb_8bit")  # torch's fused AdamW, and the Trainer's own two


def _plain(loaded: LoadedRecipe) -> bool:
    return loaded.recipe.deepspeed.enabled is False and "deepspeed.enabled" not in loaded.recipe.auto_keys


@rule
def plain_trainer_limits(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    if not _plain(loaded):
        return
    r = loaded.recipe
    ds, t = r.deepspeed, r.training
    fix = "set deepspeed.enabled: true (or leave it auto)"
    checks = [
        (ds.offload_optimizer != "none", ("deepspeed", "offload_optimizer"), "optimizer offload is DeepSpeed's"),
        (ds.offload_param != "none", ("deepspeed", "offload_param"), "parameter offload is DeepSpeed's"),
        (ds.stage == 3, ("deepspeed", "stage"), "ZeRO-3 is DeepSpeed's"),
        (r.parallel.sequence > 1, ("parallel", "sequence"), "Ulysses runs inside DeepSpeed"),
        (r.parallel.tensor > 1, ("parallel", "tensor"), "AutoTP runs inside DeepSpeed"),
        (t.tiled_mlp, ("training", "tiled_mlp"), "TiledMLP is DeepSpeed's (ALST)"),
        (t.optimizer not in PLAIN_TRAINER_OPTIMIZERS, ("training", "optimizer"),
         f"optimizer {t.optimizer} is built by DeepSpeed here; the plain Trainer runs {', '.join(PLAIN_TRAINER_OPTIMIZERS)}"),
        (not objectives.get(r.objective).plain_trainer, ("objective",), f"objective {r.objective} is tested under DeepSpeed only"),
        ((r.world_size or 1) > 1, ("launch",), f"{r.world_size} processes: the plain Trainer path runs one process here"),
    ]
    for failing, key, why in checks:
        if failing:
            yield RawFinding("R150", "error", key, f"deepspeed.enabled: false, but {why}", fix)


@rule
def plain_trainer_16bit_full(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    r = loaded.recipe
    if _plain(loaded) and r.method == "full" and r.model.dtype != "float32":
        yield RawFinding("R151", "warning", ("deepspeed", "enabled"),
                         f"a full fine-tune in {r.model.dtype} without DeepSpeed: AdamW updates the {r.model.dtype} "
                         "weights themselves, with no fp32 master copy, so updates smaller than their rounding are lost",
                         "leave deepspeed.enabled auto (DeepSpeed keeps fp32 master weights), or model.dtype: float32")


@rule
def deepspeed_settings_without_deepspeed(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    if not _plain(loaded):
        return
    from finetune.recipe import DeepSpeedSection

    section = loaded.raw.get("deepspeed") if isinstance(loaded.raw.get("deepspeed"), dict) else {}
    # Checked by R150 (offload, stage 3); a default written out (a run directory's recipe.yaml) changes nothing.
    fields = DeepSpeedSection.model_fields
    ignored = [k for k, v in section.items() if k in fields and k not in ("enabled", "offload_optimizer", "offload_param")
               and v != fields[k].get_default(call_default_factory=True) and not (k == "stage" and v == 3)]
    for key in ignored:
        yield RawFinding("R152", "warning", ("deepspeed", key),
                         f"deepspeed.{key} is not used: deepspeed.enabled is false (the plain Trainer)",
                         f"remove deepspeed.{key}, or set deepspeed.enabled: true")


@rule
def auto_without_choice(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    r = loaded.recipe
    keys = r.auto_keys & {"training.micro_batch_size", "training.loss_kernel"}
    raw_training = loaded.raw.get("training") if isinstance(loaded.raw.get("training"), dict) else {}
    why = f"objective {r.objective}" if not objectives.get(r.objective).sized_by_plan else \
        ("parallel.sequence" if r.parallel.sequence > 1 else None)
    if why is None:
        return
    for key in sorted(keys):
        name = key.split(".")[1]
        if raw_training.get(name) == "auto":  # written auto: say what it does here; a default is not the user's
            value = getattr(r.training, name)
            yield RawFinding("R153", "info", ("training", name),
                             f"training.{name}: auto is {value!r} with {why} on any GPU (only sft recipes are sized "
                             "by the plan)", "write the value you want, or remove the key")
