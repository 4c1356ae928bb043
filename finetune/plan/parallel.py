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


def apply_parallel(setup: Setup, sequence: int = 1, tensor: int = 1) -> Setup:
    """The Setup of one process of a run with these degrees (sequence, tensor recorded on it)."""
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


def fits_at(base: Setup, seq_len: int, sequence: int, tensor: int = 1) -> Optional[bool]:
    """Whether `seq_len` tokens fit one process of `base` (a Setup before apply_parallel) at these degrees."""
    from finetune.plan.planner import plan

    return plan(apply_parallel(replace(base, seq_len=seq_len, data_note=""), sequence, tensor)).fits


def longest_sequence(base: Setup, sequence: int, tensor: int = 1, limit: int = 1 << 24,
                     step: int = 1024) -> Optional[int]:
    """The longest sequence (a multiple of `step` tokens, up to `limit`) that fits at these degrees; 0 when not
    even `step` tokens fit, None without a GPU size. Memory grows with the length, so a bisection finds it."""
    if base.gpu_memory is None:
        return None
    low, high = 0, limit // step  # in units of step: low fits (or is 0), above high does not
    while low < high:
        middle = (low + high + 1) // 2
        if fits_at(base, middle * step, sequence, tensor):
            low = middle
        else:
            high = middle - 1
    return low * step


def sequence_degrees(setup: Setup, world: int) -> list[int]:
    """Ulysses degrees DeepSpeed accepts here: divisors of the world whose heads (and kv-heads, or multiples of
    them) split evenly (UlyssesSPAttentionHF's two conditions)."""
    arch = setup.arch
    out = []
    for sp in range(1, world + 1):
        if world % sp:
            continue
        if arch is not None and sp > 1 and (arch.heads % sp or (arch.kv_heads % sp and sp % arch.kv_heads)):
            continue
        out.append(sp)
    return out


def longest_table(base: Setup, world: int) -> list[tuple[int, Optional[int]]]:
    """(sp, longest sequence) for each Ulysses degree the world and the heads allow."""
    return [(sp, longest_sequence(base, sp)) for sp in sequence_degrees(base, world)]


def smallest_sequence_degree(base: Setup, world: int, length: int) -> Optional[int]:
    """The smallest Ulysses degree at which `length` tokens fit, or None."""
    for sp in sequence_degrees(base, world):
        if fits_at(base, length, sp):
            return sp
    return None


def render_table(base: Setup, world: int, length: int) -> str:
    """`plan --recommend`'s long-context part: the smallest sp for `length`, and the longest sequence per sp
    (AutoTP off: the two are not combined, lint R143)."""
    rows = longest_table(base, world)
    smallest = smallest_sequence_degree(base, world, length)
    lines = ["long context (Ulysses sequence parallelism, parallel.sequence; planner estimates):"]
    lines.append(f"  max_length {length:,}: " + (f"fits with parallel.sequence: {smallest}" if smallest else
                                                "does not fit at any parallel.sequence on this world size"))
    lines.append(f"  {'parallel.sequence':<20}{'longest sequence (tokens)':>28}")
    for sp, longest in rows:
        lines.append(f"  {sp:<20}{'n/a' if longest is None else f'{longest:,}':>28}")
    return "\n".join(lines) + "\n"


LONG_CONTEXT = 32768  # from this max_length on, `plan --recommend` adds the long-context table


def long_context_text(recipe, setup: Setup, gpus: Optional[int] = None, gpu_memory_bytes: Optional[int] = None,
                      nodes: Optional[int] = None, cpu_memory_bytes: Optional[int] = None) -> str:
    """The long-context table for a recipe with parallel.sequence or a max_length of LONG_CONTEXT or more; ""
    otherwise (and with AutoTP, which is not combined with Ulysses)."""
    from finetune.plan.from_recipe import setup_from_recipe

    if recipe.parallel.tensor > 1 or (recipe.parallel.sequence == 1 and recipe.data.max_length < LONG_CONTEXT):
        return ""
    base = setup_from_recipe(recipe, gpus, gpu_memory_bytes, nodes, cpu_memory_bytes, deepspeed=setup.deepspeed,
                             parallel=False)
    base = replace(base, seq_len=recipe.data.max_length, data_note="")
    return render_table(base, base.world, recipe.data.max_length)
