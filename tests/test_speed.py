"""Issue 35, fast parts: the steady-state figures (finetune.speed), the host-side counts of a batch, `auto` decided by
the plan (finetune.plan.auto) and recorded in the run directory, lint's R150-R153, and the per-step stop flag
(no per-step collective; the last step finishes the run: issue 34).

    python -m pytest tests/test_speed.py
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from finetune.plan.archs import BY_NAME
from finetune.recipe import Recipe
from finetune.speed import WARMUP_STEPS, flops_per_token, matmul_params, peak_bf16_flops, steady, steady_text

# ------------------------------------------------------------------------------------------------
# finetune.speed


def test_steady_leaves_out_the_warm_up_steps():
    # a slow first step (warm-up), then 1 s per step at 1,000 tokens a step (sum of squared lengths 2 x 500^2)
    stamps = [0.0, 30.0] + [30.0 + i for i in range(1, 11)]
    tokens, squares = [1000] * 11, [2 * 500 ** 2] * 11
    out = steady(stamps, tokens, squares, world=1)
    assert out["steps"] == 11 - WARMUP_STEPS and out["tokens_per_second"] == pytest.approx(1000.0)
    assert out["step_seconds_p50"] == pytest.approx(1.0) and out["step_seconds_p90"] == pytest.approx(1.0)
    assert out["mfu"] is None and out["reason"] is None  # no architecture: no FLOPs
    assert "steady 1,000 tokens/s over steps 6-11" in steady_text(out)
    assert out["per_step"] == {"seconds": [1.0] * 6, "tokens": [1000] * 6}  # the window's steps, one by one
    short = steady(stamps[:WARMUP_STEPS + 2], tokens, squares)
    assert short["tokens_per_second"] is None and "needs 7" in short["reason"] and "n/a" in steady_text(short)
    assert steady([], [], [])["steps"] == 0  # a start that trained nothing (resumed at its last step)


def test_mfu_uses_the_anchors_flops_basis_and_the_datasheet_peak():
    arch = BY_NAME["llama-3-8b"]
    # every matmul weight: all parameters but the embedding lookup and the 65 norms (torchtitan, PaLM appendix B)
    assert matmul_params(arch) == 8_030_261_248 - 128_256 * 4096 - 65 * 4096
    assert flops_per_token(arch, 2048) == 6 * matmul_params(arch) + 12 * 32 * 4096 * 2048
    peak, source = peak_bf16_flops("NVIDIA H100 80GB HBM3")
    assert peak == 989e12 and "H100" in source
    assert peak_bf16_flops("NVIDIA H100 PCIe")[0] == 756e12 and peak_bf16_flops("NVIDIA H200")[0] == 989e12
    assert peak_bf16_flops("NVIDIA A100-SXM4-80GB")[0] == 312e12 and peak_bf16_flops("Tesla P40") == (None, None)
    stamps = [float(i) for i in range(WARMUP_STEPS + 11)]  # 1 s a step
    steps = len(stamps) - 1
    out = steady(stamps, [2048] * steps, [2048 ** 2] * steps, world=1, arch=arch, peak_flops=peak)
    assert out["mfu"] == pytest.approx(2048 * flops_per_token(arch, 2048) / 989e12)


# ------------------------------------------------------------------------------------------------
# The collators' host-side counts


def test_collators_count_trained_tokens_and_squared_lengths_on_the_host():
    import torch

    from finetune.data.packing import COUNTS_KEY, Collator, FlatteningCollator

    rows = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8] * 10, "labels": [8] * 10}]
    batch = Collator(0, counts=True)(rows)
    assert batch[COUNTS_KEY] == (13, 3 * 3 + 10 * 10)
    assert batch["input_ids"].shape == (2, 16) and batch["input_ids"].dtype == torch.long
    assert batch["attention_mask"].sum().item() == 13 and batch["labels"][0, 3:].eq(-100).all()
    assert COUNTS_KEY not in Collator(0)(rows)  # the verification batch: plain tensors only
    packed = [{"input_ids": [1] * 7, "labels": [1] * 7, "position_ids": [0, 1, 2, 0, 1, 2, 3]}]
    assert Collator(0, counts=True)(packed)[COUNTS_KEY] == (7, 3 * 3 + 4 * 4)
    assert FlatteningCollator(False, counts=True)(packed)[COUNTS_KEY] == (7, 3 * 3 + 4 * 4)
    # padded to a multiple for the GPU (data.pad_to_multiple_of): the counts are still the rows' own tokens
    bucketed = Collator(0, counts=True, bucket=64)
    assert bucketed(rows)[COUNTS_KEY] == (13, 3 * 3 + 10 * 10) and bucketed(rows)["input_ids"].shape == (2, 64)
    assert bucketed(packed)[COUNTS_KEY] == (7, 3 * 3 + 4 * 4) and bucketed(rows[1:])["input_ids"].shape == (1, 64)


# ------------------------------------------------------------------------------------------------
# auto, decided by the plan


def recipe(method: str = "lora", **training) -> Recipe:
    data = {"model": {"name_or_path": "qwen2.5-0.5b"}, "data": {"path": "org/d", "max_length": 2048},
            "method": method, "training": training}
    return Recipe.model_validate(data)


def test_total_flos_is_transformers_count_with_the_parameters_counted_once(tmp_path):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from finetune.train.counting import CountingTrainer

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, target_modules="all-linear"))
    trainer = CountingTrainer(model=model, args=TrainingArguments(str(tmp_path), report_to=[], use_cpu=True))
    walks = []
    count = model.num_parameters
    model.num_parameters = lambda **kwargs: walks.append(kwargs) or count(**kwargs)
    batches = [{"input_ids": torch.zeros(n, 16, dtype=torch.long)} for n in (1, 3, 2)]
    assert [trainer.floating_point_ops(b) for b in batches] == [Trainer.floating_point_ops(trainer, b) for b in batches]
    assert len(walks) == 1 + 3  # ours once, the Trainer's on every call
    assert trainer.floating_point_ops({"labels": torch.zeros(1, 4)}) == 0  # no input ids: nothing, as transformers


def test_auto_without_a_machine_is_the_memory_safe_default():
    r = recipe()
    assert r.auto_keys == {"training.gradient_checkpointing", "training.loss_kernel", "training.micro_batch_size",
                           "deepspeed.enabled", "data.pad_to_multiple_of"}
    t = r.training
    assert (t.gradient_checkpointing, t.loss_kernel, t.micro_batch_size, r.deepspeed.enabled) == (True, "default", 1, True)
    assert r.data.pad_to_multiple_of == 1  # each micro batch as long as its longest row, as before the key
    written = recipe(gradient_checkpointing=False, micro_batch_size=4)
    assert written.auto_keys == {"training.loss_kernel", "deepspeed.enabled", "data.pad_to_multiple_of"}


def test_auto_pads_micro_batches_to_few_lengths_on_a_gpu_only():
    """data.pad_to_multiple_of: auto is 64 on a GPU for sft (cuDNN's attention plans each new length once), 1 on a
    CPU, for the objectives TRL collates and for padding_free; a written value wins."""
    from finetune.data.packing import GPU_PAD_MULTIPLE
    from finetune.plan.auto import Machine, resolve

    gpu = Machine(gpus_per_node=1, gpu_memory=24 * 2**30)
    decision = resolve(recipe(), gpu)
    assert decision.recipe.data.pad_to_multiple_of == GPU_PAD_MULTIPLE == 64
    line = next(x for x in decision.lines() if x.startswith("data.pad_to_multiple_of"))
    assert "at most 32 lengths up to max_length 2048" in line and "cuDNN" in line
    assert resolve(recipe(), Machine(on_gpu=False)).recipe.data.pad_to_multiple_of == 1
    dpo = Recipe.model_validate({"model": {"name_or_path": "qwen2.5-0.5b"}, "objective": "dpo",
                                 "data": {"path": "org/d"}})
    assert resolve(dpo, gpu).recipe.data.pad_to_multiple_of == 1
    flat = Recipe.model_validate({"model": {"name_or_path": "qwen2.5-0.5b"},
                                  "data": {"path": "org/d", "padding_free": True}})
    assert resolve(flat, gpu).recipe.data.pad_to_multiple_of == 1
    vlm = Recipe.model_validate({"model": {"name_or_path": "Qwen/Qwen2.5-VL-7B-Instruct"}, "data": {"path": "org/d"}})
    assert resolve(vlm, gpu).recipe.data.pad_to_multiple_of == 1  # the vision collator pads its own batches
    written = Recipe.model_validate({"model": {"name_or_path": "qwen2.5-0.5b"},
                                     "data": {"path": "org/d", "pad_to_multiple_of": 8}})
    assert "data.pad_to_multiple_of" not in written.auto_keys
    assert resolve(written, gpu).recipe.data.pad_to_multiple_of == 8
    with pytest.raises(ValueError, match="a number of tokens from 1 to 4,096"):
        Recipe.model_validate({"model": {"name_or_path": "qwen2.5-0.5b"},
                               "data": {"path": "org/d", "pad_to_multiple_of": 0}})


def test_auto_on_one_gpu_trains_faster_within_the_bound_and_keeps_the_rows_per_step():
    from finetune.plan.auto import Machine, resolve

    r = recipe(gradient_accumulation_steps=8)
    decided = resolve(r, Machine(gpus_per_node=1, gpu_memory=24 * 2**30)).recipe
    t = decided.training
    assert decided.deepspeed.enabled is False  # LoRA SFT on one GPU: the plain Trainer
    assert t.micro_batch_size * t.gradient_accumulation_steps == 8 and t.micro_batch_size > 1
    assert t.gradient_checkpointing is False and t.loss_kernel == "chunked"  # the logits would stand in the way
    lines = "\n".join(resolve(r, Machine(gpus_per_node=1, gpu_memory=24 * 2**30)).lines())
    assert "8 rows per GPU per step = micro batch" in lines and "upper bound" in lines
    small = resolve(r, Machine(gpus_per_node=1, gpu_memory=6 * 2**30)).recipe.training
    assert small.gradient_checkpointing is True and small.micro_batch_size * small.gradient_accumulation_steps == 8
    # a value the recipe writes wins; the rest is still decided around it
    kept = resolve(recipe(gradient_accumulation_steps=8, micro_batch_size=2, gradient_checkpointing=True),
                   Machine(gpus_per_node=1, gpu_memory=24 * 2**30)).recipe.training
    assert (kept.micro_batch_size, kept.gradient_accumulation_steps, kept.gradient_checkpointing) == (2, 8, True)


def test_auto_keeps_deepspeed_where_it_does_something_or_cannot_know():
    from finetune.plan.auto import Machine, resolve

    r = recipe()
    assert resolve(r, Machine(gpus_per_node=2, gpu_memory=80 * 2**30)).recipe.deepspeed.enabled is True
    assert resolve(r, Machine(on_gpu=False)).recipe.deepspeed.enabled is True  # CPU: DeepSpeed's CPU accelerator
    out = resolve(recipe("full"), Machine(gpus_per_node=1, gpu_memory=80 * 2**30))
    assert out.recipe.deepspeed.enabled is True and "fp32 master weights" in out.lines()[0]
    unknown = resolve(r, Machine(gpus_per_node=1)).recipe.training  # no GPU memory: the memory-safe values
    assert (unknown.gradient_checkpointing, unknown.loss_kernel, unknown.micro_batch_size) == (True, "default", 1)


def test_the_run_directory_keeps_auto_in_the_recipe_and_the_decisions_beside_it(tmp_path):
    from finetune.plan.auto import Machine, resolve
    from finetune.recipe import load_recipe
    from finetune.rundir.layout import read_run_dir, write_run_dir

    path = tmp_path / "r.yaml"
    path.write_text("model: {name_or_path: qwen2.5-0.5b}\ndata: {path: org/d}\n"
                    "training: {gradient_accumulation_steps: 8}\n")
    loaded = load_recipe(path)
    decision = resolve(loaded.recipe, Machine(gpus_per_node=1, gpu_memory=24 * 2**30))
    loaded.recipe = decision.recipe
    run = write_run_dir(loaded, tmp_path / "run", world_size=1, auto=decision)
    text = (run / "recipe.yaml").read_text()
    assert "micro_batch_size: auto" in text and "gradient_checkpointing: auto" in text and "enabled: auto" in text
    assert "pad_to_multiple_of: auto" in text
    args = json.loads((run / "training_args.json").read_text())
    assert args["per_device_train_batch_size"] == decision.recipe.training.micro_batch_size > 1
    assert args["optim"] == "adamw_torch_fused"  # the plain Trainer's optimizer
    again, _, _ = read_run_dir(run)  # what the runner trains: the decisions, not the machine-less defaults
    assert again.training == decision.recipe.training and again.deepspeed.enabled is False
    assert again.data.pad_to_multiple_of == 64
    # the record lints clean and decides the same on the same GPU (a recorded recipe reproduces the run)
    from finetune.lint import lint_paths

    assert not [f for f in lint_paths([run / "recipe.yaml"]).findings if f.rule >= "R150"]
    assert resolve(load_recipe(run / "recipe.yaml").recipe, Machine(gpus_per_node=1, gpu_memory=24 * 2**30)).values() \
        == decision.values()


def test_lint_explains_what_the_plain_trainer_cannot_run(write_recipe):
    from finetune.lint import lint_paths

    def rules(text: str) -> set[str]:
        return {f.rule for f in lint_paths([write_recipe(text)]).findings}

    base = "model: {name_or_path: org/m}\ndata: {path: org/d}\n"
    assert not rules(base) & {"R150", "R151", "R152", "R153"}
    assert "R150" in rules(base + "deepspeed: {enabled: false, offload_optimizer: cpu, stage: 2}\n")
    assert "R150" in rules(base + "deepspeed: {enabled: false}\nlaunch: {procs_per_node: 2}\n")
    assert "R151" in rules(base + "method: full\ndeepspeed: {enabled: false}\n")
    assert "R152" in rules(base + "deepspeed: {enabled: false, stage: 0}\n")
    assert "R153" in rules(base + "objective: dpo\ntraining: {micro_batch_size: auto}\n")


# ------------------------------------------------------------------------------------------------
# The stop flag and the last step (issue 34)


def test_a_stop_that_falls_on_the_last_step_finishes_the_run(tmp_path):
    from transformers import TrainerControl, TrainerState

    from finetune.train.preemption import AlreadyTrained, PreemptionCallback

    callback = PreemptionCallback(tmp_path, keep=2, dtype_bytes=4, full=False)
    state, control = TrainerState(), TrainerControl()
    state.global_step, state.max_steps = 12, 12
    callback.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        callback.on_step_end(None, state, control)
        assert not control.should_save and callback.stopped_at is None  # no checkpoint to train a 13th step from

        class Args:
            save_on_each_node = False

        callback.on_train_end(Args(), state, control)
        assert callback.finishing and signal.getsignal(signal.SIGTERM) == callback._on_signal  # outputs go on
    finally:
        callback.finished()
    assert signal.getsignal(signal.SIGTERM) != callback._on_signal
    resumed = PreemptionCallback(tmp_path, keep=2, dtype_bytes=4, full=False)
    with pytest.raises(AlreadyTrained):  # a checkpoint at the last step: outputs, not one more step
        resumed.on_train_begin(None, state, control)
    resumed.uninstall()


def test_the_launcher_calls_a_run_finished_when_the_ranks_wrote_it_after_a_signal(tmp_path):
    import time

    from finetune.run.launch.commands import LaunchPlan
    from finetune.run.launch.outcome import judge

    plan = LaunchPlan(argv=["torchrun"], env={}, run_dir=tmp_path, launcher="torchrun", procs_per_node=1, nodes=1,
                      node_rank=0, world_size=1, device="cpu")
    started = time.time()
    assert judge(plan, 1, "", signal.SIGTERM, started).returncode == 128 + signal.SIGTERM
    (tmp_path / "summary.json").write_text("{}")
    outcome = judge(plan, 1, "", signal.SIGTERM, started)
    assert outcome.ok and "after the last step" in outcome.message


def _flag_rank(rank: int, port: int, out: Path, signal_step: int, seconds: tuple) -> None:  # pragma: no cover
    """One of two gloo ranks (forked children): rank 1 is signalled before the end of `signal_step`; each rank's
    steps take seconds[rank] by the clock its StopAgreement reads. Writes [stopped at, signal name, exchanges]."""
    from datetime import timedelta

    import torch.distributed as dist
    from transformers import TrainerControl, TrainerState

    from finetune.train.dist import cpu_group
    from finetune.train.preemption import PreemptionCallback

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    callback = PreemptionCallback(out, keep=2, dtype_bytes=4, full=False, group=cpu_group(timedelta(seconds=60)))
    callback.first_estimate = 1
    state, control = TrainerState(), TrainerControl()
    state.max_steps = 40
    callback.agreement.clock = lambda: state.global_step * seconds[rank]
    for step in range(1, state.max_steps):
        state.global_step = step
        if step == signal_step and rank == 1:
            callback.signal_at, callback.signal_name = 1.0, "SIGTERM"
        callback.on_step_end(None, state, control)
        if control.should_training_stop:
            break
    (out / f"rank{rank}").write_text(json.dumps([callback.stopped_at, callback.signal_name,
                                                 callback.agreement.exchanges]))
    dist.destroy_process_group()


@pytest.mark.parametrize("signal_step, seconds, stop, exchanges", [
    (3, (0.1, 0.1), 4, 3),  # in the warm-up (5 steps): every step, the stop one step after the signal
    # then every 0.5 s: 5 steps of 0.1 s; exchanges at steps 1-6, 11, 16 (the one that carries the signal)
    (12, (0.1, 0.1), 17, 8),
    (12, (0.1, 0.25), 13, 9),  # the smallest gap any rank proposes: 2 steps of 0.25 s; 1-6, 8, 10, 12
])
def test_the_ranks_agree_on_the_stop_without_a_collective_every_step(tmp_path, signal_step, seconds, stop,
                                                                      exchanges):
    from transformers import TrainerState  # noqa: F401 - imported before the fork, for the children
    import torch.multiprocessing as mp

    from finetune.run.launch.commands import free_port

    # forked: the children have torch and transformers imported already (spawn would import them again, ~20 s)
    mp.start_processes(_flag_rank, args=(free_port(), tmp_path, signal_step, seconds), nprocs=2,
                       start_method="fork")
    assert json.loads((tmp_path / "rank0").read_text()) == [stop, "a signal to another rank", exchanges]
    assert json.loads((tmp_path / "rank1").read_text()) == [stop, "SIGTERM", exchanges]


def test_convert_says_a_checkpoint_without_deepspeed_needs_no_convert(tmp_path):
    from finetune.weights.convert import ConvertError, find_checkpoint

    checkpoint = tmp_path / "checkpoint-6"
    checkpoint.mkdir()
    (checkpoint / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(ConvertError, match="checkpoint of a run without DeepSpeed: .* already holds the adapter"):
        find_checkpoint(checkpoint)


OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.96 GiB. GPU 0 has a total capacity of 23.53 GiB "
       "of which 1.02 GiB is free. Of the allocated memory 20.11 GiB is allocated by PyTorch")


def test_out_of_gpu_memory_names_what_auto_chose_and_a_command_that_resumes_with_the_memory_safe_values(tmp_path):
    """An `auto` choice bets on the plan's bound; when a rank runs out of GPU memory anyway, `finetune train` says what
    auto chose and the flags that run the same command with the memory-safe values. The flags are checked against
    the run directory's own rules: --overwrite with no checkpoint, --force-resume where the micro batch changes."""
    from finetune.plan.auto import Machine, memory_safe_values, resolve
    from finetune.recipe import load_recipe
    from finetune.rundir import checkpoint as ckpt
    from finetune.rundir.layout import resolved_recipe, write_run_dir
    from finetune.run.launch.outcome import Outcome, RankFailure, out_of_memory_advice

    path = tmp_path / "r.yaml"
    path.write_text("model: {name_or_path: qwen2.5-0.5b}\ndata: {path: org/d, max_length: 2048}\n"
                    "training: {gradient_accumulation_steps: 8}\n")
    loaded = load_recipe(path)
    decision = resolve(loaded.recipe, Machine(gpus_per_node=1, gpu_memory=24 * 2**30))
    t = decision.recipe.training
    assert (t.gradient_checkpointing, t.micro_batch_size > 1, t.loss_kernel) == (False, True, "chunked")
    # every memory key auto decided is pinned: left auto, the micro batch would grow again with checkpointing on
    assert memory_safe_values(decision) == {"training.gradient_checkpointing": True, "training.loss_kernel": "chunked",
                                            "training.micro_batch_size": 1}
    sets = ["training.gradient_checkpointing=true", "training.loss_kernel=chunked", "training.micro_batch_size=1"]
    loaded.recipe = decision.recipe
    run = write_run_dir(loaded, tmp_path / "run", world_size=1, auto=decision)
    failed = Outcome(1, failures=[RankFailure(0, 0, 1, message=OOM)], message=f"rank 0 (local rank 0) exited with code 1: {OOM}")
    first, command, plan = out_of_memory_advice(failed, run, decision)
    assert f"`auto` chose training.gradient_checkpointing = false, training.micro_batch_size = {t.micro_batch_size}" in first
    assert command == (f"the same command with --overwrite --set {sets[0]} --set {sets[1]} --set {sets[2]} runs with "
                       "the memory-safe values; it starts again (no checkpoint was saved)")
    assert plan.startswith(f"`finetune plan {run / 'recipe.yaml'} --gpu-memory 23.53GiB --recommend`")
    assert out_of_memory_advice(Outcome(1, message="rank 0 exited with code 1: ValueError: bad row"), run, decision) == []

    # A checkpoint was saved: the rows per step stay 8 with micro batch 1, and only --force-resume accepts the change.
    saved = run / "checkpoint-4"
    saved.mkdir()
    (saved / "trainer_state.json").write_text(json.dumps({"global_step": 4}))
    ckpt.publish(saved, 4)
    [_, command, _] = out_of_memory_advice(failed, run, decision)
    assert command.startswith("the same command with --force-resume --set training.gradient_checkpointing=true")
    assert command.endswith("it resumes from checkpoint-4, the rows per optimizer step unchanged")

    def preflight(overrides: list[str]):  # what `finetune train RUN/recipe.yaml --set ...` decides and checks
        again = resolve(load_recipe(run / "recipe.yaml", overrides).recipe, Machine(gpus_per_node=1, gpu_memory=24 * 2**30))
        return again.recipe.training, lambda force: ckpt.plan_resume(run, resolved_recipe(again.recipe, run), 1, 1,
                                                                     resume=True, force=force)

    safe, resume = preflight(sets)
    assert (safe.gradient_checkpointing, safe.micro_batch_size, safe.gradient_accumulation_steps) == (True, 1, 8)
    assert "--force-resume" in resume(False).error
    assert resume(True).error is None and resume(True).checkpoint.step == 4
    # where auto's micro batch was 1 already, the same flags resume without --force-resume (checkpointing and the
    # loss kernel are not in the resume key)
    one = resolve(load_recipe(run / "recipe.yaml", ["training.micro_batch_size=1"]).recipe,
                  Machine(gpus_per_node=1, gpu_memory=24 * 2**30))
    [_, command, _] = out_of_memory_advice(failed, run, one)
    assert command.startswith("the same command with --set ") and command.endswith("it resumes from checkpoint-4")
    # the memory-safe values everywhere already: the planner's search, nothing to pin
    safe = resolve(load_recipe(run / "recipe.yaml", sets).recipe, Machine(gpus_per_node=1, gpu_memory=24 * 2**30))
    assert memory_safe_values(safe) == {}
    [only] = out_of_memory_advice(failed, run, safe)
    assert only.startswith("a rank ran out of GPU memory with memory settings `auto` did not choose for speed; "
                           "`finetune plan")


def test_a_rerun_that_runs_out_of_gpu_memory_too_ends_with_the_planners_search(tmp_path, monkeypatch, tiny_cache):
    """`finetune train` end to end but the launches (both runs out of GPU memory): auto decided on a (faked) 24 GiB
    GPU, the run again with the memory-safe values (tests/launches/test_launch.py trains it for real), and once that
    fails too, no third run: the error, and the planner's search for a setup that fits."""
    from typer.testing import CliRunner

    import finetune.run.decide as decide
    import finetune.run.start as start
    from finetune.cli import app
    from finetune.plan.auto import Machine
    from finetune.run.launch.outcome import Outcome, RankFailure

    monkeypatch.setenv("FINETUNE_CACHE", str(tiny_cache))
    monkeypatch.setattr(decide, "machine_from_facts", lambda *a: Machine(gpus_per_node=1, gpu_memory=24 * 2**30))
    launched = []

    def out_of_memory(prepared, **_):
        launched.append(prepared.loaded.recipe.training)
        prepared.release()
        return Outcome(1, failures=[RankFailure(0, 0, 1, message=OOM)], message=f"rank 0 (local rank 0) exited with code 1: {OOM}")

    monkeypatch.setattr(start, "start_run", out_of_memory)
    data = Path(__file__).resolve().parent.parent / "recipes" / "data" / "demo_instructions.jsonl"
    (tmp_path / "r.yaml").write_text(f"model: {{name_or_path: 'builtin:tiny-llama', dtype: float32}}\n"
                                     f"data: {{path: '{data}', max_length: 64}}\n"
                                     "training: {gradient_accumulation_steps: 8, max_steps: 2}\nlaunch: {procs_per_node: 1}\n")
    result = CliRunner().invoke(app, ["train", str(tmp_path / "r.yaml"), "--output-dir", str(tmp_path / "run")])
    assert result.exit_code == 1, result.output
    assert [(t.gradient_checkpointing, t.micro_batch_size, t.loss_kernel) for t in launched] == \
        [(False, 8, "default"), (True, 1, "chunked")]
    lines = result.stderr.splitlines()
    assert "note: training again with the memory-safe values, as the same command with --overwrite --set " \
           "training.gradient_checkpointing=true --set training.loss_kernel=chunked --set training.micro_batch_size=1 " \
           "would; it starts again (no checkpoint was saved)" in lines
    assert lines[-2].startswith("note: a rank ran out of GPU memory with memory settings `auto` did not choose for speed; "
                                "`finetune plan ") and lines[-2].endswith("--gpu-memory 23.53GiB --recommend` lists setups "
                                                                          "that fit: ZeRO stage, offload, micro batch, checkpointing")
    assert lines[-1].startswith("error: training failed: rank 0 (local rank 0) exited with code 1: torch.OutOfMemoryError")


@pytest.mark.parametrize("line, gpu", [
    (OOM, True),
    ("RuntimeError: CUDA error: out of memory", True),
    ("RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`", True),
    ("ValueError: out of memory budget for tokenizing", False),
    ("rank 1 was killed by SIGKILL", False),  # the host's OOM killer: not the GPU's memory
])
def test_what_counts_as_out_of_gpu_memory(line, gpu, tmp_path):
    from finetune.run.launch.outcome import Outcome, out_of_gpu_memory

    assert (out_of_gpu_memory(Outcome(1, message=line)) is not None) is gpu
    log = tmp_path / "stderr.log"  # the DeepSpeed launcher's failures come with the rank's log only
    log.write_text("Traceback (most recent call last):\n  ...\n" + line + "\n")
    assert (out_of_gpu_memory(Outcome(1, message="rank 1 failed", logs=[log])) is not None) is gpu
