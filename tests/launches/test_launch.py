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


OOM_RUNNER = '''
import torch
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main():
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.96 GiB. GPU 0 has a total capacity of 23.53 "
                                 "GiB of which 1.02 GiB is free.")


main()
'''


def test_a_run_out_of_gpu_memory_under_auto_runs_again_with_the_memory_safe_values(tmp_path, monkeypatch, tiny_cache):
    """`finetune train` in process, on a (faked) 24 GiB GPU where auto decides for speed. The first launch's rank
    raises torch's OutOfMemoryError (written to torchrun's error file, as a real one is), and the same command trains
    the run again from scratch with every memory key auto decided pinned to its memory-safe value. The first
    attempt's logs stay in RUN/logs/first-attempt/."""
    from typer.testing import CliRunner

    import finetune.run.decide as decide
    import finetune.run.start as start
    from finetune.cli import app
    from finetune.plan.auto import Machine
    from finetune.recipe import load_recipe
    from tests.conftest import REPO

    monkeypatch.setenv("FINETUNE_CACHE", str(tiny_cache))
    (tmp_path / "fakes").mkdir()
    (tmp_path / "fakes" / "oom_runner.py").write_text(OOM_RUNNER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fakes"))
    monkeypatch.setattr(decide, "machine_from_facts", lambda *a: Machine(gpus_per_node=1, gpu_memory=24 * 2**30))
    real_prepare, calls = start.prepare, []

    def prepare(*args, **kwargs):  # the first launch runs the fake rank, the second the real runner
        calls.append(kwargs)
        return real_prepare(*args, **({**kwargs, "module": "oom_runner"} if len(calls) == 1 else kwargs))

    monkeypatch.setattr(start, "prepare", prepare)
    data = REPO / "recipes" / "data" / "demo_instructions.jsonl"
    (tmp_path / "r.yaml").write_text("model: {name_or_path: 'builtin:tiny-llama', dtype: float32}\n"
                                     f"data: {{path: '{data}', max_length: 64}}\n"
                                     "training: {gradient_accumulation_steps: 8, max_steps: 2, logging_steps: 1}\n"
                                     "launch: {procs_per_node: 1}\n")
    out = tmp_path / "run"
    done = CliRunner().invoke(app, ["train", str(tmp_path / "r.yaml"), "--output-dir", str(out), "--master-port",
                                    str(free_port())])
    assert done.exit_code == 0, done.stderr[-4000:]
    assert len(calls) == 2 and calls[1]["force_resume"] is False and calls[1]["resume"] is True
    assert re.search(r"note: a rank ran out of GPU memory where `auto` chose training.gradient_checkpointing = false, "
                     r".*training.micro_batch_size = 8 for speed", done.stderr), done.stderr[-4000:]
    assert ("note: training again with the memory-safe values, as the same command with --overwrite --set "
            "training.gradient_checkpointing=true --set training.loss_kernel=chunked --set training.micro_batch_size=1 "
            "would; it starts again (no checkpoint was saved)") in done.stderr
    assert f"finished: {out}" in done.stderr
    # the record: the values pinned in recipe.yaml (it reproduces the run that finished), the first attempt's logs kept
    t = load_recipe(out / "recipe.yaml").recipe.training
    assert (t.gradient_checkpointing, t.loss_kernel, t.micro_batch_size, t.gradient_accumulation_steps) == \
        (True, "chunked", 1, 8)
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
    first = out / "logs" / "first-attempt"
    assert any("CUDA out of memory" in f.read_text(errors="replace") for f in first.rglob("*") if f.is_file())
