"""Activations and logits: tensors saved for backward, attention masks and the loss kernels' working set."""

from __future__ import annotations

from finetune import objectives
from finetune.plan.archs import LAYER_LINEARS
from finetune.plan.loss import loss_working_set
from finetune.plan.parallel import tiled_mlp_saving
from finetune.plan.params import param_groups
from finetune.plan.setup import Setup, Term
from finetune.plan.states import kbit_prepared, trainable_weight_bytes


def activation_terms(setup: Setup, late_gradients: int = 0, dequantized: int = 0) -> list[Term]:
    """`late_gradients`: gradients made in backward once the loss buffers are freed, alive through the step (DeepSpeed's
    ZeRO-0 gradients and ZeRO-2 partition, states.backward_gradients): beside backward's own peak, not the loss.
    `dequantized`: bitsandbytes' 16-bit copy of the running 4-bit layer's weight (states.dequantized_weight_bytes),
    alive at backward's own peak, in a layer, not beside the loss."""
    per_layer = layer_activation_bytes(setup)
    tokens = setup.micro_batch * setup.seq_len
    arch = setup.arch
    assert arch is not None
    e = setup.element_bytes
    h = arch.hidden
    full = setup.method == "full"
    terms: list[Term] = []
    if setup.gradient_checkpointing:
        # transformers' GradientCheckpointingLayer: each decoder layer keeps only its input. After
        # prepare_model_for_kbit_training the residual stream is fp32 (the fp32 embedding's output, the fp32
        # norms' and 4-bit linears' outputs added to it): 4 bytes per element.
        r = 4 if kbit_prepared(setup) else e
        terms.append(Term("activations", "layer inputs (checkpointed)", arch.layers * tokens * r * h,
                          phase="backward", note=f"{arch.layers} layers x {r * h} B/token"
                                                 + (" (fp32 residual stream)" if r != e else "")))
        if setup.router_logits and arch.moe_layers:
            # Each MoE layer returns its router logits, which wait for the auxiliary loss outside the checkpoint.
            terms.append(Term("activations", "router logits (auxiliary loss)", arch.moe_layers * tokens * 4 * arch.experts,
                              phase="backward", note=f"{arch.moe_layers} layers x {arch.experts} experts x 4 B/token"))
    else:
        saved = arch.layers * per_layer
        if not full:
            # Layer 0's first norm sees an input that needs no gradient (frozen embedding): nothing saved.
            saved -= tokens * (4 * h + 4)
        terms.append(Term("activations", "saved for backward", saved, phase="backward",
                          note=f"{arch.layers} layers x {per_layer // tokens:,} B/token"
                               + (" + seq^2 scores" if setup.attn == "eager" else ""), stacked=True))
    kept = bnb_kept_inputs(setup)
    if kept:
        terms.append(Term("activations", "4-bit linear inputs (bitsandbytes < 0.43.2)", kept, phase="backward",
                          note="MatMul4Bit kept ctx.tensors = (A, B) in every layer: checkpointing cannot drop them"))
    head = tokens * (4 * h + 4 + (e * h if full else 0))  # final norm
    if full or "lm_head" in setup.lora_targets or "lm_head" in setup.modules_to_save:
        head += tokens * e * h  # lm_head input, for its weight gradient
    head += batch_and_rope_bytes(setup)
    terms.append(Term("activations", "final norm, head input", head, phase="backward"))
    if kbit_prepared(setup):
        # Under the Trainer's bf16 autocast the fp32 output head runs in 16 bits: autocast casts its weight
        # and the matmul saves that copy for the input's gradient, alive until the head's backward.
        terms.append(Term("activations", "16-bit cast of the fp32 output head (autocast)", arch.vocab * h * e,
                          phase="backward", note=f"{arch.vocab:,} vocab x {h:,} hidden x {e} B"))
    mask = attention_mask_bytes(setup)
    if mask:
        terms.append(Term("activations", "attention mask", mask, phase="backward",
                          note=f"4D mask, {'1 x (batch x seq)^2, padding_free bound' if flattened(setup) else 'batch x seq^2'}"))
    logits, logits_note = loss_working_set(setup)
    # Backward's own peak comes after the loss buffers are freed (they do not coexist), so only the
    # part above them raises the total.
    tiled = tiled_mlp_saving(setup)
    working = backward_working_bytes(setup, per_layer) - tiled
    extra = max(0, working - logits)
    what = "layer recompute + gradients" if setup.gradient_checkpointing else "backward temporaries"
    terms.append(Term("activations", what, extra, phase="backward",
                      note=("beyond the loss buffers" if extra else "smaller than the loss buffers")
                      + (f"; MLP in {setup.tiled_mlp_shards} slices (tiled_mlp)" if tiled else "")))
    raised = 0
    if late_gradients:
        # Backward's own peak comes with the gradients made so far (all of them, on the safe side). A buffer, as
        # ZeRO-3's gradient buffer is, so that model_states stays DeepSpeed's estimators' number.
        raised = max(0, working + late_gradients - logits) - extra
        terms.append(Term("buffers", "gradients at backward's own peak", raised, phase="backward",
                          note="beyond the loss buffers" if raised else "backward's start, with the loss buffers, "
                                                                         "is higher"))
    if dequantized:
        beyond = max(0, working + late_gradients + dequantized - logits) - extra - raised
        terms.append(Term("buffers", "dequantized 4-bit weight", beyond, phase="backward",
                          note=f"the largest quantized linear in 16 bits ({dequantized / 2**20:,.0f} MiB) while its "
                               "layer runs: " + ("at backward's own peak, beyond the loss buffers" if beyond else
                                                 "backward's start, with the loss buffers, is higher")))
    terms.append(Term("logits", "loss working set", logits, phase="backward", note=logits_note))
    return terms


