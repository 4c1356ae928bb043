"""The `finetune` command line. Wiring only: each command parses, calls a module, prints.

Heavy libraries (torch, deepspeed, transformers) are imported inside the commands that need them,
so `finetune --help`, `lint`, `render`, `schema` and `plan` start in a fraction of a second.
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import List, Optional

import typer

app = typer.Typer(
    name="finetune",
    help="Fine-tune open LLMs from one YAML recipe: lint, plan, render, train, convert, merge, chat, eval.",
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
    """Fine-tune open LLMs from one YAML recipe: lint, plan, render, train, convert, merge, chat, eval."""


SET_HELP = "Override a recipe key, e.g. --set deepspeed.stage=3 (repeatable; the value is read as YAML)."


def fail(message: str, code: int = 1) -> "typer.Exit":
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def _exists(path: Path, test=Path.exists) -> bool:
    """pathlib's exists()/is_file() raise on a name too long to stat; such a path is no file."""
    try:
        return test(path)
    except (OSError, ValueError):
        return False


def usable_path(option: str, path: Optional[Path]) -> None:
    """Exit 2 on a path no file system can hold (a component over 255 bytes), before anything stats it."""
    from finetune.recipe import plain_path

    if path is not None:
        try:
            plain_path(str(path))
        except ValueError as exc:
            raise fail(f"{option}: {exc}", 2) from None


def load_or_exit(recipe: Path, overrides: Optional[List[str]]):
    """Load a recipe or print every problem (file:line:col) and exit 1."""
    from finetune.recipe import RecipeProblem, load_recipe

    try:
        return load_recipe(recipe, overrides or [])
    except RecipeProblem as exc:
        for problem in exc.problems:
            typer.echo(problem.render(), err=True)
        raise typer.Exit(1) from None


@app.command()
def lint(
    paths: List[Path] = typer.Argument(..., help="Recipes (.yaml), DeepSpeed configs (.json) or directories (searched recursively)."),
    fmt: str = typer.Option("text", "--format", help="text, json or github (GitHub Actions annotations)."),
    strict: bool = typer.Option(False, "--strict", help="Fail on warnings too."),
    world_size: Optional[int] = typer.Option(None, "--world-size", min=1, help="World size for DeepSpeed JSON batch-size checks."),
    recipe: Optional[Path] = typer.Option(None, "--recipe", help="Check DeepSpeed JSON files against this recipe's TrainingArguments."),
    gpus: Optional[int] = typer.Option(None, "--gpus", min=1, help="GPUs per node to check memory against (runs the planner)."),
    gpu_memory: Optional[str] = typer.Option(None, "--gpu-memory", help="Memory per GPU, e.g. 24GiB (runs the planner)."),
    overrides: Optional[List[str]] = typer.Option(None, "--set", help=SET_HELP),
    hf: bool = typer.Option(True, "--hf/--no-hf", help="DeepSpeed JSON is used through the HF Trainer (default; "
                            "\"auto\" values are filled in), or with plain deepspeed.initialize (--no-hf)."),
) -> None:
    """Check recipes and DeepSpeed JSON before anyone rents a GPU. Exit 0 clean, 1 on errors, 2 on usage errors.

    Example:

    \b
        $ finetune lint recipes ds_configs
        recipes/bad.yaml:7:3: error R002 `lora.rr`: unknown key (did you mean `r`?)
        1 file with problems: 1 error, 0 warnings
    """
    from finetune.lint import LintOptions, lint_paths
    from finetune.lint.report import FORMATS, render

    if fmt not in FORMATS:
        raise fail(f"--format must be one of {', '.join(FORMATS)}", 2)
    missing = [str(p) for p in paths if not _exists(p)]
    if missing:
        raise fail(f"no such file or directory: {', '.join(missing)}", 2)
    if recipe is not None and not _exists(recipe, Path.is_file):
        raise fail(f"--recipe {recipe}: no such file", 2)
    if recipe is not None and not hf:
        raise fail("--recipe and --no-hf do not go together: a recipe trains through the HF Trainer", 2)
    options = LintOptions(world_size=world_size, recipe=recipe, gpus=gpus, gpu_memory=gpu_memory,
                          overrides=overrides or [], hf=hf)
    try:
        options.validate()
    except ValueError as exc:
        raise fail(str(exc), 2) from None
    result = lint_paths(paths, options)
    typer.echo(render(result, fmt), nl=False)
    raise typer.Exit(result.exit_code(strict))


