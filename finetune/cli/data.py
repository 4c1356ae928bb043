"""`finetune data show RECIPE`: one example as the run will train it, its trained tokens marked."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from finetune import objectives
from finetune.cli.common import SET_HELP, fail, handled, load_or_exit

data_app = typer.Typer(name="data", help="Look at a recipe's data as training will see it.", no_args_is_help=True,
                       add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)


def show(
    recipe: Path = typer.Argument(..., metavar="RECIPE", help="Recipe file."),
    row: int = typer.Option(1, "--row", min=1, help="Which row of the first local source (1-based)."),
    overrides: Optional[List[str]] = typer.Option(None, "--set", help=SET_HELP),
) -> None:
    """Tokenize one row with the recipe's tokenizer, format, max_length and masking, and print it with the
    tokens the loss trains on between [[ and ]] (everything else is context the model only reads). For dpo, orpo,
    simpo, kto and reward recipes: each sequence TRL's trainer makes of the row (chosen and rejected); grpo: the
    prompt the completions are generated from.

    Example:

    \b
        $ finetune data show recipes/demo.yaml
        recipes/data/demo_instructions.jsonl:1 (alpaca): 24 tokens, 7 trained (between [[ ]])
        <s>### Instruction:
        What is 7 plus 0?
        ### Response:
        [[7 plus 0 is 7.</s>]]
    """
    from finetune.data.show import TRAINED_END, TRAINED_START, show_example

    from finetune.rundir.run_dir import resolve_base
    from finetune.tokenizer import load_tokenizer

    loaded = load_or_exit(recipe, overrides)
    typer.echo(f"loading the tokenizer of {loaded.recipe.model.name_or_path} ...", err=True)
    try:
        tokenizer = load_tokenizer(loaded.recipe, resolve_base(loaded.recipe))
    except (OSError, ValueError) as exc:
        raise fail(f"cannot load the tokenizer of {loaded.recipe.model.name_or_path}: {str(exc).splitlines()[0]}") from None
    if not objectives.get(loaded.recipe.objective).uses_trl:
        shown = [show_example(loaded.recipe, tokenizer, row)]
    else:
        from finetune.train.show_rows import show_rows

        shown = show_rows(loaded.recipe, tokenizer, row)
    for one in shown:
        cut = f"; cut at data.max_length {loaded.recipe.data.max_length}" if one.truncated else ""
        what = f"{one.trained} trained (between {TRAINED_START} {TRAINED_END})" if one.trained else {
            "prompts": "the completions are generated from it",
            "pairs": "scored whole (the score head reads its last token)"}.get(one.fmt, "0 trained")
        typer.echo(f"{one.where} ({loaded.recipe.objective if one.fmt in ('pairs', 'prompts') else one.fmt}): "
                   f"{one.tokens} tokens, {what}{cut}")
        typer.echo(one.text)


data_app.command("show")(handled(show))
