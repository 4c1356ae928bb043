"""Model states and DeepSpeed's buffers: weights, gradients, optimizer states, reduction buckets, swap buffers."""

from __future__ import annotations

import math
from dataclasses import replace

from finetune.plan.constants import (
    BNB_BLOCKSIZE, DS_ALLREDUCE_BUCKET_SIZE, DS_OPTIMIZER_SWAP_BUFFERS, DS_PARAM_SWAP_BUFFERS,
    DS_PARAM_SWAP_BUFFER_SIZE, GPTQ_GROUP_SIZE, MASTER_BYTES, OPTIMIZER_STATE_BYTES,
)
from finetune.plan.params import ParamGroup, four_bit_bytes, group_quant_state_bytes, largest_module_numel
from finetune.plan.result import gib
from finetune.plan.setup import Setup, Term, Terms
from finetune.plan.zero3 import zero3_live_params


def _bytes_of(group: ParamGroup, setup: Setup, trainable_bytes: int) -> int:
    if group.quantized:
        return group.count * (four_bit_bytes(group.numel) + group_quant_state_bytes(group, setup))
    if group.trainable and _is_saved_copy(group):
        return group.total * setup.element_bytes
    return group.total * (trainable_bytes if group.trainable else frozen_weight_bytes(setup))


def kbit_prepared(setup: Setup) -> bool:
    """Whether peft's prepare_model_for_kbit_training left the QLoRA base's 16-bit parameters in fp32."""
    return setup.kbit_prepared and setup.method == "qlora"


def frozen_weight_bytes(setup: Setup) -> int:
    """Bytes per element of a frozen weight that is not 4-bit: the model dtype's, or fp32 after
    prepare_model_for_kbit_training (Setup.kbit_prepared: "cast all non INT8 parameters to fp32")."""
    return 4 if kbit_prepared(setup) else setup.element_bytes


def _is_saved_copy(group: ParamGroup) -> bool:
    """peft's modules_to_save copy: a deepcopy of the original module (utils/other.py
    ModulesToSaveWrapper), so in the model dtype; cast_adapter_dtype upcasts adapter layers only."""
    return group.unit.endswith(".copy")


def _trainable_bytes_total(setup: Setup, groups: list[ParamGroup]) -> int:
    """Bytes of all trainable weights as stored (and, without DeepSpeed, of their gradients)."""
    wb = trainable_weight_bytes(setup)
    return sum(_bytes_of(g, setup, wb) for g in groups if g.trainable)


def _width(setup: Setup) -> str:
    """How the model dtype's elements are called in term names: 16-bit, or fp32 for a float32 model."""
    return "fp32" if setup.element_bytes == 4 else "16-bit"


def trainable_weight_bytes(setup: Setup) -> int:
    """DeepSpeed casts every parameter to the 16-bit dtype (engine._configure_distributed_model);
    without DeepSpeed, peft keeps LoRA weights in fp32 (autocast_adapter_dtype=True), or, in peft
    0.7-0.11, in the base weight's dtype (Setup.adapter_dtype "model") when that is a float: a 4-bit
    base's packed integers leave them in fp32 (lora/layer.py update_layer)."""
    if not setup.deepspeed and setup.method != "full" and (setup.adapter_dtype == "float32" or setup.method == "qlora"):
        return 4
    return setup.element_bytes


def _constants_note(setup: Setup) -> str:
    if setup.quant_format == "gptq-int4":
        return f"GPTQ scales + zero points per {GPTQ_GROUP_SIZE} inputs, g_idx (auto-gptq QuantLinear)"
    return "absmax per 64 values" + (" (8-bit, double quant)" if setup.double_quant else " (fp32)")


