"""Commands before anyone rents a GPU: lint, render, schema, plan, doctor (none of them trains)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from finetune.cli.common import SET_HELP, fail, load_or_exit, path_exists, problems_exit, usable_path


def lint(
    paths: List[Path] = typer.Argument(..., help="Recipes (.yaml), DeepSpeed configs (.json) or directories (searched recursively)."),
    fmt: str = typer.Option("text", "--format", help="text, json or github (GitHub Actions annotations)."),
    strict: bool = typer.Option(False, "--strict", help="Fail on warnings too."),
    world_size: Optional[int] = typer.Option(None, "--world-size", min=1, help="World size for DeepSpeed JSON batch-size checks."),
    recipe: Optional[Path] = typer.Option(None, "--recipe", help="Check DeepSpeed JSON files against this recipe's TrainingArguments."),
    gpus: Optional[int] = typer.Option(None, "--gpus", min=1, help="GPUs per node to check memory against (runs the planner)."),
    gpu_memory: Optional[str] = typer.Option(None, "--gpu-memory", help="Memory per GPU, e.g. 24GiB (runs the planner)."),
    overrides: Optional[List[str]] = typer.Option(None, "--set", help=SET_HELP),
    hf: bool = typer.Option(True, "--hf/--no-hf", help="DeepSpeed JSON is used through the HF Trainer (default; "
                            "\"auto\" values are filled in), or with plain deepspeed.initialize (--no-hf)."),
) -> None:
    """Check recipes and DeepSpeed JSON before anyone rents a GPU. Exit 0 clean, 1 on errors, 2 on usage errors.

    Example:

    \b
        $ finetune lint recipes ds_configs
        recipes/bad.yaml:7:3: error R002 `lora.rr`: unknown key (did you mean `r`?)
        1 file with problems: 1 error, 0 warnings
    """
    from finetune.lint import LintOptions, lint_paths
    from finetune.lint.report import FORMATS, render

    if fmt not in FORMATS:
        raise fail(f"--format must be one of {', '.join(FORMATS)}", 2)
    missing = [str(p) for p in paths if not path_exists(p)]
    if missing:
        raise fail(f"no such file or directory: {', '.join(missing)}", 2)
    if recipe is not None and not path_exists(recipe, Path.is_file):
        raise fail(f"--recipe {recipe}: no such file", 2)
    if recipe is not None and not hf:
        raise fail("--recipe and --no-hf do not go together: a recipe trains through the HF Trainer", 2)
    options = LintOptions(world_size=world_size, recipe=recipe, gpus=gpus, gpu_memory=gpu_memory,
                          overrides=overrides or [], hf=hf)
    try:
        options.validate()
    except ValueError as exc:
        raise fail(str(exc), 2) from None
    result = lint_paths(paths, options)
    typer.echo(render(result, fmt), nl=False)
    raise typer.Exit(result.exit_code(strict))


def render(
    recipe: Path = typer.Argument(..., help="Recipe file."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Directory to write deepspeed.json and training_args.json into (default: print)."),
    world_size: Optional[int] = typer.Option(None, "--world-size", min=1, help="Fix the world size (otherwise the recipe's, or auto)."),
    overrides: Optional[List[str]] = typer.Option(None, "--set", help=SET_HELP),
) -> None:
    """Write the DeepSpeed JSON and TrainingArguments a recipe implies (stable key order).

    Example:

    \b
        $ finetune render recipes/llama3/8b_qlora_2x12gb.yaml -o rendered/
        wrote rendered/deepspeed.json
        wrote rendered/training_args.json
    """
    from finetune.dsconfig import dumps, render_deepspeed, render_training_args
    from finetune.fsutil import write_atomic

    loaded = load_or_exit(recipe, overrides)
    ds = render_deepspeed(loaded.recipe, world_size)
    args = render_training_args(loaded.recipe)
    if output is None:
        typer.echo("# deepspeed.json")
        typer.echo(dumps(ds), nl=False)
        typer.echo("# training_args.json")
        typer.echo(dumps(args), nl=False)
        return
    try:
        output.mkdir(parents=True, exist_ok=True)
        for name, data in (("deepspeed.json", ds), ("training_args.json", args)):
            write_atomic(output / name, dumps(data))
            typer.echo(f"wrote {output / name}")
    except OSError as exc:
        raise fail(f"cannot write to {output}: {exc.strerror or exc}") from None


def schema(output: Optional[Path] = typer.Option(None, "-o", "--output", help="Write to a file instead of stdout.")) -> None:
    """Print the recipe JSON Schema (for YAML language servers in editors).

    Example:

    \b
        $ finetune schema -o recipe.schema.json
        # then, first line of a recipe:  # yaml-language-server: $schema=recipe.schema.json
    """
    from finetune.fsutil import write_atomic
    from finetune.recipe import json_schema

    usable_path("-o", output)
    text = json.dumps(json_schema(), indent=2) + "\n"
    if output is None:
        typer.echo(text, nl=False)
    else:
        try:
            write_atomic(output, text)
        except OSError as exc:
            raise fail(f"cannot write {output}: {exc.strerror or exc}") from None

def doctor(
    fmt: str = typer.Option("text", "--format", help="text or json."),
    recipe: Optional[Path] = typer.Option(None, "--recipe", help="Also run the checks this recipe needs (what `finetune train` checks)."),
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
    """
    from finetune.doctor import failed, render_text, report, run_doctor

    if fmt not in ("text", "json"):
        raise fail("--format must be text or json", 2)
    loaded = load_or_exit(recipe, None) if recipe is not None else None
    facts, checks = run_doctor(recipe=loaded.recipe if loaded else None)
    if fmt == "json":
        typer.echo(json.dumps(report(facts, checks), indent=2))
    else:
        typer.echo(render_text(facts, checks), nl=False)
    raise typer.Exit(1 if failed(checks) else 0)

