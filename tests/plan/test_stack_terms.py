"""The planner terms read from the measured stacks' code (docs/plan.md, "Fifth pass"), each checked against
the mechanism it models, on CPU:

- bitsandbytes before 0.43.2 kept a 4-bit linear's input on its autograd context (MatMul4Bit.forward:
  `ctx.tensors = (A, B)`), which non-reentrant checkpointing cannot drop;
- auto-gptq's QuantLinear registers its own quantization state (qzeros, scales, g_idx), not bitsandbytes'
  absmax;
- the allocator history keeps the loss blocks of earlier records, not the activations' or the fixed-size
  buffers' blocks;
- activations saved without checkpointing carry no fragmentation term;
- peft's prepare_model_for_kbit_training casts every 16-bit parameter that is not 4-bit to fp32.

    python -m pytest -n 0 -q tests/plan/test_stack_terms.py
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from finetune.plan import Setup, plan
from finetune.plan.archs import BY_NAME
from finetune.plan.constants import FRAGMENTATION, GPTQ_GROUP_SIZE, HISTORY_RECORDS
from finetune.plan.params import gptq_state_bytes, param_groups
from finetune.plan.planner import history_base


def _terms(setup: Setup) -> dict:
    return {t.name: t for t in plan(setup).terms}


def _qlora(**kw) -> Setup:
    arch = BY_NAME["qwen2.5-7b"]
    base = dict(arch=arch, params=arch.total_params, method="qlora", deepspeed=False, seq_len=2048,
                micro_batch=1, lora_targets=("q_proj", "k_proj", "v_proj"), gradient_checkpointing=True)
    base.update(kw)
    return Setup(**base)


def test_a_ctx_attribute_survives_non_reentrant_checkpointing_a_saved_tensor_does_not():
    """The mechanism: bitsandbytes 0.41-0.43.1's MatMul4Bit kept its input as `ctx.tensors = (A, B)`; torch's
    non-reentrant checkpoint drops what save_for_backward saves (saved-tensor hooks) but cannot see a ctx
    attribute, so that input lives until the layer's backward. Measured with torch on CPU: live bytes after
    a checkpointed forward of two such layers."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from tests.plan.test_planner import LiveBytes

    class KeepsOnCtx(torch.autograd.Function):  # bitsandbytes < 0.43.2
        @staticmethod
        def forward(ctx, a, w):
            ctx.tensors = (a, w)
            return a @ w

        @staticmethod
        def backward(ctx, grad):
            _, w = ctx.tensors
            return grad @ w.t(), None

    class SavesForBackward(torch.autograd.Function):  # bitsandbytes >= 0.43.2 saves nothing of A either
        @staticmethod
        def forward(ctx, a, w):
            ctx.save_for_backward(a, w)
            return a @ w

        @staticmethod
        def backward(ctx, grad):
            _, w = ctx.saved_tensors
            return grad @ w.t(), None

    tokens, width = 256, 64
    w = torch.randn(width, width)

    def kept_after_forward(fn) -> int:
        x = torch.randn(tokens, width, requires_grad=True)
        live = LiveBytes({x.untyped_storage().data_ptr(), w.untyped_storage().data_ptr()})

        def layer(h):
            return fn.apply(h * 1.0, w)  # h * 1.0: the layer's own input tensor, as a norm's output is

        with live.mode:
            out = checkpoint(lambda h: layer(layer(h)), x, use_reentrant=False)
        live.sweep()
        alive = live.current - out.untyped_storage().nbytes()
        out.sum().backward()
        return alive

    per_input = tokens * width * 4
    assert kept_after_forward(SavesForBackward) == 0
    assert kept_after_forward(KeepsOnCtx) == 2 * per_input


def test_old_bitsandbytes_keeps_every_layers_4bit_inputs_under_checkpointing():
    base = _qlora()
    old = replace(base, bnb_keeps_inputs=True)
    arch, e, tokens = base.arch, base.element_bytes, base.seq_len
    kept = _terms(old)["4-bit linear inputs (bitsandbytes < 0.43.2)"]
    # The input q/k/v share, o_proj's, the one gate/up share, down_proj's: in every layer.
    assert kept.bytes == arch.layers * tokens * e * (2 * arch.hidden + arch.q_dim + arch.intermediate)
    assert kept.field == "activations" and kept.phase == "backward"
    assert "4-bit linear inputs (bitsandbytes < 0.43.2)" not in _terms(base)
    assert plan(old).memory_views["allocated"] - plan(base).memory_views["allocated"] == kept.bytes
    # Without checkpointing the LoRA targets' inputs are saved already: only the others are added.
    unckpt = _terms(replace(old, gradient_checkpointing=False))["4-bit linear inputs (bitsandbytes < 0.43.2)"]
    assert unckpt.bytes == arch.layers * tokens * e * (arch.hidden + arch.q_dim + arch.intermediate)
    # Not a bitsandbytes base, or not 4-bit: nothing.
    assert "4-bit linear inputs (bitsandbytes < 0.43.2)" not in _terms(replace(old, quant_format="gptq-int4"))
    assert "4-bit linear inputs (bitsandbytes < 0.43.2)" not in _terms(replace(old, method="lora"))