def layer_activation_bytes(setup: Setup) -> int:
    """Bytes one decoder layer saves for backward (no checkpointing), for micro_batch x seq_len tokens.

    Read off the HF Llama/Qwen2/Mistral code and checked against torch's saved tensors on CPU
    (tests/plan/test_planner.py): per token, with e = bytes of the 16-bit dtype,
    - each RMSNorm: its input upcast to fp32 (4h) and the rsqrt (4); full FT also its 16-bit output
      (for the norm weight's gradient);
    - a linear layer saves its input only when its weight is trained or it carries LoRA (frozen
      weights need no input for the input gradient); q/k/v share one input, as do gate/up;
      LoRA dropout > 0 makes a private dropped-out copy per target (a, the adapter's element size: 4
      without DeepSpeed, where peft keeps adapters in fp32, else e) and a bool mask (1); without dropout,
      fp32 adapters still get a private fp32 copy per target (peft's _cast_input_dtype; found by the
      trace, finetune/plan/trace/step.py), but for a bitsandbytes 4-bit base under autocast (bnb_uncast);
    - each LoRA adapter saves lora_A's output (a x r);
    - attention: eager saves q, k and v repeated to all heads, the fp32 softmax and its 16-bit copy
      (row x heads per token, row = seq, or micro_batch x seq when flattened: the seq^2 term); sdpa/flash
      save q, k, v, the output and an fp32 log-sum-exp per head, and sdpa with a mask (padded or packed
      batches) its own copy of the mask in the model dtype;
    - the MLP: the activation's input and output and up_proj's output (3 x e x intermediate).
    """
    arch = setup.arch
    assert arch is not None
    e = setup.element_bytes
    h, s = arch.hidden, setup.seq_len
    # The MLP's nn.Linear layers: a dense model's, or a MoE layer's shared expert.
    inter = arch.shared_intermediate if arch.experts else arch.intermediate
    full = setup.method == "full"
    targets = set(setup.lora_targets) if not full else set()
    dropout = not full and setup.lora_dropout > 0

    # The adapters' dtype: without DeepSpeed fp32 (peft's autocast_adapter_dtype) unless Setup.adapter_dtype
    # says "model" (peft 0.7-0.11); with DeepSpeed the model's.
    a = trainable_weight_bytes(setup) if not full else e
    # What an adapter saves per element: its dtype, but under the Trainer's autocast lora_A's F.linear casts
    # peft's fp32 copy of the input (or its dropped-out copy) back to 16 bits and saves that cast, and lora_A's
    # output is 16-bit (the fp32 copies are freed after the call).
    kept = e if setup.trainer_autocast else a
    copies = a != e and not bnb_uncast(setup)

    def linear_inputs(names: tuple[str, ...], width: int, shared_with_output: bool = False) -> int:
        if full:
            return 0 if shared_with_output else e * width
        hit = [n for n in names if n in targets]
        if not hit:
            return 0
        if dropout:
            return len(hit) * (kept + 1) * width
        if copies:
            # peft's lora.Linear.forward casts the input to the adapter's dtype for each adapter
            # (_cast_input_dtype), and lora_A keeps that private copy (or autocast's 16-bit cast of it).
            return len(hit) * kept * width
        return 0 if shared_with_output else e * width

    per_token = arch.norms_per_layer * (4 * h + 4 + (e * h if full else 0))
    fused_attention = setup.attn != "eager"
    mask_copy = 0
    per_token += linear_inputs(("q_proj", "k_proj", "v_proj"), h)
    per_token += linear_inputs(("o_proj",), arch.q_dim, shared_with_output=fused_attention)
    per_token += linear_inputs(("gate_proj", "up_proj"), h)
    per_token += linear_inputs(("down_proj",), inter)
    per_token += kept * setup.lora_r * sum(1 for n in LAYER_LINEARS if n in targets)  # lora_A's output
    if fused_attention:
        # sdpa shares key/value heads (enable_gqa) only without a mask (sdpa_attention.use_gqa_in_sdpa).
        kv = arch.q_dim if (setup.attn == "sdpa" and attention_mask_bytes(setup)) else arch.kv_dim
        per_token += e * arch.q_dim * 2 + e * kv * 2 + 4 * arch.heads  # q, out, k, v, log-sum-exp
        scores = 0
        if setup.attn == "sdpa":
            # torch's sdpa turns the shared bool mask into an additive one of the query dtype on every
            # call (convert_boolean_attn_mask) and keeps it for backward: one copy per layer.
            mask_copy = attention_mask_bytes(setup) * e
    else:
        per_token += 3 * e * arch.q_dim  # q, k and v repeated to every head
        probs = 4 + (e if e != 4 else 0)  # fp32 softmax, and its cast back to the model dtype
        scores = arch.heads * attention_row(setup) * (probs + (e if arch.attn_softcap else 0))
    per_token += moe_mlp_bytes(setup) if arch.experts else 3 * e * inter
    return (setup.micro_batch * s * (per_token + scores) + mask_copy + adapter_casts(setup, kept)
            + expert_lora_bytes(setup))


