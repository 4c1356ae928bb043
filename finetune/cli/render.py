"""`finetune render`: the DeepSpeed JSON and training arguments a recipe becomes."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from finetune.cli.common import SET_HELP, fail, load_or_exit
from finetune.rundir.names import DEEPSPEED_FILE, TRAINING_ARGS_FILE


def render(
    recipe: Path = typer.Argument(..., metavar="RECIPE", help="Recipe file."),
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
    from finetune.render import dumps, render_deepspeed, render_training_args
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
        for name, data in ((DEEPSPEED_FILE, ds), (TRAINING_ARGS_FILE, args)):
            write_atomic(output / name, dumps(data))
            typer.echo(f"wrote {output / name}")
    except OSError as exc:
        raise fail(f"cannot write to {output}: {exc.strerror or exc}") from None
