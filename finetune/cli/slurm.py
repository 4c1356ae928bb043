"""`finetune slurm`: an sbatch script that runs `finetune train` on a Slurm cluster."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from finetune.cli.common import SET_HELP, fail, load_or_exit, usable_path


def slurm(
    recipe: Path = typer.Argument(..., metavar="RECIPE", help="Recipe file."),
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
    from finetune.render import resolved_output_dir
    from finetune.run.slurm import SlurmJob, gpus_per_node, plain_job_name, sbatch_script

    usable_path("--output-dir", output_dir)
    usable_path("-o", output)
    loaded = load_or_exit(recipe, overrides)
    r = loaded.recipe
    job = SlurmJob(
        recipe_path=recipe.expanduser().absolute(),
        run_dir=(output_dir or Path(resolved_output_dir(r))).expanduser().absolute(),
        workdir=Path.cwd(), python=sys.executable, nodes=nodes or r.launch.nodes,
        gpus_per_node=gpus_per_node(r, gpus), job_name=job_name or plain_job_name(r.name or recipe.stem),
        master_port=r.launch.master_port, signal_seconds=signal_seconds or r.launch.stop_timeout,
        overrides=tuple(overrides or ()), time=time_limit, partition=partition, account=account, cpus_per_task=cpus)
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
