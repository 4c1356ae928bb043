"""`finetune train`: preflight, launch on every GPU, supervise, and say what to do next."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import List, Optional

import typer

from finetune.cli.common import SET_HELP, fail, load_or_exit, usable_path
from finetune.rundir.run_dir import RunDir


def train(
    recipe: Path = typer.Argument(..., metavar="RECIPE", help="Recipe file."),
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
    A rank out of GPU memory where `auto` chose for speed: the run trains again once with the
    memory-safe values, and says which (one machine; several get the flags to pass).

    Exit codes: 0 finished, 1 failed, 2 usage, 75 stopped by a signal with a checkpoint saved.

    Several machines (torchrun rendezvous; the same command on each, with its --node-rank):

    \b
        node0$ finetune train r.yaml --nnodes 2 --node-rank 0 --master-addr 10.0.0.1
        node1$ finetune train r.yaml --nnodes 2 --node-rank 1 --master-addr 10.0.0.1

    Example:

    \b
        $ finetune train recipes/demo.yaml
        note: no GPU: 2 CPU processes on DeepSpeed's CPU accelerator (slow; meant for tests)
        note: dataset ./recipes/data/demo_instructions.jsonl: 307 alpaca row(s), all look right
        ...
        launching 2 processes (cpu): DS_ACCELERATOR=cpu … -m torch.distributed.run --nnodes 1 --nproc-per-node 2 …
        ...
        [finetune] done: 117 steps, loss 7.148 -> 2.319, 1635 tokens/s; adapter/ in …/runs/demo
        [finetune] speed: steady 1,678 tokens/s over steps 6-117, step p50 0.128 s / p90 0.148 s; start-up 8.7 s (…)
        finished: …/runs/demo (adapter in …/runs/demo/adapter)
    """
    from finetune.rundir.checkpoint import EXIT_PREEMPTED
    from finetune.run.launch.commands import commands_per_node
    from finetune.run.launch.outcome import memory_safe_rerun, out_of_memory_advice, rerun_notes, tail_of
    from finetune.run.start import prepare, start_run

    usable_path("--output-dir", output_dir)
    launch_flags = {"nodes": nnodes, "node_rank": node_rank, "master_addr": master_addr, "master_port": master_port}
    overrides = list(overrides or []) + [f"launch.{key}={json.dumps(value)}" for key, value in launch_flags.items() if value is not None]
    loaded = load_or_exit(recipe, overrides)
    prepared = prepare(loaded, output_dir, overwrite, resume=resume, force_resume=force_resume, dry_run=dry_run)
    _say_preflight(prepared, dry_run)
    plan = prepared.plan
    if dry_run:
        from finetune.render import dumps, render_deepspeed

        typer.echo(f"# command ({plan.world_size} process{'es' if plan.world_size != 1 else ''}, run directory {prepared.run_dir})")
        commands = commands_per_node(plan)
        for label, line in commands:
            if len(commands) > 1:
                typer.echo(f"# {label}")
            typer.echo(line)
        typer.echo(f"# a real run would {_what_a_run_would_do(prepared)}")
        typer.echo("# deepspeed.json")
        typer.echo(dumps(render_deepspeed(loaded.recipe, plan.world_size)), nl=False)
        if prepared.preflight.run_dir_errors:
            raise fail(f"a real run would stop here: {prepared.preflight.run_dir_errors[0]}")
        return
    outcome = _launch(prepared, start_run)
    # `auto` bet on the plan's bound and a rank ran out of GPU memory: the same run once more with the memory-safe
    # values, on this node alone (the nodes of a multi-node run would each have to decide the same at once).
    rerun = memory_safe_rerun(outcome, prepared.run_dir, prepared.auto) if plan.nodes == 1 else None
    if rerun is not None:
        for line in rerun_notes(rerun, prepared.run_dir):
            typer.echo(f"note: {line}", err=True)
        loaded = load_or_exit(recipe, overrides + rerun.sets)
        with _first_attempt_logs(prepared.run_dir, keep=rerun.overwrite):
            prepared = prepare(loaded, prepared.run_dir, rerun.overwrite, resume=True,
                               force_resume=rerun.force_resume or force_resume)
            _say_preflight(prepared, False)
            plan = prepared.plan
            outcome = _launch(prepared, start_run)
    if outcome.ok:
        run = RunDir(prepared.run_dir)
        saved = [folder.name for folder in (run.adapter_path, run.model_path) if folder.is_dir()]
        where = f" ({' and '.join(saved)} in {', '.join(str(prepared.run_dir / s) for s in saved)})" if saved else ""
        try:
            if outcome.signal is not None:  # a stop request after the last step: nothing left to stop
                typer.echo(f"note: {outcome.message}", err=True)
            typer.echo(f"finished: {prepared.run_dir}{where}", err=True)
            for line in next_steps_lines(prepared.run_dir, saved, prepared.loaded.recipe.objective):
                typer.echo(line, err=True)
        except OSError:
            pass  # SIGHUP: the terminal is gone; exit 0 still says the run finished
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
    for line in out_of_memory_advice(outcome, prepared.run_dir, prepared.auto):
        typer.echo(f"note: {line}", err=True)
    raise fail(f"training failed: {outcome.message} (run directory: {prepared.run_dir})", outcome.returncode)


