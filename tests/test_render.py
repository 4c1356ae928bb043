"""`finetune render` and ds_configs/: deterministic, concrete where the recipe knows, HF-compatible."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from finetune.render import TEMPLATES, render_deepspeed, render_template, render_training_args
from finetune.recipe import load_recipe
from tests.conftest import MINIMAL, REPO, run_cli

GALLERY = sorted((REPO / "recipes").rglob("*.yaml"))


def autos(node, prefix=()):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from autos(value, prefix + (key,))
    elif node == "auto":
        yield ".".join(prefix)


# Keys transformers' HfTrainerDeepSpeedConfig fills when they are "auto".
HF_FILLED = {"train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "gradient_clipping",
             "optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps", "optimizer.params.weight_decay",
             "bf16.enabled", "fp16.enabled", "zero_optimization.reduce_bucket_size",
             "zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.stage3_param_persistence_threshold",
             "scheduler.params.warmup_min_lr", "scheduler.params.warmup_max_lr", "scheduler.params.total_num_steps",
             "scheduler.params.warmup_num_steps"}


@pytest.mark.parametrize("path", GALLERY, ids=lambda p: str(p.relative_to(REPO)))
def test_gallery_renders_auto_only_where_hf_fills(path):
    recipe = load_recipe(path).recipe
    config = render_deepspeed(recipe)
    assert set(autos(config)) <= HF_FILLED
    if recipe.world_size:
        t = recipe.training
        assert config["train_batch_size"] == t.micro_batch_size * t.gradient_accumulation_steps * recipe.world_size


def test_render_is_deterministic(tmp_path, write_recipe):
    path = write_recipe(MINIMAL + "deepspeed:\n  stage: 3\n  offload_optimizer: cpu\n  offload_param: cpu\n")
    first = run_cli("render", path, "-o", tmp_path / "a")
    second = run_cli("render", path, "-o", tmp_path / "b")
    assert first.returncode == 0 and second.returncode == 0, first.stderr
    for name in ("deepspeed.json", "training_args.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    ds = json.loads((tmp_path / "a" / "deepspeed.json").read_text())
    assert ds["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True}


def test_overrides_merge_last(write_recipe):
    path = write_recipe(MINIMAL + "deepspeed:\n  stage: 2\n  overrides:\n    zero_optimization: {allgather_bucket_size: 123}\n"
                        "    communication_data_type: fp32\n")
    config = render_deepspeed(load_recipe(path).recipe)
    assert config["zero_optimization"]["allgather_bucket_size"] == 123
    assert config["zero_optimization"]["stage"] == 2 and config["communication_data_type"] == "fp32"


def test_stage_specific_keys(write_recipe):
    z0 = render_deepspeed(load_recipe(write_recipe(MINIMAL + "deepspeed: {stage: 0}\n")).recipe)
    assert z0["zero_optimization"] == {"stage": 0}
    z2 = render_deepspeed(load_recipe(write_recipe(MINIMAL + "deepspeed: {stage: 2, offload_param: cpu}\n", name="b.yaml")).recipe)
    assert "offload_param" not in z2["zero_optimization"]  # lint R107 reports it; the render stays valid
    assert not any(k.startswith("stage3") for k in z2["zero_optimization"])


def test_ds_configs_in_sync_with_generator():
    out = subprocess.run([sys.executable, "scripts/gen_ds_configs.py", "--check"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout
    assert sorted(p.stem for p in (REPO / "ds_configs").glob("*.json")) == sorted(TEMPLATES)


def test_templates_are_all_auto_for_trainer_values():
    config = render_template("zero3_offload_all")
    assert config["train_batch_size"] == "auto" and config["optimizer"]["params"]["lr"] == "auto"
    assert config["zero_optimization"]["offload_param"]["device"] == "cpu"


@pytest.mark.parametrize("path", GALLERY, ids=lambda p: str(p.relative_to(REPO)))
def test_rendered_config_passes_the_real_hf_fill(path, monkeypatch):
    """The rendered JSON and TrainingArguments agree exactly as transformers checks them (no mismatch)."""
    pytest.importorskip("deepspeed")
    transformers = pytest.importorskip("transformers")
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    recipe = load_recipe(path).recipe
    world = recipe.world_size or 1
    config = render_deepspeed(recipe, world)
    kwargs = render_training_args(recipe, output_dir="/tmp/unused")
    kwargs.update(report_to="none", bf16=False, fp16=False)  # CPU here; dtype flags are compared below instead
    from dataclasses import fields

    from finetune.train.runner import training_arguments_kwargs

    # as the runner spells them for this transformers (activation_checkpointing*: no FutureWarning per recipe)
    kwargs = training_arguments_kwargs(kwargs, {f.name for f in fields(transformers.TrainingArguments)})
    args = transformers.TrainingArguments(**kwargs)
    monkeypatch.setattr(type(args), "world_size", property(lambda self: world))
    hf = HfTrainerDeepSpeedConfig(json.loads(json.dumps(config)))
    hf.trainer_config_process(args)
    mismatches = [m for m in hf.mismatches if "bf16" not in m and "fp16" not in m]
    assert mismatches == []
    assert config["bf16"]["enabled"] == (recipe.model.dtype == "bfloat16")
