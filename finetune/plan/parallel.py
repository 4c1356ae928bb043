"""Sequence (Ulysses) and tensor (AutoTP) parallelism in the memory model, and the longest sequence that fits.

What one process holds, and why the rest of the planner needs no change beyond a reshaped Setup:
- Ulysses (parallel.sequence = sp): each process holds L / sp tokens of every sequence through the whole layer
  stack; inside attention an all-to-all trades that for all L tokens of heads / sp heads, which is the same
  number of q/k/v elements. With sdpa's flash / memory-efficient kernels or flash attention (eager is refused,
  lint R142) attention memory is linear in those elements, so every activation and the logits are those of a
  sequence of L / sp tokens. Added: the all-to-all's send and receive copies of one layer's q, k, v and
  attention output (recomputed layer by layer under checkpointing, so one layer's worth is live). Weights and
  ZeRO are unchanged: ZeRO partitions over every process (DeepSpeed's sequence-data-parallel group).
- AutoTP (parallel.tensor = tp): q/k/v/gate/up are split by output columns and o/down by input rows, so one
  process holds the layers of a model with heads / tp, kv-heads / tp and intermediate / tp (embeddings, norms
  and the output head stay whole: the conservative reading); activations inside attention and the MLP shrink
  the same way. ZeRO partitions over the data-parallel processes only, world / tp.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

from finetune.plan.setup import PlanError, Setup, Term


def apply_parallel(setup: Setup, sequence: int = 1, tensor: int = 1, activation_offload: bool = False,
                   tiled_mlp: bool = False, tiled_mlp_shards: Optional[int] = None) -> Setup:
    """The Setup of one process of a run with these degrees (sequence, tensor recorded on it)."""
    if activation_offload and setup.gradient_checkpointing:
        setup = replace(setup, activation_offload=True)
    if tiled_mlp and setup.arch is not None:
        # finetune.train.parallel.use_tiled_mlp's default: ceil(tokens per process / hidden)
        shards = tiled_mlp_shards or math.ceil(-(-setup.seq_len // sequence) / setup.arch.hidden)
        setup = replace(setup, tiled_mlp_shards=max(1, shards))
    if sequence == 1 and tensor == 1:
        return setup
    notes = []
    arch, params, gpus = setup.arch, setup.params, setup.gpus_per_node
    if tensor > 1:
        if arch is None:
            raise PlanError("parallel.tensor needs the model's shapes: give a config.json or a known architecture")
        # the attention split follows the kv-heads; extra ranks hold none (DeepSpeed warns, lint R141)
        kv = max(1, arch.kv_heads // tensor)
        arch = replace(arch, heads=max(1, arch.heads // tensor), kv_heads=kv, head_dim=arch.dim_head,
                       intermediate=math.ceil(arch.intermediate / tensor),
                       moe_intermediate=math.ceil(arch.moe_intermediate / tensor) if arch.moe_intermediate else 0)
        params = arch.total_params
        gpus = max(1, gpus // tensor)
        notes.append(f"AutoTP {tensor}: each process holds 1/{tensor} of the attention and MLP weights "
                     f"({params / 1e9:.2f}B parameters with the embeddings and head whole); ZeRO partitions over "
                     f"the {gpus * setup.nodes} data-parallel processes")
    seq_len = setup.seq_len
    if sequence > 1:
        seq_len = -(-setup.seq_len // sequence)
        notes.append(f"Ulysses {sequence}: each process holds {seq_len:,} of the {setup.seq_len:,} tokens of a sequence")
    note = "; ".join(n for n in [setup.data_note, *notes] if n)
    return replace(setup, arch=arch, params=params, gpus_per_node=gpus, seq_len=seq_len, sequence=sequence,
                   tensor=tensor, data_note=note)


def parallel_terms(setup: Setup) -> list[Term]:
    """The Ulysses all-to-all buffers of one layer (send + receive of q, k, v and the attention output)."""
    arch = setup.arch
    if setup.sequence == 1 or arch is None:
        return []
    kv = max(arch.kv_heads, setup.sequence)  # DeepSpeed replicates kv-heads when sp exceeds them
    per_token = (2 * arch.heads + 2 * kv) * arch.dim_head * setup.element_bytes
    size = 2 * setup.micro_batch * setup.seq_len * per_token
    return [Term("activations", "Ulysses all-to-all buffers", size, phase="backward",
                 note=f"send + receive of q, k, v, output of one layer, {setup.seq_len:,} tokens per process")]


CHECKPOINTED_INPUTS = "layer inputs (checkpointed)"  # finetune.plan.activations' term for what offload moves


def offload_activations(setup: Setup, terms: list[Term]) -> tuple[list[Term], list[Term]]:
    """(GPU terms, CPU terms) with training.activation_offload: transformers' save_on_cpu around each checkpointed
    layer keeps its saved input in pinned host memory; one layer's is on the GPU while that layer runs."""
    if not setup.activation_offload or setup.arch is None:
        return terms, []
    out, cpu = [], []
    for term in terms:
        if term.name != CHECKPOINTED_INPUTS:
            out.append(term)
            continue
        one_layer = term.bytes // setup.arch.layers
        out.append(replace(term, name="layer input being recomputed", bytes=one_layer,
                           note="the rest in host memory (training.activation_offload)"))
        cpu.append(Term("cpu", "offloaded layer inputs (pinned)", (term.bytes - one_layer) * setup.gpus_per_node,
                        phase="backward", note=f"{setup.gpus_per_node} processes x {setup.arch.layers - 1} layers"))
    return out, cpu


def tiled_mlp_saving(setup: Setup) -> int:
    """training.tiled_mlp under gradient checkpointing: the recomputed layer's MLP activations and gradients
    (activations.layer_activation_bytes' 3 x intermediate and backward_working_bytes' (5 x intermediate - 4 x
    hidden) / 2 elements per token) exist for one slice at a time: the bytes backward's own peak sheds
    (activations.activation_terms). Without checkpointing TiledMLP would also drop the saved MLP activations; not
    modelled (the estimate stays high)."""
    arch = setup.arch
    if setup.tiled_mlp_shards <= 1 or arch is None or not setup.gradient_checkpointing or arch.experts:
        return 0
    e, tokens = setup.element_bytes, setup.micro_batch * setup.seq_len
    mlp = tokens * e * (3 * arch.intermediate + max(0, (5 * arch.intermediate - 4 * arch.hidden) // 2))
    return mlp - mlp // setup.tiled_mlp_shards
