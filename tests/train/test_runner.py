"""The per-rank runner without a launch: its helpers, its input errors, the shipped tiny recipes. Its real 2-process
runs: tests/launches/test_runner.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launches.test_runner import COMBINATIONS
from tests.train_fixtures import REPO, TINY_RECIPES, write_run_dir


def test_missing_run_inputs_is_one_line_error(tmp_path):
    result = subprocess.run([sys.executable, "-m", "finetune.train.runner", "--run-dir", str(tmp_path)],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "missing recipe.yaml, deepspeed.json, training_args.json" in result.stderr


def test_unreadable_recipe_is_reported(tmp_path):
    from finetune.rundir.layout import read_run_dir
    from finetune.rundir.errors import RunDirError

    write_run_dir(TINY_RECIPES / "lora_zero2.yaml", tmp_path)
    (tmp_path / "recipe.yaml").write_text("model: {name_or_path: x}\nmethod: lorra\n")
    with pytest.raises(RunDirError, match="cannot read the run inputs"):
        read_run_dir(tmp_path)


def test_run_dir_round_trip_keeps_the_recipe(tmp_path):
    from finetune.train.runner import read_run_dir

    written = write_run_dir(TINY_RECIPES / "qlora_zero3.yaml", tmp_path, world_size=4)
    recipe, ds, args = read_run_dir(tmp_path)
    assert recipe == written
    assert ds["train_batch_size"] == 4 * 4
    assert args["output_dir"] == str(tmp_path.resolve())


def test_cpu_accelerator_uses_torch_adam_only_for_adam():
    from finetune.train.runner import adapt_deepspeed_config

    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2}}
    assert adapt_deepspeed_config(config, on_cpu=True)["optimizer"]["params"] == {"lr": 1e-3, "torch_adam": True}
    assert adapt_deepspeed_config(config, on_cpu=False) == config
    assert "torch_adam" not in config["optimizer"]["params"]  # the input is not modified
    lion = {"optimizer": {"type": "Lion", "params": {}}}
    assert adapt_deepspeed_config(lion, on_cpu=True) == lion


def test_training_arguments_use_the_current_names():
    from finetune.train.runner import training_arguments_kwargs

    kwargs = {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False}, "seed": 1}
    new = {"gradient_checkpointing", "activation_checkpointing", "gradient_checkpointing_kwargs",
           "activation_checkpointing_kwargs", "seed"}
    assert training_arguments_kwargs(kwargs, new) == {
        "activation_checkpointing": True, "activation_checkpointing_kwargs": {"use_reentrant": False}, "seed": 1}
    old = {"gradient_checkpointing", "gradient_checkpointing_kwargs", "seed"}
    assert training_arguments_kwargs(kwargs, old) == kwargs


def test_json_safe_makes_strict_json_that_lints_clean(tmp_path):
    # Issue 34: deepspeed.effective.json held steps_per_print "inf" (accelerate's float("inf") as a string), which
    # DeepSpeed crashes on and lint called DS110.
    from finetune.lint import LintOptions, lint_paths
    from finetune.render import STEPS_PER_PRINT
    from finetune.train.callbacks import json_safe

    text = json.dumps(json_safe({"steps_per_print": float("inf"), "a": [1.5, float("nan")]}), allow_nan=False)
    assert json.loads(text) == {"steps_per_print": STEPS_PER_PRINT, "a": [1.5, "nan"]}
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "train_batch_size": 8,
              "zero_optimization": {"stage": 3}, "steps_per_print": float("inf"), "wall_clock_breakdown": False}
    (tmp_path / "deepspeed.effective.json").write_text(json.dumps(json_safe(config), allow_nan=False))
    assert lint_paths([tmp_path / "deepspeed.effective.json"], LintOptions(hf=False)).findings == []


def test_runner_accepts_the_deepspeed_launchers_local_rank():
    from finetune.train.runner import parse_args

    args = parse_args(["--local_rank=1", "--run-dir", "runs/x"])
    assert str(args.run_dir) == "runs/x" and not args.resume


@pytest.mark.parametrize("path", sorted(p.name for p in TINY_RECIPES.glob("*.yaml")) + ["../demo.yaml"])
def test_tiny_and_demo_recipes_load(path):
    from finetune.recipe import load_recipe

    recipe = load_recipe(TINY_RECIPES / path).recipe
    assert recipe.model.name_or_path.startswith("builtin:tiny-")  # built here, nothing downloaded
    for source in recipe.data.sources or [recipe.data]:
        assert Path(source.path).is_file()  # relative to the recipe, which was given absolute


def test_every_tested_combination_has_a_recipe():
    from finetune.recipe import load_recipe

    # preference objectives (dpo_*, orpo_*, ...) are trained by tests/train/test_preference.py, sequence / tensor
    # parallel ones (long_context_*) by tests/launches/test_parallel.py, mixtures of experts (moe_*) by tests/launches/test_moe.py,
    # vision-language ones (vlm_*) by tests/launches/test_vision.py
    recipes = {p.stem: load_recipe(p).recipe for p in TINY_RECIPES.glob("*.yaml")}
    shipped = {name for name, r in recipes.items() if r.objective == "sft" and r.parallel.model_parallel == 1
               and not name.startswith(("moe_", "vlm_"))} - {"base"}
    assert shipped == set(COMBINATIONS)


def test_final_logits_take_one_sequence_at_a_time_and_equal_the_batch(tmp_path, tiny_cache):
    """The verification forward after training holds one sequence's logits on the device, not the
    batch's (and its float32 copy): at 4 x 2,048 tokens and a 128k vocabulary that was 5.9 GiB more
    than the training step itself, seen on an H100. The saved logits equal a batched forward's."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from finetune.builtin import builtin_model_dir
    from finetune.train.runner import save_final_logits

    model = AutoModelForCausalLM.from_pretrained(str(builtin_model_dir("builtin:tiny-llama", tiny_cache)),
                                                 dtype=torch.float32).train()
    ids = torch.randint(5, 200, (3, 12))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # right padding, as the collator pads
    mask[2, 4:] = 0
    seen = []
    model.register_forward_hook(lambda module, args, kwargs, out: seen.append(kwargs["input_ids"].shape[0]),
                                with_kwargs=True)
    path = tmp_path / "final_logits.safetensors"
    save_final_logits(model, {"input_ids": ids, "attention_mask": mask, "labels": ids}, "cpu", path)
    assert seen == [1, 1, 1] and model.training
    saved = load_file(str(path))
    assert set(saved) == {"logits", "input_ids", "attention_mask"}
    model.eval()
    with torch.no_grad():
        batched = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
    real = mask.bool()
    torch.testing.assert_close(saved["logits"][real], batched[real], rtol=1e-5, atol=1e-5)
    assert torch.equal(saved["input_ids"], ids) and torch.equal(saved["attention_mask"], mask)


