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
fine-tune (tests/plan/test_planner.py calls them). Terms are tagged with the phase they live in: the fp32
gradient partition of ZeRO-0/1/2 exists only in the optimizer step, after activations are freed, so
the peak (`total`) is the larger of the backward phase and the step phase.
"""

# The package's parts, by what they compute: constants (DeepSpeed defaults, measured sizes), setup
# (the input), params, states (weights / gradients / optimizer / buffers), zero3 (the gather replay),
# activations (and logits), planner (plan()), result (totals and rendering), from_recipe, recommendation.
# What the CLI, lint (P001), train, chat, scripts/ and tests use is re-exported here.
from finetune.plan.activations import attention_mask_bytes, layer_activation_bytes
from finetune.plan.auto import Machine, Resolution, machine_for
from finetune.plan.auto import resolve as resolve_auto
from finetune.plan.constants import (
    DS_ALLGATHER_BUCKET_SIZE, DS_MAX_LIVE_PARAMETERS, DS_MAX_REUSE_DISTANCE, DS_OPTIMIZER_SWAP_BUFFERS,
    DS_PARAM_PERSISTENCE_THRESHOLD, DS_PARAM_SWAP_BUFFER_SIZE, DS_PARAM_SWAP_BUFFERS, DS_PREFETCH_BUCKET_SIZE,
    DS_REDUCE_BUCKET_SIZE, DS_SUB_GROUP_SIZE,
)
from finetune.plan.from_recipe import flag_overrides, plan_recipe, recipe_without_file, resolve_model, setup_from_recipe
from finetune.plan.longest import long_context_text, longest_sequence
from finetune.plan.parallel import apply_parallel
from finetune.plan.params import ParamGroup, four_bit_bytes, largest_module_numel, param_groups, quant_constant_bytes
from finetune.plan.planner import plan
from finetune.plan.recommendation import Recommendation, recommend
from finetune.plan.result import PlanResult, gib
from finetune.plan.setup import PlanError, Setup, Term
from finetune.plan.zero3 import zero3_live_params
from finetune.units import GiB, MiB

__all__ = [
    "DS_ALLGATHER_BUCKET_SIZE", "DS_MAX_LIVE_PARAMETERS", "DS_MAX_REUSE_DISTANCE", "DS_OPTIMIZER_SWAP_BUFFERS",
    "DS_PARAM_PERSISTENCE_THRESHOLD", "DS_PARAM_SWAP_BUFFER_SIZE", "DS_PARAM_SWAP_BUFFERS", "DS_PREFETCH_BUCKET_SIZE",
    "DS_REDUCE_BUCKET_SIZE", "DS_SUB_GROUP_SIZE", "GiB", "MiB", "Machine", "ParamGroup", "PlanError", "PlanResult",
    "Resolution", "machine_for", "resolve_auto",
    "Recommendation", "Setup", "Term", "apply_parallel", "attention_mask_bytes", "flag_overrides", "four_bit_bytes", "gib",
    "largest_module_numel", "layer_activation_bytes", "long_context_text", "longest_sequence", "param_groups", "plan", "plan_recipe", "quant_constant_bytes",
    "recipe_without_file", "recommend", "resolve_model", "setup_from_recipe", "zero3_live_params",
]
