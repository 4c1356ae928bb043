"""`finetune train` end to end: the real CLI, launcher and runner on two CPU processes (the README's demo recipe),
and a real rank that raises named with its exception. The launcher's argv and supervision with fake runners are in
tests/run/test_launch.py.
"""

from __future__ import annotations

import json
import re

import pytest

from finetune.run.launch.commands import free_port


def test_finetune_train_demo(tmp_path):
    """The README's demo recipe as it ships, capped at 20 of its 117 steps: the whole demo is the README's
    set-up command (about five minutes on 2 cores); every step after the 20th is the same work again."""
    from tests.conftest import REPO, run_cli

    demo = REPO / "recipes" / "demo.yaml"
    out = tmp_path / "run"
    done = run_cli("train", demo, "--output-dir", out, "--set", "training.max_steps=20", "--master-port", str(free_port()),
                   timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"finished: {out}" in done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["train_loss_last"] < summary["train_loss_first"]
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    for name in ("recipe.yaml", "deepspeed.json", "training_args.json", "env.json"):
        assert (out / name).is_file(), name
    if summary["world_size"] > 1:
        assert (out / "logs" / "rank1" / "stderr.log").is_file()  # the other rank's output, beside rank 0's


@pytest.mark.full  # the same report from torchrun's error files in the default tier (test_an_exception_in_a_rank_...)
def test_a_real_rank_that_raises_is_named_with_its_exception(tmp_path):
    """The real runner writes torchrun's error file (torch's @record): the summary line has the exception."""
    from tests.conftest import REPO, run_cli
    from tests.weights.merge_fixtures import build_llama

    base = build_llama(tmp_path / "base", dtype="float32")
    weights = base / "model.safetensors"
    with open(weights, "r+b") as handle:  # a download cut short: the header promises more than there is
        handle.truncate(weights.stat().st_size // 2)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"extends: {REPO / 'recipes' / 'tiny' / 'base.yaml'}\nmodel: {{name_or_path: {base}}}\n"
                      f"data: {{path: {REPO / 'recipes' / 'data' / 'demo_instructions.jsonl'}}}\n")
    done = run_cli("train", recipe, "--output-dir", tmp_path / "run", "--master-port", str(free_port()), timeout=600)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    # Both ranks raise; torchrun may stop the first one's exit with SIGTERM after its error file is written.
    assert re.search(r"error: training failed: rank \d \(local rank \d\) on \S+ "
                     r"(exited with code 1|raised, then was killed by SIGTERM while exiting): "
                     r"SafetensorError: .*incomplete metadata", last), done.stderr[-3000:]
