"""`finetune slurm RECIPE`: an sbatch script that runs the recipe on SLURM nodes.

    finetune slurm recipes/llama3/70b_qlora_8xh100.yaml --nodes 4 --time 24:00:00 > job.sh
    sbatch job.sh

The script asks for one task per node; srun starts `finetune train` on every node with that
node's --node-rank (SLURM_NODEID, read by the task's own shell) and node 0 of the allocation as
the rendezvous address (`scontrol show hostnames`); each `finetune train` runs its preflight and
starts torchrun for the GPUs of its node. srun passes the batch environment to every task
(--export=ALL), so HF_HOME, HF_TOKEN, NCCL_* set before sbatch reach all nodes.

Stopping: `--signal=TERM@S` makes SLURM send SIGTERM to every task S seconds before the time
limit (preemption sends it too); each node saves its part of a checkpoint at the next step end
and exits 75, and the script requeues the job, which resumes from that checkpoint. With
`--requeue`, a preempted job is put back in the queue by SLURM itself. Give the ranks the time
(launch.stop_timeout, and the cluster's GraceTime for preemption) to write a checkpoint.
`--kill-on-bad-exit=1`: when one node fails, the others are stopped rather than left hanging in a
collective until the NCCL timeout.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from finetune.errors import FinetuneError
from finetune.recipe import Recipe

# SLURM's own variables, expanded where noted; nothing else in the script depends on the machine.
NODE_RANK = "$SLURM_NODEID"  # expanded by each task's shell (one task per node: 0 .. nodes-1)


class SlurmError(FinetuneError):
    """Options that cannot make a job script (a usage error)."""

    exit_code = 2


@dataclass
class SlurmJob:
    recipe_path: Path  # absolute
    run_dir: Path  # absolute
    workdir: Path  # absolute; relative paths in --set values are read from here
    python: str  # interpreter with finetune installed, the same path on every node
    nodes: int
    gpus_per_node: int
    job_name: str
    master_port: int
    signal_seconds: int
    overrides: tuple[str, ...] = ()
    time: Optional[str] = None
    partition: Optional[str] = None
    account: Optional[str] = None
    cpus_per_task: Optional[int] = None


def gpus_per_node(recipe: Recipe, given: Optional[int]) -> int:
    if given is not None:
        return given
    if isinstance(recipe.launch.procs_per_node, int):
        return recipe.launch.procs_per_node
    if recipe.hardware is not None:
        return recipe.hardware.gpus
    raise SlurmError("cannot tell how many GPUs each node has (launch.procs_per_node is auto and there is no "
                     "hardware.gpus): pass --gpus-per-node")


def sbatch_script(job: SlurmJob) -> str:
    directives = [
        f"--job-name={job.job_name}",
        f"--nodes={job.nodes}",
        "--ntasks-per-node=1",  # one `finetune train` per node; torchrun starts a process per GPU
        f"--gpus-per-node={job.gpus_per_node}",
    ]
    if job.cpus_per_task is not None:
        directives.append(f"--cpus-per-task={job.cpus_per_task}")
    if job.time:
        directives.append(f"--time={job.time}")
    if job.partition:
        directives.append(f"--partition={job.partition}")
    if job.account:
        directives.append(f"--account={job.account}")
    directives += [
        "--output=slurm-%x-%j.out",
        "--open-mode=append",  # a requeued job adds to the same log
        f"--signal=TERM@{job.signal_seconds}",
        "--requeue",
    ]
    train = [job.python, "-m", "finetune.cli", "train", str(job.recipe_path), "--output-dir", str(job.run_dir),
             "--nnodes", str(job.nodes)]
    for item in job.overrides:
        train += ["--set", item]
    # bash -c 'exec "$0" "$@" --node-rank "$SLURM_NODEID"' ARGS: the batch shell expands
    # $MASTER_ADDR/$MASTER_PORT once; SLURM_NODEID is expanded on each node by its task's shell.
    task = ("bash -c 'exec \"$0\" \"$@\" --node-rank \"" + NODE_RANK + "\"' "
            + " ".join(shlex.quote(a) for a in train) + ' --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"')
    lines = [
        "#!/bin/bash",
        f"# Written by `finetune slurm {job.recipe_path.name}`. Submit with: sbatch THIS_FILE",
        f"# {job.nodes} node(s) x {job.gpus_per_node} GPU(s); run directory {job.run_dir}",
        "# Exit 75: stopped by SIGTERM (time limit, preemption) with a checkpoint saved; the job is requeued",
        "# and `finetune train` resumes from that checkpoint.",
        *(f"#SBATCH {d}" for d in directives),
        "",
        "set -u",
        f"cd {shlex.quote(str(job.workdir))}",
        "# Node 0 of the allocation hosts the rendezvous (torchrun's static store).",
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"MASTER_PORT={job.master_port}",
        "export MASTER_ADDR MASTER_PORT PYTHONUNBUFFERED=1",
        "",
        f"srun --nodes={job.nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 --export=ALL \\",
        f"  {task}",
        "status=$?",
        'if [ "$status" -eq 75 ]; then',
        "  # Stopped before the time limit (or preempted) with a checkpoint: queue again to resume.",
        '  scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "$status"',
    ]
    return "\n".join(lines) + "\n"
