"""The memory planner: per-GPU (and per-node CPU) memory of a recipe, before anyone rents a GPU.

    finetune plan recipes/llama3/8b_qlora_2x12gb.yaml
    finetune plan recipes/llama3/8b_qlora_2x12gb.yaml --recommend
    finetune plan --model llama-3-8b --method qlora --lora-r 64 --zero 2 --gpus 2 --gpu-memory 12GiB

Pure Python (no torch, no DeepSpeed): the numbers come from reading the code that allocates the
memory, and every term says where it comes from. DeepSpeed's and accelerate's estimators count model
states only, and count every parameter as trainable; this one adds what fills the rest of the GPU:

- weights: the frozen base (16-bit, or 4-bit NF4 with its quantization constants) and the trainable
  weights; partitioned by ZeRO-3 (plus the gathered parameters of the module being computed).
- gradients: the 16-bit gradients (full, or a 1/N partition under ZeRO-2/3) and the fp32 gradient
  partition DeepSpeed builds for the optimizer step (the ZeRO paper leaves it out).
- optimizer: fp32 master weights and the optimizer's moments, partitioned by ZeRO-1/2/3 or offloaded.
- buffers: DeepSpeed's gradient reduction bucket (doubled by overlap_comm in ZeRO-1/2), ZeRO-3's
  prefetched / reuse-retained parameters and persistent small parameters, QLoRA's dequantized weight.
- activations: tensors saved for backward, per layer, with and without gradient checkpointing and by
  attention kernel (eager keeps the seq x seq scores; sdpa/flash do not).
- logits: the loss working set, batch x sequence x vocabulary in fp32 (1.5 MB per token at 128k vocab).
- overhead: CUDA context, NCCL buffers when there is more than one GPU, allocator fragmentation.

`model_states` (weights + gradients + optimizer) equals DeepSpeed's own
`estimate_zero2_model_states_mem_needs` / `estimate_zero3_model_states_mem_needs` for a full
fine-tune (tests/test_plan.py calls them). Terms are tagged with the phase they live in: the fp32
gradient partition of ZeRO-0/1/2 exists only in the optimizer step, after activations are freed, so
the peak (`total`) is the larger of the backward phase and the step phase.
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from finetune.archs import LAYER_LINEARS, Arch, ArchError, load_config_json, match_hub_id, names

GiB = 2**30
MiB = 2**20

# DeepSpeed's defaults (deepspeed/runtime/zero/config.py: DeepSpeedZeroConfig), used when a value is
# neither in the recipe nor `"auto"`.
DS_REDUCE_BUCKET_SIZE = 500_000_000  # reduce_bucket_size
DS_ALLGATHER_BUCKET_SIZE = 500_000_000  # allgather_bucket_size
DS_PREFETCH_BUCKET_SIZE = 50_000_000  # stage3_prefetch_bucket_size
DS_PARAM_PERSISTENCE_THRESHOLD = 100_000  # stage3_param_persistence_threshold
DS_MAX_LIVE_PARAMETERS = 1_000_000_000  # stage3_max_live_parameters
DS_MAX_REUSE_DISTANCE = 1_000_000_000  # stage3_max_reuse_distance
DS_SUB_GROUP_SIZE = 1_000_000_000  # sub_group_size
# deepspeed/runtime/config.py: allreduce_bucket_size of the stage-0 (no ZeRO) gradient all-reduce.
DS_ALLREDUCE_BUCKET_SIZE = 500_000_000
# deepspeed/runtime/zero/offload_config.py: NVMe swap buffers.
DS_OPTIMIZER_SWAP_BUFFERS = 4  # offload_optimizer.buffer_count
DS_PARAM_SWAP_BUFFERS = 5  # offload_param.buffer_count
DS_PARAM_SWAP_BUFFER_SIZE = 100_000_000  # offload_param.buffer_size (elements)

# What a process holds besides its tensors. Three counters see different parts of it (the planner
# reports all three; `fits` uses the largest, nvidia-smi's):
# - torch.cuda.max_memory_allocated: tensors, and cuBLAS' workspaces, which PyTorch takes from its
#   caching allocator (aten/src/ATen/cuda/CublasHandlePool.cpp getNewWorkspace): one per cuBLAS
#   handle and stream; the forward runs on the main thread and backward on autograd's device thread,
#   each with its own handle. Default size (parseChosenWorkspaceSize): 4096 KiB x 8 = 32 MiB on
#   Hopper (sm90), 4096 KiB x 2 + 16 KiB x 8 = 8.125 MiB on other GPUs.
# - torch.cuda.max_memory_reserved: plus what the caching allocator keeps cached but not allocated.
#   c10/cuda/CUDACachingAllocator.cpp rounds a request over 10 MiB (kMinLargeAlloc) up to 2 MiB
#   (kRoundLarge): about 1 MiB lost per large tensor kept for the run (weights); and blocks freed by
#   the tensors of one step (activations, the loss, buffers) are split and re-used by differently
#   sized ones, so the cache grows past the live peak. FRAGMENTATION is that growth as a share of the
#   memory allocated and freed within a phase (activations, the loss, transient buffers): 0.30, the
#   best of 0.1-0.5 on the calibration part of tests/data/plan_corpus.json (Qwen's published profile;
#   0.3 and 0.4 tie on median error); meta-llama/llama-cookbook PR 41 measured an independent gap of
#   the same size: peak reserved 19.36 GB for 15.22 GB peak active (FSDP LoRA, Llama-2-7B, 4 A100s),
#   4.1 GB on about 12 GB allocated and freed per step.
# - nvidia-smi: plus the memory outside PyTorch's allocator: the CUDA context (426 MiB measured with
#   PyTorch 2.10 / CUDA 13 on an RTX 6000 Ada, unsloth-zoo PR 1053; "around 400MB" with CUDA >= 11.7
#   and lazy module loading, pytorch/pytorch issue 109888; over 1 GB before CUDA 11.7; the sources
#   show the CUDA version, not the GPU generation, deciding it) and NCCL's buffers (below).
CUDA_CONTEXT = 426 * MiB
CUBLAS_WORKSPACE = {"hopper": 32 * MiB, "other": 8 * MiB + 128 * 1024}
CUBLAS_HANDLES = 2  # forward thread + autograd's backward thread
ALLOCATOR_ROUND_LARGE = 2 * MiB
ALLOCATOR_MIN_LARGE_ALLOC = 10 * MiB
FRAGMENTATION = 0.30
# NCCL's communication buffers grow with its channels and peers (NVIDIA/nccl issue 986: linear in
# the channels, no longer growing beyond 2 nodes). Two readings: 2 GPUs: the ZeRO-2 saving a user
# measured in nvidia-smi (docs/plan.md, puzzle 1: 934 MiB) falls 187.8 MiB short of the bytes
# partitioning frees at the peak (1.0955 GiB); 8 H100s (NVLink): 1.06 GB outside PyTorch after
# NCCL's init (NVIDIA/nccl issue 1685), less the CUDA context above. Linear in between; multi-node
# runs as 8.
NCCL_BUFFERS = {2: int(1.0955 * GiB) - 934 * MiB, 8: 1_060_000_000 - CUDA_CONTEXT}
# RSS of one training process on the CPU side (Python, torch, transformers, DeepSpeed, CUDA host
# allocations) before any model data: a heuristic from typical `ps` readings of 1.5-3 GB per rank.
PROCESS_RSS = 2 * GiB

# bitsandbytes 4-bit (bitsandbytes/functional.py: quantize_4bit): blocksize 64, one fp32 absmax per
# block; with double quantization (compress_statistics) the absmax are 8-bit with one fp32 absmax
# and a 256-entry fp32 code per 256 blocks (quantize_blockwise(blocksize=256)), plus an fp32 offset.
# Every quantized weight also carries the 16-value fp32 NF4 code.
BNB_BLOCKSIZE = 64
BNB_NESTED_BLOCKSIZE = 256

# Optimizer state bytes per trainable parameter (fp32 moments), beside the fp32 master copy.
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "lion": 4, "adagrad": 4, "sgd": 0, "adamw_bnb_8bit": 2}
MASTER_BYTES = 4  # fp32 master weights (DeepSpeed keeps them for every 16-bit run)

PHASES = ("both", "backward", "step")
COUNTERS = ("allocated", "reserved", "device")
FIELDS = ("weights", "gradients", "optimizer", "buffers", "activations", "logits", "overhead")


class PlanError(ValueError):
    """Input the planner cannot work with (unknown model, bad option): one line for a human."""


def _finite(function):
    """Numbers no GPU could hold (400-digit batch sizes) overflow the float arithmetic below;
    report them as a PlanError instead of an OverflowError traceback."""
    @functools.wraps(function)
    def guarded(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except OverflowError:
            raise PlanError("the numbers in this setup are too large to plan (batch size, sequence length or "
                            "model size beyond any machine)") from None
    return guarded


# ----------------------------------------------------------------------------------------------
# What is planned


@dataclass(frozen=True)
class Setup:
    """Everything the memory depends on, resolved to numbers."""

    arch: Optional[Arch]  # None: only a parameter count is known
    params: int  # total parameters
    method: str = "lora"  # full | lora | qlora
    dtype: str = "bfloat16"
    attn: str = "sdpa"
    lora_r: int = 16
    lora_targets: tuple[str, ...] = LAYER_LINEARS
    lora_dropout: float = 0.05
    modules_to_save: tuple[str, ...] = ()
    double_quant: bool = True
    optimizer: str = "adamw"
    # Without DeepSpeed: torch's fused AdamW (HF's default with torch >= 2.8) or the foreach one (the
    # default before), which allocates a temporary per moment in the step; torch 2.0's foreach AdamW
    # ("foreach_torch20") allocates two (its `denom = _foreach_add(exp_avg_sq_sqrt, eps)` is not in place).
    optimizer_impl: str = "fused"
    # The dtype the cross-entropy runs in. Today's transformers upcast the logits to fp32 (and so does
    # torch.autocast, whose fp32 list has log_softmax / nll_loss); older remote-code models that compute
    # their own loss without an upcast, run without autocast (DeepSpeed), keep it 16-bit. Corpus cases
    # set it (docs/plan.md); recipes of this project always get float32.
    loss_dtype: str = "float32"
    deepspeed: bool = True  # False: plain PyTorch (HF Trainer without DeepSpeed)
    stage: int = 2
    offload_optimizer: str = "none"
    offload_param: str = "none"
    gpus_per_node: int = 1
    nodes: int = 1
    micro_batch: int = 1
    seq_len: int = 2048
    packing: bool = False
    padding_free: bool = False
    # Every row exactly seq_len tokens with no padding and no packed boundaries (the calibration
    # measurements in tests/test_plan.py); recipes never set it: their batches are padded or packed.
    full_rows: bool = False
    gradient_checkpointing: bool = True
    loss_kernel: str = "default"  # default | chunked | liger (training.loss_kernel)
    loss_chunk_tokens: Optional[int] = None  # training.loss_chunk_tokens (None: finetune.train.loss's default)
    overlap_comm: Optional[bool] = None  # None: DeepSpeed's default (config.py overlap_comm_valid: stage 3)
    contiguous_gradients: bool = True
    reduce_bucket_size: int = DS_REDUCE_BUCKET_SIZE
    prefetch_bucket_size: int = DS_PREFETCH_BUCKET_SIZE
    param_persistence_threshold: int = DS_PARAM_PERSISTENCE_THRESHOLD
    max_live_parameters: int = DS_MAX_LIVE_PARAMETERS
    max_reuse_distance: int = DS_MAX_REUSE_DISTANCE
    sub_group_size: int = DS_SUB_GROUP_SIZE
    gpu_memory: Optional[int] = None
    cpu_memory: Optional[int] = None
    gpu_type: Optional[str] = None  # hardware.gpu_type: sizes cuBLAS' workspaces (unknown: Hopper's, the larger)
    model_label: str = ""
    launch_note: str = ""  # how the recipe's launch section chooses the process count, for the text

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def overlap(self) -> bool:
        return self.overlap_comm if self.overlap_comm is not None else self.stage == 3

    @property
    def zero(self) -> str:
        return f"ZeRO-{self.stage}" if self.deepspeed else "no DeepSpeed"

    @property
    def element_bytes(self) -> int:
        """Bytes of a weight / activation element in the model dtype."""
        return 4 if self.dtype == "float32" else 2

    def describe(self) -> str:
        where = f"{self.gpus_per_node} GPU{'s' if self.gpus_per_node != 1 else ''}"
        if self.nodes > 1:
            where += f" x {self.nodes} nodes"
        parts = [self.zero]
        if self.deepspeed and self.stage >= 1 and self.offload_optimizer != "none":
            parts.append(f"optimizer->{self.offload_optimizer}")
        if self.deepspeed and self.stage == 3 and self.offload_param != "none":
            parts.append(f"params->{self.offload_param}")
        parts.append(f"on {where}")
        parts.append(f"micro batch {self.micro_batch} x {self.seq_len} tokens")
        parts.append("checkpointing" if self.gradient_checkpointing else "no checkpointing")
        parts.append(self.attn)
        return ", ".join(parts)


@dataclass(frozen=True)
class Term:
    """One allocation: which field it adds to, its size, when it is alive, and why."""

    field: str
    name: str
    bytes: int
    phase: str = "both"  # both | backward | step
    note: str = ""
    live: Optional[int] = None  # bytes allocated at once, when less than `bytes` (ZeRO-3 sub-groups)
    # Which counter first sees it: "allocated" (a tensor: max_memory_allocated), "reserved" (cached by
    # PyTorch's allocator, not allocated: max_memory_reserved) or "device" (outside PyTorch: nvidia-smi).
    counter: str = "allocated"


@dataclass
class PlanResult:
    setup: Setup
    terms: list[Term]
    cpu_terms: list[Term]
    notes: list[str] = field(default_factory=list)
    complete: bool = True  # False when activations/logits are unknown (a bare parameter count)
    trainable: int = 0

    # -- the numbers ---------------------------------------------------------------------------

    def field_bytes(self, name: str) -> int:
        return sum(t.bytes for t in self.terms if t.field == name)

    def phase_bytes(self, phase: str, counters: tuple[str, ...] = COUNTERS) -> int:
        return sum(t.bytes if t.live is None else t.live for t in self.terms
                   if t.phase in ("both", phase) and t.counter in counters)

    @property
    def memory_views(self) -> dict[str, int]:
        """The peak as each counter reports it: torch.cuda.max_memory_allocated, max_memory_reserved
        and nvidia-smi's process usage. `total` and `fits` use the last, the largest."""
        def peak(counters: tuple[str, ...]) -> int:
            return max(self.phase_bytes(p, counters) for p in ("backward", "step"))

        return {"allocated": peak(("allocated",)), "reserved": peak(("allocated", "reserved")),
                "nvidia_smi": peak(COUNTERS)}

    @property
    def peak_phase(self) -> str:
        return "step" if self.phase_bytes("step") > self.phase_bytes("backward") else "backward"

    @property
    def per_gpu(self) -> dict[str, int]:
        out = {name: self.field_bytes(name) for name in FIELDS}
        out["model_states"] = out["weights"] + out["gradients"] + out["optimizer"]
        out["total"] = max(self.phase_bytes("backward"), self.phase_bytes("step"))
        # JSON order: model states first, then what DeepSpeed's estimators leave out.
        order = ("weights", "gradients", "optimizer", "model_states", "buffers", "activations", "logits",
                 "overhead", "total")
        return {k: out[k] for k in order}

    @property
    def cpu(self) -> dict[str, int]:
        """Per node: offloaded states while training, the checkpoint while loading (not at the same
        time: the loaded copy has moved to the GPUs before DeepSpeed allocates its CPU states), and
        the training processes themselves."""
        offload = sum(t.bytes for t in self.cpu_terms if t.field == "cpu" and t.phase != "load")
        loading = sum(t.bytes for t in self.cpu_terms if t.phase == "load")
        processes = sum(t.bytes for t in self.cpu_terms if t.field == "process")
        return {"offload": offload, "loading": loading, "processes": processes,
                "total": processes + max(offload, loading)}

    @property
    def gpu_fits(self) -> Optional[bool]:
        if self.setup.gpu_memory is None:
            return None
        return self.per_gpu["total"] <= self.setup.gpu_memory

    @property
    def cpu_fits(self) -> Optional[bool]:
        if self.setup.cpu_memory is None:
            return None
        return self.cpu["total"] <= self.setup.cpu_memory

    @property
    def fits(self) -> Optional[bool]:
        """True/False against the GPU (and CPU, when given) memory; None when no GPU memory is known."""
        gpu = self.gpu_fits
        if gpu is None:
            return None
        return gpu and self.cpu_fits is not False

    @property
    def headroom(self) -> Optional[int]:
        if self.setup.gpu_memory is None:
            return None
        return self.setup.gpu_memory - self.per_gpu["total"]

    def _tight(self) -> str:
        """PyTorch's allocator frees its cache and retries before it reports out of memory, so a run
        over only by the cached part may still start (tight: fragmentation can then make it fail)."""
        views = self.memory_views
        uncached = views["allocated"] + views["nvidia_smi"] - views["reserved"]
        if self.setup.gpu_memory is None or uncached > self.setup.gpu_memory:
            return ""
        return (f" (without the allocator's cache {gib(uncached)} GiB: it may start, with no margin for "
                "fragmentation)")

    # -- output --------------------------------------------------------------------------------

    def summary(self) -> str:
        """One line: total against capacity, with the breakdown (used by `finetune lint` rule P001)."""
        g = self.per_gpu
        parts = ", ".join(f"{name} {gib(g[name])}" for name in FIELDS if g[name] or name == "weights")
        head = f"{gib(g['total'])} GiB per GPU"
        if self.setup.gpu_memory is not None:
            head += f" of {gib(self.setup.gpu_memory)} GiB"
        text = f"{head} ({parts}; {self.setup.describe()})"
        if self.headroom is not None:
            text += f": fits, {gib(self.headroom)} GiB headroom" if self.headroom >= 0 else \
                f": {gib(-self.headroom)} GiB over"
        if self.cpu_fits is False:
            text += f"; CPU needs {gib(self.cpu['total'])} GiB of {gib(self.setup.cpu_memory)} GiB"
        if not self.complete:
            text += " (model states and buffers only: activations unknown without a config)"
        return text

    def to_json(self) -> dict[str, Any]:
        s = self.setup
        return {
            "model": s.model_label,
            "params": s.params,
            "trainable_params": self.trainable,
            "setup": {"method": s.method, "zero": s.stage if s.deepspeed else None, "deepspeed": s.deepspeed,
                      "offload_optimizer": s.offload_optimizer, "offload_param": s.offload_param,
                      "gpus_per_node": s.gpus_per_node, "nodes": s.nodes, "micro_batch": s.micro_batch,
                      "seq_len": s.seq_len, "gradient_checkpointing": s.gradient_checkpointing,
                      "attn_implementation": s.attn, "dtype": s.dtype, "loss_kernel": s.loss_kernel,
                      "reduce_bucket_size": s.reduce_bucket_size, "overlap_comm": s.overlap},
            "per_gpu": self.per_gpu,
            "memory": {"allocated_peak": self.memory_views["allocated"],
                       "reserved_peak": self.memory_views["reserved"],
                       "nvidia_smi": self.memory_views["nvidia_smi"], "fits_uses": "nvidia_smi"},
            "phases": {"backward": self.phase_bytes("backward"), "step": self.phase_bytes("step"),
                       "peak": self.peak_phase},
            "cpu": self.cpu,
            "gpu_memory": s.gpu_memory,
            "cpu_memory": s.cpu_memory,
            "fits": self.fits,
            "headroom": self.headroom,
            "complete": self.complete,
            "terms": [{"field": t.field, "name": t.name, "bytes": t.bytes, "phase": t.phase, "note": t.note}
                      for t in self.terms + self.cpu_terms if t.bytes],
            "notes": self.notes,
        }

    def render_text(self) -> str:
        s = self.setup
        lines = [f"model    {s.model_label}"]
        lines.append(f"method   {_method_line(self)}")
        lines.append(f"setup    {s.describe()}")
        if s.launch_note:
            lines.append(f"launch   {s.launch_note}")
        lines.append("")
        lines.append(f"per GPU{'':35}GiB")
        g = self.per_gpu
        for name in FIELDS:
            terms = [t for t in self.terms if t.field == name and t.bytes]
            lines.append(f"  {name:<36}{gib(g[name]):>7}")
            for t in terms:
                when = "" if t.phase == "both" else f" [{t.phase} only]"
                note = f"  {t.note}" if t.note else ""
                lines.append(f"    {t.name:<34}{gib(t.bytes):>7}{when}{note}")
            if name == "optimizer":
                lines.append(f"  {'= model states':<36}{gib(g['model_states']):>7}")
        total = f"  {'total (peak, ' + self.peak_phase + ')':<36}{gib(g['total']):>7}"
        if s.gpu_memory is not None:
            total += f"  of {gib(s.gpu_memory)}: " + (
                f"fits, {gib(self.headroom)} GiB headroom" if self.headroom >= 0 else
                f"does NOT fit, {gib(-self.headroom)} GiB over" + self._tight())
        lines.append(total)
        if self.peak_phase == "backward" and self.phase_bytes("step") != self.phase_bytes("backward"):
            lines.append(f"  {'optimizer step phase':<36}{gib(self.phase_bytes('step')):>7}")
        views = self.memory_views
        lines.append(f"  {'as torch.cuda.max_memory_allocated':<36}{gib(views['allocated']):>7}")
        lines.append(f"  {'as torch.cuda.max_memory_reserved':<36}{gib(views['reserved']):>7}"
                     "  + allocator rounding and fragmentation")
        lines.append(f"  {'as nvidia-smi':<36}{gib(views['nvidia_smi']):>7}"
                     "  + CUDA context and NCCL; `fits` uses this one")
        c = self.cpu
        lines.append("")
        lines.append(f"per node CPU{'':30}GiB")
        for t in self.cpu_terms:
            if t.bytes:
                when = {"load": " [while loading]"}.get(t.phase, "")
                note = f"  {t.note}" if t.note else ""
                lines.append(f"    {t.name:<34}{gib(t.bytes):>7}{when}{note}")
        cpu_total = f"  {'total':<36}{gib(c['total']):>7}"
        if s.cpu_memory is not None:
            cpu_total += f"  of {gib(s.cpu_memory)}: " + ("fits" if self.cpu_fits else "does NOT fit")
        lines.append(cpu_total)
        if not self.complete:
            lines.append("")
            lines.append("activations and logits are not included: pass --model with a config.json or an "
                         f"architecture name ({', '.join(names()[:3])}, ...) for them")
        for note in self.notes:
            lines.append(f"note: {note}")
        return "\n".join(lines) + "\n"


