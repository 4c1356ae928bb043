"""LoRA targets as finetune resolves them, so that peft never has to guess (issue 37).

transformers 5 keeps a mixture of experts' weights as 3-D parameters, and peft 0.21 turns `all-linear` (or any
target named like an old per-expert projection) into LoRA on every routed expert and the router for the model
types whose checkpoints transformers converts (Mixtral, Qwen3-MoE, ...), through its `ParamWrapper`, which
refuses dropout, DoRA and bias. finetune therefore names the targets itself: for a MoE family `all-linear` is the
attention and the shared expert (where there is one), and LoRA on the fused experts (`lora.target_experts`) or
the router (`lora.target_router`) is an explicit choice, passed as peft's `target_parameters`. The fused
`gate_up_proj` gets rank 2r and alpha 2 x alpha, as peft gives it when it fuses a gate and an up adapter, so the
scale alpha / r and the count per projection stay those of the recipe. Dense families keep `all-linear`, which
peft resolves to every nn.Linear but the head.

    >>> from finetune.models.families import family
    >>> resolve(LoraChoice(r=16, alpha=32), family("qwen3_moe")).modules
    ('q_proj', 'k_proj', 'v_proj', 'o_proj')
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from finetune.models.families import Family

# peft's ParamWrapper (peft/tuners/lora/layer.py, 0.21.2) raises on each of these, in these words.
PARAM_WRAPPER_RULES = {
    "dropout": "lora.ParamWrapper does not work with lora_dropout != 0",
    "dora": "lora.ParamWrapper does not work with use_dora=True",
    "bias": "lora.ParamWrapper does not work with lora_bias=True",
}


@dataclass(frozen=True)
class LoraChoice:
    """What a recipe's lora section says about targets (the torch-free core of finetune.recipe.LoraSection)."""

    r: int = 16
    alpha: float = 32
    target_modules: Union[str, tuple[str, ...]] = "all-linear"
    target_experts: bool = False
    target_router: bool = False

    @classmethod
    def of(cls, lora) -> "LoraChoice":
        modules = lora.target_modules if isinstance(lora.target_modules, str) else tuple(lora.target_modules)
        return cls(lora.r, lora.alpha, modules, lora.target_experts, lora.target_router)


@dataclass(frozen=True)
class LoraTargets:
    modules: Union[str, tuple[str, ...]]  # peft's target_modules: "all-linear" (dense) or module names
    parameters: tuple[str, ...] = ()  # peft's target_parameters: fused experts, router weight
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)

    @property
    def experts(self) -> bool:
        return any(not p.endswith(".weight") for p in self.parameters)

    @property
    def router(self) -> bool:
        return any(p.endswith(".weight") for p in self.parameters)


def resolve(choice: LoraChoice, fam: Optional[Family]) -> LoraTargets:
    """peft's target_modules and target_parameters for the family (None: a family finetune has no row for,
    whose targets pass through as written)."""
    if fam is None or not fam.moe:
        return LoraTargets(choice.target_modules)
    modules = fam.all_linear() if choice.target_modules == "all-linear" else tuple(choice.target_modules)
    parameters: list[str] = []
    rank: dict[str, int] = {}
    alpha: dict[str, float] = {}
    if choice.target_experts:
        parameters += [f"{fam.experts}.{p}" for p in fam.expert_params]
        # peft's own key for the fused projection (transformers_weight_conversion._convert_peft_config_moe)
        rank[r".*\.gate_up_proj"] = 2 * choice.r
        doubled = 2 * choice.alpha
        alpha[r".*\.gate_up_proj"] = int(doubled) if float(doubled).is_integer() else doubled  # as lora_alpha
    if choice.target_router:
        parameters.append(f"{fam.router}.weight")
    return LoraTargets(modules, tuple(parameters), rank, alpha)


def renamed_by_peft(choice: LoraChoice, fam: Optional[Family]) -> list[str]:
    """Target names peft would turn into expert or router LoRA for this family (lint says to use the flags)."""
    if fam is None or isinstance(choice.target_modules, str):
        return []
    return [t for t in choice.target_modules if t.rsplit(".", 1)[-1] in fam.peft_renames]