def plan(
    recipe: Optional[Path] = typer.Argument(None, help="Recipe file (omit it and pass --model for a quick what-if)."),
    gpus: Optional[int] = typer.Option(None, "--gpus", min=1, help="GPUs per node (default: the recipe's launch/hardware, else 1)."),
    nodes: Optional[int] = typer.Option(None, "--nodes", min=1, help="Machines (default: launch.nodes)."),
    gpu_memory: Optional[str] = typer.Option(None, "--gpu-memory", help="Memory per GPU, e.g. 24GiB (default: hardware.gpu_memory)."),
    cpu_memory: Optional[str] = typer.Option(None, "--cpu-memory", help="RAM per node, e.g. 256GiB (default: hardware.cpu_memory)."),
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
) -> None:
    """Predict per-GPU memory (weights, gradients, optimizer, DeepSpeed buffers, activations, logits, overhead) before renting.

    Pure Python, offline: model shapes come from a local config.json or a built-in table.

    Example:

    \b
        $ finetune plan --model llama-3-8b --method qlora --lora-r 64 --zero 2 --gpus 2 --gpu-memory 12GiB
        $ finetune plan recipes/llama3/8b_qlora_2x12gb.yaml --recommend
    """
    from finetune import plan as planner
    from finetune.recipe import RecipeProblem, parse_size

    if fmt not in ("text", "json"):
        raise fail("--format must be text or json", 2)
    try:
        gpu_bytes = parse_size(gpu_memory) if gpu_memory is not None else None
        cpu_bytes = parse_size(cpu_memory) if cpu_memory is not None else None
    except ValueError as exc:
        raise fail(f"--gpu-memory/--cpu-memory: {exc}", 2) from None
    try:
        sets = (overrides or []) + planner.flag_overrides(
            model=model, method=method, zero=zero, offload_optimizer=offload_optimizer, offload_param=offload_param,
            micro_batch=micro_batch, seq_len=seq_len, gradient_checkpointing=gradient_checkpointing,
            lora_r=lora_r, lora_targets=lora_targets, attn=attn)
        if recipe is not None:
            the_recipe = load_or_exit(recipe, sets).recipe
        else:
            the_recipe = planner.recipe_without_file(sets)
        setup = planner.setup_from_recipe(the_recipe, gpus, gpu_bytes, nodes, cpu_bytes, deepspeed=zero != "none",
                                          data_lengths=recipe is not None and seq_len is None)
        result = planner.plan(setup)
        advice = planner.recommend(setup, the_recipe.training.gradient_accumulation_steps) if recommend else None
    except RecipeProblem as exc:
        raise problems_exit(exc) from None
    except planner.PlanError as exc:
        raise fail(str(exc)) from None
    if fmt == "json":
        data = result.to_json()
        if advice is not None:
            data["recommendation"] = advice.to_json()
        typer.echo(json.dumps(data, indent=2))
        return
    typer.echo(result.render_text(), nl=False)
    if advice is not None:
        typer.echo("")
        typer.echo(advice.render_text(), nl=False)