def gib(value: int) -> str:
    return f"{value / GiB:.2f}"


def _method_line(result: PlanResult) -> str:
    s = result.setup
    t = result.trainable
    share = f"{100 * t / s.params:.2f}%" if s.params else "?"
    if s.method == "full":
        return f"full fine-tune: {t / 1e6:,.1f}M trainable (100%)"
    targets = ",".join(s.lora_targets)
    base = "frozen base 4-bit NF4" + (" + double quant" if s.double_quant else "") if s.method == "qlora" \
        else f"frozen base {s.dtype}"
    return f"{s.method} r={s.lora_r} on {targets}: {t:,} trainable ({share}), {base}"


# ----------------------------------------------------------------------------------------------
# Parameters


@dataclass(frozen=True)
class ParamGroup:
    """`count` tensors of `numel` elements each (for example: the q_proj weight of every layer)."""

    name: str
    numel: int
    count: int
    trainable: bool
    quantized: bool = False  # 4-bit NF4 (QLoRA's frozen linear weights)
    unit: str = ""  # the nn.Module holding it directly (one instance per layer for layer modules)
    per_layer: bool = False

    @property
    def total(self) -> int:
        return self.numel * self.count

    @property
    def storage_numel(self) -> int:
        """Elements of the stored tensor: 4-bit weights are packed 4 values per 16-bit element of the
        quant_storage dtype (what ZeRO-3 partitions and gathers for QLoRA)."""
        return (self.numel + 3) // 4 if self.quantized else self.numel


