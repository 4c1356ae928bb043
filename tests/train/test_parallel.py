"""parallel.sequence / parallel.tensor / model.rope_scaling without training (fast): the schema, what is rendered
for DeepSpeed and the Trainer, the runner's ParallelismConfig and collator, lint R140-R148 with the library
failures they stand for, the doctor's floors, and resuming on another process count up to the conversion.
The training runs are in tests/launches/test_parallel.py (slow)."""

from __future__ import annotations

import pytest

from finetune.lint import LintOptions, lint_paths
from tests.conftest import MINIMAL, REPO, hub_recipe

TINY = "model:\n  name_or_path: builtin:tiny-llama\ndata:\n  path: org/d\n"  # 4 heads, 2 kv-heads, 512 positions


def rules_of(path, **options):
    return [(f.rule, f.severity, f.key) for f in lint_paths([path], LintOptions(**options)).findings]


# ------------------------------------------------------------------------------------------------
# Schema and rendering


def test_parallel_defaults_and_bounds():
    from pydantic import ValidationError

    recipe = hub_recipe()
    assert (recipe.parallel.sequence, recipe.parallel.tensor) == (1, 1)
    with pytest.raises(ValidationError):
        hub_recipe(parallel={"sequence": 0})
    with pytest.raises(ValidationError):
        hub_recipe(parallel={"pipeline": 2})


def test_batch_arithmetic_counts_data_parallel_groups_only():
    from finetune.render import batch_arithmetic

    recipe = hub_recipe(parallel={"sequence": 4}, training={"micro_batch_size": 1, "gradient_accumulation_steps": 2},
                        data={"path": "org/d", "max_length": 131072}, launch={"procs_per_node": 8})
    out = batch_arithmetic(recipe)
    assert recipe.data_parallel_size == 2
    assert (out["data_parallel"], out["sequences_per_step"], out["tokens_per_process"]) == (2, 4, 32768)
    assert out["max_tokens_per_step"] == 4 * 131072
    assert "8 processes = 2 data-parallel x 4 sequence x 1 tensor" in out["explanation"]
    bad = batch_arithmetic(hub_recipe(parallel={"sequence": 3}, launch={"procs_per_node": 8}))
    assert bad["data_parallel"] is None and "divisible by 3" in bad["explanation"]


def test_render_sequence_parallel():
    from finetune.render import render_deepspeed, render_training_args

    recipe = hub_recipe(parallel={"sequence": 2}, launch={"procs_per_node": 4})
    ds = render_deepspeed(recipe)
    # zero.Init (no mpu: 4 processes) and the engine (world / sp = 2) check different worlds: HF fills it
    assert ds["train_batch_size"] == "auto" and "tensor_parallel" not in ds
    args = render_training_args(recipe)
    assert args["parallelism_config"] == {"sp_backend": "deepspeed", "sp_size": 2, "sp_handler": {
        "sp_seq_length_is_variable": True, "sp_attn_implementation": "sdpa"}}
    assert "parallelism_config" not in render_training_args(hub_recipe())


def test_render_autotp():
    from finetune.render import render_deepspeed

    recipe = hub_recipe(parallel={"tensor": 2}, deepspeed={"stage": 1}, launch={"procs_per_node": 4},
                        training={"micro_batch_size": 2})
    ds = render_deepspeed(recipe)
    assert ds["tensor_parallel"] == {"autotp_size": 2}
    assert ds["train_batch_size"] == 2 * 1 * 4  # DeepSpeed's config counts AutoTP ranks (no mpu)
    assert ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True  # shards gathered on save


# ------------------------------------------------------------------------------------------------
# The runner's side


