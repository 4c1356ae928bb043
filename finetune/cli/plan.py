"""`finetune plan`: will a recipe fit the GPUs, before anyone rents them?"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import List, Optional

import typer

from finetune.cli.common import SET_HELP, fail, load_or_exit

# Scripts and CI gate on the verdict: 1 and 2 are taken by bad input and usage errors.
EXIT_DOES_NOT_FIT = 3


def plan(
    recipe: Optional[Path] = typer.Argument(None, metavar="RECIPE", help="Recipe file (omit it and pass --model for a quick what-if)."),
    gpus: Optional[int] = typer.Option(None, "--gpus", min=1, help="GPUs per node (default: the recipe's launch/hardware, else 1)."),
    nodes: Optional[int] = typer.Option(None, "--nodes", min=1, help="Machines (default: launch.nodes)."),
    gpu_memory: Optional[str] = typer.Option(None, "--gpu-memory", help="Memory per GPU, e.g. 24GiB (default: hardware.gpu_memory)."),
    cpu_memory: Optional[str] = typer.Option(None, "--cpu-memory", help="RAM per node, e.g. 256GiB (default: hardware.cpu_memory)."),
    gpu_type: Optional[str] = typer.Option(None, "--gpu-type", help="GPU model, e.g. A100, RTX 4070, P40 (default: hardware.gpu_type): a card without bf16 is planned and recommended in float16."),
    fmt: str = typer.Option("text", "--format", help="text or json."),
    recommend: bool = typer.Option(False, "--recommend", help="Try ZeRO stages x offload x micro batch; print the fastest setup that fits."),
    model: Optional[str] = typer.Option(None, "--model", help="config.json (or its directory), an architecture (llama-3-8b, qwen2.5-7b, ...) or a parameter count (7.5B: model states only)."),
    method: Optional[str] = typer.Option(None, "--method", help="full, lora or qlora."),
    zero: Optional[str] = typer.Option(None, "--zero", help="ZeRO stage 0-3, or none for plain PyTorch without DeepSpeed."),
    offload_optimizer: Optional[str] = typer.Option(None, "--offload-optimizer", help="none, cpu or nvme."),
    offload_param: Optional[str] = typer.Option(None, "--offload-param", help="none, cpu or nvme (ZeRO-3)."),
    micro_batch: Optional[int] = typer.Option(None, "--micro-batch", min=1, help="Sequences per GPU per forward."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", min=8, help="Tokens per sequence (data.max_length)."),
    gradient_checkpointing: Optional[bool] = typer.Option(None, "--gradient-checkpointing/--no-gradient-checkpointing", help="Recompute activations in backward."),
    lora_r: Optional[int] = typer.Option(None, "--lora-r", min=1, help="LoRA rank."),
    lora_targets: Optional[str] = typer.Option(None, "--lora-targets", help="all-linear or a comma list: q_proj,v_proj."),
    attn: Optional[str] = typer.Option(None, "--attn", help="eager, sdpa, flash_attention_2 or flash_attention_3."),
    overrides: Optional[List[str]] = typer.Option(None, "--set", help=SET_HELP),
    trace: bool = typer.Option(False, "--trace", help="Also run one training step of transformers' model code on fake tensors (no weights, no GPU; needs torch) and report its peak by kind."),
) -> None:
    """Predict per-GPU memory (weights, gradients, optimizer, DeepSpeed buffers, activations, logits, overhead) before renting.

    Pure Python, offline: model shapes come from a local config.json or a built-in table.

    Exit codes: 0 fits (or no GPU memory given to judge), 3 does NOT fit (GPU or CPU memory; with
    --recommend too: the recipe as written does not fit), 1 bad recipe or model, 2 usage.

    Example:

    \b
        $ finetune plan --model llama-3-8b --method qlora --lora-r 64 --zero 2 --gpus 2 --gpu-memory 12GiB \
            --set training.loss_kernel=default
        model    llama-3-8b (8.03B params, hidden 4096, 32 layers, 32/8 heads, vocab 128256)
        ...
          total (peak, backward)                11.98  of 12.00: does NOT fit: the upper bound 14.01 GiB is 2.01 GiB over …
        $ echo $?
        3
        $ finetune plan --model llama-3-8b --method qlora --lora-r 64 --zero 2 --gpus 2 --gpu-memory 12GiB
        ...
          training.loss_kernel = "chunked": the logits (2.94 GiB with the default loss, 0.73 chunked) stand between this GPU and micro batch 1: upper bound 10.89 of 12.00 GiB
        $ finetune plan recipes/llama3/8b_qlora_2x12gb.yaml --recommend
    """
    from finetune import plan as planner
    from finetune.recipe import parse_size

    if fmt not in ("text", "json"):
        raise fail("--format must be text or json", 2)
    try:
        gpu_bytes = parse_size(gpu_memory) if gpu_memory is not None else None
        cpu_bytes = parse_size(cpu_memory) if cpu_memory is not None else None
    except ValueError as exc:
        raise fail(f"--gpu-memory/--cpu-memory: {exc}", 2) from None
    sets = (overrides or []) + planner.flag_overrides(
        model=model, method=method, zero=zero, offload_optimizer=offload_optimizer, offload_param=offload_param,
        micro_batch=micro_batch, seq_len=seq_len, gradient_checkpointing=gradient_checkpointing,
        lora_r=lora_r, lora_targets=lora_targets, attn=attn)
    if zero == "none":
        sets.append("deepspeed.enabled=false")
    if recipe is not None:
        the_recipe = load_or_exit(recipe, sets).recipe
    else:
        the_recipe = planner.recipe_without_file(sets)
    auto = planner.resolve_auto(the_recipe, planner.machine_for(the_recipe, gpus, gpu_bytes, nodes, cpu_bytes))
    the_recipe = auto.recipe
    setup = planner.setup_from_recipe(the_recipe, gpus, gpu_bytes, nodes, cpu_bytes,
                                      data_lengths=recipe is not None and seq_len is None)
    if gpu_type is not None:
        setup = replace(setup, gpu_type=gpu_type)
    result = planner.plan(setup)
    advice = planner.recommend(setup, the_recipe.training.gradient_accumulation_steps) if recommend else None
    traced = _trace(setup, the_recipe.model.name_or_path) if trace else None
    if fmt == "json":
        data = result.to_json()
        data["auto"] = auto.to_json()
        if advice is not None:
            data["recommendation"] = advice.to_json()
        if traced is not None:
            data["trace"] = traced.to_json()
        typer.echo(json.dumps(data, indent=2))
    else:
        typer.echo(result.render_text(), nl=False)
        if auto.choices:
            typer.echo("\nauto (what `auto` in the recipe becomes on this setup; a value the recipe writes wins):")
            for line in auto.lines():
                typer.echo(f"  {line}")
        if traced is not None:
            typer.echo("")
            typer.echo(traced.render_text(), nl=False)
        if advice is not None:
            typer.echo("")
            typer.echo(advice.render_text(), nl=False)
            long_context = planner.long_context_text(the_recipe, setup, gpus, gpu_bytes, nodes, cpu_bytes)
            if long_context:
                typer.echo("")
                typer.echo(long_context, nl=False)
    if result.fits is False:
        raise typer.Exit(EXIT_DOES_NOT_FIT)


def _trace(setup, name_or_path: str):
    """finetune.plan.trace.step, imported here: without --trace `finetune plan` never imports torch."""
    try:
        from finetune.plan.trace.step import config_of, trace
    except ImportError as exc:  # pragma: no cover - the light install
        raise fail(f"--trace needs torch, transformers and peft (pip install 'finetune[train]'): {exc}") from None
    return trace(setup, config_of(name_or_path))
