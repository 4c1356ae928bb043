"""The model's parameters as peft/bitsandbytes leave them (`ParamGroup`), and 4-bit storage sizes."""

from __future__ import annotations

import math
from dataclasses import dataclass

from finetune.plan.archs import LAYER_LINEARS
from finetune.plan.constants import BNB_BLOCKSIZE, BNB_NESTED_BLOCKSIZE, GPTQ_GROUP_SIZE
from finetune.plan.setup import Setup


@dataclass(frozen=True)
class ParamGroup:
    """`count` tensors of `numel` elements each (for example: the q_proj weight of every layer)."""

    name: str
    numel: int
    count: int
    trainable: bool
    quantized: bool = False  # 4-bit NF4 (QLoRA's frozen linear weights)
    unit: str = ""  # the nn.Module holding it directly (one instance per layer for layer modules)
    per_layer: bool = False
    in_features: int = 0  # a linear weight's input width (GPTQ's per-input-group state; 0: not a linear)

    @property
    def total(self) -> int:
        return self.numel * self.count

    @property
    def storage_numel(self) -> int:
        """Elements of the stored tensor: 4-bit weights are packed 4 values per 16-bit element of the
        quant_storage dtype (what ZeRO-3 partitions and gathers for QLoRA)."""
        return (self.numel + 3) // 4 if self.quantized else self.numel


def param_groups(setup: Setup) -> list[ParamGroup]:
    """Every parameter of the model as peft/bitsandbytes leave it: which are trainable, which are 4-bit."""
    arch = setup.arch
    if arch is None:
        return [ParamGroup("all parameters", setup.params, 1, setup.method == "full", unit="model")]
    full = setup.method == "full"
    lora = not full
    qlora = setup.method == "qlora"
    h, v, n, r = arch.hidden, arch.vocab, arch.layers, setup.lora_r
    targets = set(setup.lora_targets) if lora else set()
    out = [ParamGroup("embed_tokens", v * h, 1, full, unit="embed_tokens")]
    if "embed_tokens" in setup.modules_to_save and lora:
        # peft's ModulesToSaveWrapper: a trainable copy beside the frozen original.
        out.append(ParamGroup("embed_tokens copy (modules_to_save)", v * h, 1, True, unit="embed_tokens.copy"))
    for k in range(arch.norms_per_layer):
        out.append(ParamGroup(f"layer norm {k + 1}", h, n, full, unit=f"norm{k + 1}", per_layer=True))
    if arch.layer_extras:
        # q/k norms and attention sinks: small vectors of the attention module (fetched with its projections)
        out.append(ParamGroup("q/k norms, attention sinks", arch.layer_extras, n, full, unit="attn_extras",
                              per_layer=True))

    def linears(lins, count: int, prefix: str = "") -> None:
        for lin in lins:
            unit = f"{prefix}{lin.name}"
            # transformers' bitsandbytes integration quantizes every nn.Linear but the output head.
            out.append(ParamGroup(f"{unit}.weight", lin.weight_numel, count, full, quantized=qlora,
                                  unit=unit, per_layer=True, in_features=lin.in_features))
            if lin.bias:
                out.append(ParamGroup(f"{unit}.bias", lin.out_features, count, full, unit=unit, per_layer=True))
            if lin.name in targets:
                out.append(ParamGroup(f"{unit}.lora_A", r * lin.in_features, count, True,
                                      unit=f"{unit}.lora_A", per_layer=True))
                out.append(ParamGroup(f"{unit}.lora_B", lin.out_features * r, count, True,
                                      unit=f"{unit}.lora_B", per_layer=True))

    linears(arch.attention_linears(), n)
    if arch.dense_mlp_layers:
        linears(arch.mlp_linears(arch.intermediate), arch.dense_mlp_layers)
    if arch.moe_layers:
        m = arch.moe_layers
        out.extend(moe_groups(setup))
        if arch.shared_intermediate:
            linears(arch.mlp_linears(arch.shared_intermediate), m, prefix="shared_expert.")
        if arch.shared_expert_gate:
            out.append(ParamGroup("shared_expert_gate.weight", h, m, full, quantized=qlora,
                                  unit="shared_expert_gate", per_layer=True))
            if lora and ("shared_expert_gate" in targets or set(LAYER_LINEARS) <= targets):
                # an nn.Linear(hidden, 1): peft's all-linear reaches it, and finetune's resolution names it
                out.append(ParamGroup("shared_expert_gate.lora_A", r * h, m, True,
                                      unit="shared_expert_gate.lora_A", per_layer=True))
                out.append(ParamGroup("shared_expert_gate.lora_B", r, m, True,
                                      unit="shared_expert_gate.lora_B", per_layer=True))
    out.append(ParamGroup("final norm", h, 1, full, unit="final_norm"))
    if not arch.tied:
        out.append(ParamGroup("lm_head", v * h, 1, full, unit="lm_head"))
    if "lm_head" in targets:
        out.append(ParamGroup("lm_head.lora_A", r * h, 1, True, unit="lm_head.lora_A"))
        out.append(ParamGroup("lm_head.lora_B", v * r, 1, True, unit="lm_head.lora_B"))
    if "lm_head" in setup.modules_to_save and lora:
        out.append(ParamGroup("lm_head copy (modules_to_save)", v * h, 1, True, unit="lm_head.copy"))
    from finetune.plan.vision import vision_groups

    return out + [ParamGroup(**group) for group in vision_groups(setup)]  # a VLM's tower and projector


