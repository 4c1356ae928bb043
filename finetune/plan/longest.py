"""The longest sequence a recipe fits, per Ulysses degree, and the smallest degree for a length (`plan --recommend`).

Memory grows with the sequence length, so a bisection over lengths (in steps of 1,024 tokens) on the planner's
own estimate finds the longest; one process of each degree is finetune.plan.parallel.apply_parallel's Setup.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from finetune.plan.parallel import apply_parallel
from finetune.plan.planner import plan
from finetune.plan.setup import Setup


def fits_at(base: Setup, seq_len: int, sequence: int, tensor: int = 1) -> Optional[bool]:
    """Whether `seq_len` tokens fit one process of `base` (a Setup before apply_parallel) at these degrees."""
    return plan(apply_parallel(replace(base, seq_len=seq_len, data_note=""), sequence, tensor,
                               activation_offload=base.activation_offload)).fits


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
    lines.append(f"  max_length {length:,}: " + (f"fits with parallel.sequence: {smallest} (apply with: --set "
                                                f"parallel.sequence={smallest})" if smallest else
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
    from finetune.plan.from_recipe import setup_from_recipe  # from_recipe -> parallel, not -> here

    if recipe.parallel.tensor > 1 or (recipe.parallel.sequence == 1 and recipe.data.max_length < LONG_CONTEXT):
        return ""
    base = setup_from_recipe(recipe, gpus, gpu_memory_bytes, nodes, cpu_memory_bytes, deepspeed=setup.deepspeed,
                             parallel=False)
    base = replace(base, seq_len=recipe.data.max_length, data_note="",
                   activation_offload=recipe.training.activation_offload and base.gradient_checkpointing)
    return render_table(base, base.world, recipe.data.max_length)