def test_parallelism_config_names_the_data_parallel_size():
    from accelerate.parallelism_config import ParallelismConfig

    from finetune.render import render_training_args
    from finetune.train.parallel import ParallelError, training_arguments

    args = render_training_args(hub_recipe(parallel={"sequence": 2}, model={"name_or_path": "m",
                                                                             "attn_implementation": "flash_attention_2"}))
    config = training_arguments(args, world_size=4)["parallelism_config"]
    assert isinstance(config, ParallelismConfig)
    assert (config.sp_size, config.sp_backend, config.dp_shard_size, config.data_parallel_size) == (2, "deepspeed", 2, 2)
    assert config.sp_handler.sp_attn_implementation == "flash_attention_2"
    assert training_arguments(args, world_size=2)["parallelism_config"].data_parallel_size == 1
    with pytest.raises(ParallelError, match="does not divide the 3 processes"):
        training_arguments(args, world_size=3)


def test_sequence_parallel_collator_pads_to_a_multiple_and_adds_positions():
    import torch

    from finetune.data.packing import Collator, FlatteningCollator
    from finetune.train.parallel import SequenceParallelCollator

    rows = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8, 9], "labels": [8, 9]}]
    batch = SequenceParallelCollator(Collator(0), sp=3, pad_token_id=0)(rows)
    assert batch["input_ids"].shape == (2, 9)  # the collator's 8, then a multiple of 3
    assert batch["position_ids"][0].tolist() == list(range(8)) + [0]
    assert batch["labels"][0, 3:].eq(-100).all() and batch["attention_mask"][1].tolist() == [1, 1] + [0] * 7
    fixed = SequenceParallelCollator(Collator(0), sp=2, pad_token_id=0, width=15)(rows)
    assert fixed["input_ids"].shape == (2, 16)  # gloo: one width for every batch
    flat = SequenceParallelCollator(FlatteningCollator(flash_kwargs=True), sp=2, pad_token_id=0)(rows)
    assert "cu_seq_lens_q" not in flat and flat["input_ids"].shape[1] % 2 == 0
    assert torch.equal(flat["position_ids"][0, :5], torch.tensor([0, 1, 2, 0, 1]))


def test_rope_scaling_is_merged_into_the_config(tiny_cache):
    from finetune.builtin import builtin_model_dir
    from finetune.train.parallel import rope_scaled_config

    recipe = hub_recipe(model={"name_or_path": "builtin:tiny-llama", "rope_scaling": {"rope_type": "yarn", "factor": 4}})
    config = rope_scaled_config(str(builtin_model_dir("builtin:tiny-llama", tiny_cache)), recipe.model)
    assert config.rope_parameters["rope_type"] == "yarn" and config.rope_parameters["factor"] == 4
    assert config.rope_parameters["rope_theta"] == 10000.0  # kept from the model's own parameters
    assert config.rope_parameters["original_max_position_embeddings"] == 512 and config.max_position_embeddings == 2048


def test_rope_scaling_keys_of_the_type():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="low_freq_factor and high_freq_factor"):
        hub_recipe(model={"name_or_path": "m", "rope_scaling": {"rope_type": "llama3", "factor": 8}})
    with pytest.raises(ValidationError, match="do not apply to rope_type linear"):
        hub_recipe(model={"name_or_path": "m", "rope_scaling": {"rope_type": "linear", "factor": 2, "beta_fast": 32}})


# ------------------------------------------------------------------------------------------------
# Lint


def test_tiny_long_context_recipe_is_clean():
    assert rules_of(REPO / "recipes" / "tiny" / "long_context_sp2.yaml") == []


