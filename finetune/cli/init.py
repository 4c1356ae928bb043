"""`finetune init`: write a starter recipe for a model and a data file."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from finetune import objectives
from finetune.cli.common import fail, input_file


def init(
    data: Path = typer.Option(..., "--data", help="Your training data: a .jsonl, .json, .csv or .parquet file."),
    model: str = typer.Option("builtin:tiny-llama", "--model", help="Hub id or local directory of the base model (default: the built-in tiny model, to try it on a CPU)."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Recipe to write (default: DATA's name with .yaml, beside it)."),
    fmt: Optional[str] = typer.Option(None, "--format", help="alpaca, messages, sharegpt, text or prompt (grpo) (default: read off the first row: prompt/chosen/rejected rows train dpo, prompt/completion/label kto, prompts alone grpo)."),
    method: str = typer.Option("lora", "--method", help="full, lora or qlora."),
) -> None:
    """Write a starter recipe for MODEL and DATA, the data format read off its first row; then lint it.

    Example:

    \b
        $ finetune init --data qa.jsonl
        wrote qa.yaml (alpaca, columns {instruction: question, output: answer}; epochs: 60 rows x 10 = 75 steps (1 epoch: 8 steps, too few to learn); lint: no problems)
    """
    from finetune.data.formats import FORMATS
    from finetune.data.validate import BadRow, iter_rows
    from finetune.fsutil import write_atomic
    from finetune.builtin import is_builtin
    from finetune.data.starter import StarterError, epochs_note, guess_objective, starter_recipe

    if method not in ("full", "lora", "qlora"):
        raise fail("--method must be full, lora or qlora", 2)
    if fmt is not None and fmt not in FORMATS:
        raise fail(f"--format {fmt}: unknown format (known: {', '.join(FORMATS)})", 2)
    input_file("--data", data)
    if data.suffix not in (".jsonl", ".json", ".csv", ".parquet"):
        raise fail(f"--data {data}: unsupported file type `{data.suffix}` (.jsonl, .json, .csv or .parquet)", 2)
    output = output or data.with_suffix(".yaml")
    if output.exists():
        raise fail(f"{output} exists; choose another -o (init never overwrites a recipe)")
    where, row = next(iter(iter_rows(data)), (str(data), None))
    if row is None or isinstance(row, BadRow):
        raise StarterError(f"{where}: " + (row.message if isinstance(row, BadRow) else "no rows"))
    objective, found, columns = guess_objective(row) if fmt is None else ("grpo" if fmt == "prompt" else "sft", fmt, {})
    fmt = fmt or found
    rows = sum(1 for _ in iter_rows(data))
    record = objectives.get(objective)  # the rewards read an answer column
    answer = next((k for k in ("answer", "solution", "output") if k in row), None) if record.generates else None
    write_atomic(output, starter_recipe(model, data, output, fmt, columns, method, tiny=is_builtin(model),
                                        objective=objective, answer=answer, rows=rows))
    from finetune.lint import LintOptions, lint_paths

    result = lint_paths([output], LintOptions())
    verdict = "no problems" if not result.findings else f"{len(result.errors)} error(s), {len(result.warnings)} warning(s): run finetune lint {output}"
    mapping = f", columns {{{', '.join(f'{k}: {v}' for k, v in columns.items())}}}" if columns else ""
    what = fmt if record.format_decides else f"objective {objective}"
    typer.echo(f"wrote {output} ({what}{mapping}; epochs: {epochs_note(rows, objective)}; lint: {verdict})", err=True)