def test_the_verification_batch_is_the_first_examples_cut_short_and_padded():
    """final_logits.safetensors holds the first 4 training examples (a packed block's one by one), their
    first LOGITS_TOKENS tokens each: a file of a few MB, not 4.2 GB for 2,048-token rows at a 128k vocab."""
    from finetune.train.runner import LOGITS_BATCH, LOGITS_TOKENS
    from finetune.train.sft import fixed_batch

    long = list(range(10, 10 + 3 * LOGITS_TOKENS))
    packed = {"input_ids": [5, 6, 7] + long, "labels": [-100, 6, 7] + long,
              "position_ids": [0, 1, 2] + list(range(len(long)))}  # two examples in one block
    rows = [packed, {"input_ids": [8, 9], "labels": [8, 9]}, {"input_ids": [3] * 5, "labels": [3] * 5},
            {"input_ids": [4] * 7, "labels": [4] * 7}]
    batch = fixed_batch(rows, 0, LOGITS_BATCH, LOGITS_TOKENS)
    assert batch["input_ids"].shape == (LOGITS_BATCH, LOGITS_TOKENS) and "position_ids" not in batch
    assert batch["input_ids"][0, :3].tolist() == [5, 6, 7] and batch["attention_mask"][0].sum() == 3
    assert batch["input_ids"][1].tolist() == long[:LOGITS_TOKENS] and batch["attention_mask"][1].all()
    assert batch["input_ids"][2, :2].tolist() == [8, 9] and batch["attention_mask"][3].sum() == 5