def param_groups(setup: Setup) -> list[ParamGroup]:
    """Every parameter of the model as peft/bitsandbytes leave it: which are trainable, which are 4-bit."""
    arch = setup.arch
    if arch is None:
        return [ParamGroup("all parameters", setup.params, 1, setup.method == "full", unit="model")]
    full = setup.method == "full"
    lora = not full
    qlora = setup.method == "qlora"
    h, v, n, r = arch.hidden, arch.vocab, arch.layers, setup.lora_r
    targets = set(setup.lora_targets) if lora else set()
    out = [ParamGroup("embed_tokens", v * h, 1, full, unit="embed_tokens")]
    if "embed_tokens" in setup.modules_to_save and lora:
        # peft's ModulesToSaveWrapper: a trainable copy beside the frozen original.
        out.append(ParamGroup("embed_tokens copy (modules_to_save)", v * h, 1, True, unit="embed_tokens.copy"))
    for k in range(arch.norms_per_layer):
        out.append(ParamGroup(f"layer norm {k + 1}", h, n, full, unit=f"norm{k + 1}", per_layer=True))

    def linears(lins, count: int, prefix: str = "") -> None:
        for lin in lins:
            unit = f"{prefix}{lin.name}"
            # transformers' bitsandbytes integration quantizes every nn.Linear but the output head.
            out.append(ParamGroup(f"{unit}.weight", lin.weight_numel, count, full, quantized=qlora,
                                  unit=unit, per_layer=True))
            if lin.bias:
                out.append(ParamGroup(f"{unit}.bias", lin.out_features, count, full, unit=unit, per_layer=True))
            if lin.name in targets:
                out.append(ParamGroup(f"{unit}.lora_A", r * lin.in_features, count, True,
                                      unit=f"{unit}.lora_A", per_layer=True))
                out.append(ParamGroup(f"{unit}.lora_B", lin.out_features * r, count, True,
                                      unit=f"{unit}.lora_B", per_layer=True))

    linears(arch.attention_linears(), n)
    if arch.dense_mlp_layers:
        linears(arch.mlp_linears(arch.intermediate), arch.dense_mlp_layers)
    if arch.moe_layers:
        m = arch.moe_layers
        # transformers keeps the router and the experts as plain Parameters (not nn.Linear): LoRA's
        # "all-linear" and bitsandbytes' 4-bit skip them, so a QLoRA keeps them 16-bit.
        out.append(ParamGroup("router", arch.router_params, m, full, unit="router", per_layer=True))
        out.append(ParamGroup("experts (gate_up_proj, down_proj)", arch.expert_params, m, full, unit="experts",
                              per_layer=True))
        if arch.shared_intermediate:
            linears(arch.mlp_linears(arch.shared_intermediate), m, prefix="shared_expert.")
        if arch.shared_expert_gate:
            out.append(ParamGroup("shared_expert_gate.weight", h, m, full, quantized=qlora,
                                  unit="shared_expert_gate", per_layer=True))
            if lora and set(LAYER_LINEARS) <= targets:
                # peft's "all-linear" reaches this nn.Linear(hidden, 1) as well.
                out.append(ParamGroup("shared_expert_gate.lora_A", r * h, m, True,
                                      unit="shared_expert_gate.lora_A", per_layer=True))
                out.append(ParamGroup("shared_expert_gate.lora_B", r, m, True,
                                      unit="shared_expert_gate.lora_B", per_layer=True))
    out.append(ParamGroup("final norm", h, 1, full, unit="final_norm"))
    if not arch.tied:
        out.append(ParamGroup("lm_head", v * h, 1, full, unit="lm_head"))
    if "lm_head" in targets:
        out.append(ParamGroup("lm_head.lora_A", r * h, 1, True, unit="lm_head.lora_A"))
        out.append(ParamGroup("lm_head.lora_B", v * r, 1, True, unit="lm_head.lora_B"))
    if "lm_head" in setup.modules_to_save and lora:
        out.append(ParamGroup("lm_head copy (modules_to_save)", v * h, 1, True, unit="lm_head.copy"))
    return out


def largest_module_numel(groups: list[ParamGroup], trainable_only: bool = False) -> int:
    """Most parameter elements held directly by one module (DeepSpeed's largest_layer_params:
    stage3.py model_to_params, `m.parameters(recurse=False)`): the embedding or the head here."""
    per_unit: dict[str, int] = {}
    for g in groups:
        if g.unit == "model":
            continue  # a bare parameter count: module sizes unknown (counted as 0, like the ZeRO paper)
        if trainable_only and not g.trainable:
            continue
        per_unit[g.unit] = per_unit.get(g.unit, 0) + g.storage_numel
    return max(per_unit.values(), default=0)


def quant_constant_bytes(numel: int, double_quant: bool) -> int:
    """Bytes of bitsandbytes' quantization state for one 4-bit weight of `numel` elements."""
    blocks = math.ceil(numel / BNB_BLOCKSIZE)
    nf4_code = 16 * 4
    if not double_quant:
        return blocks * 4 + nf4_code
    nested_blocks = math.ceil(blocks / BNB_NESTED_BLOCKSIZE)
    # 8-bit absmax + fp32 absmax per 256 blocks + the 256-entry fp32 dynamic code + fp32 offset.
    return blocks + nested_blocks * 4 + 256 * 4 + 4 + nf4_code


def four_bit_bytes(numel: int) -> int:
    """Packed NF4 storage: two values per byte (whatever quant_storage dtype holds them)."""
    return (numel + 1) // 2


# ----------------------------------------------------------------------------------------------
# The planner


@_finite
def plan(setup: Setup) -> PlanResult:
    """Per-GPU and per-node CPU memory of `setup`."""
    groups = param_groups(setup)
    trainable = sum(g.total for g in groups if g.trainable)
    terms: list[Term] = []
    cpu: list[Term] = []
    notes: list[str] = []
    terms += _weights(setup, groups, cpu, notes)
    terms += _gradients_and_optimizer(setup, groups, trainable, cpu, notes)
    terms += _buffers(setup, groups, trainable, notes)
    complete = setup.arch is not None
    if complete:
        terms += _activations(setup)
        notes += _moe_notes(setup)
    terms += _overhead(setup, groups, terms)
    cpu += _cpu_base(setup, groups)
    return PlanResult(setup, terms, cpu, notes, complete, trainable)


def _moe_notes(setup: Setup) -> list[str]:
    arch = setup.arch
    if arch is None or not arch.experts or setup.method == "full":
        return []
    out = [f"mixture of experts: all {arch.experts} experts of each layer are resident; a token runs through "
           f"{arch.experts_per_token}. transformers stores the experts (and the router) as plain parameters, not "
           "nn.Linear: the plan adapts the attention" + (" and shared-expert" if arch.shared_intermediate else "")
           + " projections only; peft versions that also reach experts through target_parameters train more"]
    if setup.method == "qlora":
        out.append("bitsandbytes 4-bit replaces nn.Linear layers only: the experts stay in "
                   f"{setup.dtype} ({arch.moe_layers * arch.expert_params / 1e9:.1f}B parameters)")
    return out


def _bytes_of(group: ParamGroup, setup: Setup, trainable_bytes: int) -> int:
    if group.quantized:
        return group.count * (four_bit_bytes(group.numel) + quant_constant_bytes(group.numel, setup.double_quant))
    if group.trainable and _is_saved_copy(group):
        return group.total * setup.element_bytes
    return group.total * (trainable_bytes if group.trainable else setup.element_bytes)


def _is_saved_copy(group: ParamGroup) -> bool:
    """peft's modules_to_save copy: a deepcopy of the original module (utils/other.py
    ModulesToSaveWrapper), so in the model dtype; cast_adapter_dtype upcasts adapter layers only."""
    return group.unit.endswith(".copy")


def _trainable_bytes_total(setup: Setup, groups: list[ParamGroup]) -> int:
    """Bytes of all trainable weights as stored (and, without DeepSpeed, of their gradients)."""
    wb = _trainable_weight_bytes(setup)
    return sum(_bytes_of(g, setup, wb) for g in groups if g.trainable)


def _width(setup: Setup) -> str:
    """How the model dtype's elements are called in term names: 16-bit, or fp32 for a float32 model."""
    return "fp32" if setup.element_bytes == 4 else "16-bit"


def _trainable_weight_bytes(setup: Setup) -> int:
    """DeepSpeed casts every parameter to the 16-bit dtype (engine._configure_distributed_model);
    without DeepSpeed, peft keeps LoRA weights in fp32 (autocast_adapter_dtype=True)."""
    if not setup.deepspeed and setup.method != "full":
        return 4
    return setup.element_bytes


