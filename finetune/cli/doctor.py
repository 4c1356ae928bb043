"""`finetune doctor`: is this machine ready to train (versions, GPUs, DeepSpeed ops)?"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from finetune.cli.common import fail, load_or_exit


def doctor(
    fmt: str = typer.Option("text", "--format", help="text or json."),
    recipe: Optional[Path] = typer.Option(None, "--recipe", help="Also run the checks this recipe needs (what `finetune train` checks)."),
    build_ops: bool = typer.Option(False, "--build-ops", help="Then compile the DeepSpeed ops a run on this machine "
                                   "(with --recipe: of this recipe, else AdamW without offload) would compile on first "
                                   "use, for a machine image or before the paid hours start."),
) -> None:
    """Python, torch, CUDA, GPUs, NCCL and library versions, checked against known-bad combinations. Exit 1 if a check fails.

    Example:

    \b
        $ finetune doctor
        torch         2.5.1+cu124 (CUDA 12.4, NCCL 2.21.5; GPU available: yes)
        GPU 0         NVIDIA GeForce RTX 4070, 12.0 GiB, sm_89, bf16
        ...
        fail  qlora-zero3.bitsandbytes: bitsandbytes 0.43.1 is too old for QLoRA + ZeRO-3: needs >=0.43.3
              fix: pip install -U 'bitsandbytes>=0.43.3'
        $ finetune doctor --recipe recipe.yaml --build-ops   # FusedAdam (CPU Adam if offloaded), compiled now
    """
    from finetune.run.doctor import failed, render_text, report, run_doctor

    if fmt not in ("text", "json"):
        raise fail("--format must be text or json", 2)
    loaded = load_or_exit(recipe, None) if recipe is not None else None
    if fmt == "text":  # importing torch and the GPU probe take seconds: say so (issue 24)
        typer.echo("checking Python, torch, GPUs and library versions ...", err=True)
    facts, checks = run_doctor(recipe=loaded.recipe if loaded else None)
    if fmt == "json":
        typer.echo(json.dumps(report(facts, checks), indent=2))
    else:
        typer.echo(render_text(facts, checks), nl=False)
    if failed(checks):
        raise typer.Exit(1)
    if build_ops:
        _build_ops(facts, loaded.recipe if loaded else None)


def _build_ops(facts, recipe) -> None:
    """The JIT ops of a launch here (finetune.run.deepspeed_ops.ops_needed), compiled now; messages on stderr. A
    recipe's are those of the run `finetune train` would start here (its auto keys decided for this machine)."""
    from finetune.run.deepspeed_ops import build_ahead
    from finetune.run.doctor import decided_here

    recipe = decided_here(recipe, facts) if recipe is not None else None
    build_ahead("cuda" if facts.gpus else "cpu", recipe, log=lambda line: typer.echo(line, err=True))
