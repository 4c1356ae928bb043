"""The per-rank runner for real: 2-process DeepSpeed runs on CPU.

Every case trains a tiny recipe from recipes/tiny/ under torchrun, then checks what a user relies on: the loss
fell, and the saved adapter or weights, reloaded here with PEFT/transformers, reproduce the logits the trained
model computed at the end of training. The runner's helpers and input errors: tests/train/test_runner.py.

    python -m pytest tests/launches/test_runner.py            # about 2-4 minutes on 2 cores
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune.rundir.names import PREPARE_FILE
from tests.train_fixtures import reload_logits

# recipe file -> what it saves
COMBINATIONS = {
    "lora_zero2": "adapter",
    "lora_zero3": "adapter",
    "qlora_zero3": "adapter",
    "lora_zero2_offload": "adapter",
    "full_zero3_offload": "model",  # and training.loss_kernel: chunked
    "full_zero0": "model",
    "mix_alpaca_sharegpt": "adapter",  # data.sources: alpaca + ShareGPT, 3:1
}

# In the full tier only (CI's time): a full fine-tune trains in the default tier as full_zero3_offload, and mixtures
# are tokenized and sampled in process (tests/data/test_prepare.py, tests/data/test_formats.py).
FULL_TIER = {"full_zero0", "mix_alpaca_sharegpt"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.full) if n in FULL_TIER else n for n in COMBINATIONS])
def test_two_process_run_learns_and_saves_what_it_trained(name, tiny_run, tiny_cache):
    import torch

    from finetune.builtin import builtin_model_dir

    run_dir, result, recipe = tiny_run(name)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == recipe.training.max_steps
    assert summary["train_loss_last"] < summary["train_loss_first"] - 0.3, summary["loss_history"]
    assert len(summary["loss_history"]) == recipe.training.max_steps  # logging_steps: 1
    assert summary["tokens_trained"] > 0 and summary["tokens_per_second"] > 0
    assert summary["wall_seconds"] > 0
    steady = summary["steady"]  # issue 35: the steps after the warm-up, tokens counted on the host, summed over ranks
    assert steady["steps"] == recipe.training.max_steps - 5 and steady["tokens_per_second"] > 0
    assert 0 < steady["step_seconds_p50"] <= steady["step_seconds_p90"] and steady["tokens"] < summary["tokens_trained"]
    assert steady["flops_per_token"] > 0 and steady["mfu"] is None and steady["reason"] == "no MFU on a CPU"
    startup = summary["startup"]
    # launched by hand (train_fixtures.launch_runner): no launcher's prepare.json; by `finetune train`: its seconds
    tokenize = startup["tokenize"]
    if (run_dir / PREPARE_FILE).is_file():
        assert tokenize["seconds"] >= 0 and (tokenize["cached"] or tokenize["rows"] > 0), startup
    else:
        assert tokenize is None, startup
    assert all(startup[k] > 0 for k in ("imports", "process_group", "model", "deepspeed_init", "first_step")), startup
    assert summary["world_size"] == 2
    assert summary["peak_memory_scope"] == "training"  # read before the verification forward
    assert summary["loss_kernel"] == recipe.training.loss_kernel
    assert summary["peak_memory_kind"] == "cpu_peak_rss"
    assert len(summary["peak_memory_bytes"]) == 2 and all(b > 50 * 2**20 for b in summary["peak_memory_bytes"])

    env = json.loads((run_dir / "env.json").read_text())
    assert env["world_size"] == 2 and env["devices"] == "cpu" and env["versions"]["deepspeed"]
    effective = json.loads((run_dir / "deepspeed.effective.json").read_text())
    assert effective["zero_optimization"]["stage"] == recipe.deepspeed.stage
    assert effective["optimizer"]["params"]["torch_adam"] is True  # CPU accelerator: no FusedAdam
    assert effective["train_batch_size"] == recipe.training.micro_batch_size * 2

    if recipe.data.sources:
        _check_mixture_report(result, run_dir, recipe)
    output = COMBINATIONS[name]
    assert summary["output"] == output
    assert (run_dir / output).is_dir() and not list(run_dir.glob(".*.partial"))
    assert (run_dir / "tokenizer" / "tokenizer.json").is_file()
    if output == "adapter":
        _check_adapter_files(run_dir, recipe)

    expected, reloaded, untrained = reload_logits(run_dir, base=builtin_model_dir("builtin:tiny-llama", tiny_cache))
    torch.testing.assert_close(reloaded, expected, rtol=1e-4, atol=1e-4)
    # ... and training changed the model: the untrained base predicts something else.
    assert (untrained - expected).abs().max() > 1e-2


def _check_mixture_report(result, run_dir, recipe):
    """alpaca + ShareGPT 3:1: one report (the launcher tokenizes, the ranks load the cache), alpaca whole, chats to a third."""
    alpaca, chats = (Path(s.path) for s in recipe.data.sources)
    rows = len(alpaca.read_text().splitlines())
    report = [line.removeprefix("[finetune] ") for line in result.stdout.splitlines() if line.startswith("[finetune] data: ")]
    assert report == [f"data: {alpaca} (alpaca): {rows} rows -> {rows} examples; {rows} in the mixture (all)",
                      f"data: {chats} (sharegpt): 80 rows -> 80 examples; {round(rows / 3)} in the mixture "
                      f"(repeated {round(rows / 3) / 80:.2f}x)"]
    mix = json.loads((run_dir / "data_mix.json").read_text())
    assert [(m["format"], m["rows"], m["dropped"], m["mixed"]) for m in mix] == [
        ("alpaca", rows, 0, rows), ("sharegpt", 80, 0, round(rows / 3))]


def _check_adapter_files(run_dir, recipe):
    from safetensors.torch import load_file

    config = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    base = Path(config["base_model_name_or_path"])
    assert base.is_absolute() and (base / "config.json").is_file()
    assert config["r"] == recipe.lora.r
    weights = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    # 4 layers x 7 linear layers x (A, B), plus the modules trained whole; ZeRO-3 partitions would show up as
    # empty tensors.
    assert len([key for key in weights if ".lora_" in key]) == 4 * 7 * 2
    whole = sorted(key.split(".")[-2] for key in weights if ".lora_" not in key)
    assert whole == sorted(recipe.lora.modules_to_save or []), whole
    for key, tensor in weights.items():
        assert tensor.numel() > 0, key
        if ".lora_" not in key:
            continue
        rank_dim = 0 if "lora_A" in key else 1
        assert tensor.shape[rank_dim] == recipe.lora.r, (key, tuple(tensor.shape))
    # B starts at zero; trained, every B is non-zero.
    assert all(t.abs().max() > 0 for k, t in weights.items() if "lora_B" in k)