def bnb_uncast(setup: Setup) -> bool:
    """peft's LoRA over a bitsandbytes 4-bit layer casts the input to the adapters' fp32 only outside autocast
    (lora/bnb.py Linear4bit.forward: `requires_conversion = not torch.is_autocast_enabled()`): under the Trainer's
    CUDA autocast lora_A takes the layer's own 16-bit input, which q/k/v (and gate/up) share, and saves no copy of
    it. Over the fp32 inputs prepare_model_for_kbit_training leaves, autocast's 16-bit cast is each adapter's own.
    Measured: an H200, Llama-3.2-1B shape at 8,192 tokens, Q-LoRA keeps 16 KiB per token and layer less than LoRA
    over bf16 weights (docs/plan.md, "Ninth pass"). Torch's CPU autocast is not what `is_autocast_enabled()` asks
    about, so `--trace` sets the same (finetune.plan.trace.qlora.four_bit_linears)."""
    return (setup.method == "qlora" and setup.quant_format == "bnb-nf4" and setup.trainer_autocast
            and not kbit_prepared(setup))


def adapter_casts(setup: Setup, kept: int) -> int:
    """Autocast's 16-bit copies of one layer's fp32 adapter weights: lora_A's and lora_B's matmuls save the
    cast weight for the input's gradient, so it lives until the layer's backward, not only while the
    autocast cache holds it."""
    if kept == trainable_weight_bytes(setup) or setup.method == "full" or setup.arch is None:
        return 0
    adapters = sum(g.total for g in param_groups(setup) if g.per_layer and g.unit.endswith((".lora_A", ".lora_B")))
    return kept * adapters // setup.arch.layers