@pytest.mark.parametrize("extra,expected", [
    ({"parallel": {"sequence": 3}, "launch": {"procs_per_node": 4}}, ("R140", "error", "parallel.sequence")),
    ({"parallel": {"sequence": 3}, "launch": {"procs_per_node": 3}}, ("R141", "error", "parallel.sequence")),  # 4 heads, 2 kv
    ({"parallel": {"sequence": 8}, "launch": {"procs_per_node": 8}}, ("R141", "error", "parallel.sequence")),  # 4 heads
    ({"parallel": {"tensor": 4}, "deepspeed": {"stage": 1}, "launch": {"procs_per_node": 4}},
     ("R141", "warning", "parallel.tensor")),
    ({"model": {"attn_implementation": "eager"}, "parallel": {"sequence": 2}}, ("R142", "error", "model.attn_implementation")),
    ({"parallel": {"tensor": 2}, "deepspeed": {"stage": 3}}, ("R143", "error", "parallel.tensor")),
    ({"parallel": {"tensor": 2, "sequence": 2}}, ("R143", "error", "parallel.tensor")),
    ({"parallel": {"sequence": 2}, "data": {"packing": True}}, ("R144", "error", "data.packing")),
    ({"parallel": {"sequence": 2}, "objective": "dpo"}, ("R145", "error", "parallel.sequence")),
    ({"parallel": {"sequence": 2}, "training": {"gradient_accumulation_steps": 2}},
     ("R146", "info", "training.gradient_accumulation_steps")),
    ({"data": {"max_length": 2048}}, ("R147", "warning", "data.max_length")),
    ({"model": {"rope_scaling": {"rope_type": "yarn", "factor": 2}}, "data": {"max_length": 2048}},
     ("R147", "warning", "model.rope_scaling.factor")),
    ({"parallel": {"tensor": 2}, "method": "qlora"}, ("R148", "error", "parallel.tensor")),
    ({"parallel": {"tensor": 2}, "method": "lora", "deepspeed": {"stage": 1}}, ("R148", "error", "parallel.tensor")),
    ({"parallel": {"sequence": 2}, "deepspeed": {"stage": 2}}, ("R149", "warning", "parallel.sequence")),
])
def test_parallel_rules(write_recipe, extra, expected):
    import json

    from finetune.render import deep_merge

    recipe = deep_merge({"model": {"name_or_path": "builtin:tiny-llama"}, "data": {"path": "org/d", "max_length": 256}}, extra)
    assert expected in rules_of(write_recipe(json.dumps(recipe)))  # JSON is YAML


def test_rope_scaling_covering_the_length_is_clean(write_recipe):
    path = write_recipe(TINY.replace("builtin:tiny-llama\n", "builtin:tiny-llama\n  rope_scaling: {rope_type: yarn, factor: 4}\n")
                        + "  max_length: 2048\n")
    assert [r for r in rules_of(path) if r[0] == "R147"] == []


def test_sequence_a_multiple_of_the_kv_heads_is_allowed(write_recipe):
    # DeepSpeed replicates kv-heads when sp is a multiple of their count (kv_replication_factor)
    path = write_recipe(TINY + "  max_length: 256\nparallel:\n  sequence: 4\nlaunch:\n  procs_per_node: 4\n"
                        "deepspeed:\n  stage: 3\n")
    assert rules_of(path) == []


def test_unknown_model_skips_the_shape_rules(write_recipe):
    assert rules_of(write_recipe(MINIMAL + "parallel:\n  sequence: 2\ndeepspeed:\n  stage: 3\n")) == []


def test_eager_is_what_accelerate_refuses_for_ulysses():
    """R142's oracle: accelerate's DeepSpeed SP handler refuses eager before DeepSpeed sees it."""
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    with pytest.raises(ValueError, match="eager"):
        DeepSpeedSequenceParallelConfig(sp_attn_implementation="eager")


def test_autotp_with_zero3_is_what_transformers_refuses():
    """R143's oracle: transformers' ZeRO-3 loading path with an AutoTP config (the error a 2-process run hits in
    from_pretrained; DeepSpeed's engine itself would accept it)."""
    from transformers.integrations.deepspeed import (HfDeepSpeedConfig, _apply_weight_conversions_to_state_dict,
                                                     unset_hf_deepspeed_config)

    config = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "tensor_parallel": {"autotp_size": 2},
                                "train_micro_batch_size_per_gpu": 1})
    try:
        with pytest.raises(NotImplementedError, match="DeepSpeed Tensor Parallelism"):
            list(_apply_weight_conversions_to_state_dict(None, {}, []))  # a generator: runs when iterated
    finally:
        unset_hf_deepspeed_config()
        del config


