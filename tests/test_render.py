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
    if recipe.world_size and recipe.parallel.sequence == 1:
        t = recipe.training
        assert config["train_batch_size"] == t.micro_batch_size * t.gradient_accumulation_steps * recipe.world_size
    elif recipe.parallel.sequence > 1:  # two DeepSpeed configs with two worlds read it (finetune.render._train_batch_size)
        assert config["train_batch_size"] == "auto"


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


def test_adam_steps_torch_fused_adamw_unless_offloaded_or_the_overrides_say(write_recipe):
    """DeepSpeed's Adam/AdamW as torch's fused AdamW (nothing to JIT-compile, the Trainer's optimizer in LLaMA-Factory's
    and axolotl's configs); DeepSpeedCPUAdam where the optimizer is offloaded; `torch_adam` in the overrides wins."""
    def block(**sections):
        text = MINIMAL + "".join(f"{key}: {json.dumps(value)}\n" for key, value in sections.items())
        return render_deepspeed(load_recipe(write_recipe(text)).recipe)["optimizer"]

    for stage in (0, 1, 2, 3):
        assert {"torch_adam": True, "fused": True}.items() <= block(deepspeed={"stage": stage})["params"].items()
    assert block(training={"optimizer": "adam"})["params"]["torch_adam"] is True
    offloaded = block(deepspeed={"stage": 3, "offload_optimizer": "cpu"})["params"]
    assert "torch_adam" not in offloaded and "fused" not in offloaded
    written = block(deepspeed={"overrides": {"optimizer": {"params": {"torch_adam": False}}}})["params"]
    assert written["torch_adam"] is False and "fused" not in written  # FusedAdam takes no `fused`
    assert "torch_adam" not in block(training={"optimizer": "lion"})["params"]
    lion = block(deepspeed={"overrides": {"optimizer": {"type": "Lion"}}})["params"]  # the type the overrides write
    assert "torch_adam" not in lion and "fused" not in lion


def test_a_resumed_run_keeps_the_adam_its_deepspeed_json_records(tmp_path):
    """finetune.rundir.layout.with_recorded_optimizer: the recorded implementation wins where both blocks are Adam or
    AdamW; another optimizer, or no record, leaves the new config as it is."""
    from finetune.render import dumps
    from finetune.rundir.layout import with_recorded_optimizer

    def config(kind="AdamW", **params):
        return {"optimizer": {"type": kind, "params": {"lr": 1e-4, **params}}, "zero_optimization": {"stage": 2}}

    torch_adam = config(fused=True, torch_adam=True)
    assert with_recorded_optimizer(torch_adam, tmp_path) is torch_adam  # nothing recorded
    (tmp_path / "deepspeed.json").write_text(dumps(config(lr=3e-4)))  # FusedAdam, as written before 2026-11-28
    kept = with_recorded_optimizer(torch_adam, tmp_path)
    assert kept == config()  # the new lr stays: only the implementation is the record's
    assert torch_adam == config(fused=True, torch_adam=True)  # the config given is left as it was
    (tmp_path / "deepspeed.json").write_text(dumps(torch_adam))
    assert with_recorded_optimizer(config(torch_adam=False), tmp_path) == torch_adam
    (tmp_path / "deepspeed.json").write_text(dumps(config("Lion")))
    assert with_recorded_optimizer(torch_adam, tmp_path) is torch_adam


def test_optimizer_class_reads_the_block_as_deepspeeds_engine_does():
    """finetune.render.optimizer_class: what engine._configure_basic_optimizer builds, by type (any case), torch_adam
    as Python's truth (the string "false" is true), and the optimizer's offload device."""
    from finetune.render import offload_device, optimizer_class

    def config(kind, offload=None, **params):
        zero = {"stage": 2, **({"offload_optimizer": {"device": offload}} if offload else {})}
        return {"optimizer": {"type": kind, "params": params}, "zero_optimization": zero}

    assert optimizer_class(config("AdamW")) == optimizer_class(config("adam", torch_adam=0)) == "FusedAdam"
    assert optimizer_class(config("AdamW", torch_adam=True)) == optimizer_class(config("Adam", torch_adam="false")) \
        == "torch.optim.AdamW"
    assert optimizer_class(config("AdamW", "cpu")) == optimizer_class(config("adamw", "nvme")) == "DeepSpeedCPUAdam"
    assert optimizer_class(config("AdamW", "auto")) == "FusedAdam"  # accelerate's "auto" offloads nothing
    assert (optimizer_class(config("Lion")), optimizer_class(config("Lion", "cpu"))) == ("FusedLion", "DeepSpeedCPULion")
    assert (optimizer_class(config("Adagrad")), optimizer_class(config("Adagrad", "cpu"))) == \
        ("torch.optim.Adagrad", "DeepSpeedCPUAdagrad")
    assert optimizer_class(config("Lamb")) == "FusedLamb"
    assert optimizer_class({"zero_optimization": {"stage": 2}}) is None  # the Trainer's optimizer
    assert optimizer_class(config("SGD")) is None and optimizer_class(config("MuAdam")) is None
    assert offload_device(config("AdamW", "disk"), "offload_optimizer") is None  # refused by DeepSpeed
    assert offload_device({}, "offload_param") == "none"
