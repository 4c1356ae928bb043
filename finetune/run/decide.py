"""The recipe a launch on a machine runs: its auto keys decided (finetune.plan.auto) for that machine's GPUs and the
processes a launch there starts. `finetune train` (finetune.run.start), `finetune doctor --recipe` and
scripts/bench_hf.py all decide through here, so that they judge the same run."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from finetune.plan.auto import Resolution, machine_from_facts, resolve
from finetune.run.launch.commands import procs_per_node as launch_procs

if TYPE_CHECKING:
    from finetune.recipe import Recipe
    from finetune.run.machine import Facts


def resolve_on(recipe: "Recipe", facts: "Facts", procs_per_node: Optional[int] = None) -> Resolution:
    """`recipe`'s auto keys decided for the machine `facts` describe (its visible GPUs; the smallest one's memory
    decides), with `procs_per_node` processes (None: as many as a launch there starts)."""
    gpus = facts.gpus if facts.cuda_available else []
    procs = procs_per_node or launch_procs(recipe, len(gpus))
    return resolve(recipe, machine_from_facts(procs, recipe.launch.nodes, gpus))
