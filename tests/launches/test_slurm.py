"""`finetune slurm`'s script run for real on two "nodes" of 127.0.0.1 sharing one run directory, with the stand-ins for
srun/scontrol of tests/run/test_slurm.py (where the script itself is checked against its golden file).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from finetune.run.slurm import sbatch_script
from finetune.run.launch.commands import free_port
from tests.run.test_slurm import fake_slurm, job
from tests.train_fixtures import REPO, TINY_RECIPES, cache_dir, runner_env


@pytest.mark.full  # two nodes on localhost in the default tier: tests/launches/test_multinode.py
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
