"""`finetune prepare`: check and tokenize a recipe's training set into the cache, on every core, without training."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from finetune import objectives
from finetune.cli.common import SET_HELP, fail, load_or_exit


def prepare(
    recipe: Path = typer.Argument(..., help="Recipe file."),
    overrides: Optional[List[str]] = typer.Option(None, "--set", help=SET_HELP),
    num_proc: Optional[int] = typer.Option(None, "--num-proc", min=1, help="Processes that tokenize (default: data.num_proc, auto = every core here)."),
) -> None:
    """Tokenize the training set into the cache that `finetune train` memory-maps, and stop.

    Run it on a cheap CPU machine before renting the GPUs: with the same FINETUNE_CACHE (copy
    ~/.cache/finetune/tokenized/ over, or share it), `finetune train` finds the cache and starts in
    seconds. Every row is checked first (file and line of each problem, all at once). The cache is
    written under a temporary name and renamed when complete: a prepare that is killed leaves
    nothing a later run would take for a cache. `finetune train` does this same step itself, before
    it starts any rank, when the cache is missing.

    Example:

    \b
        $ finetune prepare recipes/demo.yaml
        [finetune] tokenizing recipes/data/demo_instructions.jsonl: 307 rows, 1 process
        [finetune] data: recipes/data/demo_instructions.jsonl (alpaca): 307 rows -> 307 examples; 307 in the mixture (all)
        [finetune] tokenized data: 307 rows -> 307 sequences, 8237 tokens in 0.4 s (768 rows/s, 1 process) -> ~/.cache/finetune/tokenized/3f0c9e1d2a7b6c54
        prepared: `finetune train recipes/demo.yaml` will find it
    """
    loaded = load_or_exit(recipe, overrides)
    if not objectives.get(loaded.recipe.objective).pretokenized:
        raise fail(f"objective {loaded.recipe.objective}: TRL tokenizes preference rows in the trainer; "
                   "`finetune prepare` tokenizes SFT data only")
    from finetune.data.sources import sources_of
    from finetune.data.validate import validate

    checked = validate(sources_of(loaded.recipe.data))
    if not checked.ok:
        for message in checked.messages():
            typer.echo(f"error: {message}", err=True)
        raise fail(f"{checked.total} problem{'s' if checked.total != 1 else ''} in the data; nothing was tokenized")
    from finetune.data.prepare_recipe import prepare_recipe
    from finetune.tokenizer import load_for_launch

    # A bad row or model is a FinetuneError: finetune.cli.common.handled prints its line and exits 1.
    try:
        done = prepare_recipe(loaded.recipe, load_for_launch(loaded.recipe),
                              lambda line: typer.echo(f"[finetune] {line}", err=True), num_proc)
    except OSError as exc:
        raise fail(f"cannot load the tokenizer or write the cache: {exc.strerror or exc}") from None
    typer.echo(f"prepared: {done.path} ({'already there' if done.cached else f'{done.seconds:.1f} s'}); "
               f"`finetune train {recipe}` will find it", err=True)
