"""LoRA on parameters (peft's ParamWrapper: `lora.target_experts`, `lora.target_router`), merged onto the base
checkpoint's own tensors one at a time, exactly as peft's merge_and_unload() then save_pretrained() write them.

peft adapts a 3-D expert parameter (experts, out, in) with lora_A (r x experts, in) and lora_B (out, r x
experts): expert e's update is B[:, e::experts-interleaved] @ A[e*r:(e+1)*r] (get_delta_weight's einsum
"o r e, e r i -> e o i"), scaled, then cast to the parameter's dtype before it is added (ParamWrapper.merge:
`param.data += delta_weight`, both 16-bit). transformers 5 keeps a layer's experts fused in memory
(`gate_up_proj`: every expert's gate rows then its up rows) and saves them split per expert (Qwen-MoE:
`experts.{e}.gate_proj.weight`; Mixtral: `block_sparse_moe.experts.{e}.w1.weight`), so one fused update lands
on 3 x experts checkpoint tensors, each computed from its expert's factors alone (the per-expert einsum gives
the same bits as peft's batched one, tests/models/test_moe.py). gpt-oss keeps the fused tensors on disk: one update, one
tensor. Several parameters of one module nest their wrappers in the order the module declares them, the first
innermost (`experts.base_layer.lora_A` is gate_up_proj's, `experts.lora_A` down_proj's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from finetune.weights.errors import MergeError

_BASE_LAYER = ".base_layer"


@dataclass
class ExpertUpdate:
    """LoRA on one fused expert parameter of one layer (`param`: its path in the model in memory)."""

    param: str
    A: torch.Tensor  # (rank x experts, in), float32
    B: torch.Tensor  # (out, rank x experts), float32
    scaling: float
    rank: int
    transposed: bool = False  # the parameter is (experts, in, out) (gpt-oss), else (experts, out, in)

    @property
    def experts(self) -> int:
        return self.A.shape[0] // self.rank

    def delta(self, expert: Optional[int] = None) -> torch.Tensor:
        """scale x B @ A as peft's get_delta_weight makes it, float32: every expert's (in the parameter's layout)
        or one expert's (out, in)."""
        n = self.experts
        a = self.A.reshape(n, -1, self.A.shape[-1])  # (experts, rank, in)
        b = self.B.reshape(self.B.shape[0], -1, n)  # (out, rank, experts)
        pattern = "o r e, e r i -> e i o" if self.transposed else "o r e, e r i -> e o i"
        if expert is not None:
            a, b = a[expert:expert + 1], b[:, :, expert:expert + 1]
        return torch.einsum(pattern, b, a) * self.scaling


@dataclass
class ExpertSlice:
    """What one base tensor gets of an ExpertUpdate: an expert's rows (None: the whole fused tensor)."""

    update: ExpertUpdate
    expert: Optional[int] = None
    rows: Optional[slice] = None

    @property
    def module(self) -> str:
        return self.update.param


def wrapped_parameters(config: dict) -> dict[str, list[str]]:
    """{module suffix: [parameter names]} of the adapter's target_parameters (`mlp.experts`: gate_up_proj,
    down_proj), the names in the order the model declares them (gate_up_proj before down_proj)."""
    out: dict[str, list[str]] = {}
    for target in config.get("target_parameters") or []:
        module, _, name = str(target).rpartition(".")
        out.setdefault(module, []).append(name)
    order = ("gate_up_proj", "down_proj")
    return {m: sorted(names, key=lambda n: order.index(n) if n in order else len(order)) for m, names in out.items()}


def parameter_of(module: str, wrapped: dict[str, list[str]]) -> Optional[str]:
    """The parameter path a (possibly nested) ParamWrapper module adapts, or None for an ordinary module:
    `...mlp.experts.base_layer` -> `...mlp.experts.gate_up_proj` when it wraps gate_up_proj and down_proj."""
    depth = 0
    base = module
    while base.endswith(_BASE_LAYER):
        base, depth = base[: -len(_BASE_LAYER)], depth + 1
    for suffix, names in wrapped.items():
        if base == suffix or base.endswith("." + suffix):
            if depth >= len(names):
                return None
            return f"{base}.{names[len(names) - 1 - depth]}"
    return None


def expert_slices(update: ExpertUpdate, base_tensors: dict, family) -> tuple[dict[str, ExpertSlice], list[str]]:
    """({base tensor name: slice}, problems) for one fused update on the checkpoint's layout."""
    if family is None or not family.moe:
        return {}, [f"{update.param}: LoRA on fused experts, but finetune has no expert layout for this base's "
                    "model type; merge it with peft's merge_and_unload() (it loads the whole model in RAM)"]
    update.transposed = family.transposed
    module, _, name = update.param.rpartition(".")
    disk_module = family.checkpoint_path(module)
    if not family.checkpoint_expert:
        target = f"{disk_module}.{name}"
        problem = _shape_problem(target, base_tensors, tuple(update.delta(0).shape[1:]), update.experts)
        return ({} if problem else {target: ExpertSlice(update)}), [problem] if problem else []
    gate, up, down = family.checkpoint_projections
    out: dict[str, ExpertSlice] = {}
    problems: list[str] = []
    rows_out = update.B.shape[0]
    parts = [(gate, slice(0, rows_out // 2)), (up, slice(rows_out // 2, rows_out))] if name == "gate_up_proj" \
        else [(down, None)] if name == "down_proj" else []
    if not parts:
        return {}, [f"{update.param}: no per-expert layout known for the parameter `{name}`"]
    for e in range(update.experts):
        for proj, rows in parts:
            target = family.checkpoint_expert.format(experts=disk_module, e=e, proj=proj)
            width = (rows.stop - rows.start) if rows else rows_out
            problem = _shape_problem(target, base_tensors, (width, update.A.shape[1]), None)
            if problem:
                problems.append(problem)
            else:
                out[target] = ExpertSlice(update, e, rows)
    return out, problems


def _shape_problem(name: str, base_tensors: dict, shape: tuple, experts: Optional[int]) -> Optional[str]:
    info = base_tensors.get(name)
    want = ((experts,) if experts else ()) + tuple(shape)
    if info is None:
        return f"LoRA on experts matches no base tensor {name}"
    if tuple(info.shape) != want:
        return f"LoRA on experts makes a {want} update but the base {name} is {tuple(info.shape)}"
    return None


def merge_expert(weight: torch.Tensor, part: ExpertSlice, out_dtype: torch.dtype) -> torch.Tensor:
    """weight + its share of the update, rounded as ParamWrapper.merge rounds: the delta cast to the weight's
    dtype, then added in that dtype, then cast to the output dtype."""
    delta = part.update.delta(part.expert)
    if part.expert is not None:
        delta = delta[0]
        if part.rows is not None:
            delta = delta[part.rows]
    merged = weight + delta.to(weight.dtype)
    out = merged.to(out_dtype)
    if not bool(torch.isfinite(out).all()):
        raise MergeError(f"merged {part.module} has inf/NaN values; the adapter (or the --dtype) is broken for this base")
    return out


def checkpoint_names(shapes: dict[str, tuple], family) -> dict[str, tuple[str, Optional[int], Optional[slice], tuple]]:
    """{name save_pretrained writes: (name in memory, expert, rows, shape)} for a full model's state dict in memory
    (what a ZeRO checkpoint holds): the fused experts split per expert as transformers 5 saves them, renamed
    modules (Mixtral's mlp -> block_sparse_moe) renamed; every other tensor as it is."""
    out: dict[str, tuple[str, Optional[int], Optional[slice], tuple]] = {}
    for name, shape in shapes.items():
        module, _, param = name.rpartition(".")
        fused = family is not None and family.checkpoint_expert and module.endswith("." + family.experts) \
            and param in family.expert_params and len(shape) == 3
        if not fused:
            out[family.checkpoint_path(name) if family is not None else name] = (name, None, None, tuple(shape))
            continue
        gate, up, down = family.checkpoint_projections
        experts, rows_out, cols = shape
        disk = family.checkpoint_path(module)
        parts = [(gate, slice(0, rows_out // 2)), (up, slice(rows_out // 2, rows_out))] if param == "gate_up_proj" \
            else [(down, None)]
        for e in range(experts):
            for proj, rows in parts:
                height = (rows.stop - rows.start) if rows else rows_out
                out[family.checkpoint_expert.format(experts=disk, e=e, proj=proj)] = (name, e, rows, (height, cols))
    return out
