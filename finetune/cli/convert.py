"""`finetune convert`: a DeepSpeed checkpoint turned into a PEFT adapter or a model."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from finetune.cli.common import shard_size_or_exit, write_errors, write_progress
from finetune.rundir.names import ADAPTER_CONFIG, ADAPTER_DIR


def convert(
    checkpoint: Path = typer.Argument(..., metavar="CHECKPOINT", help="checkpoint-N/ (with `latest` and global_stepN/) or a global_stepN/ directory."),
    output: Path = typer.Option(..., "-o", "--output", help="Directory for the adapter (LoRA) or the safetensors weights (full)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="bfloat16, float16 or float32 (default: the dtype the model trained in)."),
    adapter_config: Optional[Path] = typer.Option(None, "--adapter-config", help=f"{ADAPTER_CONFIG} to use (default: the checkpoint's, or the run's {ADAPTER_DIR}/)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output directory."),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="Largest output shard for full fine-tunes."),
) -> None:
    """Turn a DeepSpeed ZeRO checkpoint (any stage, any world size) into a PEFT adapter or HF safetensors, on CPU.

    Example:

    \b
        $ finetune convert runs/x/checkpoint-500 -o runs/x/adapter-500
        wrote runs/x/adapter-500/adapter_model.safetensors (448 tensors, 335.5 MB)
        converted runs/x/checkpoint-500 (LoRA adapter, bfloat16) into runs/x/adapter-500
    """
    from finetune.weights.convert import convert as run_convert

    shard_bytes = shard_size_or_exit(max_shard_size)
    with write_errors("convert", output):
        with write_progress("converting") as (log, on_write):
            result = run_convert(checkpoint, output, dtype=dtype, overwrite=overwrite, adapter_config=adapter_config,
                                 max_shard_size=shard_bytes, log=log, on_write=on_write)
    what = "LoRA adapter" if result.kind == "lora" else f"full weights, {result.shards} shard{'s' if result.shards > 1 else ''}"
    typer.echo(f"converted {checkpoint} ({what}, {result.dtype.removeprefix('torch.')}) into {output}")
