"""`plan()`: assembles every term of a `Setup` into a `PlanResult`, plus the overhead and CPU terms."""

from __future__ import annotations

import re
from typing import Optional

from finetune.plan.activations import activation_terms, backward_end_terms
from finetune.plan.allocator import resident_waste
from finetune.plan.constants import (
    CUBLAS_HANDLES, CUBLAS_WORKSPACE, CUDA_CONTEXT, FRAGMENTATION, HISTORY_RECORDS, NCCL_BUFFERS, PROCESS_RSS, MiB,
)
from finetune.plan.parallel import offload_activations, parallel_terms
from finetune.plan.params import ParamGroup, four_bit_bytes, param_groups
from finetune.plan.grpo import generation_terms
from finetune.plan.preference import reference_terms
from finetune.plan.result import PlanResult
from finetune.plan.setup import Setup, Term, overflow_as_plan_error
from finetune.plan.vision import vision_notes, vision_terms
from finetune.plan.states import (
    backward_gradients, buffer_terms, dequantized_weight_bytes, gradient_and_optimizer_terms, trainable_weight_bytes,
    weight_terms,
)


@overflow_as_plan_error
def plan(setup: Setup) -> PlanResult:
    """Per-GPU and per-node CPU memory of `setup`."""
    groups = param_groups(setup)
    trainable = sum(g.total for g in groups if g.trainable)
    weights = weight_terms(setup, groups)
    states = gradient_and_optimizer_terms(setup, groups, trainable)
    terms: list[Term] = [*weights.gpu, *reference_terms(setup, trainable), *generation_terms(setup), *states.gpu,
                         *buffer_terms(setup, groups, trainable)]
    cpu: list[Term] = [*weights.cpu, *states.cpu]
    notes: list[str] = [*weights.notes, *states.notes]
    complete = setup.arch is not None
    if complete:
        late = backward_gradients(setup, trainable)
        dequantized = dequantized_weight_bytes(setup, groups)
        activations, offloaded = offload_activations(setup, activation_terms(setup, late, dequantized))
        terms += activations + parallel_terms(setup) + vision_terms(setup)
        terms += backward_end_terms(setup, terms)
        cpu += offloaded
        notes += _moe_notes(setup) + vision_notes(setup)
    notes += bf16_note(setup)
    terms += _overhead(setup, groups, terms)
    cpu += _cpu_base(setup, groups)
    return PlanResult(setup, terms, cpu, notes, complete, trainable)


def _moe_notes(setup: Setup) -> list[str]:
    arch = setup.arch
    if arch is None or not arch.experts or setup.method == "full":
        return []
    adapted = "the attention" + (" and shared-expert" if arch.shared_intermediate else "") + " projections"
    if setup.lora_experts:
        adapted += ", every routed expert (gate_up_proj at rank 2r, down_proj), whose weights run as W + BA: one " \
                   f"layer's stack ({arch.expert_params * setup.element_bytes / 2**30:.2f} GiB) is kept for backward"
    if setup.lora_router:
        adapted += ", the router"
    out = [f"mixture of experts: all {arch.experts} experts of each layer are resident; a token runs through "
           f"{arch.experts_per_token}. LoRA adapts {adapted}" + ("" if setup.lora_experts else
           " (lora.target_experts: true adapts the experts too)")]
    if setup.router_logits:
        out.append("the router's auxiliary loss is on (moe.router_aux_loss_coef null: the model's weight): every "
                   "layer's router logits are kept until the loss")
    if setup.method == "qlora":
        out.append("bitsandbytes 4-bit replaces nn.Linear layers only: the experts stay in "
                   f"{setup.dtype} ({arch.moe_layers * arch.expert_params / 1e9:.1f}B parameters)")
    return out