def test_prepare_model_for_kbit_training_leaves_fp32_weights_and_an_fp32_residual_stream():
    """peft's own function on a small 4-bit-like model: every 16-bit parameter but the packed 4-bit weights
    becomes fp32; the plan counts the non-4-bit frozen weights at 4 bytes, the checkpointed layer inputs at 4
    bytes and the head's 16-bit autocast copy (the trace checks the sizes: tests/plan/trace/test_trace.py GRID)."""
    import torch
    from peft import prepare_model_for_kbit_training
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    packed = model.model.layers[0].mlp.down_proj.weight
    packed.requires_grad_(False)
    packed.data = torch.zeros(packed.numel() // 2, dtype=torch.uint8)  # a stand-in for bitsandbytes' packing
    prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert dtypes.pop("model.layers.0.mlp.down_proj.weight") == torch.uint8
    assert set(dtypes.values()) == {torch.float32}

    base = _qlora(lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    prepared = replace(base, kbit_prepared=True)
    arch, tokens = base.arch, base.seq_len
    before, after = _terms(base), _terms(prepared)
    frozen16 = sum(g.total for g in param_groups(base) if not g.trainable and not g.quantized)
    assert after["frozen base fp32"].bytes == 4 * frozen16 == 2 * before["frozen base 16-bit"].bytes
    assert after["layer inputs (checkpointed)"].bytes == arch.layers * tokens * 4 * arch.hidden
    assert after["16-bit cast of the fp32 output head (autocast)"].bytes == arch.vocab * arch.hidden * 2
    # LoRA over a 16-bit base is not prepared: nothing changes.
    lora = replace(base, method="lora")
    assert plan(replace(lora, kbit_prepared=True)).memory_views == plan(lora).memory_views


def test_gptq_state_is_auto_gptqs_quantlinear_buffers():
    """auto-gptq 0.5.1 nn_modules/qlinear/qlinear_cuda_old.py QuantLinear.__init__ registers qweight (int32,
    in/32*bits x out), qzeros (int32, ceil(in/group) x out/32*bits), scales (fp16, ceil(in/group) x out) and
    g_idx (int32, in): the state beside the packed weight is the last three."""
    import torch

    bits = 4
    for infeatures, outfeatures in ((4096, 12288), (11008, 4096), (5120, 13696)):
        groups = math.ceil(infeatures / GPTQ_GROUP_SIZE)
        qzeros = torch.zeros((groups, outfeatures // 32 * bits), dtype=torch.int32, device="meta")
        scales = torch.zeros((groups, outfeatures), dtype=torch.float16, device="meta")
        g_idx = torch.zeros((infeatures,), dtype=torch.int32, device="meta")
        buffers = sum(t.numel() * t.element_size() for t in (qzeros, scales, g_idx))
        assert gptq_state_bytes(infeatures, outfeatures) == buffers
    setup = _qlora(quant_format="gptq-int4", dtype="float16")
    quantized = [g for g in param_groups(setup) if g.quantized]
    want = sum(g.count * gptq_state_bytes(g.in_features, g.numel // g.in_features) for g in quantized)
    assert _terms(setup)["quantization constants"].bytes == want
    assert want < _terms(replace(setup, quant_format="bnb-nf4", double_quant=False))["quantization constants"].bytes


def test_history_keeps_the_earlier_records_loss_blocks_only():
    base = _qlora(shapes_vary=True, expandable_segments=False)
    terms = plan(base).terms
    named = {t.name: t for t in terms}
    assert history_base(terms) == named["loss working set"].bytes
    assert named["allocator history"].bytes == int(named["loss working set"].bytes * sum(HISTORY_RECORDS))
    # Without checkpointing the activations grow many-fold, the history does not.
    unckpt = {t.name: t for t in plan(replace(base, gradient_checkpointing=False)).terms}
    assert unckpt["allocator history"].bytes == named["allocator history"].bytes
    # Old bitsandbytes' kept inputs are activations: no history either.
    old = {t.name: t for t in plan(replace(base, bnb_keeps_inputs=True)).terms}
    assert old["allocator history"].bytes == named["allocator history"].bytes


@pytest.mark.parametrize("attn", ["flash_attention_2", "eager"])
def test_activations_saved_without_checkpointing_carry_no_fragmentation(attn):
    setup = _qlora(method="lora", gradient_checkpointing=False, attn=attn)
    terms = plan(setup).terms
    saved = next(t for t in terms if t.name == "saved for backward")
    assert saved.stacked
    rest = sum(t.bytes for t in terms if t.phase == "backward" and t.counter == "allocated" and not t.stacked)
    fragmentation = next(t for t in terms if t.name == "allocator fragmentation" and t.phase == "backward")
    assert fragmentation.bytes == int(rest * FRAGMENTATION)