def test_ulysses_head_rule_matches_deepspeed_arithmetic():
    """R141 restates UlyssesSPAttentionHF's two conditions; check them on the source we depend on."""
    import inspect

    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    source = inspect.getsource(UlyssesSPAttentionHF.__init__)
    assert "self.attn_head_count % self.world_size != 0" in source
    assert "self.global_kv_head_count % self.world_size == 0 or self.world_size % self.global_kv_head_count == 0" in source


def test_doctor_checks_the_floors():
    from finetune.run.doctor import Facts, parallel_checks

    facts = Facts(python="3.11", platform="linux", packages={"deepspeed": "0.17.0", "accelerate": "1.15.0",
                                                               "transformers": "5.23.0"})
    failed = [c.name for c in parallel_checks(hub_recipe(parallel={"sequence": 2}), facts) if c.status == "fail"]
    assert failed == ["ulysses.deepspeed"]
    assert [c for c in parallel_checks(hub_recipe(parallel={"tensor": 2}), facts) if c.status != "ok"] == []  # >= 0.16.4


# ------------------------------------------------------------------------------------------------
# Resume on another process count


def _fields(world, accumulation=1, sequence=1):
    return {"world_size": world, "training.micro_batch_size": 4, "training.gradient_accumulation_steps": accumulation,
            "parallel.sequence": sequence, "training.learning_rate": 1e-3}


def test_process_count_change_keeping_the_rows_per_step_resumes():
    from finetune.rundir.resume_key import process_count_change

    blocking, note = process_count_change(_fields(2), _fields(1, accumulation=2))
    assert blocking == [] and "process count 2 -> 1 with the same 8 sequences per step" in note

    blocking, note = process_count_change(_fields(2, sequence=2), _fields(1))  # a Ulysses pair -> one process
    assert blocking and "cannot be converted" in note and "resume on 2 processes" in note  # deepspeed 0.19.8


def test_process_count_change_that_changes_the_batch_says_how():
    from finetune.rundir.resume_key import process_count_change

    blocking, note = process_count_change(_fields(2), _fields(1))
    assert blocking == ["world size (processes): 2 -> 1"]
    assert note == "to resume on 1 processes keep 8 sequences per step: set training.gradient_accumulation_steps: 2"
    blocking, _ = process_count_change(_fields(2), {**_fields(1, accumulation=2), "training.learning_rate": 2e-3})
    assert "training.learning_rate: 0.001 -> 0.002" in blocking  # any other change still blocks


def test_plan_resume_allows_exactly_a_process_count_change(tmp_path):
    from finetune.rundir.checkpoint import plan_resume, publish
    from finetune.rundir.resume_key import RESUME_KEY_FILE, resume_fields, resume_key_text

    resolved = {"model": {"name_or_path": "m"}, "method": "lora", "data": {"path": "d"},
                "training": {"micro_batch_size": 4, "gradient_accumulation_steps": 1}, "deepspeed": {"stage": 2}}
    (tmp_path / RESUME_KEY_FILE).write_text(resume_key_text(resume_fields(resolved, 2)))
    (tmp_path / "checkpoint-3").mkdir()
    publish(tmp_path / "checkpoint-3", 3, {"world_size": 2})
    same_rows = {**resolved, "training": {"micro_batch_size": 4, "gradient_accumulation_steps": 2}}
    plan = plan_resume(tmp_path, same_rows, 1, nodes=1, resume=True, force=False)
    assert plan.error is None and plan.checkpoint.step == 3
    assert any("universal format" in n for n in plan.notes)
    plan = plan_resume(tmp_path, resolved, 1, nodes=1, resume=True, force=False)
    assert "set training.gradient_accumulation_steps: 2" in plan.error and "--force-resume" in plan.error