def weight_terms(setup: Setup, groups: list[ParamGroup]) -> Terms:
    """The weights on each GPU; under ZeRO-3 with offload_param, the partitions' CPU memory or NVMe swap buffers."""
    wb = trainable_weight_bytes(setup)
    frozen16 = sum(_bytes_of(g, setup, wb) for g in groups if not g.trainable and not g.quantized)
    quantized = [g for g in groups if g.quantized]
    packed = sum(g.count * four_bit_bytes(g.numel) for g in quantized)
    constants = sum(g.count * group_quant_state_bytes(g, setup) for g in quantized)
    train = sum(_bytes_of(g, setup, wb) for g in groups if g.trainable)
    dt = "fp32" if wb == 4 else setup.dtype.replace("bfloat16", "bf16").replace("float16", "fp16")
    if not (setup.deepspeed and setup.stage == 3):
        return Terms((
            Term("weights", f"frozen base {'fp32' if kbit_prepared(setup) else _width(setup)}", frozen16,
                 note="fp32: prepare_model_for_kbit_training" if kbit_prepared(setup) else f"{setup.dtype}"),
            Term("weights", "frozen base 4-bit", packed, note="NF4, 2 values per byte"),
            Term("weights", "quantization constants", constants, note=_constants_note(setup)),
            Term("weights", "trainable", train, note=dt),
        ))
    # ZeRO-3 partitions every parameter (frozen ones too) across all GPUs, except the ones at or below
    # stage3_param_persistence_threshold (partition_parameters.py: ds_persist), which every GPU keeps
    # whole. Quantization constants are attributes of the 4-bit tensors, not parameters: never split.
    n = setup.world
    thr = setup.param_persistence_threshold
    stored = {id(g): (g.count * four_bit_bytes(g.numel) if g.quantized else _bytes_of(g, setup, wb)) for g in groups}
    persistent = sum(stored[id(g)] for g in groups if g.storage_numel <= thr)
    partitioned = sum(stored.values()) - persistent
    gathered = largest_module_numel(groups) * setup.element_bytes
    terms, cpu, notes = [], [], []
    if setup.offload_param == "none":
        terms.append(Term("weights", f"partition 1/{n}", math.ceil(partitioned / n),
                          note=f"{_width(setup)} partitions of all parameters (stage3.py: lp_param_buffer)"))
    elif setup.offload_param == "cpu":
        cpu.append(Term("cpu", "parameter partitions", math.ceil(partitioned / n) * setup.gpus_per_node,
                        note="offload_param=cpu, pinned"))
    else:
        cpu.append(Term("cpu", "parameter swap buffers", setup.gpus_per_node * DS_PARAM_SWAP_BUFFERS
                        * DS_PARAM_SWAP_BUFFER_SIZE * setup.element_bytes,
                        note="offload_param=nvme: buffer_count x buffer_size"))
        notes.append(f"parameters on NVMe: {gib(partitioned)} GiB per node on disk")
    terms.append(Term("weights", "quantization constants", constants, note="not partitioned"))
    # Backward only: step() starts with _partition_all_parameters (stage3.py), which releases every
    # gathered parameter before the optimizer runs (a whole DeepSpeed step measured on CPU peaks at the
    # planned step phase without it: docs/plan.md). On one rank DeepSpeed gathers nothing (single_rank_views),
    # yet the term stays, as in DeepSpeed's own estimator (issue 35: `model states` equals
    # estimate_zero3_model_states_mem_needs; the single-GPU ZeRO-3 rows of the corpus measured above the
    # plan without it): an over-estimate of at most one module's 16-bit copy there.
    one_rank = " (one rank gathers nothing: DeepSpeed's estimator counts it, the plan keeps it)" \
        if single_rank_views(setup) else ""
    terms.append(Term("weights", "gathered largest module", gathered, phase="backward",
                      note=f"estimate_zero3_model_states_mem_needs: {setup.element_bytes} bytes x "
                           f"largest_layer_params{one_rank}"))
    if persistent:
        terms.append(Term("buffers", "persistent small params", persistent,
                          note=f"params <= {thr:,} elements stay whole on every GPU"))
    return Terms(tuple(terms), tuple(cpu), tuple(notes))


def foreach_adam_temporaries(setup: Setup) -> int:
    """How many moment-sized temporaries torch's multi-tensor Adam(W) allocates at once in its step:
    exp_avg_sq_sqrt = _foreach_sqrt(exp_avg_sqs) for every parameter (torch >= 2.1 then adds eps in
    place); torch 2.0 also allocated denom = _foreach_add(exp_avg_sq_sqrt, eps) while the first was
    alive. The fused kernel has none."""
    if setup.optimizer not in ("adamw", "adam"):
        return 0
    return {"foreach": 1, "foreach_torch20": 2}.get(setup.optimizer_impl, 0)