def _overhead(setup: Setup, groups: list[ParamGroup], terms: list[Term]) -> list[Term]:
    hopper = is_hopper(setup.gpu_type)
    workspace = CUBLAS_WORKSPACE["hopper" if hopper else "other"]
    out = [Term("overhead", "cuBLAS workspaces", CUBLAS_HANDLES * workspace,
                note=f"{CUBLAS_HANDLES} x {workspace / MiB:g} MiB ({'Hopper' if hopper else 'pre-Hopper'}"
                     f"{', GPU type unknown' if setup.gpu_type is None else ''}; CublasHandlePool.cpp)")]
    rounding = _allocator_rounding(setup, groups)
    if rounding:
        how = ("512 B blocks in 2 / 20 MiB expandable pages" if setup.expandable_segments else
               "2 MiB / 20 MiB segments, large ones rounded to 2 MiB")
        out.append(Term("overhead", "allocator rounding", rounding, counter="reserved",
                        note=f"weight tensors: {how} (CUDACachingAllocator.cpp; finetune/plan/allocator.py)"))
    kept = [t for t in terms if t.remade]
    cached = sum(t.bytes for t in kept)
    if cached:
        # zero_grad (or DeepSpeed's step) frees the gradients after each step (not alive at the loss peak: the
        # allocated counter), but PyTorch's cache keeps their blocks, re-requested at the same sizes by the next
        # backward: the reserved counter still holds them while the loss buffers are alive.
        out.append(Term("overhead", "cached gradient blocks", cached, phase="backward", counter="reserved",
                        note="freed after the step, kept by the caching allocator for the next backward"))
    for phase in ("backward", "step"):
        # Memory allocated and freed within the step: activations, the loss, transient buffers (not torch's
        # gradients: the same sizes every step, their cached blocks are reused as they are).
        # Saved activations without checkpointing are left out: the replay of the rules over a traced step
        # (scripts/plan_corpus.py --allocator swift-benchmark/037: Qwen-7B LoRA, 2,048 tokens, no
        # checkpointing) reserves 0.85 GiB over the allocated peak for one shape, 6% of its 13.8 GiB
        # backward, where 30% of it would be 4.1 GiB: a stack of blocks freed and re-requested in order.
        transient = sum(t.bytes for t in terms if t.phase == phase and t not in kept and not t.stacked)
        if transient:
            out.append(Term("overhead", "allocator fragmentation", int(transient * FRAGMENTATION), phase=phase,
                            counter="reserved",
                            note=f"{FRAGMENTATION:.0%} of what the {phase} phase allocates and frees "
                                 "(fitted: docs/plan.md)"))
        shaped = history_base(terms)
        if shaped and phase == "backward" and setup.shapes_vary and not setup.expandable_segments:
            out += _history(setup, shaped, terms + out)
    out.append(Term("overhead", "CUDA context", CUDA_CONTEXT, counter="device",
                    note="outside PyTorch: driver + lazily loaded kernels (measured, CUDA >= 11.7)"))
    nccl = nccl_buffer_bytes(setup.world)
    if nccl:
        out.append(Term("overhead", "NCCL buffers", nccl, counter="device",
                        note=f"outside PyTorch: {setup.world} ranks (NCCL issues 986, 1685)"))
    return out


def history_base(terms: list[Term]) -> int:
    """What an earlier, shorter longest batch leaves cached for good: the loss's working set (tokens x
    vocabulary tensors, a few blocks of GiBs that no later request of another size fits; _history).
    Tensors of the same size every step (dequantized 4-bit or GPTQ weights, DeepSpeed's buckets, gathered
    parameters) get back the block they freed (get_free_block's best fit), and the activations' many
    per-layer blocks serve a longer batch's smaller requests: the replay of the rules over a traced step
    (scripts/plan_corpus.py --allocator swift-benchmark/008,swift-benchmark/037: Qwen-7B LoRA at 2,048
    tokens with and without checkpointing) leaves 9.79 GiB cached in blocks of 1 GiB and more in both, the
    loss blocks of the 4 earlier records (3.06 x 3.48 GiB = 10.65 planned), though 037's activations are
    13.8 GiB more: 37.61 GiB reserved in all, measured 37.70, where a history of all backward frees planned 74.52."""
    return sum(t.bytes for t in terms if t.phase == "backward" and t.field == "logits")


def _history(setup: Setup, transient: int, terms: list[Term]) -> list[Term]:
    """The cache of earlier, shorter longest batches (constants.HISTORY_RECORDS), up to the GPU's memory: before
    a cudaMalloc fails the allocator frees every unsplit cached segment and retries (release_cached_blocks),
    so the reserved counter stops at the GPU's size less what lies outside PyTorch."""
    factor = sum(HISTORY_RECORDS)
    size = int(transient * factor)
    note = (f"batches of varying shape without expandable segments: the loss blocks of {len(HISTORY_RECORDS)} "
            f"shorter longest-so-far batches stay cached ({factor:.2f} x the loss working set; docs/plan.md)")
    if setup.gpu_memory is not None:
        below = sum(t.bytes if t.live is None else t.live for t in terms
                    if t.phase in ("both", "backward") and t.counter in ("allocated", "reserved"))
        room = setup.gpu_memory - CUDA_CONTEXT - nccl_buffer_bytes(setup.world) - below
        if size > room:
            size = max(0, room)
            note += "; up to the GPU's memory (the cache is freed before an allocation fails)"
    return [Term("overhead", "allocator history", size, phase="backward", counter="reserved", note=note)]


