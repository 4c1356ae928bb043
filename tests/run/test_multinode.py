"""Several machines: the commands each node runs (golden files). Two real "nodes" on 127.0.0.1:
tests/launches/test_multinode.py.

The golden files in tests/golden/ are the exact commands; after an intended change, rewrite them with

    FINETUNE_UPDATE_GOLDEN=1 python -m pytest tests/run/test_multinode.py tests/run/test_slurm.py

and review the diff.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from finetune.run.launch.commands import commands_per_node, deepspeed_env_text, plan_launch
from finetune.recipe import Recipe
from tests.conftest import hub_recipe, write_local_inputs

GOLDEN = Path(__file__).parents[1] / "golden"
RUN = Path("/runs/demo")


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("FINETUNE_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"{path} differs; see the module docstring to update it"


def recipe(**launch) -> Recipe:
    return hub_recipe(launch=launch)


def render(commands: list[tuple[str, str]]) -> str:
    return "".join(f"# {label}\n{line}\n" for label, line in commands)


def test_torchrun_command_of_every_node():
    r = recipe(nodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29600, procs_per_node=8)
    plan = plan_launch(r, RUN, gpu_count=8, python="python", environ={})
    commands = commands_per_node(plan)
    assert [label for label, _ in commands] == ["node 0", "node 1 (this machine)"]
    check_golden("torchrun_2nodes.txt", render(commands))
    assert plan.env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "300"  # launch.stop_timeout: time to checkpoint


def test_hostfile_launch_commands(monkeypatch):
    monkeypatch.chdir(GOLDEN)
    r = recipe(hostfile="hostfile", nodes=2, master_addr="10.0.0.1", procs_per_node=4)
    plan = plan_launch(r, RUN, gpu_count=4, python="python", environ={})
    text = render(commands_per_node(plan)).replace(str(GOLDEN), "<golden>")
    check_golden("deepspeed_hostfile_2nodes.txt", text)
    assert plan.world_size == 8 and plan.hosts == {"worker-0": 8, "worker-1": 8}


def test_per_node_command_is_what_deepspeeds_pdsh_runner_runs(monkeypatch):
    """Our printout of the remote command against DeepSpeed's own PDSHRunner.get_cmd."""
    from deepspeed.launcher.multinode_runner import PDSHRunner
    from deepspeed.launcher.runner import apply_num_nodes_and_gpus, encode_world_info, parse_args

    monkeypatch.chdir(GOLDEN)
    r = recipe(hostfile="hostfile", nodes=2, master_addr="10.0.0.1", procs_per_node=4)
    plan = plan_launch(r, RUN, gpu_count=4, python=sys.executable, environ={})
    args = parse_args(plan.argv[3:])
    resources = apply_num_nodes_and_gpus({"worker-0": list(range(8)), "worker-1": list(range(8)),
                                          "worker-2": list(range(8))}, args.num_nodes, args.num_gpus)
    cmd, _kill, _env = PDSHRunner(args, encode_world_info(resources)).get_cmd({}, resources)
    theirs = cmd[cmd.index(sys.executable):]
    for index, (_label, line) in enumerate(commands_per_node(plan)[1:]):
        ours = line.split(" ")
        assert ours == [part.replace("%n", str(index)) for part in theirs]
    assert cmd[:cmd.index(sys.executable)][-1] == f"cd {os.path.abspath('.')};"  # same directory on every host


def test_other_nodes_get_the_environment_through_deepspeeds_env_file():
    text = deepspeed_env_text({"FINETUNE_CACHE": "/cache", "HF_HOME": "/hf", "HF_TOKEN": "secret", "TQDM_DISABLE": "1"})
    assert text == "TQDM_DISABLE=1\nFINETUNE_CACHE=/cache\nHF_HOME=/hf\n"  # never a token in the run directory


def test_dry_run_prints_every_node(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from finetune.cli import app

    monkeypatch.chdir(tmp_path)
    write_local_inputs(tmp_path)
    (tmp_path / "r.yaml").write_text("model: {name_or_path: ./model}\ndata: {path: data.jsonl}\nlaunch: {procs_per_node: 2}\n")
    result = CliRunner().invoke(app, ["train", "r.yaml", "--output-dir", "out", "--dry-run", "--nnodes", "3",
                                      "--node-rank", "2", "--master-addr", "10.0.0.1", "--master-port", "29700"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith("# command (6 processes")
    for rank in range(3):
        label = lines[1 + 2 * rank]
        assert label == f"# node {rank}" + (" (this machine)" if rank == 2 else "")
        command = lines[2 + 2 * rank]
        assert f"--nnodes 3 --nproc-per-node 2 --node-rank {rank} --master-addr 10.0.0.1 --master-port 29700" in command
    assert not (tmp_path / "out").exists()


