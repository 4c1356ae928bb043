"""`finetune plan --trace` (finetune/plan/trace/step.py): one training step of transformers' model code on fake
tensors, against torch's own accounting of the same step run for real on the CPU, and at 8B / 70B shapes."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from finetune.builtin import builtin_config
from finetune.plan import Setup, plan
from finetune.plan.archs import BY_NAME, arch_from_config
from tests.conftest import REPO, run_cli

TINY = {"model_type": "llama", **builtin_config("builtin:tiny-llama")}


def _tiny(**kw) -> Setup:
    arch = arch_from_config(TINY, "tiny")
    base = dict(arch=arch, params=arch.total_params, method="lora", deepspeed=False, micro_batch=2, seq_len=64,
                lora_r=8, lora_dropout=0.0, full_rows=True, dtype="bfloat16")
    return Setup(**{**base, **kw})


def _real_step(setup: Setup):
    """The same step on real CPU tensors: (LiveTensors' peak, torch profiler's peak, in bytes)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    from finetune.plan.trace import step as T
    from finetune.plan.trace.live_tensors import LiveTensors

    torch.manual_seed(0)
    model = T.build_model(setup, TINY)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    with T.data_decisions(setup), T.cuda_paths():
        batch = T.make_batch(setup, TINY["vocab_size"])
        optimizer = T.make_optimizer(model, setup)
        autocast = T.trainer_autocast(setup)
        T.run_step(model, optimizer, batch, autocast=autocast)
        tracker = LiveTensors(model, optimizer, TINY["vocab_size"], inputs=batch.values())
        with tracker:
            T.run_step(model, optimizer, batch, tracker, autocast=autocast)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                     with_stack=True) as prof:
            T.run_step(model, optimizer, batch, autocast=autocast)
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline("cpu")
    return tracker.peak, max(sum(s) for s in sizes)


def _traced_bytes(result) -> int:
    """The trace's peak without the cited CUDA-only terms (what the CPU kernels allocate)."""
    return result.phase_peaks[result.phase] - sum(b for _, b, _ in result.cuda_only)


@pytest.mark.parametrize("settings", [
    {"method": "lora", "attn": "sdpa", "gradient_checkpointing": False},
    {"method": "full", "attn": "eager", "gradient_checkpointing": False},
    {"method": "lora", "attn": "sdpa", "gradient_checkpointing": True},
], ids=["lora-sdpa", "full-eager", "lora-sdpa-checkpointing"])
def test_trace_equals_the_real_cpu_step(settings):
    """The fake-tensor trace is the real step's tensor bytes exactly; without checkpointing it is also
    torch's profiler's memory timeline (torch.profiler._memory_profiler, every CPU allocation of the step)
    to within 256 bytes. With checkpointing the profiler sees 5-7% more than any dispatch-level count
    (docs/plan.md, 'The trace': allocations no aten op returns), so only the first equality is asserted."""
    from finetune.plan.trace.step import trace

    setup = _tiny(**settings)
    fake = trace(setup, TINY)
    real, profiled = _real_step(setup)
    assert _traced_bytes(fake) == real
    if not setup.gradient_checkpointing:
        assert abs(profiled - real) <= 256, (profiled, real)
    else:
        assert real <= profiled <= real * 1.06


@pytest.mark.parametrize("settings", [
    dict(gradient_checkpointing=True),
    dict(gradient_checkpointing=False),
    dict(method="full", gradient_checkpointing=False),
    dict(gradient_checkpointing=True, deepspeed=True),
], ids=["lora-checkpointing", "lora", "full", "lora-16-bit-adapters"])
def test_extrapolated_depth_equals_the_full_trace(settings):
    """Traced at 2, 3 and 4 layers and extrapolated to 7, as deep as the whole trace, also where a phase's peak
    moves with depth: with fp32 adapters under autocast and checkpointing, backward's peak is at its start
    (the loss's buffers) up to 5 layers and at its end (layer 0's recompute, every gradient) from 6."""
    from finetune.plan.trace.step import trace

    config = {**TINY, "num_hidden_layers": 7}
    arch = arch_from_config(config, "tiny7")
    setup = _tiny(arch=arch, params=arch.total_params, **settings)
    short, whole = trace(setup, config), trace(setup, config, extrapolate=False)
    assert "extrapolated to 7" in short.notes[0]
    assert (short.peak, short.phase, short.by_kind, short.phase_peaks) == \
           (whole.peak, whole.phase, whole.by_kind, whole.phase_peaks)


@pytest.mark.parametrize("model,method,seq", [("llama-3-8b", "lora", 4096), ("llama-2-70b", "qlora", 2048)])
def test_7b_and_70b_trace_in_seconds(model, method, seq):
    from finetune.plan.trace.step import trace

    import peft  # noqa: F401  (imports are not the trace's time)
    import transformers  # noqa: F401

    arch = BY_NAME[model]
    setup = Setup(arch=arch, params=arch.total_params, method=method, deepspeed=False, seq_len=seq)
    cpu = time.process_time()
    result = trace(setup)
    assert time.process_time() - cpu < 20  # CPU seconds: wall time on a shared CI box varies
    weights = result.by_kind["weights"]
    planned = plan(setup)
    assert weights == pytest.approx(planned.field_bytes("weights"), rel=0.01)
    assert set(result.phase_peaks) == {"forward", "backward", "step"} and result.peak == max(result.phase_peaks.values())