def _say_preflight(prepared, dry_run: bool) -> None:
    """The preflight's lint report, notes and warnings; its errors end the command (a dry run still shows the launch
    when only the run directory is refused)."""
    from finetune.run.deepspeed_ops import COMPILE_NOTE

    report = prepared.preflight
    if report.lint_report:
        typer.echo(report.lint_report, err=True, nl=False)
    launching = report.ok and not dry_run  # nothing compiles otherwise: no note that it will (issue 24)
    for note in report.notes + (prepared.plan.notes if prepared.plan else []):
        if launching or not note.startswith(COMPILE_NOTE):
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
            count = report.problem_count
            raise fail(f"preflight failed ({count} problem{'s' if count != 1 else ''}); nothing was started or written")


def _launch(prepared, start_run):
    """Start the run and wait for it: its Outcome (a run directory that cannot be written ends the command)."""
    plan = prepared.plan
    typer.echo(f"launching {plan.world_size} process{'es' if plan.world_size != 1 else ''} ({plan.device}): {plan.display()}", err=True)
    try:
        return _run_with_display(prepared, start_run)
    except FileExistsError as exc:
        raise fail(str(exc)) from None
    except OSError as exc:
        from finetune.rundir.checkpoint import disk_error_message

        raise fail(disk_error_message(exc, prepared.run_dir)
                   or f"cannot write the run directory {prepared.run_dir}: {exc.strerror or exc}") from None


@contextmanager
def _first_attempt_logs(run_dir: Path, keep: bool):
    """`keep` (a rerun that replaces the run directory): the failed attempt's logs end in RUN/logs/first-attempt/ of
    the directory that replaced it, whatever that run comes to."""
    import os
    import shutil
    import tempfile

    from finetune.rundir.names import FIRST_ATTEMPT_LOGS, LOGS_DIR

    logs = Path(run_dir) / LOGS_DIR
    if not keep or not logs.is_dir():
        yield
        return
    before = os.stat(run_dir).st_ino
    with tempfile.TemporaryDirectory(prefix="finetune-first-attempt-") as held:
        shutil.copytree(logs, Path(held) / LOGS_DIR, symlinks=True)
        try:
            yield
        finally:
            replaced = run_dir.is_dir() and os.stat(run_dir).st_ino != before  # not where the rerun never started
            if replaced and logs.is_dir():
                shutil.copytree(Path(held) / LOGS_DIR, logs / FIRST_ATTEMPT_LOGS, symlinks=True, dirs_exist_ok=True)


def _what_a_run_would_do(prepared) -> str:
    """One line for --dry-run: resume, start fresh, join, replace, or refuse (and why)."""
    report = prepared.preflight
    if report.run_dir_errors:
        return f"refuse: {report.run_dir_errors[0]}"
    if prepared.resume_from is not None:
        return f"resume from {prepared.resume_from.name} (step {prepared.resume_from.step}) in {prepared.run_dir}"
    if report.join:
        return f"join the run directory {prepared.run_dir} written by another node of this run"
    from finetune.run.preflight import run_dir_entries

    if prepared.overwrite and run_dir_entries(prepared.run_dir):
        return f"replace the previous run in {prepared.run_dir} and start fresh (--overwrite)"
    return f"start fresh in {prepared.run_dir}"


def _run_with_display(prepared, start_run):
    """start_run, under a live progress bar when stdout is a terminal (plain relayed lines otherwise)."""
    import os

    from finetune.progress_env import PROGRESS_ENV
    from finetune.run import progress
    if not progress.wanted():
        return start_run(prepared)
    os.environ.setdefault(PROGRESS_ENV, progress.LIVE_INTERVAL)  # the ranks inherit it
    with progress.TrainingDisplay() as display:
        return start_run(prepared, console=display)


def next_steps_lines(run_dir: Path, saved: List[str], objective: str = "sft") -> List[str]:
    """The `next:` lines after a finished run (finetune.serve.next_steps decides them, for report.html too)."""
    from finetune.serve import lines, next_steps

    return lines(next_steps(run_dir, objective, saved=saved))