def moe_groups(setup: Setup) -> list[ParamGroup]:
    """A MoE layer's router and experts, and their LoRA as finetune.models.targets resolves it.

    transformers keeps the router and the experts as plain Parameters (not nn.Linear): bitsandbytes' 4-bit skips
    them, so a QLoRA keeps them 16-bit, and peft adapts them only as target_parameters (ParamWrapper): LoRA on
    the fused experts is lora_A (r x experts, in) and lora_B (out, r x experts) per projection, gate_up_proj at
    rank 2r (in: hidden, out: 2 x width), down_proj at r; on the router a plain (r, hidden), (experts, r) pair."""
    arch = setup.arch
    assert arch is not None
    full, lora = setup.method == "full", setup.method != "full"
    h, m, r, e, w = arch.hidden, arch.moe_layers, setup.lora_r, arch.experts, arch.moe_intermediate
    out = [ParamGroup("router", arch.router_params, m, full, unit="router", per_layer=True),
           ParamGroup("experts (gate_up_proj, down_proj)", arch.expert_params + arch.expert_bias_params, m, full,
                      unit="experts", per_layer=True)]
    if lora and setup.lora_router:
        out.append(ParamGroup("router.lora_A", r * h, m, True, unit="router.lora_A", per_layer=True))
        out.append(ParamGroup("router.lora_B", e * r, m, True, unit="router.lora_B", per_layer=True))
    if lora and setup.lora_experts:
        out.append(ParamGroup("experts.lora_A (gate_up_proj, down_proj)", 2 * r * e * h + r * e * w, m, True,
                              unit="experts.lora_A", per_layer=True))
        out.append(ParamGroup("experts.lora_B (gate_up_proj, down_proj)", 2 * w * 2 * r * e + h * r * e, m, True,
                              unit="experts.lora_B", per_layer=True))
    return out


def largest_module_numel(groups: list[ParamGroup], trainable_only: bool = False) -> int:
    """Most parameter elements held directly by one module (DeepSpeed's largest_layer_params:
    stage3.py model_to_params, `m.parameters(recurse=False)`): the embedding or the head here."""
    per_unit: dict[str, int] = {}
    for g in groups:
        if g.unit == "model":
            continue  # a bare parameter count: module sizes unknown (counted as 0, like the ZeRO paper)
        if trainable_only and not g.trainable:
            continue
        per_unit[g.unit] = per_unit.get(g.unit, 0) + g.storage_numel
    return max(per_unit.values(), default=0)


def quant_constant_bytes(numel: int, double_quant: bool) -> int:
    """Bytes of bitsandbytes' quantization state for one 4-bit weight of `numel` elements."""
    blocks = math.ceil(numel / BNB_BLOCKSIZE)
    nf4_code = 16 * 4
    if not double_quant:
        return blocks * 4 + nf4_code
    nested_blocks = math.ceil(blocks / BNB_NESTED_BLOCKSIZE)
    # 8-bit absmax + fp32 absmax per 256 blocks + the 256-entry fp32 dynamic code + fp32 offset.
    return blocks + nested_blocks * 4 + 256 * 4 + 4 + nf4_code


def group_quant_state_bytes(group: ParamGroup, setup: Setup) -> int:
    """The quantization state of one 4-bit weight of `group` as the setup's format stores it."""
    if setup.quant_format == "gptq-int4" and group.in_features:
        return gptq_state_bytes(group.in_features, group.numel // group.in_features)
    return quant_constant_bytes(group.numel, setup.double_quant)


def gptq_state_bytes(in_features: int, out_features: int, group_size: int = GPTQ_GROUP_SIZE) -> int:
    """auto-gptq 0.5.1's QuantLinear (nn_modules/qlinear/qlinear_cuda_old.py L48-L63) registers, beside the
    packed int32 qweight: qzeros (int32, 4-bit zero points packed 8 per element) and scales (fp16), one
    per output per group of `group_size` inputs, and g_idx (int32, one per input)."""
    groups = math.ceil(in_features / group_size)
    return groups * out_features // 2 + groups * out_features * 2 + in_features * 4


def four_bit_bytes(numel: int) -> int:
    """Packed NF4 storage: two values per byte (whatever quant_storage dtype holds them)."""
    return (numel + 1) // 2