def _weights(setup: Setup, groups: list[ParamGroup], cpu: list[Term], notes: list[str]) -> list[Term]:
    wb = _trainable_weight_bytes(setup)
    frozen16 = sum(_bytes_of(g, setup, wb) for g in groups if not g.trainable and not g.quantized)
    quantized = [g for g in groups if g.quantized]
    packed = sum(g.count * four_bit_bytes(g.numel) for g in quantized)
    constants = sum(g.count * quant_constant_bytes(g.numel, setup.double_quant) for g in quantized)
    train = sum(_bytes_of(g, setup, wb) for g in groups if g.trainable)
    dt = "fp32" if wb == 4 else setup.dtype.replace("bfloat16", "bf16").replace("float16", "fp16")
    if not (setup.deepspeed and setup.stage == 3):
        return [
            Term("weights", f"frozen base {_width(setup)}", frozen16, note=f"{setup.dtype}"),
            Term("weights", "frozen base 4-bit", packed, note="NF4, 2 values per byte"),
            Term("weights", "quantization constants", constants,
                 note="absmax per 64 values" + (" (8-bit, double quant)" if setup.double_quant else " (fp32)")),
            Term("weights", "trainable", train, note=dt),
        ]
    # ZeRO-3 partitions every parameter (frozen ones too) across all GPUs, except the ones at or below
    # stage3_param_persistence_threshold (partition_parameters.py: ds_persist), which every GPU keeps
    # whole. Quantization constants are attributes of the 4-bit tensors, not parameters: never split.
    n = setup.world
    thr = setup.param_persistence_threshold
    stored = {id(g): (g.count * four_bit_bytes(g.numel) if g.quantized else _bytes_of(g, setup, wb)) for g in groups}
    persistent = sum(stored[id(g)] for g in groups if g.storage_numel <= thr)
    partitioned = sum(stored.values()) - persistent
    gathered = largest_module_numel(groups) * setup.element_bytes
    terms = []
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
    terms += [
        Term("weights", "quantization constants", constants, note="not partitioned"),
        Term("weights", "gathered largest module", gathered,
             note=f"estimate_zero3_model_states_mem_needs: {setup.element_bytes} bytes x largest_layer_params"),
    ]
    if persistent:
        terms.append(Term("buffers", "persistent small params", persistent,
                          note=f"params <= {thr:,} elements stay whole on every GPU"))
    return terms


def foreach_adam_temporaries(setup: Setup) -> int:
    """How many moment-sized temporaries torch's multi-tensor Adam(W) allocates at once in its step:
    exp_avg_sq_sqrt = _foreach_sqrt(exp_avg_sqs) for every parameter (torch >= 2.1 then adds eps in
    place); torch 2.0 also allocated denom = _foreach_add(exp_avg_sq_sqrt, eps) while the first was
    alive. The fused kernel has none."""
    if setup.optimizer not in ("adamw", "adam"):
        return 0
    return {"foreach": 1, "foreach_torch20": 2}.get(setup.optimizer_impl, 0)


def _gradients_and_optimizer(setup: Setup, groups: list[ParamGroup], trainable: int, cpu: list[Term],
                             notes: list[str]) -> list[Term]:
    n = setup.world
    e = _trainable_weight_bytes(setup)
    states = OPTIMIZER_STATE_BYTES[setup.optimizer]
    opt_name = f"{setup.optimizer} states"
    if not setup.deepspeed:
        # Plain PyTorch: gradients and optimizer states in each parameter's dtype (fp32 LoRA adapters,
        # 16-bit modules_to_save copies and full fine-tunes).
        stored = _trainable_bytes_total(setup, groups)
        state_total = stored * states // 4 if setup.optimizer != "adamw_bnb_8bit" else trainable * 2
        out = [Term("gradients", "gradients", stored, note="same dtype as the trainable weights"),
               Term("optimizer", opt_name, state_total, note="torch optimizer, parameter dtype")]
        temporaries = foreach_adam_temporaries(setup)
        if temporaries:
            out.append(Term("buffers", "foreach Adam temporaries", temporaries * stored, phase="step",
                            note=f"{temporaries} moment-sized (optimizer_impl {setup.optimizer_impl})"))
        return out
    if setup.stage == 0 and setup.dtype == "float32":
        # No bf16/fp16: engine._do_optimizer_sanity_check returns no wrapper, the optimizer runs as is.
        return [Term("gradients", "fp32 gradients", trainable * 4),
                Term("optimizer", opt_name, trainable * states)]
    if setup.stage == 0:
        # deepspeed/runtime/fp16/fused_optimizer.py (FP16_Optimizer, also for bf16 without ZeRO):
        # fp32 master copy of all trainable weights; step() turns the 16-bit grads into fp32 copies,
        # flattens them (a second fp32 copy) and hands the flat buffer to the optimizer as .grad.
        return [
            Term("gradients", f"{_width(setup)} gradients", trainable * e),
            Term("gradients", "fp32 gradients", trainable * 4, phase="step", note="flat fp32 copy for the step"),
            Term("optimizer", "fp32 master weights", trainable * MASTER_BYTES),
            Term("optimizer", opt_name, trainable * states),
            Term("buffers", "fp32 grad copies (flatten)", trainable * 4, phase="step",
                 note="FP16_Optimizer.step: per-param .to(fp32) before flattening"),
        ]
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
        terms.append(Term("gradients", f"{_width(setup)} gradient partition 1/{n}", part * e))
    elif setup.stage == 3 and not offload:
        terms.append(Term("buffers", f"contiguous gradient partition 1/{n}", part * e,
                          note="grad_partitions_flat_buffer (not in DeepSpeed's ZeRO-3 estimator)"))
    if setup.stage == 3:
        # The module being computed has its whole 16-bit gradient before the reduce-scatter
        # (estimate_zero3_model_states_mem_needs: the other 2 x largest_layer_params).
        terms.append(Term("gradients", "gradient of gathered module",
                          largest_module_numel(groups, trainable_only=True) * e, note="before reduce-scatter"))
    if offload:
        device = setup.offload_optimizer
        per_rank = part * (MASTER_BYTES + states + 4)
        if setup.stage == 3:
            per_rank += part * e  # grad_partitions_flat_buffer lives on the CPU with offload (stage3.py: self.device)
        else:
            per_rank += part * e  # param_buffer_of_bit16_for_cpu_offload_groups (stage_1_and_2.py)
        if device == "cpu":
            cpu.append(Term("cpu", "offloaded optimizer", per_rank * setup.gpus_per_node,
                            note="fp32 master + states + fp32 grads + 16-bit staging, pinned, per node"))
        else:
            largest = min(setup.sub_group_size, part)
            cpu.append(Term("cpu", "optimizer swap buffers", DS_OPTIMIZER_SWAP_BUFFERS * largest * 4 * setup.gpus_per_node,
                            note="NVMe offload: buffer_count x sub-group, fp32"))
            notes.append(f"optimizer states on NVMe: {gib(per_rank * setup.gpus_per_node)} GiB per node on disk")
        return terms
    # fp32 gradient partition for the step, built in step() from the 16-bit partition and dropped
    # after it: stage_1_and_2.py single_grad_partition; stage3.py _prepare_fp32_grad_for_sub_group,
    # one sub-group (sub_group_size elements) at a time.
    at_once = min(part, setup.sub_group_size) * 4 if setup.stage == 3 and part > setup.sub_group_size else None
    terms += [
        Term("gradients", f"fp32 gradient partition 1/{n}", part * 4, phase="step",
             note="not in the ZeRO paper's 2+2+12 bytes"
                  + (f"; {gib(at_once)} GiB at once (one sub_group_size)" if at_once else ""), live=at_once),
        Term("optimizer", f"fp32 master weights 1/{n}", part * MASTER_BYTES),
        Term("optimizer", f"{opt_name} 1/{n}", part * states),
    ]
    return terms


def _buffers(setup: Setup, groups: list[ParamGroup], trainable: int, notes: list[str]) -> list[Term]:
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
    live = zero3_live_params(setup, groups)
    largest = largest_module_numel(groups)
    extra = max(0, live - largest)
    if extra:
        terms.append(Term("buffers", "prefetched / retained params", extra * e, phase="backward",
                          note=f"peak {live / 1e6:,.0f}M gathered (prefetch {setup.prefetch_bucket_size:,}, "
                               f"reuse distance {setup.max_reuse_distance:,})"))
    return terms


def _dequant_buffer(setup: Setup, groups: list[ParamGroup]) -> list[Term]:
    """bitsandbytes runs a 4-bit linear on more than a few rows as dequantize + F.linear (backends/cuda/
    ops.py gemm_4bit: the fallback past _gemm_4bit_custom_max_m), and backward dequantizes again
    (autograd/_functions.py MatMul4Bit.backward): one 16-bit copy of the largest quantized weight,
    plus its fp32 absmax when those are double-quantized."""
    largest = max((g.numel for g in groups if g.quantized), default=0)
    if not largest:
        return []
    absmax = math.ceil(largest / BNB_BLOCKSIZE) * 4 if setup.double_quant else 0
    return [Term("buffers", "dequantized 4-bit weight", largest * setup.element_bytes + absmax, phase="backward",
                 note="largest quantized linear, 16-bit, while it runs")]


def zero3_live_params(setup: Setup, groups: list[ParamGroup]) -> int:
    """Peak number of gathered (full) parameter elements on a GPU in a steady-state ZeRO-3 step.

    Replays partitioned_param_coordinator.py over the module trace (forward, then backward in reverse,
    with each layer's forward recomputed first under gradient checkpointing):
    - fetch_sub_module gathers the module's parameters, then prefetches the next ones in trace
      order, up to stage3_prefetch_bucket_size elements per call while fewer than
      stage3_max_live_parameters are available. Every call moves the prefetch frontier further, so
      in a steady-state step the gathered parameters grow to about max_live_parameters (1e9 by
      default: 2 GB in 16-bit), plus whatever single module crosses the limit;
    - release_sub_module frees them, except parameters used again within stage3_max_reuse_distance
      elements of trace (__params_to_release) or already prefetched for a later step.
    Parameters at or under stage3_param_persistence_threshold are never gathered (counted elsewhere).
    """
    # The trace depends only on these (param_groups is a function of the same fields).
    key = (setup.arch, setup.params, setup.method, setup.lora_r, setup.lora_targets, setup.modules_to_save,
           setup.param_persistence_threshold, setup.gradient_checkpointing)
    return _live_cached(key, setup.prefetch_bucket_size, setup.max_live_parameters, setup.max_reuse_distance)


@functools.lru_cache(maxsize=64)
def _live_cached(key: tuple, prefetch: int, max_live: int, reuse: int) -> int:
    trace = _trace_cached(key)
    return _replay_zero3(trace, prefetch, max_live, reuse) if trace else 0


@functools.lru_cache(maxsize=16)
def _trace_cached(key: tuple) -> list:
    arch, params, method, r, targets, saved, threshold, ckpt = key
    setup = Setup(arch=arch, params=params, method=method, lora_r=r, lora_targets=targets, modules_to_save=saved,
                  param_persistence_threshold=threshold, gradient_checkpointing=ckpt, stage=3)
    return _module_trace(setup, param_groups(setup))