def test_cli_trace_gives_the_peak_by_kind():
    import json

    out = run_cli("plan", str(REPO / "recipes" / "demo.yaml"), "--trace", "--format", "json")
    assert out.returncode == 0, out.stderr
    traced = json.loads(out.stdout)["trace"]
    assert set(traced["by_kind"]) == {"weights", "optimizer", "gradients", "activations", "logits", "temporaries"}
    assert traced["peak"] == traced["phase_peaks"][traced["phase"]]
    assert traced["peak"] >= sum(traced["by_kind"].values())


def test_trace_text_names_each_kind():
    from finetune.plan.trace.step import trace

    text = trace(_tiny(), TINY).render_text()
    assert text.startswith("trace    one training step")
    for kind in ("weights", "optimizer", "gradients", "activations", "logits", "temporaries", "cuBLAS"):
        assert f"    {kind}" in text


def test_trace_refuses_what_it_does_not_run():
    from finetune.plan import PlanError
    from finetune.plan.trace.step import trace

    with pytest.raises(PlanError, match="SFT step only"):
        trace(replace(_tiny(), objective="dpo"), TINY)
    with pytest.raises(PlanError, match="parameter count"):
        trace(Setup(arch=None, params=10**9), None)


# What the analytic planner (finetune/plan/activations.py, states.py) gives against the trace of the same
# step: LoRA and QLoRA, short and long rows, checkpointing on and off, each attention kernel, padded and
# full rows. The trace is one GPU without DeepSpeed (its model states are checked against DeepSpeed's own
# estimators and allocations in tests/plan/test_planner.py).
GRID = [
    dict(method="lora", seq_len=256, gradient_checkpointing=True, attn="sdpa"),
    dict(method="lora", seq_len=4096, gradient_checkpointing=True, attn="flash_attention_2", full_rows=True),
    dict(method="qlora", seq_len=256, gradient_checkpointing=True, attn="sdpa"),
    dict(method="qlora", seq_len=4096, gradient_checkpointing=True, attn="flash_attention_2", full_rows=True),
    dict(method="lora", seq_len=512, micro_batch=2, gradient_checkpointing=False, attn="sdpa", lora_dropout=0.05),
    dict(method="lora", seq_len=512, gradient_checkpointing=False, attn="eager", full_rows=True),
    dict(method="qlora", seq_len=1024, micro_batch=2, gradient_checkpointing=False, attn="sdpa", full_rows=True),
    # peft 0.7-0.11 (corpus cases): adapters in the base dtype, no fp32 copies of the adapted inputs.
    dict(method="lora", seq_len=512, micro_batch=2, gradient_checkpointing=False, attn="sdpa", lora_dropout=0.05,
         adapter_dtype="model"),
    # peft's prepare_model_for_kbit_training (corpus cases): fp32 embeddings, head and norms, fp32 residual
    # stream, the head's 16-bit autocast copy.
    dict(method="qlora", seq_len=256, gradient_checkpointing=True, attn="sdpa", kbit_prepared=True),
    dict(method="qlora", seq_len=4096, gradient_checkpointing=True, attn="flash_attention_2", full_rows=True,
         kbit_prepared=True),
    # training.loss_kernel: chunked, traced with finetune/loss_kernel.py's own chunks.
    dict(method="lora", seq_len=2048, gradient_checkpointing=True, attn="sdpa", loss_kernel="chunked"),
]


def _analytic_against_trace(model: str, settings: dict) -> float:
    from finetune.plan.trace.step import trace

    arch = BY_NAME[model]
    setup = Setup(arch=arch, params=arch.total_params, deepspeed=False, **settings)
    traced = trace(setup)
    return plan(setup).memory_views["allocated"] / traced.peak - 1


# Every other row of GRID in the full tier only (CI's time; each trace is ~2 s of a 2-core machine).
GRID_PARAMS = [pytest.param(s, marks=pytest.mark.full) if i % 2 else s for i, s in enumerate(GRID)]


@pytest.mark.parametrize("settings", GRID_PARAMS, ids=lambda s: "-".join(str(v) for v in s.values()))
def test_analytic_plan_is_within_3_percent_of_the_trace(settings):
    assert abs(_analytic_against_trace("qwen2.5-0.5b", settings)) <= 0.03


