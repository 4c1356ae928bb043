"""`finetune slurm`: the sbatch script against a golden file, and run for real with stand-ins for srun/scontrol.

The stand-ins (shell scripts on PATH) do what SLURM does for this script: `scontrol show hostnames`
lists the allocation, `srun` starts the command once per node with SLURM_NODEID set (here: all on
127.0.0.1, one run directory shared by both "nodes", as on a cluster file system).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.recipe import load_recipe
from finetune.run.slurm import SlurmError, SlurmJob, gpus_per_node, sbatch_script
from tests.conftest import run_cli
from tests.test_multinode import check_golden
from finetune.run.launch.commands import free_port
from tests.train_fixtures import REPO, TINY_RECIPES, cache_dir, runner_env


def job(**changes) -> SlurmJob:
    values = dict(recipe_path=Path("/work/recipes/llama3/70b_qlora_8xh100.yaml"), run_dir=Path("/shared/runs/llama3-70b"),
                  workdir=Path("/work"), python="/work/.venv/bin/python", nodes=2, gpus_per_node=8,
                  job_name="llama3-70b", master_port=29500, signal_seconds=300,
                  overrides=("training.max_steps=1000",), time="24:00:00", partition="gpu", account=None,
                  cpus_per_task=32)
    values.update(changes)
    return SlurmJob(**values)


def test_sbatch_script_golden():
    check_golden("sbatch_2nodes.sh", sbatch_script(job()))


def test_gpus_per_node_comes_from_the_recipe():
    recipe = load_recipe(REPO / "recipes" / "llama3" / "70b_qlora_8xh100.yaml").recipe
    assert gpus_per_node(recipe, None) == 8  # hardware.gpus
    assert gpus_per_node(recipe, 4) == 4
    bare = load_recipe(REPO / "recipes" / "tiny" / "lora_zero2.yaml", ["launch.procs_per_node=auto"]).recipe
    with pytest.raises(SlurmError, match="--gpus-per-node"):
        gpus_per_node(bare, None)


def test_cli_prints_the_script(tmp_path):
    result = run_cli("slurm", REPO / "recipes" / "llama3" / "70b_qlora_8xh100.yaml", "--nodes", "4", "--time", "2:00:00",
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --nodes=4\n#SBATCH --ntasks-per-node=1\n#SBATCH --gpus-per-node=8\n" in result.stdout
    assert f"train {REPO / 'recipes/llama3/70b_qlora_8xh100.yaml'} --output-dir {tmp_path}/runs/" in result.stdout
    assert "--nnodes 4" in result.stdout and f"cd {tmp_path}" in result.stdout
    out = tmp_path / "job.sh"
    assert run_cli("slurm", REPO / "recipes" / "llama3" / "70b_qlora_8xh100.yaml", "-o", out, cwd=tmp_path).returncode == 0
    assert os.access(out, os.X_OK) and out.read_text().startswith("#!/bin/bash\n")


FAKE_SCONTROL = """\
#!/bin/bash
# scontrol stand-in: hostnames of the allocation; requeue is recorded
case "$1 $2" in
  "show hostnames") for h in $SLURM_JOB_NODELIST; do echo "$h"; done ;;
  *) echo "$*" >> "$FAKE_SLURM_LOG" ;;
esac
"""

FAKE_SRUN = """\
#!/bin/bash
# srun stand-in: start the command once per node with SLURM_NODEID set, wait for all, first failure wins
nodes=1
while [[ "$1" == --* ]]; do
  case "$1" in --nodes=*) nodes="${1#--nodes=}" ;; esac
  shift
done
echo "srun nodes=$nodes" >> "$FAKE_SLURM_LOG"
pids=()
for ((i = 0; i < nodes; i++)); do
  SLURM_NODEID=$i SLURM_PROCID=$i SLURM_NNODES=$nodes "$@" > "$FAKE_SLURM_OUT.node$i" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || { code=$?; [ $status -eq 0 ] && status=$code; }; done