def bnb_kept_inputs(setup: Setup) -> int:
    """bitsandbytes < 0.43.2 (Setup.bnb_keeps_inputs): each 4-bit linear's input A stays on its autograd
    context until the layer's backward (bitsandbytes/autograd/_functions.py MatMul4Bit.forward, 0.41-0.43.1:
    `ctx.tensors = (A, B)`; PR 1270 made it `(None, B)`). Saved-tensor hooks never see it, so with
    non-reentrant checkpointing (what HF training sets here, and ms-swift forced: swift/llm/utils/model.py
    at 4312aeb2 L1380-1399) every layer keeps its 4-bit inputs: the one tensor q/k/v share, o_proj's,
    the one gate/up share, down_proj's (e x (2h + q_dim + intermediate) per token). Without checkpointing
    the layers keep their activations anyway: only the inputs of linears without LoRA are added (a LoRA
    target's input is already saved, layer_activation_bytes). Reentrant checkpointing runs the forward
    without a graph: nothing is kept (not planned: this project's training is non-reentrant but for
    LoRA under ZeRO-3, where bitsandbytes is recent)."""
    arch = setup.arch
    if not setup.bnb_keeps_inputs or setup.method != "qlora" or setup.quant_format != "bnb-nf4" or arch is None:
        return 0
    inter = arch.shared_intermediate if arch.experts else arch.intermediate
    groups = [(("q_proj", "k_proj", "v_proj"), arch.hidden), (("o_proj",), arch.q_dim)]
    if inter:  # a dense MLP, or a MoE layer's shared expert (bitsandbytes skips the fused experts)
        groups += [(("gate_proj", "up_proj"), arch.hidden), (("down_proj",), inter)]
    targets = set(setup.lora_targets)
    width = sum(w for names, w in groups
                if (setup.gradient_checkpointing or not targets.intersection(names)))
    return arch.layers * setup.micro_batch * setup.seq_len * setup.element_bytes * width


def moe_mlp_bytes(setup: Setup) -> int:
    """A MoE block's saved tensors per token (transformers' MixtralExperts / Qwen2MoeExperts loop):
    the router's fp32 softmax over all experts (4 x experts) and its top-k values and indices; for
    each of the k experts a token is routed to, the gated MLP's 3 x e x width, its output kept for the
    routing-weight product (e x hidden) and the fp32 weight and index (12); with full fine-tuning also
    each expert's gathered input and down_proj's input. The shared expert is a gated MLP (3 x e x
    width), and with Qwen2-MoE's sigmoid gate its output and the gate are kept too."""
    arch = setup.arch
    assert arch is not None
    e, h, k = setup.element_bytes, arch.hidden, arch.experts_per_token
    per_expert = 3 * e * arch.moe_intermediate + e * h + 12
    if setup.method == "full":
        per_expert += e * h + e * arch.moe_intermediate
    router = 4 * arch.experts + 12 * k + 4
    if setup.router_logits:
        router += 4 * arch.experts  # the layer's fp32 router logits, returned for the auxiliary loss
    shared = 3 * e * arch.shared_intermediate if arch.shared_intermediate else 0
    if arch.shared_intermediate and arch.shared_expert_gate:
        shared += e * h + e
    return k * per_expert + router + shared


