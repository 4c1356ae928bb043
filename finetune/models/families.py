"""What finetune knows about each transformers model family, as data (no torch).

One row per `model_type`: the projections LoRA's `all-linear` means, and for a mixture of experts its layout:
the sparse block DeepSpeed's ZeRO-3 must fetch whole (a leaf), the fused expert parameters and their
orientation, the router, the shared expert, and where the checkpoint keeps the experts when that differs from
the model in memory. transformers 5 fuses each layer's per-expert nn.Linear weights into two 3-D parameters
on load (`experts.gate_up_proj`: gate and up concatenated, `experts.down_proj`) and splits them back on save
(conversion_mapping.py), so a Qwen3-MoE or Mixtral checkpoint still holds `experts.{e}.gate_proj.weight`
(Mixtral: `block_sparse_moe.experts.{e}.w1.weight`), while gpt-oss keeps the fused tensors on disk too.
tests/models/test_moe.py checks every row against the installed transformers and DeepSpeed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
GATED_MLP = ("gate_proj", "up_proj", "down_proj")

# DeepSpeed 0.19.8's DEFAULT_LEAF_MODULE_CLASSES (runtime/zero/leaf_module_config.py). A `leaf_module.classes`
# in the config replaces this list rather than extending it, so finetune writes these out with its own.
DEEPSPEED_DEFAULT_LEAF_CLASSES = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)


@dataclass(frozen=True)
class Family:
    model_type: str
    attention: tuple[str, ...] = ATTENTION  # the attention's nn.Linear layers (Phi-3: qkv_proj, o_proj)
    mlp: tuple[str, ...] = GATED_MLP  # a dense layer's MLP (Phi-3: gate_up_proj, down_proj)
    # Mixture of experts ("" for a dense family):
    moe_block: str = ""  # the sparse block's fully qualified class: ZeRO-3's leaf
    experts: str = "mlp.experts"  # the module holding the fused expert parameters, relative to a layer
    expert_params: tuple[str, ...] = ("gate_up_proj", "down_proj")  # in declaration order (peft nests them so)
    transposed: bool = False  # experts stored (experts, in, out) (gpt-oss); else (experts, out, in)
    router: str = "mlp.gate"  # the router module, whose `weight` LoRA may target
    shared_expert: tuple[str, ...] = ()  # the shared expert's nn.Linear layers, relative to a layer
    # The checkpoint's per-expert tensor of one projection: "{experts}" is the experts' module path in the
    # checkpoint, "{e}" the expert, "{proj}" one of `checkpoint_projections`. "" when the checkpoint holds the
    # fused tensors as they are in memory.
    checkpoint_expert: str = ""
    checkpoint_projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # gate, up, down
    checkpoint_renames: tuple[tuple[str, str], ...] = ()  # module path in memory -> in the checkpoint
    # peft 0.21 rewrites a LoRA config for model types whose checkpoints transformers 5 converts (peft's
    # transformers_weight_conversion.py): target names ending in these become LoRA on the fused experts and
    # the router, so finetune never names them as target_modules for such a family.
    peft_renames: tuple[str, ...] = ()
    names: tuple[str, ...] = ()  # how the family's published models are named on the hub (lower case)
    sdpa: bool = True  # its transformers 5.24 model class runs sdpa (Gemma 2, gpt-oss: _supports_sdpa = False)

    @property
    def moe(self) -> bool:
        return bool(self.moe_block)

    def all_linear(self) -> tuple[str, ...]:
        """LoRA target_modules for `all-linear` on this family: every nn.Linear of a layer that peft would wrap
        as a module. For a MoE family: the attention and the shared expert, never the experts or the router
        (`lora.target_experts`, `lora.target_router` add those as parameters)."""
        if not self.moe:
            return self.attention + self.mlp
        shared = tuple(n for n in self.shared_expert if not n.endswith(tuple("." + r for r in self.peft_renames)))
        return self.attention + shared

    def checkpoint_path(self, module: str) -> str:
        """`module` (a path in the model in memory) as the checkpoint names it."""
        for memory, disk in self.checkpoint_renames:
            module = re.sub(rf"(^|\.){re.escape(memory)}(?=\.|$)", rf"\g<1>{disk}", module)
        return module


_MOE_MODULES = "transformers.models.{0}.modeling_{0}.{1}"

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", names=(r"llama",)),
    Family("mistral", names=(r"mistral",)),
    Family("qwen2", names=(r"qwen2\.5", r"qwen2-")),
    Family("qwen3", names=(r"qwen3-",)),
    Family("gemma2", names=(r"gemma-?2",), sdpa=False),
    Family("gemma3_text", names=(r"gemma-?3-(270m|1b)",)),  # 4b and up are gemma3 (images too)
    Family("olmo2", names=(r"olmo-?2",)),
    Family("phi3", attention=("qkv_proj", "o_proj"), mlp=("gate_up_proj", "down_proj"), names=(r"phi-?[34]",)),
    Family("mixtral", moe_block=_MOE_MODULES.format("mixtral", "MixtralSparseMoeBlock"),
           checkpoint_expert="{experts}.{e}.{proj}.weight", checkpoint_projections=("w1", "w3", "w2"),
           checkpoint_renames=(("mlp", "block_sparse_moe"),),
           peft_renames=("gate", "w1", "w3", "w2"), names=(r"mixtral",)),
    Family("qwen2_moe", moe_block=_MOE_MODULES.format("qwen2_moe", "Qwen2MoeSparseMoeBlock"),
           shared_expert=("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj",
                          "mlp.shared_expert_gate"),
           checkpoint_expert="{experts}.{e}.{proj}.weight", names=(r"qwen1\.5-moe", r"qwen2-57b-a14b")),
    Family("qwen3_moe", moe_block=_MOE_MODULES.format("qwen3_moe", "Qwen3MoeSparseMoeBlock"),
           checkpoint_expert="{experts}.{e}.{proj}.weight", peft_renames=("gate", "gate_proj", "up_proj", "down_proj"),
           names=(r"qwen3-[0-9.]+b-a[0-9.]+b", r"qwen3-coder-[0-9.]+b-a[0-9.]+b")),
    Family("gpt_oss", moe_block=_MOE_MODULES.format("gpt_oss", "GptOssMLP"), transposed=True, router="mlp.router",
           names=(r"gpt-oss",), sdpa=False),
)}


def family(model_type: Optional[str]) -> Optional[Family]:
    return FAMILIES.get(model_type or "")


def family_by_name(name: str) -> Optional[Family]:
    """The family a hub id's name belongs to (`Qwen/Qwen3-30B-A3B-Instruct-2507` -> qwen3_moe), or None.
    MoE families are tried first: `qwen3-30b-a3b` is also a `qwen3-` name."""
    text = name.strip().lower().replace("_", "-").rsplit("/", 1)[-1]
    ordered = sorted(FAMILIES.values(), key=lambda f: not f.moe)
    for fam in ordered:
        if any(re.search(rf"(?<![a-z0-9]){pattern}", text) for pattern in fam.names):
            return fam
    return None


def leaf_classes(fam: Optional[Family]) -> list[str]:
    """DeepSpeed's default leaf classes plus the family's sparse block: what ZeRO-3 must fetch whole."""
    classes = list(DEEPSPEED_DEFAULT_LEAF_CLASSES)
    if fam is not None and fam.moe and fam.moe_block not in classes:
        classes.append(fam.moe_block)
    return classes
