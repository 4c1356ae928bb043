"""Preference training for real (slow): the tiny model, the shipped preference data, CPU processes.

- SFT -> DPO -> merge, chained in one test to share its runs: the session's shared SFT run; DPO continuing its adapter
  (2 processes, LoRA, ZeRO-3) stopped by SIGTERM and resumed; rewards/margins and rewards/accuracies rise,
  summary.json and TensorBoard hold them; `finetune convert` of the last checkpoint gives the saved adapter;
  `finetune merge` gives a model whose logits are the run's.
- DPO with QLoRA + ZeRO-3 and full + ZeRO-2 with a reference model (2 processes, 4 steps each, side by side).
- ORPO, KTO and SimPO, a few steps each in one process (the three side by side).

    python -m pytest tests/launches/test_preference.py        # a few minutes on 2 cores
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from finetune.run.launch.commands import free_port
from tests.train_fixtures import REPO, TINY_RECIPES, cache_dir, runner_env, write_run_dir

# every tiny preference recipe and the test that trains it (tests/train/test_preference.py checks the list)
TRAINED = {
    "dpo_lora_zero3": "test_sft_then_dpo_stopped_resumed_converted_and_merged",
    "dpo_qlora_zero3": "test_dpo_qlora_zero3_and_full_zero2_with_a_reference_model",
    "dpo_full_zero2": "test_dpo_qlora_zero3_and_full_zero2_with_a_reference_model",
    "orpo_lora": "test_orpo_kto_and_simpo_train",
    "kto_lora": "test_orpo_kto_and_simpo_train",
    "simpo_lora": "test_orpo_kto_and_simpo_train",
}
DPO_STEPS = 16


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    from finetune.builtin import ensure_builtin_model

    root = cache_dir(tmp_path_factory)
    ensure_builtin_model("builtin:tiny-llama", root)
    return root


def finetune_cli(*args, cache: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "finetune.cli", *map(str, args)], cwd=REPO, env=runner_env(cache),
                          capture_output=True, text=True, timeout=timeout)


def train_argv(recipe: Path, out: Path, *sets: str) -> list[str]:
    argv = [sys.executable, "-m", "finetune.cli", "train", str(recipe), "--output-dir", str(out),
            "--master-port", str(free_port())]
    for item in sets:
        argv += ["--set", item]
    return argv


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def logits_of(model_dir_or_model, inputs: dict):
    import torch
    from transformers import AutoModelForCausalLM

    model = model_dir_or_model
    if isinstance(model, Path):
        model = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(**inputs, use_cache=False).logits.float()


@pytest.mark.full  # DPO trains in the default tier (test_dpo_qlora_zero3_...); this chain adds stop, resume, convert, merge
def test_sft_then_dpo_stopped_resumed_converted_and_merged(tmp_path, cache, shared_sft_run):
    import torch
    from safetensors.torch import load_file

    from finetune.rundir import checkpoint as ckpt

    # 1. SFT: a LoRA adapter to continue from (the session's shared SFT run; nothing here writes into it)
    sft = shared_sft_run[0]

    # 2. DPO from that adapter, 2 processes, ZeRO-3; SIGTERM after 5 steps
    dpo = tmp_path / "dpo"
    sets = (f"model.adapter={sft}", "training.save_steps=4", "training.report_to=[tensorboard]")
    argv = train_argv(TINY_RECIPES / "dpo_lora_zero3.yaml", dpo, *sets)
    log = tmp_path / "dpo.log"
    with open(log, "wb") as handle:
        first = subprocess.Popen(argv, cwd=REPO, env=runner_env(cache), stdout=handle, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 400
        while log.read_text(errors="replace").count("{'loss':") < 5:
            assert first.poll() is None, log.read_text(errors="replace")[-4000:]
            assert time.monotonic() < deadline, "no 5 DPO steps in time"
            time.sleep(0.1)
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=300) == ckpt.EXIT_PREEMPTED, log.read_text(errors="replace")[-4000:]
    step = ckpt.latest_complete(dpo).step
    assert 5 <= step < DPO_STEPS and not (dpo / "adapter").exists()

    # 3. resume to the end
    second = subprocess.run(argv, cwd=REPO, env=runner_env(cache), capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-4000:]
    assert f"resuming from checkpoint-{step} (step {step})" in second.stderr
    result = summary(dpo)
    assert result["objective"] == "dpo" and result["steps"] == DPO_STEPS
    assert [e["step"] for e in result["loss_history"]] == list(range(1, DPO_STEPS + 1))
    metrics = result["preference_metrics"]
    # step 1: policy == reference (the frozen `ref` copy of the SFT adapter), so every reward is 0
    assert metrics["rewards/margins"]["first"] == 0.0 and metrics["rewards/accuracies"]["first"] == 0.0
    assert metrics["rewards/margins"]["last"] > 0.3 and metrics["rewards/accuracies"]["last"] >= 0.5, metrics
    assert result["train_loss_last"] < result["train_loss_first"] == pytest.approx(math.log(2), abs=1e-4)
    assert "rewards/margins" in second.stderr + second.stdout  # the closing line names them
    # report.html shows the reward curves of the whole run (issue 24), the resumed part included
    page = (dpo / "report.html").read_text()
    assert (dpo / "rewards.png").is_file() and "Preference rewards" in page and "data:image/png;base64," in page

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(dpo / "tensorboard")).Reload()
    assert {"train/rewards/margins", "train/rewards/accuracies", "train/loss"} <= set(events.Tags()["scalars"])

    # 4. convert the last checkpoint: the adapter the run saved (without TRL's frozen `ref` copy)
    saved = load_file(str(dpo / "adapter" / "adapter_model.safetensors"))
    assert saved and not any(".ref." in name for name in saved)
    converted = tmp_path / "converted"
    done = finetune_cli("convert", dpo / f"checkpoint-{DPO_STEPS}", "-o", converted, cache=cache)
    assert done.returncode == 0, done.stderr[-3000:]
    again = load_file(str(converted / "adapter_model.safetensors"))
    assert again.keys() == saved.keys()
    for name, tensor in saved.items():
        torch.testing.assert_close(again[name], tensor, rtol=0, atol=0, msg=name)

    # 5. merge: one model whose logits are the trained ones
    merged = tmp_path / "merged"
    done = finetune_cli("merge", dpo, "-o", merged, cache=cache)
    assert done.returncode == 0, done.stderr[-3000:]
    fixed = load_file(str(dpo / "final_logits.safetensors"))
    inputs = {k: v for k, v in fixed.items() if k != "logits"}
    torch.testing.assert_close(logits_of(merged, inputs), fixed["logits"], rtol=1e-4, atol=1e-4)


def train_tiny(names: dict[str, int], tmp_path: Path, cache: Path) -> dict[str, dict]:
    """Train each tiny recipe (name -> processes) under torchrun, all at once: most of a short run is
    start-up (imports, process group, DeepSpeed), which overlaps well on two cores. Returns their summaries."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    runs = {}
    for name, procs in names.items():
        run_dir = tmp_path / name
        recipe = write_run_dir(TINY_RECIPES / f"{name}.yaml", run_dir, world_size=procs)
        log = open(tmp_path / f"{name}.log", "wb")
        process = subprocess.Popen([*argv, str(procs), "-m", "finetune.train.runner", "--run-dir", str(run_dir)],
                                   cwd=REPO, env=runner_env(cache), stdout=log, stderr=subprocess.STDOUT)
        runs[name] = (recipe, run_dir, process, log)
    out = {}
    for name, (recipe, run_dir, process, log) in runs.items():
        code = process.wait(timeout=600)
        log.close()
        assert code == 0, (tmp_path / f"{name}.log").read_text(errors="replace")[-6000:]
        result = summary(run_dir)
        assert result["steps"] == recipe.training.max_steps and result["objective"] == recipe.objective
        assert all(math.isfinite(e["loss"]) for e in result["loss_history"])
        assert (run_dir / result["output"]).is_dir()
        out[name] = result
    return out


