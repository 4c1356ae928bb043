"""LoRA on a mixture of experts' fused experts and router under ZeRO-3 on 2 processes equals 1 process (issue 37):
real DeepSpeed runs on CPU of recipes/tiny/moe_lora_zero3.yaml (the built-in Qwen3-MoE), slow.

    python -m pytest tests/launches/test_moe.py

Both runs train the same 8 rows per step (2 x 4, or 1 x 4 accumulated twice); the token-weighted loss makes that
the same number, so losses and gradient norms agree to float32 rounding (bound 1e-5 relative, as
tests/launches/test_parallel.py). The router's auxiliary loss is off in both: it depends on which rows share a forward.
The 2-process run then converts (its ZeRO-3 checkpoint), and merges (its adapter) exactly as peft does.
"""

from __future__ import annotations

import json

import pytest

from tests.train_fixtures import TINY_RECIPES, launch_runner, write_run_dir

RTOL = 1e-5
RECIPE = TINY_RECIPES / "moe_lora_zero3.yaml"
SETS = ("moe.router_aux_loss_coef=0", "training.save_steps=6")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_cache):
    from finetune.builtin import ensure_builtin_model

    ensure_builtin_model("builtin:tiny-qwen3-moe", tiny_cache)
    tmp = tmp_path_factory.mktemp("moe")
    out = {}
    for name, procs, extra in (("two", 2, ()), ("one", 1, ("launch.procs_per_node=1",
                                                            "training.gradient_accumulation_steps=2"))):
        run_dir = tmp / name
        write_run_dir(RECIPE, run_dir, world_size=procs, overrides=SETS + extra)
        result = launch_runner(run_dir, tiny_cache, procs=procs)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
        out[name] = run_dir
    return out


def _curve(run_dir, key="loss"):
    return [e[key] for e in json.loads((run_dir / "summary.json").read_text())["loss_history"]]


def test_zero3_with_expert_lora_equals_one_process(runs):
    from finetune.models.families import FAMILIES

    two, one = runs["two"], runs["one"]
    assert _curve(two) == pytest.approx(_curve(one), rel=RTOL)
    assert _curve(two, "grad_norm") == pytest.approx(_curve(one, "grad_norm"), rel=10 * RTOL)
    assert _curve(two)[-1] < _curve(two)[0] - 0.5
    leaf = json.loads((two / "deepspeed.json").read_text())["zero_optimization"]["leaf_module"]
    assert FAMILIES["qwen3_moe"].moe_block in leaf["classes"]
    adapter = json.loads((two / "adapter" / "adapter_config.json").read_text())
    assert sorted(adapter["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj", "mlp.gate.weight"]


def test_its_checkpoint_converts_and_its_adapter_merges_as_peft_does(runs, tmp_path, tiny_cache):
    from safetensors.torch import load_file

    from finetune.builtin import ensure_builtin_model
    from finetune.weights.convert import convert
    from finetune.weights.merge import merge
    from tests.weights.merge_fixtures import assert_same, peft_merged_state_dict
    from tests.weights.test_merge import load_dir

    two = runs["two"]
    convert(two / "checkpoint-6", tmp_path / "converted")
    saved = load_file(str(two / "adapter" / "adapter_model.safetensors"))
    assert_same(load_file(str(tmp_path / "converted" / "adapter_model.safetensors")), saved)
    base = ensure_builtin_model("builtin:tiny-qwen3-moe", tiny_cache)
    merge(base, two / "adapter", tmp_path / "merged")
    assert_same(load_dir(tmp_path / "merged"), peft_merged_state_dict(base, two / "adapter"))