# GPUs before Ampere (compute capability < 8.0) have no bf16 and no FlashAttention-2 (lint R103 reads it too).
_PRE_AMPERE = re.compile(
    r"\b(v100|t4|p40|p100|p4|p6|k80|k40|m40|m60|titan\s*(v|xp?|rtx)|quadro\s*rtx|gtx\s*\d+|rtx\s*20\d\d|tesla\s*[kmp]\d*)\b",
    re.IGNORECASE,
)


def pre_ampere(gpu_type: Optional[str]) -> bool:
    """A GPU named as one before Ampere: no bf16, no FlashAttention (an unknown GPU is not one)."""
    return bool(gpu_type) and _PRE_AMPERE.search(gpu_type) is not None


def bf16_note(setup: Setup) -> list[str]:
    """What a bf16 setup on a card without bf16 must change (the memory is the same in float16)."""
    if setup.dtype != "bfloat16" or not pre_ampere(setup.gpu_type):
        return []
    sets = " ".join(f"--set {s}" for s in FLOAT16_SETS[setup.method == "qlora"])
    return [f"{setup.gpu_type} has no bf16 (compute capability below 8.0): train in float16, which needs the same "
            f"memory ({sets})"]


# The recipe keys that move a bf16 run to float16 (QLoRA: its 4-bit matmuls and, equal under ZeRO-3, its storage).
FLOAT16_SETS = {False: ("model.dtype=float16",),
                True: ("model.dtype=float16", "quantization.compute_dtype=float16", "quantization.storage_dtype=float16")}


def is_hopper(gpu_type: Optional[str]) -> bool:
    """H100/H200/H800/GH200 (sm90); an unknown GPU counts as one (the larger cuBLAS workspace)."""
    if not gpu_type:
        return True
    return re.search(r"\b(g?h(100|200|800|20))\b", gpu_type.lower()) is not None


def nccl_buffer_bytes(world: int) -> int:
    """NCCL's buffers per GPU for `world` ranks: the two published readings (NCCL_BUFFERS),
    linear in between, the 8-GPU figure beyond."""
    if world < 2:
        return 0
    (lo, lo_bytes), (hi, hi_bytes) = sorted(NCCL_BUFFERS.items())
    if world >= hi:
        return hi_bytes
    return int(lo_bytes + (hi_bytes - lo_bytes) * (world - lo) / (hi - lo))


def _allocator_rounding(setup: Setup, groups: list[ParamGroup]) -> int:
    """What the caching allocator reserves beyond the weight tensors that live for the run, one
    allocation each (finetune/plan/allocator.py). DeepSpeed flattens the trainable ones (and ZeRO-3
    every partition) into a few large buffers, where the rounding is negligible."""
    if setup.deepspeed and setup.stage == 3:
        return 0
    wb = trainable_weight_bytes(setup)
    tensors = []
    for g in groups:
        if g.trainable and setup.deepspeed:
            continue
        size = four_bit_bytes(g.numel) if g.quantized else g.numel * (wb if g.trainable else setup.element_bytes)
        tensors.append((g.count, size))
    return resident_waste(tensors, setup.expandable_segments)


def _cpu_base(setup: Setup, groups: list[ParamGroup]) -> list[Term]:
    procs = setup.gpus_per_node
    # With procs_per_node: auto the count is the planned GPUs', not what a GPU-less machine starts.
    per_gpu = " (1 per GPU)" if setup.launch_note else ""
    out = [Term("process", f"{procs} training process{'es' if procs > 1 else ''}{per_gpu}", procs * PROCESS_RSS,
                note="estimate: Python + libraries per rank")]
    # Loading: without ZeRO-3 every rank reads the whole checkpoint into CPU memory before moving it
    # to its GPU; QLoRA quantizes shard by shard on the GPU; ZeRO-3's zero.Init partitions while
    # loading, one checkpoint shard (about 5 GB on the hub) at a time.
    weights16 = sum(g.total for g in groups if not g.trainable or setup.method == "full") * setup.element_bytes
    if setup.method == "qlora" or (setup.deepspeed and setup.stage == 3):
        per_rank = min(weights16, 5 * 10**9)
        note = "one checkpoint shard per rank"
    else:
        per_rank = weights16
        note = "each rank holds the full checkpoint once"
    out.append(Term("cpu", "checkpoint loading", per_rank * procs, phase="load", note=note))
    return out
