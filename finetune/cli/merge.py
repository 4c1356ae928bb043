"""`finetune merge`: an adapter merged into its base model, streaming, on a CPU box."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from finetune.cli.common import fail, shard_size_or_exit, write_errors, write_progress
from finetune.rundir.names import ADAPTER_DIR, RECIPE_FILE


def merge(
    run_dir: Optional[Path] = typer.Argument(None, metavar="RUN_DIR", help=f"Run directory ({RECIPE_FILE} + {ADAPTER_DIR}/); gives --base and --adapter."),
    output: Path = typer.Option(..., "-o", "--output", help="Directory for the merged model (written beside it, renamed at the end)."),
    base: Optional[Path] = typer.Option(None, "--base", help="Local base model directory (safetensors); overrides the run's."),
    adapter: Optional[Path] = typer.Option(None, "--adapter", help="PEFT LoRA adapter directory; overrides the run's."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="bfloat16, float16 or float32 (default: the base's)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output directory."),
    verify: bool = typer.Option(False, "--verify", help="Then compare logits with base + adapter (loads both; for models that fit in RAM)."),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="Largest output shard, e.g. 5GB or 500MB."),
    fsync: bool = typer.Option(False, "--fsync", help="Wait until the shards are on disk before publishing the output (as slow as the disk)."),
) -> None:
    """Merge a LoRA adapter into its base model, streaming one tensor at a time (RAM need: one tensor, not the model).

    Example:

    \b
        $ finetune merge runs/llama3-8b-qlora -o merged/llama3-8b
        wrote model-00001-of-00004.safetensors (4.98 GB)
        ...
        merged 224 LoRA layers into merged/llama3-8b (4 shards, 16.06 GB) in 141.2 s
    """
    from finetune.weights.merge import merge as run_merge
    from finetune.weights.merge_inputs import resolve_inputs
    from finetune.weights.verify import verify as run_verify
    from finetune.units import human_size
    from finetune.weights.errors import MergeError

    if run_dir is None and (base is None or adapter is None):
        raise fail("give a run directory, or both --base and --adapter", 2)
    shard_bytes = shard_size_or_exit(max_shard_size)
    def verified(merged: Path) -> None:
        # Before publishing: a merge that fails --verify never appears at OUTPUT (issue 25).
        check = run_verify(merged, inputs.base, inputs.adapter)
        typer.echo(f"verify: max |logits merged - logits base+adapter| = {check.max_abs_diff:.3g} "
                   f"(tolerance {check.tolerance:.3g}, from rounding to the stored dtype: {check.rounding:.3g}; "
                   f"the adapter moves logits by up to {check.adapter_effect:.3g})")
        if not check.ok:
            kept = "keeps what it held" if output.exists() else "was not written"
            raise MergeError(f"verify: the merged model does not reproduce base + adapter; it was not published "
                             f"({output} {kept})")

    with write_errors("merge", output):
        inputs = resolve_inputs(run_dir, base, adapter)
        with write_progress("merging") as (log, on_write):
            result = run_merge(inputs.base, inputs.adapter, output, dtype=dtype, overwrite=overwrite,
                               max_shard_size=shard_bytes, log=log, source_dirs=inputs.tokenizer_dirs,
                               fsync=fsync, on_write=on_write, check=verified if verify else None)
    typer.echo(f"merged {result.merged_layers} LoRA layers into {output} ({result.shards} shard"
               f"{'s' if result.shards > 1 else ''}, {human_size(result.total_bytes)}) in {result.seconds:.1f} s")
    for line in _next_lines(output):
        typer.echo(line)


def _next_lines(merged: Path) -> list:
    """What to do with the merged model (issue 34: merge printed no next step): chat, serve with the trained prompt."""
    from finetune.serve import lines, merged_next_steps

    return lines(merged_next_steps(merged))
