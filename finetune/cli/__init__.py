"""The `finetune` command line: a Typer app whose commands, one module per stage of the workflow, parse, call and print."""

from __future__ import annotations

import sys

import typer

from finetune.cli.chat import chat
from finetune.cli.common import handled
from finetune.cli.convert import convert
from finetune.cli.data import data_app
from finetune.cli.doctor import doctor
from finetune.cli.eval import eval_command
from finetune.cli.export import export
from finetune.cli.init import init
from finetune.cli.lint import lint
from finetune.cli.merge import merge
from finetune.cli.plan import plan
from finetune.cli.prepare import prepare
from finetune.cli.publish import publish
from finetune.cli.render import render
from finetune.cli.schema import schema
from finetune.cli.slurm import slurm
from finetune.cli.train import train

app = typer.Typer(
    name="finetune",
    help="Fine-tune open LLMs from one YAML recipe: lint, plan, render, prepare, train, convert, merge, chat, eval, export, publish.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"finetune {version('finetune')}")
        except PackageNotFoundError:  # run from a source tree that was never installed
            from finetune import __version__

            typer.echo(f"finetune {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """Fine-tune open LLMs from one YAML recipe: lint, plan, render, prepare, train, convert, merge, chat, eval, export, publish."""


# The order `finetune --help` lists them in.
app.command()(handled(init))
app.add_typer(data_app, name="data")
for _command in (lint, render, schema, merge, prepare, train, chat):
    app.command()(handled(_command))
app.command("eval")(handled(eval_command))
app.command()(handled(export))
app.command()(handled(publish))
for _command in (doctor, convert, plan, slurm):
    app.command()(handled(_command))


def main() -> None:
    from finetune import quiet

    quiet.install()
    try:
        app()
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
