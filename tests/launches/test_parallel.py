"""Sequence parallelism (Ulysses), AutoTP and resuming on another process count: real DeepSpeed runs on CPU
processes, each compared with a 1-process run of the same recipe (slow).

    python -m pytest tests/launches/test_parallel.py

Why the runs must agree: with parallel.sequence 2 on 2 processes the data-parallel size is 1, so each step
trains the same rows as one process does (DeepSpeed's UlyssesSPDataLoaderAdapter feeds the rows of both ranks
to the pair one after another, in the sampler's order), and the loss is the token-weighted mean over both
halves of each sequence, i.e. the same number. AutoTP ranks see the same rows and split only the matmuls.
What differs is the order of float32 additions (all-to-all, reductions of halves, split matmuls), so the
losses agree to float32 rounding accumulated over a few steps: observed |diff| <= 1e-6 on losses of ~5-7;
the bound below (1e-5 relative) leaves a margin of 10x, while a wrong row, scale or mask moves the losses by
1e-2 or more (step 2 differs by 2e-2 when micro batches are weighted per batch instead of per token).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.train_fixtures import TINY_RECIPES, launch_runner, write_run_dir

RTOL = 1e-5
ONE_PROCESS = ("parallel.sequence=1", "launch.procs_per_node=1")
# Full fine-tunes of 8 rows per step, however they are spread: one process accumulating 2 micro batches of 4,
# an AutoTP pair accumulating 2 x 4, a Ulysses pair on micro batches of 8 (and that pair resumed from its
# step 3), and (resumed) two data-parallel processes of 4.
FULL = ("method=full", "training.learning_rate=2.0e-3", "deepspeed.stage=2")
SAVE = ("training.save_steps=2", "training.save_total_limit=null")
DATA_PARALLEL = FULL + SAVE + ("parallel.sequence=1",)  # 2 processes x micro batch 4
# The shipped LoRA ZeRO-3 Ulysses recipe against one process: in the full tier (CI's time); Ulysses' equality and its
# resume are checked in the default tier on the full fine-tune pair (sp_full_zero2).
FULL_TIER_RUNS = {"ref_lora", "sp_lora_zero3"}
RUNS = {
    "ref_lora": (1, ONE_PROCESS),
    "sp_lora_zero3": (2, ()),  # recipes/tiny/long_context_sp2.yaml as shipped
    "ref_full": (1, FULL + SAVE + ONE_PROCESS + ("training.gradient_accumulation_steps=2",)),
    # saves at step 3: resumed there by "sp_resumed" (issue 34: a Ulysses run never resumed)
    "sp_full_zero2": (2, FULL + ("training.micro_batch_size=8", "training.save_steps=3", "training.save_total_limit=null")),
    "tp_full_zero1": (2, FULL + ("parallel.sequence=1", "parallel.tensor=2", "deepspeed.stage=1",
                                 "training.gradient_accumulation_steps=2")),
}


def _train(tmp, name, procs, overrides=()):
    run_dir = Path(tmp) / name
    write_run_dir(TINY_RECIPES / "long_context_sp2.yaml", run_dir, world_size=procs, overrides=overrides)
    return run_dir


def _run(run_dir, cache, procs, extra=()):
    result = launch_runner(run_dir, cache, procs=procs, extra=extra)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


def _summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def _curve(run_dir, key="loss"):
    return [entry[key] for entry in _summary(run_dir)["loss_history"]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_cache):
    """Every run once, shared by the tests below (each run is 15-30 s on 2 CPU cores)."""
    tmp = tmp_path_factory.mktemp("parallel")
    out = {"tmp": tmp, "cache": tiny_cache}
    for name, (procs, overrides) in RUNS.items():
        if name not in FULL_TIER_RUNS:
            _ensure(out, name, tmp, tiny_cache)
    # A chain of resumes, each on another process count: the 1-process run's step-2 checkpoint continued on 2
    # data-parallel processes (steps 3-6), whose step-4 checkpoint is continued on 1 process again (steps 5-6,
    # run when a test asks for it: _resumed_on_one, in the full tier).
    two = _train(tmp, "resumed_on_two", 2, DATA_PARALLEL)
    shutil.copytree(out["ref_full"] / "checkpoint-2", two / "checkpoint-2")
    out["resumed_on_two"], out["resumed_on_two.result"] = two, _run(two, tiny_cache, 2, extra=("--resume",))
    # The Ulysses pair's step-3 checkpoint continued by a Ulysses pair (steps 4-6).
    sp = _train(tmp, "sp_resumed", 2, RUNS["sp_full_zero2"][1])
    shutil.copytree(out["sp_full_zero2"] / "checkpoint-3", sp / "checkpoint-3")
    out["sp_resumed"], out["sp_resumed.result"] = sp, _run(sp, tiny_cache, 2, extra=("--resume",))
    return out


@pytest.mark.parametrize("parallel,reference", [pytest.param("sp_lora_zero3", "ref_lora", marks=pytest.mark.full),
                                                ("sp_full_zero2", "ref_full"), ("tp_full_zero1", "ref_full")])
def test_parallel_run_equals_one_process(runs, parallel, reference):
    _ensure(_ensure(runs, parallel), reference)
    ours, ref = runs[parallel], runs[reference]
    assert _curve(ours) == pytest.approx(_curve(ref), rel=RTOL)
    # the gradients too: their global norm before clipping, step by step. Ulysses under ZeRO-1/2: DeepSpeed
    # divides the all-reduced gradients by dp / sp (stage_1_and_2.py), while the Trainer's loss is already the
    # mean over the group, so they come out sp times larger (lint R149); clipping at max_grad_norm 1.0 (these
    # norms are ~3-22) and Adam's scale invariance keep the losses equal.
    scale = 2 if parallel == "sp_full_zero2" else 1
    assert [g / scale for g in _curve(ours, "grad_norm")] == pytest.approx(_curve(ref, "grad_norm"), rel=10 * RTOL)
    assert _curve(ours)[-1] < _curve(ours)[0] - 1.0  # and it learned
    assert _summary(ours)["world_size"] == 2
    # the same tokens (AutoTP ranks see them twice; the summary counts them once)
    assert _summary(ours)["tokens_trained"] == _summary(ref)["tokens_trained"]
    effective = json.loads((ours / "deepspeed.effective.json").read_text())
    # the engine's batch: micro x accumulation x data-parallel size (accelerate sets it from the parallelism config
    # under Ulysses); AutoTP counts both processes in DeepSpeed's world though they see the same 8 rows
    assert effective["train_batch_size"] == {"sp_lora_zero3": 4, "sp_full_zero2": 8, "tp_full_zero1": 16}[parallel]
    if parallel.startswith("sp"):
        assert json.loads((ours / "training_args.json").read_text())["parallelism_config"]["sp_size"] == 2
    if parallel.startswith("tp"):
        assert effective["tensor_parallel"]["autotp_size"] == 2


def test_saved_weights_match_one_process(runs):
    import torch
    from safetensors.torch import load_file

    # AutoTP's shards are gathered on save (stage3_gather_16bit_weights_on_model_save): whole tensors come back
    tp, ref = load_file(str(runs["tp_full_zero1"] / "model" / "model.safetensors")), \
        load_file(str(runs["ref_full"] / "model" / "model.safetensors"))
    assert tp.keys() == ref.keys()
    for name, tensor in ref.items():
        assert tp[name].shape == tensor.shape, name
        torch.testing.assert_close(tp[name], tensor, rtol=0, atol=1e-3)  # 6 Adam steps of lr 2e-3: |diff| ~1e-4


@pytest.mark.full
def test_a_ulysses_runs_final_logits_match_one_process(runs):
    import torch
    from safetensors.torch import load_file

    _ensure(_ensure(runs, "sp_lora_zero3"), "ref_lora")
    # Ulysses: the final logits of the fixed batch, computed after training (SP is off in eval)
    sp_logits = load_file(str(runs["sp_lora_zero3"] / "final_logits.safetensors"))
    ref_logits = load_file(str(runs["ref_lora"] / "final_logits.safetensors"))
    # on CPU the SP batch is padded to max_length (gloo); compare the real tokens of the reference's rows
    width = ref_logits["logits"].shape[1]
    real = ref_logits["attention_mask"].bool()
    torch.testing.assert_close(sp_logits["logits"][:, :width][real], ref_logits["logits"][real], rtol=1e-4, atol=1e-4)


def _ensure(runs, name, tmp=None, cache=None):
    """RUNS[name] trained once (the full tier's runs when a test asks for them)."""
    if name not in runs:
        procs, overrides = RUNS[name]
        runs[name] = _train(tmp or runs["tmp"], name, procs, overrides)
        runs[name + ".result"] = _run(runs[name], cache or runs["cache"], procs)
    return runs


def _resumed_on_one(runs):
    """The 2-process run's step-4 checkpoint continued on 1 process (steps 5-6)."""
    if "resumed_on_one" not in runs:
        one = _train(runs["tmp"], "resumed_on_one", 1, RUNS["ref_full"][1])
        shutil.copytree(runs["resumed_on_two"] / "checkpoint-4", one / "checkpoint-4")
        runs["resumed_on_one"], runs["resumed_on_one.result"] = one, _run(one, runs["cache"], 1, extra=("--resume",))
    return runs


@pytest.mark.parametrize("resumed,saved,now,step", [("resumed_on_two", 1, 2, 2),
                                                    pytest.param("resumed_on_one", 2, 1, 4, marks=pytest.mark.full)])
def test_resume_on_another_process_count_continues_the_loss_curve(runs, resumed, saved, now, step):
    if resumed == "resumed_on_one":
        runs = _resumed_on_one(runs)
    log = runs[resumed + ".result"].stdout
    assert (f"checkpoint-{step} was saved by {saved} processes, this run has {now}: converted to DeepSpeed's "
            "universal checkpoint") in log
    resumed, original = runs[resumed], runs["ref_full"]
    assert (resumed / f"checkpoint-{step}" / "latest_universal").read_text() == f"global_step{step}_universal"
    assert json.loads((resumed / "deepspeed.effective.json").read_text())["checkpoint"]["load_universal"] is True
    summary = _summary(resumed)
    assert summary["resumed_from"].endswith(f"checkpoint-{step}") and summary["steps"] == 6
    assert summary["world_size"] == now
    # the steps after the checkpoint, trained from the re-partitioned Adam states, continue the 1-process curve
    assert _curve(resumed)[step:] == pytest.approx(_curve(original)[step:], rel=RTOL)
    assert _curve(resumed, "grad_norm")[step:] == pytest.approx(_curve(original, "grad_norm")[step:], rel=10 * RTOL)


def test_a_ulysses_run_resumes_mid_epoch_to_the_losses_of_the_uninterrupted_run(runs):
    """Issue 34: every resume of a parallel.sequence run failed on rank 0 with `AttributeError:
    'UlyssesSPDataLoaderAdapter' object has no attribute 'dataset'` (accelerate's skip_first_batches). Step 3 of a
    pair is 3 of the adapter's micro batches: one batch of the loader it wraps, skipped unread, and one micro batch
    of the next (finetune.train.parallel.skip_batches); steps 4-6 then train the rows the uninterrupted run did."""
    resumed, original = runs["sp_resumed"], runs["sp_full_zero2"]
    assert "resuming from checkpoint-3 (step 3)" in runs["sp_resumed.result"].stdout
    assert _summary(resumed)["steps"] == 6 and _summary(resumed)["resumed_from"].endswith("checkpoint-3")
    assert _curve(resumed)[3:] == pytest.approx(_curve(original)[3:], rel=RTOL)
    assert _curve(resumed, "grad_norm")[3:] == pytest.approx(_curve(original, "grad_norm")[3:], rel=10 * RTOL)
