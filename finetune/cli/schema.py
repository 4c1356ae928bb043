"""`finetune schema`: the recipe's JSON Schema, for editors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from finetune.cli.common import fail, usable_path


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