def expert_lora_bytes(setup: Setup) -> int:
    """What LoRA on the fused experts and the router adds to one MoE layer's saved tensors (the trace: peft
    0.21's ParamWrapper, tests/models/test_moe.py). The experts then run on W + scale x B @ A, a parametrization
    computed once per forward: that whole stack of expert weights is saved for backward (every expert, 3 x
    hidden x width each: 1.2 GB in bf16 per layer of Qwen3-30B-A3B), and with the weights needing a gradient
    the experts keep their inputs too (each token's k routed copies of hidden and of width). The router's LoRA
    keeps its merged weight, its input and 12 bytes per token of routing state."""
    arch = setup.arch
    if arch is None or not arch.experts or setup.method == "full":
        return 0
    e, tokens = setup.element_bytes, setup.micro_batch * setup.seq_len
    out = 0
    if setup.lora_experts:
        routed = arch.experts_per_token * tokens * (arch.hidden + arch.moe_intermediate) * e
        out += arch.expert_params * e + routed
    if setup.lora_router:
        out += arch.experts * arch.hidden * e + tokens * (arch.hidden * e + 12)
    return out


def backward_working_bytes(setup: Setup, per_layer: int) -> int:
    """What backward allocates beyond the saved activations, at its own peak (fitted to torch's CPU
    allocations of tiny Llamas, tests/plan/test_planner.py): with checkpointing, one layer's recomputed
    activations plus the MLP's gradients, about (2.5 x intermediate - 2 x hidden) 16-bit elements per
    token, or the fp32 adapters' input copies of the recompute when larger; without, the final norm's
    fp32 gradient temporaries, about 20 x hidden bytes per token."""
    arch = setup.arch
    assert arch is not None
    tokens = setup.micro_batch * setup.seq_len
    if setup.gradient_checkpointing:
        grads = max(0, (5 * arch.active_mlp_width - 4 * arch.hidden) // 2) * setup.element_bytes
        return max(per_layer + tokens * max(grads, adapter_input_copies(setup)), tokens * eager_softmax_backward(setup))
    # Without checkpointing every layer's saved tensors are counted already: the softmax's two fp32 gradients
    # are what its backward adds (the 16-bit copy of the probabilities is freed by then).
    scores = arch.heads * attention_row(setup) if setup.attn == "eager" else 0
    return tokens * max(20 * arch.hidden, scores * (8 - setup.element_bytes))


def eager_softmax_backward(setup: Setup) -> int:
    """Bytes per token live in eager attention's softmax backward in a recomputed layer, the layer's MLP and
    the 16-bit copy of the probabilities freed by then: the saved fp32 probabilities, their fp32 gradient (cast
    from the 16-bit one) and the scores' (12 bytes per score), the repeated q, k and v, and the input norm's
    fp32 input (the trace: Qwen2.5-7B at 4,096 tokens, 470M scores per layer, peaks there when the loss is
    chunked)."""
    arch = setup.arch
    if setup.attn != "eager" or arch is None:
        return 0
    return arch.heads * attention_row(setup) * 12 + 3 * setup.element_bytes * arch.q_dim + 4 * arch.hidden + 4


def adapter_input_copies(setup: Setup) -> int:
    """Bytes per token of an adapted input, peft's fp32 copies of it and the base layer's output while its
    adapter runs (fp32 adapters over a 16-bit model): lora.Linear.forward holds the 16-bit input `x` (the
    frozen base layer keeps none of it) and the base layer's `result`, `_cast_input_dtype`'s fp32 copy and,
    with dropout, its dropped-out fp32 copy, all alive until lora_A has cast its input back to 16 bits (the
    trace: at the recompute of down_proj, whose input is the widest). Freed as the adapter returns, so this
    peaks at one module; with checkpointing that is in backward."""
    arch = setup.arch
    assert arch is not None
    a = trainable_weight_bytes(setup)
    if setup.method == "full" or a == setup.element_bytes or bnb_uncast(setup):
        return 0
    # After prepare_model_for_kbit_training the input is fp32 already: the cast returns it, no copy.
    x = 4 if kbit_prepared(setup) else setup.element_bytes
    per_input = x + (a if x != a else 0) + (a if setup.lora_dropout > 0 else 0)
    return max((lin.in_features * per_input + lin.out_features * x for lin in arch.layer_linears()
                if lin.name in setup.lora_targets), default=0)


def backward_end_terms(setup: Setup, terms: list[Term]) -> list[Term]:
    """Without DeepSpeed the gradients belong to the step phase (backward makes them, zero_grad frees them).
    At backward's end the first decoder layer's backward runs beside every later layer's gradient: its
    saved (or recomputed) activations and its backward temporaries are live with them, and what forward left
    for the whole backward (that layer's checkpointed input, the 4D mask, the ids and labels, RoPE's cos/sin).
    The trace: a Mistral-7B full fine-tune at 2 x 4,096 tokens with checkpointing peaks there, 1.7 GiB over
    the step. Counted in the step phase beyond the phase's other moments (the optimizer's temporaries, the
    tied embedding's gradients, an accumulated gradient's temporary), less the gradients not made yet: the
    layer's own and an untied embedding's (a tied one's head part waits in autograd's accumulation buffer
    from the start of backward, as large). With gradient accumulation the gradients are alive in backward
    already, and the backward phase holds this moment."""
    arch = setup.arch
    if setup.deepspeed or arch is None or objectives.get(setup.objective).uses_trl \
            or setup.gradient_accumulation > 1:  # TRL's step frees its tensors its own way
        return []
    e, tokens = setup.element_bytes, setup.micro_batch * setup.seq_len
    per_layer = layer_activation_bytes(setup)
    working = backward_working_bytes(setup, per_layer) + (0 if setup.gradient_checkpointing else per_layer)
    if setup.gradient_checkpointing:
        working += tokens * arch.hidden * (4 if kbit_prepared(setup) else e)
    working += attention_mask_bytes(setup) + batch_and_rope_bytes(setup)
    wb = trainable_weight_bytes(setup)
    groups = [g for g in param_groups(setup) if g.trainable]
    own = sum(g.total * wb for g in groups if g.per_layer) // arch.layers
    own += sum(g.total * (e if g.unit.endswith(".copy") else wb) for g in groups
               if g.unit.startswith("embed_tokens") and (g.unit.endswith(".copy") or not arch.tied))
    others = sum(t.bytes for t in terms if t.phase == "step" and t.field == "buffers")
    size = working - own - others
    if size <= 0:
        return []
    return [Term("activations", "first layer's backward, beside the gradients", size, phase="step",
                 note="backward's end: its activations and temporaries, beyond the step's other moments")]


def batch_and_rope_bytes(setup: Setup) -> int:
    """What forward keeps for the whole of backward besides the layers: the input ids and labels (int64) and
    RoPE's cos/sin, shared by all layers."""
    assert setup.arch is not None
    return setup.micro_batch * setup.seq_len * 16 + 2 * setup.seq_len * setup.arch.dim_head * setup.element_bytes


def flattened(setup: Setup) -> bool:
    """One row per micro batch (finetune.data.packing.make_collator): padding_free, or packing under flash."""
    return setup.padding_free or (setup.packing and setup.attn.startswith("flash"))


def attention_row(setup: Setup) -> int:
    """Tokens one query is masked against: a row. A flattened row holds the whole micro batch; padding_free
    rows vary with the data, and max_length per example bounds them at micro_batch x seq_len."""
    return setup.micro_batch * setup.seq_len if flattened(setup) else setup.seq_len


def attention_mask_bytes(setup: Setup) -> int:
    """The 4D mask transformers' masking_utils materialises for sdpa (bool) and eager (the model dtype),
    once per forward, (rows, 1, row, row): padded rows, packed rows (block-diagonal, from the position
    ids) and flattened rows (1, 1, micro_batch x seq, micro_batch x seq) all build one; sdpa alone skips
    it for full unpadded rows (is_causal). Flash attention takes boundaries (cu_seq_lens) instead."""
    if setup.attn.startswith("flash") or (setup.attn == "sdpa" and setup.full_rows):
        return 0
    per = setup.element_bytes if setup.attn == "eager" else 1
    rows = 1 if flattened(setup) else setup.micro_batch
    return rows * attention_row(setup) ** 2 * per