def backward_gradients(setup: Setup, trainable: int) -> int:
    """Bytes of DeepSpeed's 16-bit gradients that are not alive at backward's start, made after the loss buffers.

    - ZeRO-2's partition: allocated at the first gradient's hook (stage_1_and_2.py copy_grads_in_partition:
      `torch.empty` when grads_in_partition is None), dropped at backward's end (independent_gradient_partition_epilogue
      -> _release_ipg_buffers), and step() frees the gradient views into it (free_grad_in_param_list). Measured: an
      H200, Llama-3.2-1B shape, full fine-tune at 8,192 tokens without checkpointing peaked 2.30 GiB (its partition)
      under the plan that counted it beside the loss (docs/plan.md, "Ninth pass").
    - ZeRO-0: every .grad is made by backward; after the step engine._take_model_step calls the wrapper's
      zero_grad(set_to_none=True) (FP16_Optimizer, FP16_UnfusedOptimizer; engine.zero_grad without one), which sets
      each .grad to None. Measured: the same shape's full fine-tune at 4 x 2,048 tokens peaked 2.30 GiB (its 16-bit
      gradients) under the plan that counted them beside the loss (docs/plan.md, "Tenth pass").

    So with one micro batch per step the loss buffers at backward's start never meet them; they are there once the
    first gradient has arrived, after them. With accumulation the next micro batches' backward starts with the
    gradients so far. ZeRO-1 (not measured) and the offloaded stages keep their gradients alive throughout."""
    if not setup.deepspeed or setup.gradient_accumulation != 1 or setup.offload_optimizer != "none":
        return 0
    if setup.stage == 2:
        return math.ceil(trainable / setup.world) * trainable_weight_bytes(setup)
    if setup.stage == 0:
        return trainable * (4 if setup.dtype == "float32" else trainable_weight_bytes(setup))
    return 0


def _late(setup: Setup, term: Term, trainable: int) -> Term:
    """`term`, the 16-bit gradients, in the step phase where backward makes them after the loss buffers
    (backward_gradients): the allocated counter does not have them beside the loss, the reserved one has their
    cached blocks (planner._overhead), and backward's own later peak counts them (activations.activation_terms)."""
    if not backward_gradients(setup, trainable):
        return term
    return replace(term, phase="step", remade=True,
                   note=(term.note + "; " if term.note else "") + "made by backward's first gradient, after the loss "
                        "buffers are freed: in backward counted with its later peak")


