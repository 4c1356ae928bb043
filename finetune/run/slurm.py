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

import re
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


def plain_job_name(name: str) -> str:
    """A recipe's name as a SLURM job name: letters, digits, `.`, `_` and `-` only (a newline there ended the
    #SBATCH line and the rest ran as a command, issue 34)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-")[:64] or "finetune"


def comment_text(value: object) -> str:
    """`value` for a `#` comment line: control characters (newline, CR, ...) written as escapes, so the comment
    ends where the line does."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(value))


def shell_word(value: object) -> str:
    """`value` as one bash word that keeps the script one command per line: shlex.quote, or for a value with
    control characters bash's $'...' with them escaped (inside '...' a newline is safe but splits the line)."""
    text = str(value)
    if all(c.isprintable() for c in text):
        return shlex.quote(text)
    escaped = "".join(c if c.isprintable() and c not in "\\'" else "\\" + c if c in "\\'"
                      else f"\\x{ord(c):02x}" if ord(c) < 256 else f"\\u{ord(c):04x}" for c in text)
    return f"$'{escaped}'"


# What sbatch reads in one #SBATCH value: no blank, quote or control character (a newline would end the directive
# and start a command line; sbatch splits directives at blanks).
_DIRECTIVE_VALUE = re.compile(r"[\w.,:@%+=/-]+")


def directive_problems(job: SlurmJob) -> list[str]:
    """The user-given values that cannot be written into an #SBATCH line as they are."""
    given = {"--job-name": job.job_name, "--time": job.time, "--partition": job.partition, "--account": job.account}
    return [f"{option} {value!r}: only letters, digits and . , : @ % + = / - _ fit an #SBATCH line"
            for option, value in given.items() if value is not None and not _DIRECTIVE_VALUE.fullmatch(value)]


def sbatch_script(job: SlurmJob) -> str:
    problems = directive_problems(job)
    if problems:
        raise SlurmError("; ".join(problems))
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
            + " ".join(shell_word(a) for a in train) + ' --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"')
    lines = [
        "#!/bin/bash",
        f"# Written by `finetune slurm {comment_text(job.recipe_path.name)}`. Submit with: sbatch THIS_FILE",
        f"# {job.nodes} node(s) x {job.gpus_per_node} GPU(s); run directory {comment_text(job.run_dir)}",
        "# Exit 75: stopped by SIGTERM (time limit, preemption) with a checkpoint saved; the job is requeued",
        "# and `finetune train` resumes from that checkpoint.",
        *(f"#SBATCH {d}" for d in directives),
        "",
        "set -u",
        f"cd {shell_word(job.workdir)}",
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
