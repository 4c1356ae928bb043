"""`finetune lint`: recipes and DeepSpeed configs checked without torch, in CI."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from finetune.cli.common import SET_HELP, fail, path_exists


def lint(
    paths: List[Path] = typer.Argument(..., metavar="PATH", help="Recipes (.yaml), DeepSpeed configs (.json) or directories (searched recursively)."),
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
        recipes/llama3/8b_dpo_qlora_2x12gb.yaml:15:3: info R120 `model.adapter`: no adapter_config.json in runs/llama3-8b-qlora or runs/llama3-8b-qlora/adapter here (`finetune train` will refuse to start)
        … files checked, 0 with problems: 0 errors, 0 warnings
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
