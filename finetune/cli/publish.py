"""`finetune publish`: a run, a merged model or a GGUF export to a Hugging Face Hub repository, with its model card."""

from __future__ import annotations

from pathlib import Path

import typer

from finetune.cli.common import input_path


def publish(
    path: Path = typer.Argument(..., metavar="RUN_OR_EXPORT", help="A run directory (its adapter or full weights), a merged model (finetune merge) or a GGUF export (finetune export)."),
    repo: str = typer.Option(..., "--repo", help="The Hub repository, USER/NAME (created if it does not exist)."),
    private: bool = typer.Option(False, "--private", help="Create the repository private (an existing one keeps its visibility)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="List every file and print the model card; send nothing (no token needed)."),
) -> None:
    """Publish a run, a merged model or a GGUF export to the Hugging Face Hub, with a model card.

    The card: base model, relation, library, data sets, licence, eval results, the exact prompt format, the run's
    numbers and loss plot, serve commands, the recipe without local paths or secrets.

    Needs a Hugging Face token (HF_TOKEN, or `hf auth login`) unless --dry-run; HF_ENDPOINT names another hub.

    Example:

    \b
        $ finetune publish runs/demo --repo me/demo-lora --dry-run
        would upload to me/demo-lora (adapter, 8 files, 3.3 MB):
          adapter_model.safetensors  ...
        $ finetune publish exports/demo-q8 --repo me/demo-gguf
    """
    from finetune.publish.upload import publish as run_publish
    from finetune.units import human_size

    input_path("RUN_OR_EXPORT", path)
    result = run_publish(path, repo, private=private, dry_run=dry_run, log=lambda line: typer.echo(line, err=True))
    pub = result.publication
    total = human_size(sum(i.size for i in pub.items))
    verb = "would upload" if dry_run else "uploaded"
    typer.echo(f"{verb} to {repo} ({pub.kind}, {len(pub.items)} files, {total}):")
    for line in result.listing():
        typer.echo(line)
    if dry_run:
        typer.echo("\n--- README.md (the model card) ---")
        typer.echo(result.card, nl=False)
    else:
        typer.echo(f"commit: {result.url}")