def test_conversion_failure_is_one_clear_line(tmp_path):
    import subprocess

    from finetune.rundir.checkpoint import publish
    from finetune.train.universal import UniversalCheckpointError, convert, saved_world_size

    checkpoint = tmp_path / "checkpoint-3"
    (checkpoint / "global_step3").mkdir(parents=True)
    (checkpoint / "latest").write_text("global_step3")
    publish(checkpoint, 3, {"world_size": 2})
    assert saved_world_size(checkpoint) == 2

    def failing(argv, **kwargs):
        assert argv[1:3] == ["-m", "deepspeed.checkpoint.ds_to_universal"] and "--inject_missing_state" in argv
        return subprocess.CompletedProcess(argv, 1, "", "Traceback ...\nAssertionError: no optimizer states\n")

    with pytest.raises(UniversalCheckpointError, match="ds_to_universal: AssertionError: no optimizer states"):
        convert(checkpoint, run=failing)
    assert not (checkpoint / "latest_universal").exists() and not list(checkpoint.glob(".*partial"))


def test_conversion_reads_and_writes_only_inside_the_checkpoint(tmp_path):
    """Issue 34 item 1: a `latest` naming a folder outside (here `../../X`) was converted, and the universal
    copy written beside it, outside the checkpoint; links the conversion writes through are replaced instead."""
    import subprocess

    from finetune.rundir.checkpoint import publish
    from pathlib import Path

    from finetune.train.universal import UniversalCheckpointError, convert

    outside = tmp_path / "X"
    (outside / "global_step3").mkdir(parents=True)
    checkpoint = tmp_path / "run" / "checkpoint-3"
    (checkpoint / "global_step3").mkdir(parents=True)
    publish(checkpoint, 3, {"world_size": 2})
    calls = []

    def converter(argv, **kwargs):
        calls.append(argv)
        Path(argv[argv.index("--output_folder") + 1], "zero").mkdir(parents=True)
        return subprocess.CompletedProcess(argv, 0, "", "")

    for tag in ("../../X/global_step3", str(outside / "global_step3")):
        (checkpoint / "latest").write_text(tag)
        with pytest.raises(UniversalCheckpointError, match="outside"):
            convert(checkpoint, run=converter)
    assert not calls and sorted(p.name for p in tmp_path.iterdir()) == ["X", "run"]
    assert list(outside.iterdir()) == [outside / "global_step3"]
    (checkpoint / "latest").write_text("global_step3")
    (checkpoint / ".global_step3_universal.partial").symlink_to(outside, target_is_directory=True)
    with pytest.raises(UniversalCheckpointError, match="partial is a link to .*outside"):
        convert(checkpoint, run=converter)
    # links that stay inside are replaced, never written through
    (checkpoint / ".global_step3_universal.partial").unlink()
    (checkpoint / ".global_step3_universal.partial").symlink_to(checkpoint / "global_step3", target_is_directory=True)
    (checkpoint / "latest_universal").symlink_to(checkpoint / "global_step3" / "x")
    target = convert(checkpoint, run=converter)
    assert target == checkpoint / "global_step3_universal" and (target / "zero").is_dir()
    assert not (checkpoint / "latest_universal").is_symlink() and (checkpoint / "latest_universal").read_text() == target.name
    assert not list((checkpoint / "global_step3").iterdir()) and list(outside.iterdir()) == [outside / "global_step3"]


# ------------------------------------------------------------------------------------------------
# ALST's tiled MLP


