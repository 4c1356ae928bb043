"""Two real "nodes" on 127.0.0.1: two `finetune train --node-rank` processes with one CPU process each and the same
master port, each with its own run directory (machines with their own disks), train the tiny recipe to the end.
The commands each node runs are checked against golden files in tests/run/test_multinode.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

from finetune.run.launch.commands import free_port
from tests.train_fixtures import REPO, TINY_RECIPES, runner_env


def test_two_nodes_on_localhost_train_to_the_end(tmp_path, tiny_cache):
    port = free_port()
    procs = []
    for rank in (0, 1):
        argv = [sys.executable, "-m", "finetune.cli", "train", str(TINY_RECIPES / "lora_zero2.yaml"),
                "--output-dir", str(tmp_path / f"node{rank}"), "--set", "launch.procs_per_node=1",
                "--set", "training.save_steps=6", "--nnodes", "2", "--node-rank", str(rank),
                "--master-addr", "127.0.0.1", "--master-port", str(port)]
        procs.append(subprocess.Popen(argv, cwd=REPO, env=runner_env(tiny_cache), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n\n".join(o[-3000:] for o in outputs)
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    summary = json.loads((node0 / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 12
    assert summary["train_loss_last"] < summary["train_loss_first"] - 0.3
    assert (node0 / "adapter" / "adapter_model.safetensors").is_file()
    assert not (node1 / "adapter").exists()  # the final weights are written once, by rank 0
    # Separate disks: each node keeps what it needs to resume on its own (DeepSpeed's node-local storage).
    for node, rank in ((node0, 0), (node1, 1)):
        last = node / "checkpoint-12"
        assert (last / "COMPLETE").is_file() and (last / "latest").read_text() == "global_step12"
        assert (last / "global_step12" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").is_file()
        assert (last / "global_step12" / "mp_rank_00_model_states.pt").is_file()
        assert (last / f"rng_state_{rank}.pth").is_file() and (last / "trainer_state.json").is_file()
    assert "the nodes do not share the run directory" in outputs[0]