@pytest.mark.parametrize("model,settings,term", [
    ("mistral-7b-v0.3", dict(method="lora"), "layer recompute + gradients"),
    ("mistral-7b-v0.3", dict(method="full"), "first layer's backward, beside the gradients"),
    ("qwen2.5-0.5b", dict(method="full", seq_len=8192, loss_kernel="chunked"), "first layer's backward, beside the gradients"),
    ("qwen2.5-0.5b", dict(method="lora", attn="eager", micro_batch=1, adapter_dtype="model", loss_kernel="chunked"),
     "layer recompute + gradients"),
], ids=["lora", "full", "full-tied-chunked", "eager-chunked"])
def test_backward_peaks_away_from_the_loss_are_planned(model, settings, term):
    """Without DeepSpeed, where the loss's buffers are small (Mistral-7B's vocabulary, or the chunked loss),
    two other moments of backward hold the peak: the recompute of the last layer, where peft holds down_proj's
    input and its fp32 copies for the fp32 adapters (LoRA), and the first layer's backward beside every
    later layer's gradient (full fine-tuning; with tied embeddings the head's part of their gradient waits in
    autograd's buffer from the start), and eager attention's softmax backward in the recomputed layer. Before
    they were planned: -2.0%, -3.1%, -3.2% and -25.9%."""
    settings = dict(dict(seq_len=4096, micro_batch=2, gradient_checkpointing=True, attn="sdpa"), **settings)
    arch = BY_NAME[model]
    terms = {t.name: t for t in plan(Setup(arch=arch, params=arch.total_params, deepspeed=False, **settings)).terms}
    assert terms[term].bytes > 0
    assert abs(_analytic_against_trace(model, settings)) <= 0.01


def test_qlora_under_autocast_keeps_no_fp32_copies_in_the_recompute():
    """peft's LoRA over a bitsandbytes 4-bit layer skips its fp32 cast under the Trainer's CUDA autocast
    (activations.bnb_uncast; the trace switches the cast off the same way), so the recompute that holds LoRA's
    peak (above) stays under the loss's buffers for Q-LoRA: the peak is at backward's start, where no quantized
    layer runs, so the dequantized 4-bit weight is not there either (the plan counted it, 1.2% over the trace:
    0.11 GiB of Mistral-7B's 9.5; the H200's Q-LoRA rows measured the same, docs/plan.md "Tenth pass")."""
    settings = dict(method="qlora", seq_len=4096, micro_batch=2, gradient_checkpointing=True, attn="sdpa")
    arch = BY_NAME["mistral-7b-v0.3"]
    setup = Setup(arch=arch, params=arch.total_params, deepspeed=False, **settings)
    terms = {t.name: t for t in plan(setup).terms}
    assert terms["layer recompute + gradients"].bytes == 0 and terms["dequantized 4-bit weight"].bytes == 0
    assert abs(_analytic_against_trace("mistral-7b-v0.3", settings)) <= 0.003


def test_gemma2_soft_capping_is_within_1_percent_of_the_trace():
    """Gemma 2 (eager attention, soft-capped scores and logits): the loss keeps the final tanh's output, not its
    input too (the plan was 7.9% over the trace here while it counted both)."""
    settings = dict(method="lora", seq_len=2048, gradient_checkpointing=True, attn="eager")
    assert abs(_analytic_against_trace("gemma-2-2b", settings)) <= 0.01


@pytest.mark.parametrize("settings", [
    dict(method="lora", modules_to_save=("embed_tokens", "lm_head")),
    dict(method="full", optimizer_impl="foreach"),
    dict(method="full", optimizer_impl="foreach", gradient_accumulation=2),
], ids=["modules-to-save", "full-foreach", "full-foreach-accumulation"])
def test_tied_embeddings_are_within_1_percent_of_the_trace(settings):
    """A tied model (Qwen2.5-0.5B, 256 tokens): peft's trainable copies of the tied embedding and head (the trace
    keeps every shared tensor shared), and a full fine-tune whose multi-tensor AdamW's temporaries come after
    backward's two embedding-sized gradients, not with them."""
    assert abs(_analytic_against_trace("qwen2.5-0.5b", dict(settings, seq_len=256, attn="sdpa"))) <= 0.01


@pytest.mark.parametrize("seq", [256, 2048])
def test_full_fine_tuning_is_within_3_percent_of_the_trace(seq):
    """Full fine-tuning without DeepSpeed: at 2,048 tokens the peak is the loss's, without gradients; at 256
    it is backward's end, with every gradient and a tied embedding's two extra vocab x hidden gradients."""
    assert abs(_analytic_against_trace("qwen2.5-0.5b", dict(method="full", seq_len=seq, attn="sdpa"))) <= 0.03


@pytest.mark.parametrize("model,settings", [
    ("qwen2.5-0.5b", dict(method="full", seq_len=2048, attn="sdpa")),
    ("qwen2.5-0.5b", dict(method="full", seq_len=256, attn="sdpa")),
    ("llama-3-8b", dict(method="full", seq_len=256, attn="sdpa")),
    ("qwen2.5-0.5b", dict(method="lora", seq_len=512, gradient_checkpointing=False, attn="eager", full_rows=True)),
])
def test_gradient_accumulation_is_within_3_percent_of_the_trace(model, settings):
    """A later micro batch of an accumulation cycle: backward starts with every gradient alive (the Trainer's
    zero_grad runs after the step) and AccumulateGrad adds each new gradient into it: at 2,048 tokens the
    loss's peak now holds the gradients; at 256 backward's end also holds the largest new gradient."""
    assert abs(_analytic_against_trace(model, dict(settings, gradient_accumulation=2))) <= 0.03