def _module_trace(setup: Setup, groups: list[ParamGroup]) -> list[tuple[str, int, int]]:
    """[(module key, elements gathered, elements traversed)] for every module DeepSpeed's hooks see in
    one step, containers and parameter-free modules included (each of their pre-forward/backward
    hooks calls fetch_sub_module, which prefetches further). Forward runs in call order; backward
    visits modules in the reverse order of their forward completion; gradient checkpointing re-runs
    each decoder layer's forward just before its backward. peft's LoRA layer runs its base layer, its
    dropout, lora_A and lora_B, each a module with its own hooks.
    """
    arch = setup.arch
    if arch is None:
        return []
    thr = setup.param_persistence_threshold
    units: dict[str, list[ParamGroup]] = {}
    for g in groups:
        units.setdefault(g.unit, []).append(g)

    frozen: set[str] = set()

    def leaf(key: str, members: list[ParamGroup]) -> tuple[str, int, int]:
        gathered = sum(g.storage_numel for g in members if g.storage_numel > thr)
        if gathered and not any(g.trainable for g in members):
            frozen.add(key)
        return key, gathered, sum(g.storage_numel for g in members)

    def container(key: str, children: list) -> tuple:
        return ("call", (key, 0, 0), children)

    def module(prefix: str, unit: str) -> tuple:
        """A projection (with its LoRA modules when it has them), as a call tree."""
        base = leaf(f"{prefix}{unit}", units.get(unit, []))
        if f"{unit}.lora_A" not in units:
            return ("call", base, [])
        return container(f"{prefix}{unit}.wrapper", [
            ("call", base, []), ("call", (f"{prefix}{unit}.dropout", 0, 0), []),
            ("call", leaf(f"{prefix}{unit}.lora_A", units[f"{unit}.lora_A"]), []),
            ("call", leaf(f"{prefix}{unit}.lora_B", units[f"{unit}.lora_B"]), [])])

    def layer(i: int) -> tuple:
        p = f"{i}."
        attn = container(p + "attn", [module(p, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")])
        mlp = container(p + "mlp", [module(p, "gate_proj"), ("call", (p + "act", 0, 0), []),
                                     module(p, "up_proj"), module(p, "down_proj")])
        if i >= arch.dense_mlp_layers:
            # A MoE block: the router, the experts module (every expert's weights at once), then the
            # shared expert and its gate.
            shared = [module(p, "shared_expert.gate_proj"), ("call", (p + "shared_act", 0, 0), []),
                      module(p, "shared_expert.up_proj"), module(p, "shared_expert.down_proj")] \
                if arch.shared_intermediate else []
            gate = [module(p, "shared_expert_gate")] if arch.shared_expert_gate else []
            mlp = container(p + "mlp", [module(p, "router"), module(p, "experts")] + shared + gate)
        norms = [module(p, f"norm{k + 1}") for k in range(arch.norms_per_layer)]
        # Gemma 2 wraps attention and MLP in pre/post norms; Llama-style models have one norm before each.
        body = [norms[0], attn] + norms[1:-1] + [mlp] + norms[-1:] if arch.norms_per_layer == 4 else \
            [norms[0], attn, norms[1], mlp]
        return container(p + "layer", body)

    # modules_to_save: the trainable copy runs instead of the original.
    embed = ("call", leaf("embed_tokens", units.get("embed_tokens.copy") or units.get("embed_tokens", [])), [])
    if arch.tied:
        head_base = embed[1]  # one Parameter: gathering it for the head is gathering the embedding
    else:
        head_base = leaf("lm_head", units.get("lm_head.copy") or units.get("lm_head", []))
    if "lm_head.lora_A" in units:
        head = container("lm_head.wrapper", [("call", head_base, []), ("call", ("lm_head.dropout", 0, 0), []),
                                             ("call", leaf("lm_head.lora_A", units["lm_head.lora_A"]), []),
                                             ("call", leaf("lm_head.lora_B", units["lm_head.lora_B"]), [])])
    else:
        head = ("call", head_base, [])
    layers = [layer(i) for i in range(arch.layers)]
    model = container("model", [embed, ("call", ("rotary", 0, 0), [])] + layers
                      + [("call", leaf("final_norm", units.get("final_norm", [])), [])])
    top = container("causal_lm", [model, head])
    if setup.method != "full":
        top = container("peft_model", [top])  # PeftModel (LoraModel calls the model's forward directly)

    def forward(node: tuple, out: list) -> None:
        out.append(node[1])
        for child in node[2]:
            forward(child, out)

    def completion(node: tuple, out: list) -> None:
        for child in node[2]:
            completion(child, out)
        out.append(node)

    trace: list[tuple] = [(*step, False) for step in _walk(top, forward)]
    finished: list[tuple] = []
    completion(top, finished)
    layer_keys = {lay[1][0] for lay in layers}
    # With a frozen embedding no gradient flows into it, nor into layer 0's first norm and the frozen
    # q/k/v base layers that read its output: their backward hooks never fire. Not so with gradient
    # checkpointing: peft (and prepare_model_for_kbit_training) then make the embedding's output
    # require grad (enable_input_require_grads), so every module runs backward.
    no_grad = set()
    if setup.method != "full" and "embed_tokens.copy" not in units and not setup.gradient_checkpointing:
        no_grad = {"embed_tokens", "0.norm1"} | {f"0.{n}{x}" for n in ("q_proj", "k_proj", "v_proj")
                                                  for x in ("", ".dropout")}
    pending = None
    for node in reversed(finished):
        key = node[1][0]
        if key in no_grad:
            continue
        trace.append((*node[1], False))
        if setup.gradient_checkpointing and key in layer_keys:
            pending = node
        elif pending is not None and not node[2]:
            # The first leaf of a checkpointed layer to run backward needs its saved tensors: the
            # layer's forward runs again. Frozen parameters gathered for it stay until that leaf's
            # backward is done (partitioned_param_coordinator.py: ds_recompute_parameters).
            for step in _walk(pending, forward, children_only=True):
                trace.append((*step, step[0] in frozen))
            trace.append(RELEASE_HELD)
            pending = None
    return trace


RELEASE_HELD = ("<release recompute params>", 0, 0, False)


def _walk(node: tuple, forward, children_only: bool = False) -> list:
    out: list = []
    for child in (node[2] if children_only else [node]):
        forward(child, out)
    return out


def _replay_zero3(trace: list[tuple], prefetch: int, max_live: int, reuse: int) -> int:
    n = len(trace)
    size = {step[0]: step[1] for step in trace}
    # Where each step's parameters are used next, and the elements of trace before each step.
    next_use = [n] * n
    last_seen: dict[str, int] = {}
    for i in range(n - 1, -1, -1):
        key = trace[i][0]
        next_use[i] = last_seen.get(key, n)
        last_seen[key] = i
    before = [0]
    for step in trace:
        before.append(before[-1] + step[2])
    available: set[str] = set()
    held: set[str] = set()
    live = 0
    fetched_for: dict[str, int] = {}  # most recent step a parameter was (pre)fetched for
    queue = 0  # the prefetch queue walks the trace in order
    peak = 0
    for index, (key, numel, _, hold) in enumerate(trace):
        if key == RELEASE_HELD[0]:
            for k in held & available:
                available.discard(k)
                live -= size[k]
            held.clear()
            continue
        if key not in available:
            available.add(key)
            live += numel
        fetched_for[key] = max(fetched_for.get(key, index), index)
        queue = max(queue, index + 1)
        budget = min(max(0, max_live - live), prefetch)
        prefetched = 0
        while queue < n and prefetched < budget:
            ahead = trace[queue][0]
            if ahead not in available and ahead != RELEASE_HELD[0]:
                available.add(ahead)
                live += size[ahead]
                prefetched += size[ahead]
            fetched_for[ahead] = max(fetched_for.get(ahead, queue), queue)
            queue += 1
        peak = max(peak, live)
        if hold:
            held.add(key)
            continue
        nxt = next_use[index]
        reused = nxt < n and before[nxt] - before[index + 1] < reuse
        if not reused and fetched_for[key] <= index:
            available.discard(key)
            live -= numel
    return peak


def _activations(setup: Setup) -> list[Term]:
    per_layer = layer_activation_bytes(setup)
    tokens = setup.micro_batch * setup.seq_len
    arch = setup.arch
    assert arch is not None
    e = setup.element_bytes
    h = arch.hidden
    full = setup.method == "full"
    terms: list[Term] = []
    if setup.gradient_checkpointing:
        # transformers' GradientCheckpointingLayer: each decoder layer keeps only its input.
        terms.append(Term("activations", "layer inputs (checkpointed)", arch.layers * tokens * e * h,
                          phase="backward", note=f"{arch.layers} layers x {e * h} B/token"))
    else:
        saved = arch.layers * per_layer
        if not full:
            # Layer 0's first norm sees an input that needs no gradient (frozen embedding): nothing saved.
            saved -= tokens * (4 * h + 4)
        terms.append(Term("activations", "saved for backward", saved, phase="backward",
                          note=f"{arch.layers} layers x {per_layer // tokens:,} B/token"
                               + (" + seq^2 scores" if setup.attn == "eager" else "")))
    head = tokens * (4 * h + 4 + (e * h if full else 0))  # final norm
    if full or "lm_head" in setup.lora_targets or "lm_head" in setup.modules_to_save:
        head += tokens * e * h  # lm_head input, for its weight gradient
    head += tokens * 16  # input ids + labels (int64)
    head += 2 * setup.seq_len * arch.dim_head * e  # RoPE cos/sin, shared by all layers
    terms.append(Term("activations", "final norm, head input", head, phase="backward"))
    mask = attention_mask_bytes(setup)
    if mask:
        terms.append(Term("activations", "attention mask", mask, phase="backward",
                          note=f"4D mask, {'1 x (batch x seq)^2, padding_free bound' if flattened(setup) else 'batch x seq^2'}"))
    logits = logits_bytes(setup)
    # Backward's own peak comes after the loss buffers are freed (they do not coexist), so only the
    # part above them raises the total.
    extra = max(0, backward_working_bytes(setup, per_layer) - logits)
    what = "layer recompute + gradients" if setup.gradient_checkpointing else "backward temporaries"
    terms.append(Term("activations", what, extra, phase="backward",
                      note="beyond the loss buffers" if extra else "smaller than the loss buffers"))
    terms.append(Term("logits", "loss working set", logits, phase="backward", note=logits_note(setup)))
    return terms


def layer_activation_bytes(setup: Setup) -> int:
    """Bytes one decoder layer saves for backward (no checkpointing), for micro_batch x seq_len tokens.

    Read off the HF Llama/Qwen2/Mistral code and checked against torch's saved tensors on CPU
    (tests/test_plan.py): per token, with e = bytes of the 16-bit dtype,
    - each RMSNorm: its input upcast to fp32 (4h) and the rsqrt (4); full FT also its 16-bit output
      (for the norm weight's gradient);
    - a linear layer saves its input only when its weight is trained or it carries LoRA (frozen
      weights need no input for the input gradient); q/k/v share one input, as do gate/up;
      LoRA dropout > 0 makes a private dropped-out copy per target (e) and a bool mask (1);
    - each LoRA adapter saves lora_A's output (e x r);
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

    def linear_inputs(names: tuple[str, ...], width: int, shared_with_output: bool = False) -> int:
        if full:
            return 0 if shared_with_output else e * width
        hit = [n for n in names if n in targets]
        if not hit:
            return 0
        if dropout:
            return len(hit) * (e + 1) * width
        return 0 if shared_with_output else e * width

    per_token = arch.norms_per_layer * (4 * h + 4 + (e * h if full else 0))
    fused_attention = setup.attn != "eager"
    mask_copy = 0
    per_token += linear_inputs(("q_proj", "k_proj", "v_proj"), h)
    per_token += linear_inputs(("o_proj",), arch.q_dim, shared_with_output=fused_attention)
    per_token += linear_inputs(("gate_proj", "up_proj"), h)
    per_token += linear_inputs(("down_proj",), inter)
    per_token += e * setup.lora_r * sum(1 for n in LAYER_LINEARS if n in targets)
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
    return setup.micro_batch * s * (per_token + scores) + mask_copy


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
    shared = 3 * e * arch.shared_intermediate if arch.shared_intermediate else 0
    if arch.shared_intermediate and arch.shared_expert_gate:
        shared += e * h + e
    return k * per_expert + router + shared


def backward_working_bytes(setup: Setup, per_layer: int) -> int:
    """What backward allocates beyond the saved activations, at its own peak (fitted to torch's CPU
    allocations of tiny Llamas, tests/test_plan.py): with checkpointing, one layer's recomputed
    activations plus the MLP's gradients, about (2.5 x intermediate - 2 x hidden) 16-bit elements per
    token; without, the final norm's fp32 gradient temporaries, about 20 x hidden bytes per token."""
    arch = setup.arch
    assert arch is not None
    tokens = setup.micro_batch * setup.seq_len
    if setup.gradient_checkpointing:
        grads = max(0, (5 * arch.active_mlp_width - 4 * arch.hidden) // 2) * setup.element_bytes
        return per_layer + tokens * grads
    return tokens * 20 * arch.hidden


def flattened(setup: Setup) -> bool:
    """One row per micro batch (finetune.train.data.make_collator): padding_free, or packing under flash."""
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


def loss_element_bytes(setup: Setup) -> int:
    """Bytes of one log-prob in the cross-entropy: 4 when it runs in fp32 (transformers' upcast, or
    autocast), 2 when a model's own loss runs on 16-bit logits without autocast (Setup.loss_dtype)."""
    return 4 if setup.loss_dtype == "float32" else 2


def logits_bytes(setup: Setup) -> int:
    """The loss: transformers' ForCausalLMLoss upcasts the logits to fp32 and cross_entropy keeps the
    fp32 log-softmax for backward; at the start of backward the log-probs, nll_loss's gradient and
    log_softmax's gradient are alive together: 3 x 4 bytes per vocabulary entry and token (the
    16-bit logits and the fp32 copy of the forward, 6-10 bytes, are gone by then). A 16-bit loss
    (loss_dtype) keeps the same three tensors at 2 bytes each."""
    arch = setup.arch
    assert arch is not None
    tokens = setup.micro_batch * setup.seq_len
    if setup.loss_kernel == "liger":
        return liger_logits_bytes(setup)
    if setup.loss_kernel == "chunked":
        tokens = _loss_chunk(setup)
    per = 3 * loss_element_bytes(setup) + (2 * setup.element_bytes if arch.logit_softcap else 0)  # Gemma 2: tanh
    return tokens * arch.vocab * per


def _loss_chunk(setup: Setup) -> int:
    """Tokens whose logits exist at once with loss_kernel: chunked (finetune/train/loss.py)."""
    from finetune.train.loss import chunk_count

    tokens = setup.micro_batch * setup.seq_len
    assert setup.arch is not None
    return math.ceil(tokens / chunk_count(tokens, setup.arch.vocab, setup.loss_chunk_tokens))


def _liger_chunk(setup: Setup) -> int:
    """Liger's fused_linear_cross_entropy_forward: chunk = next_pow2(ceil(BT / ceil(V / H))), at most BT,
    so one chunk's logits are about as large as the hidden states."""
    arch = setup.arch
    assert arch is not None
    tokens = setup.micro_batch * setup.seq_len
    per_chunk = math.ceil(tokens / math.ceil(arch.vocab / arch.hidden))
    return min(tokens, 1 << (per_chunk - 1).bit_length())


def liger_logits_bytes(setup: Setup) -> int:
    """Liger computes each chunk's logits in the model dtype and overwrites them with their gradient
    in place; beside them it keeps the input's gradient (BT x H, model dtype) and a fp32 loss per token."""
    arch = setup.arch
    assert arch is not None
    tokens = setup.micro_batch * setup.seq_len
    e = setup.element_bytes
    return _liger_chunk(setup) * arch.vocab * e + tokens * (arch.hidden * e + 4)


def logits_note(setup: Setup) -> str:
    arch = setup.arch
    assert arch is not None
    tokens = setup.micro_batch * setup.seq_len
    if setup.loss_kernel == "liger":
        return (f"liger: {_liger_chunk(setup):,}-token chunk x vocab {arch.vocab:,} x {setup.element_bytes} B "
                f"+ input gradient")
    if setup.loss_kernel == "chunked":
        return (f"chunked: {_loss_chunk(setup):,} of {tokens:,} tokens x vocab {arch.vocab:,} x "
                f"{3 * loss_element_bytes(setup)} B")
    return (f"{tokens:,} tokens x vocab {arch.vocab:,} x {3 * loss_element_bytes(setup)} B "
            f"({setup.loss_dtype} log-probs + 2 grads)")


def _overhead(setup: Setup, groups: list[ParamGroup], terms: list[Term]) -> list[Term]:
    hopper = is_hopper(setup.gpu_type)
    workspace = CUBLAS_WORKSPACE["hopper" if hopper else "other"]
    out = [Term("overhead", "cuBLAS workspaces", CUBLAS_HANDLES * workspace,
                note=f"{CUBLAS_HANDLES} x {workspace / MiB:g} MiB ({'Hopper' if hopper else 'pre-Hopper'}"
                     f"{', GPU type unknown' if setup.gpu_type is None else ''}; CublasHandlePool.cpp)")]
    rounding = _allocator_rounding(setup, groups)
    if rounding:
        out.append(Term("overhead", "allocator rounding", rounding, counter="reserved",
                        note="large weight tensors rounded up to 2 MiB (CUDACachingAllocator.cpp)"))
    for phase in ("backward", "step"):
        # Memory allocated and freed within the step: activations, the loss, transient buffers.
        transient = sum(t.bytes for t in terms if t.phase == phase)
        if transient:
            out.append(Term("overhead", "allocator fragmentation", int(transient * FRAGMENTATION), phase=phase,
                            counter="reserved",
                            note=f"{FRAGMENTATION:.0%} of what the {phase} phase allocates and frees "
                                 "(fitted: docs/plan.md)"))
    out.append(Term("overhead", "CUDA context", CUDA_CONTEXT, counter="device",
                    note="outside PyTorch: driver + lazily loaded kernels (measured, CUDA >= 11.7)"))
    nccl = nccl_buffer_bytes(setup.world)
    if nccl:
        out.append(Term("overhead", "NCCL buffers", nccl, counter="device",
                        note=f"outside PyTorch: {setup.world} ranks (NCCL issues 986, 1685)"))
    return out


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
    """About 1 MiB (half of kRoundLarge) per weight tensor over kMinLargeAlloc that lives as its own
    allocation for the run: frozen and HF-loaded weights. DeepSpeed flattens the trainable ones (and
    ZeRO-3 every partition) into a few large buffers, where the rounding is negligible."""
    if setup.deepspeed and setup.stage == 3:
        return 0
    wb = _trainable_weight_bytes(setup)
    count = 0
    for g in groups:
        if g.trainable and setup.deepspeed:
            continue
        size = (four_bit_bytes(g.numel) if g.quantized else g.numel * (wb if g.trainable else setup.element_bytes))
        if size > ALLOCATOR_MIN_LARGE_ALLOC:
            count += g.count
    return count * ALLOCATOR_ROUND_LARGE // 2


def _cpu_base(setup: Setup, groups: list[ParamGroup]) -> list[Term]:
    procs = setup.gpus_per_node
    out = [Term("process", f"{procs} training process{'es' if procs > 1 else ''}", procs * PROCESS_RSS,
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


# ----------------------------------------------------------------------------------------------
# From a recipe


def plan_recipe(recipe, gpus: Optional[int] = None, gpu_memory_bytes: Optional[int] = None,
                nodes: Optional[int] = None, cpu_memory_bytes: Optional[int] = None,
                deepspeed: bool = True) -> PlanResult:
    """Plan a validated `finetune.recipe.Recipe`. Missing hardware comes from the recipe's `hardware`
    and `launch` sections. Raises PlanError (for example: a hub id the table does not know)."""
    return plan(setup_from_recipe(recipe, gpus, gpu_memory_bytes, nodes, cpu_memory_bytes, deepspeed))


@_finite
def setup_from_recipe(recipe, gpus: Optional[int] = None, gpu_memory_bytes: Optional[int] = None,
                      nodes: Optional[int] = None, cpu_memory_bytes: Optional[int] = None,
                      deepspeed: bool = True) -> Setup:
    from finetune.dsconfig import render_deepspeed
    from finetune.recipe import parse_size

    arch, params, label = resolve_model(recipe.model.name_or_path)
    hw = recipe.hardware
    launch_note = ""
    if gpus is None:
        if isinstance(recipe.launch.procs_per_node, int):
            gpus = recipe.launch.procs_per_node
        else:
            gpus = hw.gpus if hw is not None else 1
            cpu = recipe.launch.cpu_procs
            launch_note = (f"procs_per_node: auto starts one process per visible GPU (planned for {gpus} GPU"
                           f"{'s' if gpus != 1 else ''}{' from hardware.gpus' if hw is not None else ''}; "
                           f"--gpus N to change); without a GPU it starts {cpu} CPU process{'es' if cpu != 1 else ''}"
                           " (launch.cpu_procs), where GPU memory does not apply")
    nodes = nodes if nodes is not None else recipe.launch.nodes
    if gpu_memory_bytes is None and hw is not None and hw.gpu_memory:
        gpu_memory_bytes = parse_size(hw.gpu_memory)
    if cpu_memory_bytes is None and hw is not None and hw.cpu_memory:
        cpu_memory_bytes = parse_size(hw.cpu_memory)
    zero = render_deepspeed(recipe, gpus * nodes).get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise PlanError("deepspeed.overrides.zero_optimization must be a mapping")
    # The rendered block leaves out what its stage does not use; --recommend tries other stages, which
    # would get the recipe's own values (or "auto").
    section = recipe.deepspeed
    unused = {"reduce_bucket_size": section.reduce_bucket_size,
              "stage3_prefetch_bucket_size": section.stage3_prefetch_bucket_size,
              "stage3_param_persistence_threshold": section.stage3_param_persistence_threshold,
              "contiguous_gradients": section.contiguous_gradients}
    if section.stage3_max_live_parameters is not None:
        unused["stage3_max_live_parameters"] = section.stage3_max_live_parameters
    zero = {**unused, **zero}
    stage = _int_value(zero, "stage", 0)
    if stage not in (0, 1, 2, 3):
        raise PlanError(f"zero_optimization.stage must be 0-3, got {stage}")
    hidden = arch.hidden if arch else None
    lora = recipe.lora
    targets = LAYER_LINEARS if lora.target_modules == "all-linear" else tuple(lora.target_modules)
    overlap = zero.get("overlap_comm")
    return Setup(
        arch=arch, params=params, model_label=label,
        method=recipe.method, dtype=recipe.model.dtype, attn=recipe.model.attn_implementation,
        lora_r=lora.r, lora_targets=tuple(targets), lora_dropout=lora.dropout,
        modules_to_save=tuple(lora.modules_to_save or ()),
        double_quant=recipe.quantization.double_quant,
        optimizer=recipe.training.optimizer,
        deepspeed=deepspeed,
        stage=stage,
        offload_optimizer=_device(zero.get("offload_optimizer")) if stage >= 1 else "none",
        offload_param=_device(zero.get("offload_param")) if stage == 3 else "none",
        gpus_per_node=gpus, nodes=nodes,
        micro_batch=recipe.training.micro_batch_size, seq_len=recipe.data.max_length,
        packing=recipe.data.packing, padding_free=recipe.data.padding_free,
        gradient_checkpointing=recipe.training.gradient_checkpointing,
        loss_kernel=recipe.training.loss_kernel, loss_chunk_tokens=recipe.training.loss_chunk_tokens,
        overlap_comm=bool(overlap) if overlap is not None else None,
        contiguous_gradients=bool(zero.get("contiguous_gradients", True)),
        # "auto" values are filled by transformers/integrations/deepspeed.py from hidden_size.
        reduce_bucket_size=_size_value(zero, "reduce_bucket_size", DS_REDUCE_BUCKET_SIZE,
                                       hidden * hidden if hidden else None),
        prefetch_bucket_size=_size_value(zero, "stage3_prefetch_bucket_size", DS_PREFETCH_BUCKET_SIZE,
                                         int(0.9 * hidden * hidden) if hidden else None),
        param_persistence_threshold=_size_value(zero, "stage3_param_persistence_threshold",
                                                DS_PARAM_PERSISTENCE_THRESHOLD, 10 * hidden if hidden else None),
        max_live_parameters=_size_value(zero, "stage3_max_live_parameters", DS_MAX_LIVE_PARAMETERS, None),
        max_reuse_distance=_size_value(zero, "stage3_max_reuse_distance", DS_MAX_REUSE_DISTANCE, None),
        sub_group_size=_size_value(zero, "sub_group_size", DS_SUB_GROUP_SIZE, None),
        gpu_memory=gpu_memory_bytes, cpu_memory=cpu_memory_bytes,
        gpu_type=hw.gpu_type if hw is not None else None,
        launch_note=launch_note,
    )


def _device(block: Any) -> str:
    if isinstance(block, dict):
        device = block.get("device", "none")
        return device if device in ("none", "cpu", "nvme") else "none"
    return "none"


def _int_value(zero: dict, key: str, default: int) -> int:
    value = zero.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PlanError(f"zero_optimization.{key} must be a number, got {value!r}")
    return int(value)


def _size_value(zero: dict, key: str, default: int, auto: Optional[int]) -> int:
    value = zero.get(key, default)
    if value == "auto":
        # Without the model's hidden size "auto" cannot be resolved; DeepSpeed's default is the
        # closest guess (and an over-estimate for small models).
        return auto if auto is not None else default
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise PlanError(f"zero_optimization.{key} must be a number or \"auto\", got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise PlanError(f"zero_optimization.{key} must be a non-negative number, got {value!r}")
    return int(value)


_COUNT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMBT])\s*$", re.IGNORECASE)
_COUNT_UNITS = {"k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


def resolve_model(name: str) -> tuple[Optional[Arch], int, str]:
    """(architecture or None, total parameters, label) for a model reference.

    Accepts a local directory with config.json (or the file itself), a `builtin:` tiny model, a
    hub id or table name the built-in table knows, or a bare parameter count such as `7.5B`.
    """
    text = str(name).strip()
    count = _COUNT_RE.match(text)
    if count:
        params = int(float(count.group(1)) * _COUNT_UNITS[count.group(2).lower()])
        return None, params, f"{text} parameters (model states only)"
    if text.startswith("builtin:"):
        from finetune.archs import arch_from_config
        from finetune.tiny import BUILTIN_CONFIGS

        key = text[len("builtin:"):]
        if key not in BUILTIN_CONFIGS:
            raise PlanError(f"unknown built-in model {text!r} (known: {', '.join('builtin:' + k for k in BUILTIN_CONFIGS)})")
        arch = replace(arch_from_config({"model_type": "llama", **BUILTIN_CONFIGS[key]}, text), name=text)
        return arch, arch.total_params, arch.describe()
    path = Path(text).expanduser()
    if path.exists():
        if path.is_dir() and not (path / "config.json").is_file():
            raise PlanError(f"{path} has no config.json: pass --model with a config.json, an architecture "
                            f"name ({', '.join(names()[:4])}, ...) or a parameter count such as 7.5B")
        try:
            arch = load_config_json(path)
        except ArchError as exc:
            raise PlanError(str(exc)) from None
        return arch, arch.total_params, f"{arch.describe()} [from {path}]"
    arch = match_hub_id(text)
    if arch is not None:
        label = arch.describe() + ("" if text.lower() == arch.name else f" [table match for {text}]")
        return arch, arch.total_params, label
    raise PlanError(f"model {text!r} is neither a local directory with config.json nor a known architecture: "
                    f"pass --model with a config.json path, an architecture name ({', '.join(names())}) "
                    "or a parameter count such as 7.5B")


# ----------------------------------------------------------------------------------------------
# --recommend


# How much slower each choice is, as a sort key (first difference decides), from the documented
# costs: offloading moves the optimizer (and parameters) over PCIe and runs Adam on the CPU, the
# slowest; ZeRO-3 all-gathers parameters in forward and backward, ~1.5x the communication of
# ZeRO-0/1/2 (which move as much as plain data parallel); then compute per sequence: gradient
# checkpointing recomputes the forward (x 4/3), and a micro batch of t tokens keeps the GPU busy
# about t / (t + 1024) of the time (small matmuls leave it idle), so the cost per token is
# (1 + 1024 / t); then fewer parameters gathered ahead; among stages with equal communication,
# the lower one (less bookkeeping).
SATURATION_TOKENS = 1024


def compute_cost(setup: Setup) -> float:
    tokens = setup.micro_batch * setup.seq_len
    return (4 / 3 if setup.gradient_checkpointing else 1.0) * (1 + SATURATION_TOKENS / tokens)


OFFLOAD_LEVELS = (("none", "none"), ("cpu", "none"), ("cpu", "cpu"))
# A recommendation keeps this share of the GPU free: the CUDA context, NCCL and fragmentation terms
# are estimates, not measurements.
RECOMMEND_MARGIN = 0.05
# The stage3_max_live_parameters --recommend tries besides the recipe's (DeepSpeed's default is 1e9).
FEWER_LIVE_PARAMETERS = 100_000_000


def speed_key(setup: Setup) -> tuple:
    offload = OFFLOAD_LEVELS.index((setup.offload_optimizer, setup.offload_param)) \
        if (setup.offload_optimizer, setup.offload_param) in OFFLOAD_LEVELS else len(OFFLOAD_LEVELS)
    return (offload, setup.deepspeed and setup.stage == 3, round(compute_cost(setup), 6),
            -setup.max_live_parameters, setup.stage if setup.deepspeed else -1)


@dataclass
class Recommendation:
    current: PlanResult
    chosen: Optional[PlanResult]
    tried: list[PlanResult]
    reasons: list[str]
    gradient_accumulation_steps: Optional[int] = None

    def to_json(self) -> dict[str, Any]:
        c = self.chosen
        return {
            "chosen": None if c is None else {
                "zero": c.setup.stage, "offload_optimizer": c.setup.offload_optimizer,
                "offload_param": c.setup.offload_param, "micro_batch": c.setup.micro_batch,
                "gradient_checkpointing": c.setup.gradient_checkpointing,
                "gradient_accumulation_steps": self.gradient_accumulation_steps,
                "per_gpu": c.per_gpu, "cpu": c.cpu, "headroom": c.headroom,
                "set": recommendation_overrides(self)},
            "reasons": self.reasons,
            "tried": [{"zero": r.setup.stage, "offload_optimizer": r.setup.offload_optimizer,
                       "offload_param": r.setup.offload_param, "micro_batch": r.setup.micro_batch,
                       "gradient_checkpointing": r.setup.gradient_checkpointing,
                       "total": r.per_gpu["total"], "cpu_total": r.cpu["total"], "fits": r.fits}
                      for r in self.tried],
        }

    def render_text(self) -> str:
        lines = [f"recommendation ({self.current.setup.gpus_per_node * self.current.setup.nodes} GPU"
                 f"{'s' if self.current.setup.world != 1 else ''} of {gib(self.current.setup.gpu_memory or 0)} GiB):"]
        if self.chosen is None:
            lines.append("  nothing tried fits: fewer tokens per micro batch (data.max_length), more GPUs, "
                         "or QLoRA instead of LoRA")
        else:
            c = self.chosen
            lines.append(f"  {c.setup.describe()}")
            lines.append(f"  {c.summary()}")
            sets = recommendation_overrides(self)
            if sets:
                lines.append("  apply with: " + " ".join(f"--set {s}" for s in sets))
            else:
                lines.append("  the recipe's own setup is already the fastest that fits")
        for reason in self.reasons:
            lines.append(f"  why: {reason}")
        lines.append("")
        lines.append("  tried (GiB per GPU, micro batch " + str(self.current.setup.micro_batch) + ", checkpointing as "
                     "in the recipe):")
        for r in self.tried:
            s = r.setup
            if s.micro_batch != self.current.setup.micro_batch or \
                    s.gradient_checkpointing != self.current.setup.gradient_checkpointing:
                continue
            what = _short(s, self.current.setup.max_live_parameters)
            lines.append(f"    {what:<56}{gib(r.per_gpu['total']):>7}  {'fits' if r.fits else 'no'}")
        return "\n".join(lines) + "\n"


def _short(s: Setup, live_default: Optional[int] = None) -> str:
    if not s.deepspeed:
        return "no DeepSpeed"
    text = f"ZeRO-{s.stage}"
    if s.offload_optimizer != "none":
        text += f" + optimizer->{s.offload_optimizer}"
    if s.offload_param != "none":
        text += f" + params->{s.offload_param}"
    if live_default is not None and s.stage == 3 and s.max_live_parameters != live_default:
        text += f", max_live {s.max_live_parameters:.0e}"
    return text


def recommendation_overrides(rec: Recommendation) -> list[str]:
    """`--set` strings that turn the recipe's setup into the chosen one."""
    if rec.chosen is None:
        return []
    a, b = rec.current.setup, rec.chosen.setup
    out = []
    if b.stage != a.stage:
        out.append(f"deepspeed.stage={b.stage}")
    if b.offload_optimizer != a.offload_optimizer:
        out.append(f"deepspeed.offload_optimizer={b.offload_optimizer}")
    if b.offload_param != a.offload_param:
        out.append(f"deepspeed.offload_param={b.offload_param}")
    if b.micro_batch != a.micro_batch:
        out.append(f"training.micro_batch_size={b.micro_batch}")
        if rec.gradient_accumulation_steps is not None:
            out.append(f"training.gradient_accumulation_steps={rec.gradient_accumulation_steps}")
    if b.gradient_checkpointing != a.gradient_checkpointing:
        out.append(f"training.gradient_checkpointing={'true' if b.gradient_checkpointing else 'false'}")
    if b.max_live_parameters != a.max_live_parameters:
        out.append(f"deepspeed.stage3_max_live_parameters={b.max_live_parameters}")
    return out


def candidates(setup: Setup) -> list[Setup]:
    """Stages 0-3 x offload {none, optimizer, optimizer + params} x micro batch (halving down to 1)
    x gradient checkpointing on/off, and for ZeRO-3 a smaller stage3_max_live_parameters."""
    micro = []
    m = setup.micro_batch
    while m >= 1:
        micro.append(m)
        m //= 2
    out = []
    for stage in (0, 1, 2, 3):
        for opt, par in OFFLOAD_LEVELS:
            if (opt != "none" and stage == 0) or (par != "none" and stage != 3):
                continue
            # ZeRO-3 also tries keeping fewer parameters gathered ahead (stage3_max_live_parameters).
            lives = {setup.max_live_parameters}
            if stage == 3:
                lives.add(min(setup.max_live_parameters, FEWER_LIVE_PARAMETERS))
            for mb in micro:
                for ckpt in (False, True):
                    for live in sorted(lives, reverse=True):
                        out.append(replace(setup, deepspeed=True, stage=stage, offload_optimizer=opt,
                                           offload_param=par, micro_batch=mb, gradient_checkpointing=ckpt,
                                           max_live_parameters=live))
    return out


@_finite
def recommend(setup: Setup, accumulation: Optional[int] = None) -> Recommendation:
    """The fastest setup that fits (speed_key), with the reasons in the user's numbers."""
    if setup.gpu_memory is None:
        raise PlanError("--recommend needs the GPU memory: --gpu-memory 24GiB or hardware.gpu_memory in the recipe")
    current = plan(setup)
    tried = [plan(c) for c in candidates(setup)]
    margin = int(setup.gpu_memory * RECOMMEND_MARGIN)
    fitting = sorted((r for r in tried if r.fits and r.headroom >= margin), key=lambda r: speed_key(r.setup))
    chosen = fitting[0] if fitting else None
    steps = None
    if chosen is not None and accumulation is not None and chosen.setup.micro_batch != setup.micro_batch:
        # Keep the sequences per optimizer step: micro batch x accumulation x GPUs.
        steps = max(1, math.ceil(setup.micro_batch * accumulation / chosen.setup.micro_batch))
    rec = Recommendation(current, chosen, tried, [], steps)
    rec.reasons = explain(rec)
    return rec


def explain(rec: Recommendation) -> list[str]:
    """Why: the recipe's own setup against capacity, and what ZeRO buys or costs for this model."""
    cur = rec.current
    s = cur.setup
    out = []
    if cur.fits:
        out.append(f"the recipe as written needs {gib(cur.per_gpu['total'])} GiB per GPU of "
                   f"{gib(s.gpu_memory)}: fits")
    else:
        out.append(f"the recipe as written needs {gib(cur.per_gpu['total'])} GiB per GPU of "
                   f"{gib(s.gpu_memory)}" + (f" and {gib(cur.cpu['total'])} GiB of CPU memory of "
                                            f"{gib(s.cpu_memory)}" if cur.cpu_fits is False else ""))
    base = {(r.setup.stage, r.setup.offload_optimizer, r.setup.offload_param): r for r in rec.tried
            if r.setup.micro_batch == s.micro_batch and r.setup.gradient_checkpointing == s.gradient_checkpointing
            and r.setup.max_live_parameters == s.max_live_parameters}
    zero0 = base.get((0, "none", "none"))
    for stage in (1, 2):
        r = base.get((stage, "none", "none"))
        if r is None or zero0 is None:
            continue
        saved = zero0.per_gpu["model_states"] - r.per_gpu["model_states"]
        cost = sum(t.bytes for t in r.terms if t.field == "buffers") - \
            sum(t.bytes for t in zero0.terms if t.field == "buffers" and t.phase != "step")
        if cost > saved and stage == 2:
            what = f"{ {'full': 'full fine-tune', 'lora': 'LoRA', 'qlora': 'QLoRA'}[s.method]} of {s.params / 1e9:.1f}B"
            out.append(f"ZeRO-2 on {s.world} GPU{'s' if s.world != 1 else ''} adds {gib(cost)} GiB of gradient "
                       f"buckets (reduce_bucket_size {s.reduce_bucket_size:,}"
                       f"{', doubled by overlap_comm' if r.setup.overlap else ''}) but saves "
                       f"{gib(max(saved, 0))} GiB of gradients and optimizer states for this {what}: "
                       "stay on ZeRO-0 (or one GPU), or lower reduce_bucket_size"
                       + (f" (\"auto\" gives hidden^2 = {s.arch.hidden ** 2:,})" if s.arch else ""))
    r3 = base.get((3, "none", "none"))
    r2 = base.get((2, "none", "none"))
    if r3 is not None and r2 is not None:
        gathered = sum(t.bytes for t in r3.terms if t.name == "prefetched / retained params")
        partition_saving = r2.per_gpu["weights"] - r3.per_gpu["weights"]
        if r3.per_gpu["total"] > r2.per_gpu["total"]:
            out.append(f"ZeRO-3 needs more than ZeRO-2 here ({gib(r3.per_gpu['total'])} vs "
                       f"{gib(r2.per_gpu['total'])} GiB): partitioning the weights saves {gib(partition_saving)} GiB "
                       f"but ZeRO-3 keeps {gib(gathered)} GiB of gathered parameters "
                       f"(stage3_max_live_parameters {s.max_live_parameters:,}, prefetch "
                       f"{s.prefetch_bucket_size:,}, reuse distance {s.max_reuse_distance:,})")
    for r in (cur, rec.chosen):
        if r is None or not r.setup.deepspeed or r.setup.stage != 3:
            continue
        gathered = sum(t.bytes for t in r.terms if t.name == "prefetched / retained params")
        fewer = plan(replace(r.setup, max_live_parameters=min(r.setup.max_live_parameters, FEWER_LIVE_PARAMETERS)))
        saved = r.per_gpu["total"] - fewer.per_gpu["total"]
        if saved > 256 * MiB:
            out.append(f"ZeRO-3 keeps {gib(gathered)} GiB of parameters gathered beyond the module at work "
                       f"(prefetched up to stage3_max_live_parameters {r.setup.max_live_parameters:,}); "
                       f"--set deepspeed.stage3_max_live_parameters={FEWER_LIVE_PARAMETERS} saves {gib(saved)} GiB "
                       f"(less prefetching, some speed)")
            break
    if s.arch is not None and s.gpu_memory and cur.per_gpu["logits"] > 0.2 * s.gpu_memory:
        out.append(f"the loss alone needs {gib(cur.per_gpu['logits'])} GiB: {s.micro_batch} x {s.seq_len} tokens "
                   f"x vocab {s.arch.vocab:,} x 12 bytes; it shrinks with the micro batch"
                   + (", or with --set training.loss_kernel=chunked" if s.loss_kernel == "default" else ""))
    out.append(f"candidates must leave {RECOMMEND_MARGIN:.0%} of the GPU free: fragmentation and the CUDA context "
               "vary from run to run (docs/plan.md)")
    chosen = rec.chosen
    if chosen is not None and chosen.setup != s:
        out.append(f"chosen: {_short(chosen.setup)}, micro batch {chosen.setup.micro_batch}, "
                   f"checkpointing {'on' if chosen.setup.gradient_checkpointing else 'off'}: the fastest that fits "
                   "(order: no offload, then not ZeRO-3, then compute per token: x4/3 with checkpointing, "
                   f"x(1 + {SATURATION_TOKENS}/tokens per micro batch), then the lowest stage)")
    return out


# ----------------------------------------------------------------------------------------------
# Command-line what-ifs: flags become `--set` overrides, so a recipe and a bare model plan alike.

_ZERO_CHOICES = ("none", "0", "1", "2", "3")


def flag_overrides(*, model: Optional[str] = None, method: Optional[str] = None, zero: Optional[str] = None,
                   offload_optimizer: Optional[str] = None, offload_param: Optional[str] = None,
                   micro_batch: Optional[int] = None, seq_len: Optional[int] = None,
                   gradient_checkpointing: Optional[bool] = None, lora_r: Optional[int] = None,
                   lora_targets: Optional[str] = None, attn: Optional[str] = None,
                   dtype: Optional[str] = None) -> list[str]:
    """`--zero 3` -> `deepspeed.stage=3`, and so on (`--zero none` is handled by the caller)."""
    out = []

    def add(key: str, value: Any) -> None:
        if value is not None:
            out.append(f"{key}={json.dumps(value) if isinstance(value, str) else _yaml_scalar(value)}")

    if zero is not None and zero not in _ZERO_CHOICES:
        raise PlanError(f"--zero must be one of {', '.join(_ZERO_CHOICES)}, got {zero!r}")
    add("model.name_or_path", model)
    add("method", method)
    add("deepspeed.stage", int(zero) if zero not in (None, "none") else None)
    add("deepspeed.offload_optimizer", offload_optimizer)
    add("deepspeed.offload_param", offload_param)
    add("training.micro_batch_size", micro_batch)
    add("data.max_length", seq_len)
    add("training.gradient_checkpointing", gradient_checkpointing)
    add("lora.r", lora_r)
    if lora_targets is not None:
        targets = [t.strip() for t in lora_targets.split(",") if t.strip()]
        out.append("lora.target_modules=" + ("all-linear" if targets == ["all-linear"] else json.dumps(targets)))
    add("model.attn_implementation", attn)
    add("model.dtype", dtype)
    return out


def _yaml_scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def recipe_without_file(overrides: list[str]):
    """A recipe for `finetune plan --model ...`: defaults plus the flags (RecipeProblem on bad values)."""
    from finetune.recipe import RecipeProblem, apply_set, validate

    raw: dict[str, Any] = {"model": {"name_or_path": ""}, "data": {"path": "-"}}
    origin: dict = {}
    for item in overrides:
        apply_set(raw, origin, item)
    if not raw["model"].get("name_or_path"):
        raise PlanError("without a recipe, --model is required (a config.json, an architecture name such as "
                        "llama-3-8b, or a parameter count such as 7.5B)")
    try:
        recipe = validate(raw, origin, "<command line>")
    except RecipeProblem:
        raise
    recipe.name = "command-line"
    return recipe
