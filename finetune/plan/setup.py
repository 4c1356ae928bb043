"""What is planned: the resolved `Setup`, one allocation `Term`, and `PlanError` (with its overflow guard)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

from finetune import objectives
from finetune.errors import FinetuneError
from finetune.plan.archs import LAYER_LINEARS, Arch
from finetune.plan.constants import (
    DS_MAX_LIVE_PARAMETERS, DS_MAX_REUSE_DISTANCE, DS_PARAM_PERSISTENCE_THRESHOLD, DS_PREFETCH_BUCKET_SIZE,
    DS_REDUCE_BUCKET_SIZE, DS_SUB_GROUP_SIZE,
)


class PlanError(FinetuneError, ValueError):
    """Input the planner cannot work with (unknown model, bad option): one line for a human."""


def overflow_as_plan_error(function):
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
    # Mixture of experts (finetune.models.targets): LoRA on the fused experts / the router (peft's
    # target_parameters); the router logits of every layer kept for the auxiliary loss (output_router_logits);
    # ZeRO-3 fetching each sparse block whole (its class among leaf_module.classes).
    lora_experts: bool = False
    lora_router: bool = False
    router_logits: bool = False
    moe_leaf: bool = False
    modules_to_save: tuple[str, ...] = ()
    # Without DeepSpeed, the dtype peft keeps LoRA adapters in: "float32" (peft >= 0.12's
    # autocast_adapter_dtype, what training here gets; peft <= 0.6 too, whose lora.Linear built its
    # adapters before it had a base weight to cast them to) or "model" (peft 0.7-0.11: update_layer casts
    # them to the base layer's weight dtype). Corpus cases of that era set it (docs/plan.md).
    adapter_dtype: str = "float32"
    double_quant: bool = True
    # How a QLoRA base is quantized: "bnb-nf4" (bitsandbytes, what recipes run) or "gptq-int4" (auto-gptq's
    # cuda-old QuantLinear as HF's GPTQ integration trains it: corpus cases of GPTQ checkpoints only).
    quant_format: str = "bnb-nf4"
    # bitsandbytes before 0.43.2 kept each 4-bit linear's input on its autograd context (MatMul4Bit.forward:
    # `ctx.tensors = (A, B)`, not save_for_backward), out of reach of the saved-tensor hooks non-reentrant
    # checkpointing drops saved tensors with: every layer's 4-bit inputs stay from forward to that layer's
    # backward (bitsandbytes PR 1270, commit 9e753741, "fix QLoRA mem bug: delete useless buffered
    # activation", first in 0.43.2). Corpus cases of that stack set it; recipes run a newer bitsandbytes.
    bnb_keeps_inputs: bool = False
    # peft's prepare_model_for_kbit_training ran on the 4-bit model (peft's QLoRA recipe; TRL's SFTTrainer calls
    # it for a 4-bit model given a peft_config): every 16-bit parameter that is not 4-bit (embeddings, output
    # head, norms) is cast to fp32 (peft/utils/other.py), so the norms' fp32 weights turn their outputs, the 4-bit
    # linears' outputs (bitsandbytes' Linear4bit returns its input's dtype) and the residual stream fp32, under
    # the Trainer's bf16 autocast. Corpus cases of that stack set it; `finetune` never calls it.
    kbit_prepared: bool = False
    optimizer: str = "adamw"
    # Without DeepSpeed: torch's fused AdamW (HF's default with torch >= 2.8) or the foreach one (the
    # default before), which allocates a temporary per moment in the step; torch 2.0's foreach AdamW
    # ("foreach_torch20") allocates two (its `denom = _foreach_add(exp_avg_sq_sqrt, eps)` is not in place).
    optimizer_impl: str = "fused"
    # ZeRO-0 over 16-bit weights (engine._configure_fp16_optimizer): DeepSpeed's own FusedAdam (an "optimizer" block
    # of Adam/AdamW without torch_adam) gets FP16_Optimizer, which flattens the fp32 gradients; any other optimizer
    # (torch's with torch_adam, the Trainer's without a block, Lion) gets FP16_UnfusedOptimizer, which does not.
    # False unless said: finetune renders torch's fused AdamW (finetune.render.with_torch_adam), and the configs of
    # LLaMA-Factory and axolotl have no optimizer block (the Trainer's).
    ds_fused_adam: bool = False
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
    # Every row exactly seq_len tokens with no padding and no packed boundaries: transformers builds no 4D mask
    # for sdpa. A recipe's when its data's longest examples are cut to max_length, one row per micro batch
    # (finetune.plan.from_recipe); the calibration measurements in tests/plan/test_planner.py.
    full_rows: bool = False
    gradient_checkpointing: bool = True
    # PYTORCH_CUDA_ALLOC_CONF's expandable_segments (finetune/plan/allocator.py): what `finetune train` sets
    # unless the user set the variable; the corpus' runs predate it or left it off.
    expandable_segments: bool = True
    # Each batch has its own shape (padded to its longest row, or rows of the data's own lengths) rather than
    # one fixed shape (padding to max_length, or fixed packed rows). Without expandable segments the cache
    # then keeps segments of earlier shapes (finetune/plan/bound.py's setup classes).
    shapes_vary: bool = False
    # Micro batches per optimizer step (training.gradient_accumulation_steps). Above 1, the Trainer's
    # zero_grad runs only after the step, so every micro batch but the first starts backward with the
    # gradients of the earlier ones alive (plain PyTorch; DeepSpeed keeps its gradient partitions anyway).
    gradient_accumulation: int = 1
    loss_kernel: str = "default"  # default | chunked | liger (training.loss_kernel)
    loss_chunk_tokens: Optional[int] = None  # training.loss_chunk_tokens (None: finetune.loss_kernel's default)
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
    data_note: str = ""  # where seq_len came from when the data's lengths set it (finetune.plan.data_lengths)
    # Recipe `objective` (finetune/plan/preference.py): micro_batch already counts a pair as 2 rows for
    # dpo/orpo/simpo; reference_model: a frozen second copy of the weights (reference.mode: model).
    objective: str = "sft"
    reference_model: bool = False
    reference_adapter: bool = False  # TRL's frozen copy of a continued adapter (model.adapter)
    generation_sequences: int = 0  # GRPO: completions one GPU generates at once (finetune/plan/grpo.py)
    # parallel.sequence / parallel.tensor (finetune/plan/parallel.py): seq_len and arch are already one process's
    sequence: int = 1
    tensor: int = 1
    activation_offload: bool = False  # training.activation_offload: checkpointed layer inputs in pinned host memory
    tiled_mlp_shards: int = 1  # training.tiled_mlp: slices per MLP call (1: not tiled)
    vision: Optional[Any] = None  # a vision-language model's tower and projector (finetune.plan.vision.VisionSetup)

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

    @property
    def trainer_autocast(self) -> bool:
        """The HF Trainer runs forward and loss under torch.autocast in the 16-bit dtype: without DeepSpeed
        (accelerate's native AMP wraps the model's forward); under DeepSpeed the engine keeps the model 16-bit
        and accelerate runs no autocast."""
        return not self.deepspeed and self.element_bytes == 2

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
        label = objectives.get(self.objective).row_label  # none for sft: a row is a sequence
        rows = f" ({self.objective}: {label})" if label else ""
        parts.append(f"micro batch {self.micro_batch}{rows} x {self.seq_len} tokens")
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
    # Allocated layer by layer in forward and freed in reverse in backward, the same sizes every step (the
    # activations a model without checkpointing saves): the cache serves them again block for block, so the
    # allocator's fragmentation term leaves them out (planner._overhead; docs/plan.md, "The allocator").
    stacked: bool = False
    # Gradients freed after each step and made again at the same sizes by the next backward (the plain Trainer's,
    # ZeRO-2's 16-bit partition): not alive at backward's start (the allocated counter), but the caching allocator
    # keeps their blocks, so the reserved counter still holds them there (planner._overhead).
    remade: bool = False


@dataclass(frozen=True)
class Terms:
    """What one part of the planner found: its per-GPU terms, the per-node CPU terms and the notes that come with
    them (offloaded optimizer states are CPU memory; states on NVMe are a note). plan() puts the parts together."""

    gpu: tuple[Term, ...] = ()
    cpu: tuple[Term, ...] = ()
    notes: tuple[str, ...] = ()