def gradient_and_optimizer_terms(setup: Setup, groups: list[ParamGroup], trainable: int) -> Terms:
    """Gradients and optimizer states on each GPU; with offload_optimizer, their CPU memory or NVMe swap buffers."""
    n = setup.world
    e = trainable_weight_bytes(setup)
    states = OPTIMIZER_STATE_BYTES[setup.optimizer]
    opt_name = f"{setup.optimizer} states"
    if not setup.deepspeed:
        # Plain PyTorch: gradients and optimizer states in each parameter's dtype (fp32 LoRA adapters,
        # 16-bit modules_to_save copies and full fine-tunes).
        stored = _trainable_bytes_total(setup, groups)
        state_total = stored * states // 4 if setup.optimizer != "adamw_bnb_8bit" else trainable * 2
        # The Trainer's zero_grad (set_to_none) frees them after each step: they are made by backward and
        # live into the step, but not at the start of backward where the loss buffers peak (the trace,
        # finetune/plan/trace/step.py, shows no gradient there).
        temporaries = foreach_adam_temporaries(setup)
        if setup.gradient_accumulation > 1:
            # transformers Trainer._inner_training_loop calls optimizer.step() and model.zero_grad() only at
            # the end of each accumulation cycle: micro batches 2..N run backward with every .grad alive, and
            # torch's AccumulateGrad adds each new gradient into it (`variable.grad += new_grad`), the new one
            # a temporary of the parameter's size. At backward's end that is the largest parameter's; the
            # optimizer step comes after it, so a foreach AdamW's temporaries (below) are not alive with it
            # and only what exceeds them raises the step phase.
            wb = trainable_weight_bytes(setup)
            largest = max((_bytes_of(g, setup, wb) // g.count for g in groups if g.trainable), default=0)
            out = [Term("gradients", "gradients", stored,
                        note=f"same dtype as the trainable weights; kept across the {setup.gradient_accumulation} "
                             "accumulated micro batches (zero_grad after the step)")]
            beyond = largest - temporaries * stored
            if beyond > 0:
                out.append(Term("buffers", "accumulated gradient temporary", beyond, phase="step",
                                note="AccumulateGrad at backward's end: the largest parameter's new gradient "
                                     "before it is added to .grad" + (", beyond the foreach temporaries"
                                                                      if temporaries else "")))
        else:
            out = [Term("gradients", "gradients", stored, phase="step", remade=True,
                        note="same dtype as the trainable weights; freed by zero_grad, not alive with the loss")]
        out.append(Term("optimizer", opt_name, state_total, note="torch optimizer, parameter dtype"))
        if temporaries:
            out.append(Term("buffers", "foreach Adam temporaries", temporaries * stored, phase="step",
                            note=f"{temporaries} moment-sized (optimizer_impl {setup.optimizer_impl})"))
        arch = setup.arch
        if setup.method == "full" and arch is not None and arch.tied:
            # Backward's last step with tied embeddings (the trace, finetune/plan/trace/step.py): lm_head's weight
            # gradient (mm) and embedding_dense_backward's are both vocab x hidden, and their sum becomes the
            # .grad: two embedding-sized tensors beside every gradient. Counted in the step phase, the one
            # that holds every gradient, beyond a foreach AdamW's temporaries (the optimizer runs after it).
            size = 2 * arch.vocab * arch.hidden * setup.element_bytes - temporaries * stored
            if size > 0:
                out.append(Term("buffers", "tied embedding gradients", size, phase="step",
                                note=f"2 x {arch.vocab:,} vocab x {arch.hidden:,} hidden x {setup.element_bytes} B "
                                     "at backward's end (lm_head's + the embedding's, before their sum)"
                                     + (", beyond the foreach temporaries" if temporaries else "")))
        return Terms(tuple(out))
    if setup.optimizer in ("adam", "adamw"):  # who steps them on the GPU (finetune.render.with_torch_adam)
        stepper = ("DeepSpeed's FusedAdam (compiled with nvcc on a machine's first run)" if setup.ds_fused_adam
                   else "torch's fused AdamW (torch_adam: nothing to compile)")
    else:
        stepper = ""
    if setup.stage == 0 and setup.dtype == "float32":
        # No bf16/fp16: engine._do_optimizer_sanity_check returns no wrapper, the optimizer runs as is.
        return Terms((_late(setup, Term("gradients", "fp32 gradients", trainable * 4), trainable),
                      Term("optimizer", opt_name, trainable * states, note=stepper)))
    if setup.stage == 0 and not setup.ds_fused_adam:
        # deepspeed/runtime/fp16/unfused_optimizer.py (FP16_UnfusedOptimizer: any optimizer but DeepSpeed's FusedAdam,
        # engine._configure_fp16_optimizer): a fp32 master copy per trainable tensor; step() gives each its fp32
        # gradient (`fp16_param.grad.to(fp32)`), steps, and frees them. Nothing is flattened. Measured: an H200,
        # the Llama-3.2-1B shape's full fine-tune with torch's fused AdamW (torch_adam), 23.08 GiB (docs/plan.md).
        return Terms((
            _late(setup, Term("gradients", f"{_width(setup)} gradients", trainable * e), trainable),
            Term("gradients", "fp32 gradients", trainable * 4, phase="step", note="a fp32 copy per tensor for the step"),
            Term("optimizer", "fp32 master weights", trainable * MASTER_BYTES),
            Term("optimizer", opt_name, trainable * states, note=stepper),
        ))
    if setup.stage == 0:
        # deepspeed/runtime/fp16/fused_optimizer.py (FP16_Optimizer, also for bf16 without ZeRO, over DeepSpeed's
        # FusedAdam): fp32 master copy of all trainable weights; step() turns the 16-bit grads into fp32 copies,
        # flattens them (a second fp32 copy) and hands the flat buffer to the optimizer as .grad.
        return Terms((
            _late(setup, Term("gradients", f"{_width(setup)} gradients", trainable * e), trainable),
            Term("gradients", "fp32 gradients", trainable * 4, phase="step", note="flat fp32 copy for the step"),
            Term("optimizer", "fp32 master weights", trainable * MASTER_BYTES),
            Term("optimizer", opt_name, trainable * states, note=stepper),
            Term("buffers", "fp32 grad copies (flatten)", trainable * 4, phase="step",
                 note="FP16_Optimizer.step: per-param .to(fp32) before flattening"),
        ))
    part = math.ceil(trainable / n)
    offload = setup.offload_optimizer != "none"
    terms: list[Term] = []
    # Stage 1 keeps full 16-bit gradients through backward (reduced at the boundary); stage 2 copies
    # each gradient into its owner's partition (stage_1_and_2.py: grads_in_partition, 1/N) and frees
    # the rest; stage 3 keeps a flat 16-bit partition buffer for them (stage3.py:
    # grad_partitions_flat_buffer), which estimate_zero3_model_states_mem_needs leaves out of its
    # 18 bytes per parameter: it is listed with the buffers so that model_states stays DeepSpeed's number.
    if setup.stage == 1:
        terms.append(Term("gradients", f"{_width(setup)} gradients", trainable * e, note="stage 1 keeps them whole"))
    elif setup.stage == 2 and not offload:
        terms.append(_late(setup, Term("gradients", f"{_width(setup)} gradient partition 1/{n}", part * e), trainable))
    elif setup.stage == 3 and not offload:
        terms.append(Term("buffers", f"contiguous gradient partition 1/{n}", part * e,
                          note="grad_partitions_flat_buffer (not in DeepSpeed's ZeRO-3 estimator)"))
    if setup.stage == 3:
        # The module being computed has its whole 16-bit gradient before the reduce-scatter
        # (estimate_zero3_model_states_mem_needs: the other 2 x largest_layer_params).
        terms.append(Term("gradients", "gradient of gathered module",
                          largest_module_numel(groups, trainable_only=True) * e, phase="backward",
                          note="before reduce-scatter (freed before the step)"))
    if offload:
        device = setup.offload_optimizer
        per_rank = part * (MASTER_BYTES + states + 4)
        if setup.stage == 3:
            per_rank += part * e  # grad_partitions_flat_buffer lives on the CPU with offload (stage3.py: self.device)
        else:
            per_rank += part * e  # param_buffer_of_bit16_for_cpu_offload_groups (stage_1_and_2.py)
        if device == "cpu":
            return Terms(tuple(terms), (Term("cpu", "offloaded optimizer", per_rank * setup.gpus_per_node,
                                             note="fp32 master + states + fp32 grads + 16-bit staging, pinned, per node"),))
        largest = min(setup.sub_group_size, part)
        return Terms(tuple(terms),
                     (Term("cpu", "optimizer swap buffers", DS_OPTIMIZER_SWAP_BUFFERS * largest * 4 * setup.gpus_per_node,
                           note="NVMe offload: buffer_count x sub-group, fp32"),),
                     (f"optimizer states on NVMe: {gib(per_rank * setup.gpus_per_node)} GiB per node on disk",))
    # fp32 gradient partition for the step, built in step() from the 16-bit partition and dropped
    # after it: stage_1_and_2.py single_grad_partition; stage3.py _prepare_fp32_grad_for_sub_group,
    # one sub-group (sub_group_size elements) at a time.
    at_once = min(part, setup.sub_group_size) * 4 if setup.stage == 3 and part > setup.sub_group_size else None
    terms += [
        Term("gradients", f"fp32 gradient partition 1/{n}", part * 4, phase="step",
             note="not in the ZeRO paper's 2+2+12 bytes"
                  + (f"; {gib(at_once)} GiB at once (one sub_group_size)" if at_once else ""), live=at_once),
        Term("optimizer", f"fp32 master weights 1/{n}", part * MASTER_BYTES),
        Term("optimizer", f"{opt_name} 1/{n}", part * states, note=stepper),
    ]
    if setup.stage == 3 and e < 4:
        # stage3.py _prepare_fp32_grad_for_sub_group: self.flatten(averaged_gradients).to(fp32) copies
        # the sub-group's 16-bit gradient views into a new flat buffer first, alive beside its fp32
        # copy (6 bytes per element at that moment; measured in tests/plan/test_planner.py). A float32 model's
        # flat copy is its fp32 gradient: .to() returns it as is.
        terms.append(Term("buffers", "16-bit gradient flatten copy", min(part, setup.sub_group_size) * e,
                          phase="step", note="stage3.py _prepare_fp32_grad_for_sub_group, one sub-group"))
    elif setup.stage in (1, 2) and e < 4:
        # stage_1_and_2.py step(): single_grad_partition = self.flatten(self.averaged_gradients[i]).to(fp32)
        # (DeepSpeed 0.10-0.12; 0.19 when the partition is not pre-flattened): the same flat 16-bit copy
        # beside the fp32 one (a whole ZeRO-2 step measured on CPU: docs/plan.md).
        terms.append(Term("buffers", "16-bit gradient flatten copy", part * e, phase="step",
                          note="stage_1_and_2.py step: flatten(averaged_gradients) before .to(fp32)"))
    return Terms(tuple(terms))


def buffer_terms(setup: Setup, groups: list[ParamGroup], trainable: int) -> list[Term]:
    """The buffers on each GPU: dequantized 4-bit weights, DDP's or DeepSpeed's reduction buckets, ZeRO-3's prefetch."""
    terms = _dequant_buffer(setup, groups)
    if not setup.deepspeed:
        if setup.world > 1:
            # torch DDP (gradient_as_bucket_view=False, the default) copies every gradient into its
            # flat all-reduce buckets: the trainable gradients once more.
            terms.append(Term("buffers", "DDP gradient buckets", _trainable_bytes_total(setup, groups),
                              note="torch DistributedDataParallel reducer"))
        return terms
    e = setup.element_bytes
    n = setup.world
    largest_trainable = max((g.numel for g in groups if g.trainable), default=0)
    if setup.stage == 0:
        if n > 1:
            # engine.buffered_allreduce_fallback flattens up to allreduce_bucket_size elements at a time.
            terms.append(Term("buffers", "all-reduce flatten", min(trainable, DS_ALLREDUCE_BUCKET_SIZE) * e,
                              phase="backward", note="engine.allreduce_gradients"))
        return terms
    bucket = setup.reduce_bucket_size
    if setup.stage in (1, 2):
        if setup.contiguous_gradients:
            # stage_1_and_2.py setup_buckets(): torch.empty(reduce_bucket_size) whatever the model size,
            # and a second one when overlap_comm is on (double buffering).
            copies = 2 if setup.overlap else 1
            terms.append(Term("buffers", "reduce bucket" + (" x2 (overlap_comm)" if copies == 2 else ""),
                              copies * bucket * e, phase="backward",
                              note=f"reduce_bucket_size {bucket:,} elements"))
        # allreduce_bucket() flattens the bucket's gradients before the collective.
        terms.append(Term("buffers", "reduce flatten copy", min(bucket, trainable) * e, phase="backward"))
        if setup.offload_optimizer != "none":
            # temp_grad_buffer_for_gpu_offload: the largest parameter, staged before the copy to CPU.
            terms.append(Term("buffers", "offload staging", largest_trainable * e, phase="backward",
                              note="largest trainable parameter"))
        # allgather_bucket_size costs nothing: utils.all_gather_dp_groups gathers into the flat buffer.
        return terms
    # ZeRO-3: one reduce bucket (stage3.py _setup_for_real_optimizer; no double buffer even with
    # overlap_comm) and the reduce-scatter's staging buffer of about the same size.
    if setup.contiguous_gradients:
        terms.append(Term("buffers", "reduce bucket", bucket * e, phase="backward",
                          note=f"reduce_bucket_size {bucket:,} elements"))
    terms.append(Term("buffers", "reduce-scatter staging", min(bucket, trainable) * e, phase="backward"))
    live = 0 if single_rank_views(setup) else zero3_live_params(setup, groups)
    largest = largest_module_numel(groups)
    extra = max(0, live - largest)
    if extra:
        terms.append(Term("buffers", "prefetched / retained params", extra * e, phase="backward",
                          note=f"peak {live / 1e6:,.0f}M gathered (prefetch {setup.prefetch_bucket_size:,}, "
                               f"reuse distance {setup.max_reuse_distance:,})"))
    return terms


def single_rank_views(setup: Setup) -> bool:
    """ZeRO-3 on one rank gathers nothing: a partition is the whole parameter, and partition_parameters.py
    (_no_gather_coalesced / NoGatherHandle, DeepSpeed 0.9 and later) makes param.data a view of it on the
    same device. With offload_param the view is a copy from the CPU, as many ranks' gathers are."""
    return setup.deepspeed and setup.stage == 3 and setup.world == 1 and setup.offload_param == "none"


def dequantized_weight_bytes(setup: Setup, groups: list[ParamGroup]) -> int:
    """bitsandbytes runs a 4-bit linear on more than a few rows as dequantize + F.linear (backends/cuda/
    ops.py gemm_4bit: the fallback past _gemm_4bit_custom_max_m), and backward dequantizes again
    (autograd/_functions.py MatMul4Bit.backward): one 16-bit copy of the largest quantized weight,
    plus its fp32 absmax when those are double-quantized, alive while that layer runs. 0 without one."""
    largest = max((g.numel for g in groups if g.quantized), default=0)
    if not largest or setup.quant_format == "gptq-int4":
        return 0
    absmax = math.ceil(largest / BNB_BLOCKSIZE) * 4 if setup.double_quant else 0
    return largest * setup.element_bytes + absmax


def _dequant_buffer(setup: Setup, groups: list[ParamGroup]) -> list[Term]:
    """The dequantized 4-bit weights among the buffers: GPTQ's; bitsandbytes' where the model's shapes are
    unknown. With them, activations.activation_terms places bitsandbytes' at backward's own peak: only a running
    layer holds it, and no quantized layer runs beside the loss's buffers (the output head is not quantized). The
    H200 rows measured that: Q-LoRA 1 x 2,048 and 8,192 tokens, each 0.03 GiB (the Llama-3.2-1B shape's
    gate_proj) under the plan that counted it beside the loss (docs/plan.md, "Tenth pass")."""
    largest = max((g.numel for g in groups if g.quantized), default=0)
    if not largest:
        return []
    if setup.quant_format == "gptq-int4":
        return _gptq_dequant_terms(setup, groups, largest)
    if setup.arch is not None:
        return []
    return [Term("buffers", "dequantized 4-bit weight", dequantized_weight_bytes(setup, groups), phase="backward",
                 note="largest quantized linear, 16-bit, while it runs")]


def _gptq_dequant_terms(setup: Setup, groups: list[ParamGroup], largest: int) -> list[Term]:
    """auto-gptq 0.4-0.5's qlinear_cuda_old.QuantLinear.forward takes its CUDA kernel only below
    kernel_switch_threshold (128) rows; a training batch dequantizes the whole weight in torch ops and
    runs torch.matmul(x, weight). With an input that requires grad (LoRA, enable_input_require_grads)
    autograd saves that 16-bit weight: every quantized linear of each layer whose activations are kept
    (one layer, recomputed, with checkpointing). Unpacking goes through an int32 shift and an int8 copy:
    5 bytes per element at its peak, 3 more than the 16-bit result (measured on CPU: tests/plan/test_corpus.py)."""
    per_layer = sum(g.numel for g in groups if g.quantized and g.per_layer)
    layers = 1 if setup.gradient_checkpointing else setup.arch.layers if setup.arch else 1
    e = setup.element_bytes
    return [Term("buffers", "GPTQ dequantized weights (saved)", layers * per_layer * e, phase="backward",
                 note=f"{layers} layer{'s' if layers > 1 else ''} of 16-bit weights kept by torch.matmul for backward"),
            Term("buffers", "GPTQ unpacking", largest * 3, phase="backward",
                 note="int32 shift + int8 copy of the largest quantized weight while it dequantizes")]
