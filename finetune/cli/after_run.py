"""Commands after a run: convert a checkpoint, merge an adapter, chat with the model, evaluate it."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import List, Optional

import typer

from finetune.cli.common import fail, shard_size_or_exit


def merge(
    run_dir: Optional[Path] = typer.Argument(None, help="Run directory (recipe.yaml + adapter/); gives --base and --adapter."),
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
    from finetune.merge import merge as run_merge
    from finetune.merge_inputs import resolve_inputs
    from finetune.merge_verify import verify as run_verify
    from finetune.safetensors_io import human_size

    if run_dir is None and (base is None or adapter is None):
        raise fail("give a run directory, or both --base and --adapter", 2)
    shard_bytes = shard_size_or_exit(max_shard_size)
    with _write_errors("merge", output):
        inputs = resolve_inputs(run_dir, base, adapter)
        with _write_progress("merging") as (log, on_write):
            result = run_merge(inputs.base, inputs.adapter, output, dtype=dtype, overwrite=overwrite,
                               max_shard_size=shard_bytes, log=log, source_dirs=inputs.tokenizer_dirs,
                               fsync=fsync, on_write=on_write)
    typer.echo(f"merged {result.merged_layers} LoRA layers into {output} ({result.shards} shard"
               f"{'s' if result.shards > 1 else ''}, {human_size(result.total_bytes)}) in {result.seconds:.1f} s")
    if verify:
        check = run_verify(output, inputs.base, inputs.adapter)
        typer.echo(f"verify: max |logits merged - logits base+adapter| = {check.max_abs_diff:.3g} "
                   f"(tolerance {check.tolerance:.3g}, from rounding to the stored dtype: {check.rounding:.3g}; "
                   f"the adapter moves logits by up to {check.adapter_effect:.3g})")
        if not check.ok:
            raise fail("verify: the merged model does not reproduce base + adapter")


@contextmanager
def _write_errors(command: str, output: Path):
    """The one-line failures of merge and convert: SIGTERM (exit 143, the partial output already removed),
    bad input, and a write that fails."""
    from finetune.safetensors_io import MergeError, Terminated

    try:
        yield
    except Terminated:
        raise fail(f"{command} stopped by SIGTERM; the partial output was removed and {output} was not touched", 143) from None
    except (MergeError, FileExistsError) as exc:
        raise fail(str(exc)) from None
    except OSError as exc:
        raise fail(f"cannot write {output}: {exc.strerror or exc}") from None


@contextmanager
def _write_progress(description: str):
    """(log, on_write) for merge and convert: a live bar of bytes written when stderr (where their lines
    go) is a terminal, the plain lines on stderr and no bar otherwise."""
    from finetune import progress

    if not progress.wanted(sys.stderr):
        yield (lambda line: typer.echo(line, err=True)), None
        return
    with progress.WriteDisplay(description) as display:
        yield display.log, display.update

def convert(
    checkpoint: Path = typer.Argument(..., help="checkpoint-N/ (with `latest` and global_stepN/) or a global_stepN/ directory."),
    output: Path = typer.Option(..., "-o", "--output", help="Directory for the adapter (LoRA) or the safetensors weights (full)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="bfloat16, float16 or float32 (default: the dtype the model trained in)."),
    adapter_config: Optional[Path] = typer.Option(None, "--adapter-config", help="adapter_config.json to use (default: the checkpoint's, or the run's adapter/)."),
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
    from finetune.convert import convert as run_convert

    shard_bytes = shard_size_or_exit(max_shard_size)
    with _write_errors("convert", output):
        with _write_progress("converting") as (log, on_write):
            result = run_convert(checkpoint, output, dtype=dtype, overwrite=overwrite, adapter_config=adapter_config,
                                 max_shard_size=shard_bytes, log=log, on_write=on_write)
    what = "LoRA adapter" if result.kind == "lora" else f"full weights, {result.shards} shard{'s' if result.shards > 1 else ''}"
    typer.echo(f"converted {checkpoint} ({what}, {result.dtype.removeprefix('torch.')}) into {output}")

def chat(
    path: Optional[Path] = typer.Argument(None, help="Run directory, or a merged / full model directory."),
    base: Optional[str] = typer.Option(None, "--base", help="Base model directory or hub id (with --adapter; overrides the run's)."),
    adapter: Optional[Path] = typer.Option(None, "--adapter", help="PEFT adapter directory (overrides the run's adapter/)."),
    prompts: Optional[List[str]] = typer.Option(None, "--prompt", help="Answer this and exit (repeatable: one conversation, in order)."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", min=1, help="Longest reply, in tokens."),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0 (default): greedy, the same reply every time; > 0 samples."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for sampling (with --temperature > 0)."),
    fmt: Optional[str] = typer.Option(None, "--format", help="alpaca, messages or text (default: what the run trained on)."),
    device: str = typer.Option("auto", "--device", help="auto (the GPU if there is one), cuda or cpu."),
) -> None:
    """Talk to a trained model, with the prompt format it trained on (chat template or alpaca prompt).

    Loads base + adapter (QLoRA: the base in 4-bit, as it trained) or the merged model, on the GPU if
    there is one. Interactive: /reset starts over, /exit (or Ctrl-D) leaves.

    Example:

    \b
        $ finetune chat runs/demo --prompt "Name a primary colour."
        Red.
        $ finetune chat merged/demo
        loaded runs/demo/... (alpaca format, cpu); /reset starts over, /exit leaves
        you> Name a primary colour.
        Red.
    """
    from finetune.chat import ChatError, Conversation, answer, load_chat_model, resolve_source

    if path is None and base is None:
        raise fail("give a run directory, a model directory, or --base (and --adapter)", 2)
    try:
        source = resolve_source(path, base, adapter, fmt)
        model = load_chat_model(source, device)
    except ChatError as exc:
        raise fail(str(exc)) from None
    conversation = Conversation(model.tokenizer, model.fmt)

    def say(user: str) -> None:
        try:
            reply = answer(model, conversation, user, max_new_tokens=max_new_tokens, temperature=temperature,
                           seed=seed, on_text=lambda text: typer.echo(text, nl=False))
        except ChatError as exc:
            raise fail(str(exc)) from None
        typer.echo("")
        if reply.dropped_turns:
            typer.echo(f"(the {reply.dropped_turns} oldest turn(s) no longer fit the model's context and were left out)", err=True)

    if prompts:
        for prompt in prompts:
            say(prompt)
        return
    typer.echo(f"loaded {model.label} ({model.fmt} format, {model.device}); /reset starts over, /exit leaves", err=True)
    while True:
        try:
            user = input("you> ")
        except EOFError:
            typer.echo("")
            return
        command = user.strip()
        if command in ("/exit", "/quit"):
            return
        if command == "/reset":
            conversation.reset()
            typer.echo("(conversation cleared)", err=True)
            continue
        if command:
            say(user)


def eval_command(
    run_dir: Path = typer.Argument(..., help="Run directory."),
    data: Optional[Path] = typer.Option(None, "--data", help="Score this file instead of the validation split (read as the run's source with the same path, else as its only source)."),
    fmt: Optional[str] = typer.Option(None, "--format", help="The --data file's format (alpaca, text, messages, sharegpt), when the run mixes formats."),
    device: str = typer.Option("auto", "--device", help="auto (the GPU if there is one), cuda or cpu."),
    batch_size: int = typer.Option(8, "--batch-size", min=1, help="Sequences per forward pass."),
) -> None:
    """Loss and perplexity of the base model and the fine-tuned one, on the same tokens (written to RUN/eval.json).

    The data is the run's validation split, or --data FILE (with --format when the run mixes sources
    read in different formats and FILE is none of them); sequences are tokenized and masked as in
    training, so only the response tokens are scored when the run masked its prompts.

    Example:

    \b
        $ finetune eval runs/demo
        data: the training data (.../demo_instructions.jsonl), 307 sequences, 2861 scored tokens (not held out: ...)
        model             loss    perplexity
        base            7.0830       1191.62
        fine-tuned      1.9520          7.04
    """
    from finetune.data.formats import FORMATS
    from finetune.evaluate import EVAL_FILE, EvalError, evaluate

    if fmt is not None and fmt not in FORMATS:
        raise fail(f"--format {fmt}: unknown format (known: {', '.join(FORMATS)})", 2)
    try:
        result = evaluate(run_dir, data=data, device=device, batch_size=batch_size,
                          log=lambda line: typer.echo(line, err=True), fmt=fmt)
    except EvalError as exc:
        raise fail(str(exc)) from None
    typer.echo(result.table(), nl=False)
    typer.echo(f"wrote {run_dir / EVAL_FILE}", err=True)
