"""`finetune eval`: loss and perplexity of the base and the fine-tuned model."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from finetune.cli.common import fail, input_file


def eval_command(
    run_dir: Path = typer.Argument(..., metavar="RUN_DIR", help="Run directory."),
    data: Optional[Path] = typer.Option(None, "--data", help="Score this file instead of the validation split (read as the run's source with the same path, else as its only source)."),
    fmt: Optional[str] = typer.Option(None, "--format", help="The --data file's format (alpaca, text, messages, sharegpt), when the run mixes formats."),
    device: str = typer.Option("auto", "--device", help="auto (the GPU if there is one), cuda or cpu."),
    batch_size: int = typer.Option(8, "--batch-size", min=1, help="Sequences per forward pass."),
    tasks: Optional[List[Path]] = typer.Option(None, "--tasks", help="Benchmark tasks instead: an lm-evaluation-harness task YAML, or a folder of them (repeatable; needs pip install 'finetune[eval]'). Offline; prompted as the run trained; into eval.json's benchmarks and report.html."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="With --tasks: the first N documents of each task."),
) -> None:
    """Loss and perplexity of the base model and the fine-tuned one, on the same tokens (written to RUN/eval.json; RUN/eval-NAME.json for --data NAME.jsonl); with --tasks, lm-evaluation-harness tasks.

    The data is the run's validation split, or --data FILE (with --format when the run mixes sources
    read in different formats and FILE is none of them); sequences are tokenized and masked as in
    training, so only the response tokens are scored when the run masked its prompts.

    Example:

    \b
        $ finetune eval runs/demo
        loading runs/demo (lora adapter on builtin:tiny-llama) ...
        note: runs/demo has no validation split (data.validation_split: 0); scoring its training data
        data: the training data (.../recipes/data/demo_instructions.jsonl), 307 sequences, 2060 scored tokens (not held out: the run trained on it)
        model             loss    perplexity
        base            7.1127       1227.47
        fine-tuned      2.2870          9.85
        wrote runs/demo/eval.json

    With --tasks, lm-evaluation-harness runs the task files on both models (the table: task, metric, base,
    fine-tuned), e.g. `finetune eval runs/demo --tasks benchmarks` (the demo's answers: likelihood and exact match).
    """
    from finetune import quiet

    quiet.no_progress_bars()
    if tasks:
        if data is not None or fmt is not None:
            raise fail("--tasks reads its data from the task files: drop --data/--format", 2)
        from finetune.use.benchmark import benchmark

        result = benchmark(run_dir, list(tasks), device=device, batch_size=batch_size, limit=limit,
                           log=lambda line: typer.echo(line, err=True))
        typer.echo(result.table(), nl=False)
        from finetune.rundir.names import EVAL_FILE

        typer.echo(f"wrote {run_dir / EVAL_FILE} (benchmarks) in {result.seconds:.1f} s", err=True)
        return
    if limit is not None:
        raise fail("--limit goes with --tasks", 2)
    from finetune.data.formats import FORMATS
    from finetune.use.evaluate import eval_file, evaluate

    if fmt is not None and fmt not in FORMATS:
        raise fail(f"--format {fmt}: unknown format (known: {', '.join(FORMATS)})", 2)
    if data is not None:
        input_file("--data", data)
    result = evaluate(run_dir, data=data, device=device, batch_size=batch_size,
                      log=lambda line: typer.echo(line, err=True), fmt=fmt)
    typer.echo(result.table(), nl=False)
    typer.echo(f"wrote {run_dir / eval_file(data)}", err=True)