exit $status
"""


def fake_slurm(tmp_path: Path, srun: str = FAKE_SRUN) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", srun), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_NODELIST": "127.0.0.1",
            "SLURM_JOB_ID": "4242", "FAKE_SLURM_LOG": str(tmp_path / "slurm.log"), "FAKE_SLURM_OUT": str(tmp_path / "out")}


def test_exit_75_requeues_the_job(tmp_path):
    script = tmp_path / "job.sh"
    script.write_text(sbatch_script(job(workdir=tmp_path)))
    preempted = "#!/bin/bash\necho \"srun $*\" >> \"$FAKE_SLURM_LOG\"\nexit 75\n"
    env = {**os.environ, **fake_slurm(tmp_path, srun=preempted)}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 75, done.stderr
    log = (tmp_path / "slurm.log").read_text()
    assert "requeue 4242" in log
    # the task's command: every node's own --node-rank is left to the task's shell
    assert "bash -c exec \"$0\" \"$@\" --node-rank \"$SLURM_NODEID\" /work/.venv/bin/python -m finetune.cli train" in log
    assert "--master-addr 127.0.0.1 --master-port 29500" in log  # expanded once, the same for every node


def test_a_name_with_a_newline_runs_no_command(tmp_path):
    """Issue 34 item 2: a recipe name (and so its run directory) with a newline, written raw into a comment and
    into #SBATCH --job-name, ended the line there and the rest ran as a command in the batch script."""
    recipe = REPO / "recipes" / "tiny" / "lora_zero2.yaml"
    name = "x\ntouch PWNED\r\x0btouch PWNED2"
    result = run_cli("slurm", recipe, "--set", f"name={json.dumps(name)}", "--gpus-per-node", "1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --job-name=x-touch-PWNED-touch-PWNED2\n" in result.stdout
    assert [line for line in result.stdout.splitlines() if line.startswith("touch")] == []
    script = tmp_path / "job.sh"
    script.write_text(result.stdout)
    recorded = "#!/bin/bash\nprintf '%s\\0' \"$@\" > \"$FAKE_SLURM_LOG\"\n"
    done = subprocess.run(["bash", str(script)], env={**os.environ, **fake_slurm(tmp_path, srun=recorded)},
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "PWNED").exists() and not (tmp_path / "PWNED2").exists()
    argv = (tmp_path / "slurm.log").read_bytes().decode().split("\0")
    assert argv[argv.index("--output-dir") + 1] == str(tmp_path / "runs" / name)  # the srun line keeps it whole
    refused = run_cli("slurm", recipe, "--gpus-per-node", "1", "--partition", "gpu\ntouch PWNED", cwd=tmp_path)
    assert refused.returncode == 2 and "--partition 'gpu\\ntouch PWNED'" in refused.stderr


@pytest.mark.slow
@pytest.mark.full  # two nodes on localhost in the default tier: tests/test_multinode.py
def test_the_script_trains_on_two_nodes_sharing_a_run_directory(tmp_path, tmp_path_factory):
    from finetune.builtin import ensure_builtin_model

    cache = cache_dir(tmp_path_factory)
    ensure_builtin_model("builtin:tiny-llama", cache)
    run_dir = tmp_path / "shared" / "run"
    slurm_job = job(recipe_path=TINY_RECIPES / "lora_zero2.yaml", run_dir=run_dir, workdir=REPO, python=sys.executable,
                    gpus_per_node=1, master_port=free_port(),
                    overrides=("launch.procs_per_node=1", "training.save_steps=6"), time=None, partition=None)
    script = tmp_path / "job.sh"
    script.write_text(sbatch_script(slurm_job))
    env = {**runner_env(cache), **fake_slurm(tmp_path)}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=600)
    logs = [(tmp_path / f"out.node{i}").read_text() for i in (0, 1)]
    assert done.returncode == 0, "\n\n".join(log[-3000:] for log in logs)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 12
    assert summary["train_loss_last"] < summary["train_loss_first"] - 0.3
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()
    last = run_dir / "checkpoint-12" / "global_step12"
    assert {p.name for p in last.iterdir()} >= {"zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                                "zero_pp_rank_1_mp_rank_00_optim_states.pt"}
    assert "the nodes do not share the run directory" not in logs[0]
    assert "requeue" not in (tmp_path / "slurm.log").read_text()