@app.command()
def render(
    recipe: Path = typer.Argument(..., help="Recipe file."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Directory to write deepspeed.json and training_args.json into (default: print)."),
    world_size: Optional[int] = typer.Option(None, "--world-size", min=1, help="Fix the world size (otherwise the recipe's, or auto)."),
    overrides: Optional[List[str]] = typer.Option(None, "--set", help=SET_HELP),
) -> None:
    """Write the DeepSpeed JSON and TrainingArguments a recipe implies (stable key order).

    Example:

    \b
        $ finetune render recipes/llama3/8b_qlora_2x12gb.yaml -o rendered/
        wrote rendered/deepspeed.json
        wrote rendered/training_args.json
    """
    from finetune.dsconfig import dumps, render_deepspeed, render_training_args
    from finetune.fsutil import write_atomic

    loaded = load_or_exit(recipe, overrides)
    ds = render_deepspeed(loaded.recipe, world_size)
    args = render_training_args(loaded.recipe)
    if output is None:
        typer.echo("# deepspeed.json")
        typer.echo(dumps(ds), nl=False)
        typer.echo("# training_args.json")
        typer.echo(dumps(args), nl=False)
        return
    try:
        output.mkdir(parents=True, exist_ok=True)
        for name, data in (("deepspeed.json", ds), ("training_args.json", args)):
            write_atomic(output / name, dumps(data))
            typer.echo(f"wrote {output / name}")
    except OSError as exc:
        raise fail(f"cannot write to {output}: {exc.strerror or exc}") from None


@app.command()
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


@app.command()
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
    from finetune.recipe import parse_size

    if run_dir is None and (base is None or adapter is None):
        raise fail("give a run directory, or both --base and --adapter", 2)
    try:
        shard_bytes = parse_size(max_shard_size)
    except ValueError as exc:
        raise fail(f"--max-shard-size: {exc}", 2) from None
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


@app.command()
def train(
    recipe: Path = typer.Argument(..., help="Recipe file."),
    overrides: Optional[List[str]] = typer.Option(None, "--set", help=SET_HELP),
    output_dir: Optional[Path] = typer.Option(None, "--output-dir", help="Run directory (default: the recipe's output_dir)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Run the preflight, print the command and the DeepSpeed config; write and start nothing."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a previous run directory at the same place."),
    resume: Optional[bool] = typer.Option(None, "--resume/--no-resume", help="Continue from the newest complete checkpoint in the run directory (default: training.resume, true)."),
    force_resume: bool = typer.Option(False, "--force-resume", help="Resume even though the recipe changed in a way that breaks resumption (or the run had finished)."),
    nnodes: Optional[int] = typer.Option(None, "--nnodes", min=1, help="Machines in the run (launch.nodes); run this command on each one."),
    node_rank: Optional[int] = typer.Option(None, "--node-rank", min=0, help="This machine's index, 0 to nnodes-1 (launch.node_rank)."),
    master_addr: Optional[str] = typer.Option(None, "--master-addr", help="Address of node 0, reachable from every node (launch.master_addr)."),
    master_port: Optional[int] = typer.Option(None, "--master-port", min=1, max=65535, help="Rendezvous port on node 0 (launch.master_port)."),
) -> None:
    """Check everything (lint, environment, dataset, model, output directory), then train on every GPU here.

    Nothing is started or written when a check fails. Rank 0 prints to the console; every rank's
    output is in RUN/logs/rank<K>/. Ctrl-C or SIGTERM: every rank saves a checkpoint at the end of
    its step and the command exits 75 (run it again to resume); a second signal stops at once.
    A run directory with a complete checkpoint is resumed (same step, LR schedule, RNG, data order);
    it is refused when the recipe changed in a way that breaks resuming (--force-resume).

    Exit codes: 0 finished, 1 failed, 2 usage, 75 stopped by a signal with a checkpoint saved.

    Several machines (torchrun rendezvous; the same command on each, with its --node-rank):

    \b
        node0$ finetune train r.yaml --nnodes 2 --node-rank 0 --master-addr 10.0.0.1
        node1$ finetune train r.yaml --nnodes 2 --node-rank 1 --master-addr 10.0.0.1

    Example:

    \b
        $ finetune train recipes/demo.yaml --output-dir runs/demo
        note: dataset data/demo.jsonl: alpaca format, first 20 row(s) look right
        launching 2 process(es): python -m torch.distributed.run --nnodes 1 --nproc-per-node 2 ...
        ...
        finished: runs/demo (adapter in runs/demo/adapter)
    """
    from finetune.checkpoint import EXIT_PREEMPTED
    from finetune.launch import LaunchError, commands_per_node, tail_of
    from finetune.train_run import prepare, start_run

    usable_path("--output-dir", output_dir)
    launch_flags = {"nodes": nnodes, "node_rank": node_rank, "master_addr": master_addr, "master_port": master_port}
    overrides = list(overrides or []) + [f"launch.{key}={json.dumps(value)}" for key, value in launch_flags.items() if value is not None]
    loaded = load_or_exit(recipe, overrides)
    prepared = prepare(loaded, output_dir, overwrite, resume=resume, force_resume=force_resume, dry_run=dry_run)
    report = prepared.preflight
    if report.lint_report:
        typer.echo(report.lint_report, err=True, nl=False)
    for note in report.notes + (prepared.plan.notes if prepared.plan else []):
        typer.echo(f"note: {note}", err=True)
    for warning in report.warnings:
        typer.echo(f"warning: {warning}", err=True)
    # A dry run writes nothing, so a refused output directory does not stop it from showing the launch.
    show_anyway = dry_run and prepared.plan is not None and not report.errors and not report.lint_errors
    if not report.ok:
        prepared.release()
        for error in report.errors + ([] if show_anyway else report.run_dir_errors):
            typer.echo(f"error: {error}", err=True)
        if not show_anyway:
            count = len(report.errors) + len(report.lint_errors) + len(report.run_dir_errors)
            raise fail(f"preflight failed ({count} problem{'s' if count != 1 else ''}); nothing was started or written")
    plan = prepared.plan
    if dry_run:
        from finetune.dsconfig import dumps, render_deepspeed

        typer.echo(f"# command ({plan.world_size} process{'es' if plan.world_size != 1 else ''}, run directory {prepared.run_dir})")
        commands = commands_per_node(plan)
        for label, line in commands:
            if len(commands) > 1:
                typer.echo(f"# {label}")
            typer.echo(line)
        typer.echo(f"# a real run would {_what_a_run_would_do(prepared)}")
        typer.echo("# deepspeed.json")
        typer.echo(dumps(render_deepspeed(loaded.recipe, plan.world_size)), nl=False)
        if report.run_dir_errors:
            raise fail(f"a real run would stop here: {report.run_dir_errors[0]}")
        return
    typer.echo(f"launching {plan.world_size} process{'es' if plan.world_size != 1 else ''} ({plan.device}): {plan.display()}", err=True)
    try:
        outcome = _run_with_display(prepared, start_run)
    except (LaunchError, FileExistsError) as exc:
        raise fail(str(exc)) from None
    except OSError as exc:
        raise fail(f"cannot write the run directory {prepared.run_dir}: {exc.strerror or exc}") from None
    if outcome.ok:
        saved = [name for name in ("adapter", "model") if (prepared.run_dir / name).is_dir()]
        where = f" ({' and '.join(saved)} in {', '.join(str(prepared.run_dir / s) for s in saved)})" if saved else ""
        typer.echo(f"finished: {prepared.run_dir}{where}", err=True)
        for line in next_steps_lines(prepared.run_dir, saved):
            typer.echo(line, err=True)
        return
    if outcome.returncode == EXIT_PREEMPTED:
        try:
            typer.echo(f"stopped: {outcome.message} (run directory: {prepared.run_dir})", err=True)
        except OSError:
            pass  # SIGHUP: the terminal is gone; the exit code still says a checkpoint was saved
        raise typer.Exit(EXIT_PREEMPTED)
    if outcome.signal is not None:
        raise fail(f"{outcome.message}; the run directory {prepared.run_dir} holds what was saved", outcome.returncode)
    for log in outcome.logs:
        if outcome.failures and outcome.failures[0].local_rank == 0 and plan.launcher == "torchrun":
            break  # local rank 0's output is already on the console
        typer.echo(f"--- last lines of {log} ---", err=True)
        typer.echo(tail_of(log), err=True)
    raise fail(f"training failed: {outcome.message} (run directory: {prepared.run_dir})", outcome.returncode)


def _what_a_run_would_do(prepared) -> str:
    """One line for --dry-run: resume, start fresh, join, replace, or refuse (and why)."""
    report = prepared.preflight
    if report.run_dir_errors:
        return f"refuse: {report.run_dir_errors[0]}"
    if prepared.resume_from is not None:
        return f"resume from {prepared.resume_from.name} (step {prepared.resume_from.step}) in {prepared.run_dir}"
    if report.join:
        return f"join the run directory {prepared.run_dir} written by another node of this run"
    if prepared.overwrite and prepared.run_dir.exists() and any(prepared.run_dir.iterdir()):
        return f"replace the previous run in {prepared.run_dir} and start fresh (--overwrite)"
    return f"start fresh in {prepared.run_dir}"


@app.command()
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


@app.command("eval")
def eval_command(
    run_dir: Path = typer.Argument(..., help="Run directory."),
    data: Optional[Path] = typer.Option(None, "--data", help="Score this file (the run's data format) instead of the validation split."),
    device: str = typer.Option("auto", "--device", help="auto (the GPU if there is one), cuda or cpu."),
    batch_size: int = typer.Option(8, "--batch-size", min=1, help="Sequences per forward pass."),
) -> None:
    """Loss and perplexity of the base model and the fine-tuned one, on the same tokens (written to RUN/eval.json).

    The data is the run's validation split, or --data FILE; sequences are tokenized and masked as in
    training, so only the response tokens are scored when the run masked its prompts.

    Example:

    \b
        $ finetune eval runs/demo
        data: the training data (.../demo_instructions.jsonl), 307 sequences, 2861 scored tokens (not held out: ...)
        model             loss    perplexity
        base            7.0830       1191.62
        fine-tuned      1.9520          7.04
    """
    from finetune.evaluate import EVAL_FILE, EvalError, evaluate

    try:
        result = evaluate(run_dir, data=data, device=device, batch_size=batch_size,
                          log=lambda line: typer.echo(line, err=True))
    except EvalError as exc:
        raise fail(str(exc)) from None
    typer.echo(result.table(), nl=False)
    typer.echo(f"wrote {run_dir / EVAL_FILE}", err=True)


def _run_with_display(prepared, start_run):
    """start_run, under a live progress bar when stdout is a terminal (plain relayed lines otherwise)."""
    import os

    from finetune import progress

    if not progress.wanted():
        return start_run(prepared)
    os.environ.setdefault(progress.PROGRESS_ENV, progress.LIVE_INTERVAL)  # the ranks inherit it
    with progress.TrainingDisplay() as display:
        return start_run(prepared, console=display)


def next_steps_lines(run_dir: Path, saved: List[str]) -> List[str]:
    """What to do after a finished run, with the commands for this run directory."""
    steps = []
    if (run_dir / "report.html").is_file():
        steps.append((f"open {run_dir / 'report.html'}", "loss plot, memory, config, versions"))
    if saved:
        steps.append((f"finetune chat {run_dir}", "talk to it (--prompt TEXT for one answer)"))
        steps.append((f"finetune eval {run_dir}", "loss and perplexity, base vs fine-tuned"))
    if "adapter" in saved:
        steps.append((f"finetune merge {run_dir} -o merged/{run_dir.name}", "one model to serve (CPU, streaming)"))
    if (run_dir / "tensorboard").is_dir():
        steps.append((f"tensorboard --logdir {run_dir / 'tensorboard'}", "the curves, live"))
    if not steps:
        return []
    width = max(len(command) for command, _ in steps)
    return ["next:"] + [f"  {command.ljust(width)}  # {why}" for command, why in steps]


@app.command()
def doctor(
    fmt: str = typer.Option("text", "--format", help="text or json."),
    recipe: Optional[Path] = typer.Option(None, "--recipe", help="Also run the checks this recipe needs (what `finetune train` checks)."),
) -> None:
    """Python, torch, CUDA, GPUs, NCCL and library versions, checked against known-bad combinations. Exit 1 if a check fails.

    Example:

    \b
        $ finetune doctor
        torch         2.5.1+cu124 (CUDA 12.4, NCCL 2.21.5; GPU available: yes)
        GPU 0         NVIDIA GeForce RTX 4070, 12.0 GiB, sm_89, bf16
        ...
        fail  qlora-zero3.bitsandbytes: bitsandbytes 0.43.1 is too old for QLoRA + ZeRO-3: needs >=0.43.3
              fix: pip install -U 'bitsandbytes>=0.43.3'
    """
    from finetune.doctor import failed, render_text, report, run_doctor

    if fmt not in ("text", "json"):
        raise fail("--format must be text or json", 2)
    loaded = load_or_exit(recipe, None) if recipe is not None else None
    facts, checks = run_doctor(recipe=loaded.recipe if loaded else None)
    if fmt == "json":
        typer.echo(json.dumps(report(facts, checks), indent=2))
    else:
        typer.echo(render_text(facts, checks), nl=False)
    raise typer.Exit(1 if failed(checks) else 0)


@app.command()
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
    from finetune.recipe import parse_size

    try:
        shard_bytes = parse_size(max_shard_size)
    except ValueError as exc:
        raise fail(f"--max-shard-size: {exc}", 2) from None
    with _write_errors("convert", output):
        with _write_progress("converting") as (log, on_write):
            result = run_convert(checkpoint, output, dtype=dtype, overwrite=overwrite, adapter_config=adapter_config,
                                 max_shard_size=shard_bytes, log=log, on_write=on_write)
    what = "LoRA adapter" if result.kind == "lora" else f"full weights, {result.shards} shard{'s' if result.shards > 1 else ''}"
    typer.echo(f"converted {checkpoint} ({what}, {result.dtype.removeprefix('torch.')}) into {output}")


@app.command()
def plan(
    recipe: Optional[Path] = typer.Argument(None, help="Recipe file (omit it and pass --model for a quick what-if)."),
    gpus: Optional[int] = typer.Option(None, "--gpus", min=1, help="GPUs per node (default: the recipe's launch/hardware, else 1)."),
    nodes: Optional[int] = typer.Option(None, "--nodes", min=1, help="Machines (default: launch.nodes)."),
    gpu_memory: Optional[str] = typer.Option(None, "--gpu-memory", help="Memory per GPU, e.g. 24GiB (default: hardware.gpu_memory)."),
    cpu_memory: Optional[str] = typer.Option(None, "--cpu-memory", help="RAM per node, e.g. 256GiB (default: hardware.cpu_memory)."),
    fmt: str = typer.Option("text", "--format", help="text or json."),
    recommend: bool = typer.Option(False, "--recommend", help="Try ZeRO stages x offload x micro batch; print the fastest setup that fits."),
    model: Optional[str] = typer.Option(None, "--model", help="config.json (or its directory), an architecture (llama-3-8b, qwen2.5-7b, ...) or a parameter count (7.5B: model states only)."),
    method: Optional[str] = typer.Option(None, "--method", help="full, lora or qlora."),
    zero: Optional[str] = typer.Option(None, "--zero", help="ZeRO stage 0-3, or none for plain PyTorch without DeepSpeed."),
    offload_optimizer: Optional[str] = typer.Option(None, "--offload-optimizer", help="none, cpu or nvme."),
    offload_param: Optional[str] = typer.Option(None, "--offload-param", help="none, cpu or nvme (ZeRO-3)."),
    micro_batch: Optional[int] = typer.Option(None, "--micro-batch", min=1, help="Sequences per GPU per forward."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", min=8, help="Tokens per sequence (data.max_length)."),
    gradient_checkpointing: Optional[bool] = typer.Option(None, "--gradient-checkpointing/--no-gradient-checkpointing", help="Recompute activations in backward."),
    lora_r: Optional[int] = typer.Option(None, "--lora-r", min=1, help="LoRA rank."),
    lora_targets: Optional[str] = typer.Option(None, "--lora-targets", help="all-linear or a comma list: q_proj,v_proj."),
    attn: Optional[str] = typer.Option(None, "--attn", help="eager, sdpa, flash_attention_2 or flash_attention_3."),
    overrides: Optional[List[str]] = typer.Option(None, "--set", help=SET_HELP),
) -> None:
    """Predict per-GPU memory (weights, gradients, optimizer, DeepSpeed buffers, activations, logits, overhead) before renting.

    Pure Python, offline: model shapes come from a local config.json or a built-in table.

    Example:

    \b
        $ finetune plan --model llama-3-8b --method qlora --lora-r 64 --zero 2 --gpus 2 --gpu-memory 12GiB
        $ finetune plan recipes/llama3/8b_qlora_2x12gb.yaml --recommend
    """
    from finetune import plan as planner
    from finetune.recipe import RecipeProblem, parse_size

    if fmt not in ("text", "json"):
        raise fail("--format must be text or json", 2)
    try:
        gpu_bytes = parse_size(gpu_memory) if gpu_memory is not None else None
        cpu_bytes = parse_size(cpu_memory) if cpu_memory is not None else None
    except ValueError as exc:
        raise fail(f"--gpu-memory/--cpu-memory: {exc}", 2) from None
    try:
        sets = (overrides or []) + planner.flag_overrides(
            model=model, method=method, zero=zero, offload_optimizer=offload_optimizer, offload_param=offload_param,
            micro_batch=micro_batch, seq_len=seq_len, gradient_checkpointing=gradient_checkpointing,
            lora_r=lora_r, lora_targets=lora_targets, attn=attn)
        if recipe is not None:
            the_recipe = load_or_exit(recipe, sets).recipe
        else:
            the_recipe = planner.recipe_without_file(sets)
        setup = planner.setup_from_recipe(the_recipe, gpus, gpu_bytes, nodes, cpu_bytes, deepspeed=zero != "none")
        result = planner.plan(setup)
        advice = planner.recommend(setup, the_recipe.training.gradient_accumulation_steps) if recommend else None
    except RecipeProblem as exc:
        for problem in exc.problems:
            typer.echo(problem.render(), err=True)
        raise typer.Exit(1) from None
    except planner.PlanError as exc:
        raise fail(str(exc)) from None
    if fmt == "json":
        data = result.to_json()
        if advice is not None:
            data["recommendation"] = advice.to_json()
        typer.echo(json.dumps(data, indent=2))
        return
    typer.echo(result.render_text(), nl=False)
    if advice is not None:
        typer.echo("")
        typer.echo(advice.render_text(), nl=False)


@app.command()
def slurm(
    recipe: Path = typer.Argument(..., help="Recipe file."),
    overrides: Optional[List[str]] = typer.Option(None, "--set", help=SET_HELP),
    output_dir: Optional[Path] = typer.Option(None, "--output-dir", help="Run directory, on storage every node sees (default: the recipe's output_dir)."),
    nodes: Optional[int] = typer.Option(None, "--nodes", min=1, help="Nodes to allocate (default: launch.nodes)."),
    gpus: Optional[int] = typer.Option(None, "--gpus-per-node", min=1, help="GPUs per node (default: launch.procs_per_node, else hardware.gpus)."),
    time_limit: Optional[str] = typer.Option(None, "--time", help="SLURM time limit, e.g. 24:00:00."),
    partition: Optional[str] = typer.Option(None, "--partition", help="SLURM partition."),
    account: Optional[str] = typer.Option(None, "--account", help="SLURM account."),
    cpus: Optional[int] = typer.Option(None, "--cpus-per-task", min=1, help="CPUs for each node's task (data loading, tokenization)."),
    job_name: Optional[str] = typer.Option(None, "--job-name", help="Job name (default: the recipe's name)."),
    signal_seconds: Optional[int] = typer.Option(None, "--signal-seconds", min=10, help="SIGTERM this many seconds before the time limit, to save a checkpoint (default: launch.stop_timeout)."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Write the script to a file instead of stdout."),
) -> None:
    """Print an sbatch script that trains the recipe on SLURM: srun starts `finetune train` on every node.

    One task per node (torchrun inside starts a process per GPU), node 0 of the allocation as the
    rendezvous address, the environment passed to every node. SIGTERM before the time limit (or on
    preemption): a checkpoint is saved, the job is requeued and resumes. Nothing is submitted.

    Example:

    \b
        $ finetune slurm recipes/llama3/70b_qlora_8xh100.yaml --nodes 2 --time 24:00:00 -o job.sh
        $ sbatch job.sh
    """
    from finetune.dsconfig import resolved_output_dir
    from finetune.slurm import SlurmError, SlurmJob, gpus_per_node, sbatch_script

    usable_path("--output-dir", output_dir)
    usable_path("-o", output)
    loaded = load_or_exit(recipe, overrides)
    r = loaded.recipe
    try:
        job = SlurmJob(
            recipe_path=recipe.expanduser().absolute(),
            run_dir=(output_dir or Path(resolved_output_dir(r))).expanduser().absolute(),
            workdir=Path.cwd(), python=sys.executable, nodes=nodes or r.launch.nodes,
            gpus_per_node=gpus_per_node(r, gpus), job_name=job_name or r.name or recipe.stem,
            master_port=r.launch.master_port, signal_seconds=signal_seconds or r.launch.stop_timeout,
            overrides=tuple(overrides or ()), time=time_limit, partition=partition, account=account, cpus_per_task=cpus)
    except SlurmError as exc:
        raise fail(str(exc), 2) from None
    text = sbatch_script(job)
    if output is None:
        typer.echo(text, nl=False)
        return
    from finetune.fsutil import write_atomic

    try:
        write_atomic(output, text)
        output.chmod(0o755)
    except OSError as exc:
        raise fail(f"cannot write {output}: {exc.strerror or exc}") from None
    typer.echo(f"wrote {output}; submit with: sbatch {output}", err=True)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
