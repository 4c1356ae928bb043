"""Mixture-of-experts settings in the runner: the experts' implementation, the router's auxiliary loss the same
for every objective, LoRA targets finetune resolved (finetune.models.targets), and the aux loss in the logs.

TRL's DPO, KTO and GRPO trainers (1.16) add `router_aux_loss_coef x aux_loss` whenever the config has
`output_router_logits` (their `router_aux_loss_coef` None: the config's value), ORPO and CPO when
`config.output_router_logits` is true, while a plain forward (SFT) adds it only when the config says so. So the
runner sets both on the config before the model is built (transformers reads the coefficient in __init__):
output_router_logits true unless the coefficient is 0, and the coefficient the recipe gives (null: the model's).
Every objective then optimises the same loss.
"""

from __future__ import annotations

from typing import Any

from finetune.errors import FinetuneError
from finetune.models.identify import ModelIdentity, identify
from finetune.recipe import Recipe


def moe_identity(model_path: str) -> ModelIdentity | None:
    ident = identify(model_path)
    return ident if ident is not None and ident.moe else None


def aux_loss_coef(recipe: Recipe, ident: ModelIdentity | None) -> float | None:
    """The router loss weight this run trains with (None: not a MoE model, or one whose config does not say)."""
    if ident is None:
        return None
    if recipe.moe.router_aux_loss_coef is not None:
        return recipe.moe.router_aux_loss_coef
    value = (ident.config or {}).get("router_aux_loss_coef")
    return float(value) if isinstance(value, (int, float)) else None


def config_overrides(recipe: Recipe, model_path: str) -> dict[str, Any]:
    """Config attributes for from_pretrained: output_router_logits and router_aux_loss_coef of a MoE model."""
    ident = moe_identity(model_path)
    if ident is None:
        return {}
    coef = aux_loss_coef(recipe, ident)
    out: dict[str, Any] = {"output_router_logits": coef != 0}
    if recipe.moe.router_aux_loss_coef is not None:
        out["router_aux_loss_coef"] = recipe.moe.router_aux_loss_coef
    return out


def load_kwargs(recipe: Recipe, model_path: str) -> dict[str, Any]:
    """from_pretrained's keyword arguments for a MoE model (none for a dense one)."""
    if moe_identity(model_path) is None or recipe.moe.experts_implementation is None:
        return {}
    return {"experts_implementation": recipe.moe.experts_implementation}


def apply_config_overrides(config, recipe: Recipe, model_path: str) -> None:
    """The same overrides on a config object (when the runner passes one: rope scaling)."""
    for key, value in config_overrides(recipe, model_path).items():
        setattr(config, key, value)


class MoeError(FinetuneError, ValueError):
    """LoRA targets finetune cannot resolve for the loaded model (lint says so first when the model is local)."""


def peft_targets(recipe: Recipe, model) -> dict[str, Any]:
    """LoraConfig's target keywords for the loaded model (finetune.models.targets); a MoeError for what lint
    R161/R163 refuse, for a hub model lint could not read."""
    from finetune.models.families import family
    from finetune.models.identify import expert_count
    from finetune.models.targets import LoraChoice, resolve

    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    fam = family(model_type)
    known = fam is not None and fam.moe
    experts = expert_count(config.to_dict()) if config is not None and hasattr(config, "to_dict") else 0
    lora = recipe.lora
    if (lora.target_experts or lora.target_router) and not known:
        raise MoeError(f"lora.target_experts / target_router: finetune has no expert layout for model type "
                       f"`{model_type}`{'' if experts else ' (it is not a mixture of experts)'}")
    if experts and not known and lora.target_modules == "all-linear":
        raise MoeError(f"`{model_type}` is a mixture of experts finetune has no layout for: name the attention "
                       "projections in lora.target_modules (peft would decide what all-linear means for its experts)")
    targets = resolve(LoraChoice.of(lora), fam)
    out: dict[str, Any] = {"target_modules": targets.modules if isinstance(targets.modules, str) else list(targets.modules)}
    if targets.parameters:
        out.update(target_parameters=list(targets.parameters), rank_pattern=dict(targets.rank_pattern),
                   alpha_pattern=dict(targets.alpha_pattern))
    return out


def logging_aux_loss(trainer_class):
    """`trainer_class` logging the router's auxiliary loss (`aux_loss`, before its weight) beside the loss, as
    TRL's trainers do: the mean over the micro batches since the last log, on this rank."""

    class AuxLogged(trainer_class):
        _aux: list = []

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss, outputs = super().compute_loss(model, inputs, return_outputs=True,
                                                 num_items_in_batch=num_items_in_batch)
            aux = getattr(outputs, "aux_loss", None) if not isinstance(outputs, dict) else outputs.get("aux_loss")
            if aux is not None and model.training:
                self._aux = [*self._aux, float(aux.detach())]
            return (loss, outputs) if return_outputs else loss

        def log(self, logs, *args, **kwargs):
            if self._aux and "loss" in logs:
                logs = {**logs, "aux_loss": sum(self._aux) / len(self._aux)}
                self._aux = []
            return super().log(logs, *args, **kwargs)

    AuxLogged.__name__ = AuxLogged.__qualname__ = trainer_class.__name__
    return AuxLogged


def summary_extra(recipe: Recipe, model_path: str, log_history: list[dict[str, Any]]) -> dict[str, Any]:
    """summary.json's router loss: its weight and the first and last logged aux_loss (MoE models only)."""
    ident = moe_identity(model_path)
    if ident is None:
        return {}
    values = [e["aux_loss"] for e in log_history if "loss" in e and isinstance(e.get("aux_loss"), (int, float))]
    return {"router_aux_loss_coef": aux_loss_coef(recipe, ident),
            "aux_loss_first": values[0] if values else None, "aux_loss_last": values[-1] if values else None}