def test_dpo_qlora_zero3_and_full_zero2_with_a_reference_model(tmp_path, cache):
    pytest.importorskip("bitsandbytes")
    runs = train_tiny({"dpo_qlora_zero3": 2, "dpo_full_zero2": 2}, tmp_path, cache)
    qlora, full = runs["dpo_qlora_zero3"], runs["dpo_full_zero2"]
    assert qlora["output"] == "adapter" and "rewards/margins" in qlora["preference_metrics"]
    assert full["output"] == "model" and full["trainable_parameters"] == full["total_parameters"]
    # the reference is another model: the policy moves away from it from the first update on
    assert full["preference_metrics"]["rewards/margins"]["first"] == 0.0
    assert full["preference_metrics"]["rewards/margins"]["last"] != 0.0


def test_orpo_kto_and_simpo_train(tmp_path, cache):
    runs = train_tiny({"orpo_lora": 1, "kto_lora": 1, "simpo_lora": 1}, tmp_path, cache)
    orpo, kto, simpo = runs["orpo_lora"], runs["kto_lora"], runs["simpo_lora"]
    assert {"rewards/margins", "nll_loss", "log_odds_ratio"} <= set(orpo["preference_metrics"])
    # ORPO batches have no input_ids; finetune.train.preference counts chosen + rejected tokens (issue 24)
    assert orpo["tokens_per_second"] > 0 and orpo["tokens_trained"] > 0
    assert {"rewards/chosen", "rewards/rejected", "kl"} <= set(kto["preference_metrics"])
    assert {"rewards/margins", "rewards/accuracies"} <= set(simpo["preference_metrics"])
    # SimPO's reward is beta x the mean log-prob of the answer: never 0 like a reference-based one at step 1
    assert simpo["preference_metrics"]["rewards/chosen"]["first"] < 0
