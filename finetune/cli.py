"""The `finetune` command line. Wiring only: each command parses, calls a module, prints.

Heavy libraries (torch, deepspeed, transformers) are imported inside the commands that need them,
so `finetune --help`, `lint`, `render`, `schema` and `plan` start in a fraction of a second.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer

app = typer.Typer(
    name="finetune",
    help="Fine-tune open LLMs from one YAML recipe: lint, plan, render, train, convert, merge.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

SET_HELP = "Override a recipe key, e.g. --set deepspeed.stage=3 (repeatable; the value is read as YAML)."


def fail(message: str, code: int = 1) -> "typer.Exit":
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def load_or_exit(recipe: Path, overrides: Optional[List[str]]):
    """Load a recipe or print every problem (file:line:col) and exit 1."""
    from finetune.recipe import RecipeProblem, load_recipe

    try:
        return load_recipe(recipe, overrides or [])
    except RecipeProblem as exc:
        for problem in exc.problems:
            typer.echo(problem.render(), err=True)
        raise typer.Exit(1) from None


@app.command()
def lint(
    paths: List[Path] = typer.Argument(..., help="Recipes (.yaml), DeepSpeed configs (.json) or directories (searched recursively)."),
    fmt: str = typer.Option("text", "--format", help="text, json or github (GitHub Actions annotations)."),
    strict: bool = typer.Option(False, "--strict", help="Fail on warnings too."),
    world_size: Optional[int] = typer.Option(None, "--world-size", min=1, help="World size for DeepSpeed JSON batch-size checks."),
    recipe: Optional[Path] = typer.Option(None, "--recipe", help="Check DeepSpeed JSON files against this recipe's TrainingArguments."),
    gpus: Optional[int] = typer.Option(None, "--gpus", min=1, help="GPUs per node to check memory against (runs the planner)."),
    gpu_memory: Optional[str] = typer.Option(None, "--gpu-memory", help="Memory per GPU, e.g. 24GiB (runs the planner)."),
    overrides: Optional[List[str]] = typer.Option(None, "--set", help=SET_HELP),
) -> None:
    """Check recipes and DeepSpeed JSON before anyone rents a GPU. Exit 0 clean, 1 on errors, 2 on usage errors.

    Example:

        $ finetune lint recipes ds_configs
        recipes/bad.yaml:7:3: error R002 `lora.rr`: unknown key (did you mean `r`?)
        1 file with problems: 1 error, 0 warnings
    """
    from finetune.lint import LintOptions, lint_paths
    from finetune.lint.report import FORMATS, render

    if fmt not in FORMATS:
        raise fail(f"--format must be one of {', '.join(FORMATS)}", 2)
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise fail(f"no such file or directory: {', '.join(missing)}", 2)
    if recipe is not None and not recipe.is_file():
        raise fail(f"--recipe {recipe}: no such file", 2)
    options = LintOptions(world_size=world_size, recipe=recipe, gpus=gpus, gpu_memory=gpu_memory, overrides=overrides or [])
    try:
        options.validate()
    except ValueError as exc:
        raise fail(str(exc), 2) from None
    result = lint_paths(paths, options)
    typer.echo(render(result, fmt), nl=False)
    raise typer.Exit(result.exit_code(strict))


@app.command()
def render(
    recipe: Path = typer.Argument(..., help="Recipe file."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Directory to write deepspeed.json and training_args.json into (default: print)."),
    world_size: Optional[int] = typer.Option(None, "--world-size", min=1, help="Fix the world size (otherwise the recipe's, or auto)."),
    overrides: Optional[List[str]] = typer.Option(None, "--set", help=SET_HELP),
) -> None:
    """Write the DeepSpeed JSON and TrainingArguments a recipe implies (stable key order).

    Example:

        $ finetune render recipes/llama3-8b-qlora-2x12gb.yaml -o rendered/
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


@app.command()
def schema(output: Optional[Path] = typer.Option(None, "-o", "--output", help="Write to a file instead of stdout.")) -> None:
    """Print the recipe JSON Schema (for YAML language servers in editors).

    Example:

        $ finetune schema -o recipe.schema.json
        # then, first line of a recipe:  # yaml-language-server: $schema=recipe.schema.json
    """
    from finetune.fsutil import write_atomic
    from finetune.recipe import json_schema

    text = json.dumps(json_schema(), indent=2) + "\n"
    if output is None:
        typer.echo(text, nl=False)
    else:
        write_atomic(output, text)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