@pytest.mark.parametrize("method", ["full", "lora"])
def test_tiled_mlp_equals_the_plain_mlp(tiny_cache, method):
    """training.tiled_mlp: same loss and gradients as the plain forward (DeepSpeed's TiledMLP recomputes each
    slice in backward), on the tiny model with 4 slices per MLP call."""
    import torch
    from transformers import AutoModelForCausalLM

    from finetune.builtin import builtin_model_dir
    from finetune.train.parallel import use_tiled_mlp

    path = str(builtin_model_dir("builtin:tiny-llama", tiny_cache))
    torch.manual_seed(0)
    ids = torch.randint(3, 700, (2, 32))
    results = []
    for tiled in (False, True):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        if method == "lora":
            from peft import LoraConfig, get_peft_model

            torch.manual_seed(1)
            model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
        if tiled:
            assert use_tiled_mlp(model, shards=4) == model.config.num_hidden_layers
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        results.append((loss.item(), grads))
    (plain, plain_grads), (tiled_loss, tiled_grads) = results
    assert tiled_loss == pytest.approx(plain, rel=1e-6)
    assert plain_grads.keys() == tiled_grads.keys()
    for name, grad in plain_grads.items():
        torch.testing.assert_close(tiled_grads[name], grad, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# The planner


def _plan(**sections):
    from finetune.plan import plan, setup_from_recipe

    recipe = hub_recipe(**{"model": {"name_or_path": "meta-llama/Llama-3.1-8B-Instruct", "attn_implementation":
                                     "flash_attention_2"},
                           "data": {"path": "org/d", "max_length": 65536}, "deepspeed": {"stage": 3},
                           "launch": {"procs_per_node": 8},
                           "hardware": {"gpus": 8, "gpu_memory": "80GiB", "gpu_type": "H100"}, **sections})
    return plan(setup_from_recipe(recipe))


def _term(result, name):
    return sum(t.bytes for t in result.terms if t.name == name)


def test_ulysses_divides_activations_and_logits_and_adds_the_all_to_all():
    one, eight = _plan(), _plan(parallel={"sequence": 8})
    assert eight.setup.seq_len == 65536 // 8 and eight.setup.sequence == 8
    assert _term(eight, "loss working set") * 8 == _term(one, "loss working set")  # fp32 logits: per token
    assert _term(eight, "layer inputs (checkpointed)") * 8 == _term(one, "layer inputs (checkpointed)")
    llama = one.setup.arch  # 32 heads, 8 kv-heads, 128 per head, bf16: send + receive of q, k, v, out
    assert _term(eight, "Ulysses all-to-all buffers") == 2 * 8192 * (2 * 32 + 2 * 8) * 128 * 2 and llama.heads == 32
    assert _term(one, "Ulysses all-to-all buffers") == 0
    assert eight.field_bytes("weights") == one.field_bytes("weights")  # ZeRO-3 still shards over all 8


def test_autotp_splits_the_layer_weights():
    from finetune.plan import apply_parallel, plan, setup_from_recipe

    recipe = hub_recipe(model={"name_or_path": "meta-llama/Llama-3.1-8B-Instruct"}, method="full",
                        deepspeed={"stage": 0}, launch={"procs_per_node": 2})
    whole = setup_from_recipe(recipe, parallel=False)
    split = apply_parallel(whole, tensor=2)
    assert (split.arch.heads, split.arch.kv_heads, split.arch.intermediate) == (16, 4, 7168)
    embeddings = 2 * 128256 * 4096  # embed_tokens and lm_head stay whole
    assert split.params == pytest.approx(embeddings + (whole.params - embeddings) / 2, rel=1e-3)
    assert split.world == 1  # ZeRO partitions over the data-parallel processes only
    assert plan(split).field_bytes("weights") < 0.6 * plan(whole).field_bytes("weights")


def test_longest_sequence_grows_with_the_sequence_degree():
    from finetune.plan import longest_sequence, setup_from_recipe

    recipe = hub_recipe(model={"name_or_path": "meta-llama/Llama-3.1-8B-Instruct", "attn_implementation":
                               "flash_attention_2"}, deepspeed={"stage": 3}, launch={"procs_per_node": 8},
                        training={"loss_kernel": "chunked"}, hardware={"gpus": 8, "gpu_memory": "80GiB"})
    base = setup_from_recipe(recipe, parallel=False)
    lengths = [longest_sequence(base, sp) for sp in (1, 2, 4, 8)]
    assert all(a < b for a, b in zip(lengths, lengths[1:])) and lengths[0] > 32768
    assert all(n % 1024 == 0 for n in lengths)


def test_plan_recommend_prints_the_long_context_table():
    from tests.conftest import run_cli

    out = run_cli("plan", str(REPO / "recipes" / "llama3" / "8b_128k_sp8_8xh100.yaml"), "--recommend")
    assert out.returncode == 0, out.stderr
    assert "max_length 131,072: fits with parallel.sequence:" in out.stdout
    assert "Ulysses all-to-all buffers" in out.stdout
    table = out.stdout.split("longest sequence (tokens)")[1].strip().splitlines()
    assert [int(line.split()[0]) for line in table] == [1, 2, 4, 8]


def test_activation_offload_is_rendered_and_dropped_without_an_accelerator(tiny_cache):
    """training.activation_offload: transformers' activation_checkpointing_enable(offload=True). Here (no GPU) the
    runner gives the Trainer plain checkpointing: transformers 5.23 would ask for pinned memory, which CPU-only
    torch refuses ("pin_memory=True requires a CUDA or other accelerator backend"). The offload itself is untested."""
    import torch
    from pydantic import ValidationError
    from transformers import AutoModelForCausalLM

    from finetune.builtin import builtin_model_dir
    from finetune.render import render_training_args
    from finetune.train.model import prepare_model
    from finetune.train.parallel import without_offload_on_cpu

    recipe = hub_recipe(method="full", training={"activation_offload": True})
    args = render_training_args(recipe)
    assert args["gradient_checkpointing_kwargs"] == {"use_reentrant": False, "offload": True}
    with pytest.raises(ValidationError, match="needs gradient_checkpointing"):
        hub_recipe(training={"activation_offload": True, "gradient_checkpointing": False})
    said = []
    assert without_offload_on_cpu(args, said.append)["gradient_checkpointing_kwargs"] == {"use_reentrant": False}
    assert "no accelerator" in said[0]
    model = prepare_model(AutoModelForCausalLM.from_pretrained(str(builtin_model_dir("builtin:tiny-llama", tiny_cache))),
                          recipe)
    ids = torch.arange(3, 67).view(2, 32)
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()  # plain checkpointing, no pinned-memory error


def test_who_converts_and_when(tmp_path, monkeypatch):
    from finetune.rundir.checkpoint import publish
    from finetune.train.universal import converts_here, prepare_resume

    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert not converts_here({})  # a shared run directory: global rank 0 only
    assert converts_here({"checkpoint": {"use_node_local_storage": True}})  # each node's copy
    checkpoint = tmp_path / "checkpoint-3"
    checkpoint.mkdir()
    publish(checkpoint, 3, {"world_size": 2})
    config = {"zero_optimization": {"stage": 2}}
    # the same process count, or no checkpoint: the config as it was, nothing converted
    assert prepare_resume(str(checkpoint), config, 2, True, print) is config
    assert prepare_resume(None, config, 1, True, print) is config


def test_activation_offload_moves_the_checkpointed_inputs_to_the_host():
    plain, offloaded = _plan(), _plan(training={"activation_offload": True})
    inputs = _term(plain, "layer inputs (checkpointed)")  # 32 layers x 65,536 tokens x 4096 x 2 B
    assert inputs == 32 * 65536 * 4096 * 2
    assert _term(offloaded, "layer inputs (checkpointed)") == 0
    assert _term(offloaded, "layer input being recomputed") == inputs // 32
    cpu = sum(t.bytes for t in offloaded.cpu_terms if t.name == "offloaded layer inputs (pinned)")
    assert cpu == (inputs - inputs // 32) * 8  # per node: 8 processes
    assert plain.per_gpu["total"] - offloaded.per_gpu["total"] >= inputs - inputs // 32


def test_tiled_mlp_shrinks_the_recomputed_layer():
    plain = _plan(training={"loss_kernel": "chunked"})  # small loss buffers: the recompute term shows whole
    tiled = _plan(training={"loss_kernel": "chunked", "tiled_mlp": True})
    assert tiled.setup.tiled_mlp_shards == 16  # 65,536 tokens / hidden 4096
    e, tokens, inter, hidden = 2, 65536, 14336, 4096
    mlp = tokens * e * (3 * inter + (5 * inter - 4 * hidden) // 2)
    drop = _term(plain, "layer recompute + gradients") - _term(tiled, "layer recompute + gradients")
    assert drop == mlp - mlp // 16 and _term(tiled, "layer recompute + gradients") > 0
