"""DeepSpeed's defaults and the measured or documented sizes the planner adds up (no logic)."""

from __future__ import annotations

from finetune.units import GiB, MiB

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
# What `finetune train` sets PYTORCH_CUDA_ALLOC_CONF to on GPUs unless the user configured the allocator
# (ALLOC_CONF_NAMES; run/launch/commands.py): expandable segments map freed pages back into one growing
# segment per stream instead of caching fixed 2 MiB / 20 MiB+ blocks, so a freed block of one size serves a
# request of another (PyTorch's CUDA semantics notes, "Optimizing memory usage with PYTORCH_CUDA_ALLOC_CONF");
# finetune.plan.allocator models what the allocator reserves with and without it.
TRAINING_ALLOC_CONF = "expandable_segments:True"
# The variables torch's CUDA allocator reads its settings from, in the order torch 2.13 reads them
# (c10/cuda/CUDAAllocatorConfig.h); a user who set either has configured the allocator.
ALLOC_CONF_NAMES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
CUBLAS_WORKSPACE = {"hopper": 32 * MiB, "other": 8 * MiB + 128 * 1024}
CUBLAS_HANDLES = 2  # forward thread + autograd's backward thread
FRAGMENTATION = 0.30
# Without expandable segments, when every batch has its own shape, a batch longer than all before needs blocks
# larger than any cached one: it takes new segments and those of the shorter batches stay cached (the caching
# allocator's rules, finetune/plan/allocator.py). HISTORY_RECORDS is the stated order of such longest batches
# (docs/plan.md, "The allocator"): each one longer than the last, at the expected records of lengths spread
# evenly up to max_length (the gap to max_length halves with each); the reserved counter keeps the loss blocks
# of every earlier record (tokens x vocabulary: no later request of another size fits them; the activations'
# smaller blocks are served again: planner.history_base), sum(HISTORY_RECORDS) x the last one's loss working set.
HISTORY_RECORDS = (1 / 2, 3 / 4, 7 / 8, 15 / 16)
# The stated upper bound (finetune/plan/bound.py; docs/plan.md, "The bound"): per setup class, the
# BOUND_QUANTILE quantile of measured / planned over the cases of tests/data/plan_corpus.json in that class,
# less 1; a class needs BOUND_MIN_CASES cases (else the next wider class serves). {class: (width, cases)}:
# written by `python scripts/plan_corpus.py --widths` and checked by tests/plan/test_corpus.py (not tuned to
# a case: quantiles of all of them, recomputed whenever the planner changes).
BOUND_QUANTILE = 0.95
BOUND_MIN_CASES = 10
BOUND_WIDTHS: dict[str, tuple[float, int]] = {
    'all': (0.1938, 155),
    'one shape': (0.1925, 104),
    'one shape / full': (0.1792, 14),
    'one shape / lora': (0.1976, 54),
    'one shape / lora / no DeepSpeed': (0.1292, 39),
    'one shape / qlora': (0.1604, 36),
    'one shape / qlora / ZeRO-0/1/2': (0.1782, 26),
    'shapes vary': (0.1508, 51),
    'shapes vary / lora': (0.133, 36),
    'shapes vary / lora / no DeepSpeed': (0.133, 36),
}
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
# GPTQ checkpoints (corpus cases only, Setup.quant_format "gptq-int4"): inputs per quantization group. Qwen's
# Int4 models come from its run_gptq.py, whose --group-size defaults to 128 (QwenLM/Qwen run_gptq.py L69).
GPTQ_GROUP_SIZE = 128

# Optimizer state bytes per trainable parameter (fp32 moments), beside the fp32 master copy.
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "lion": 4, "adagrad": 4, "sgd": 0, "adamw_bnb_8bit": 2}
MASTER_BYTES = 4  # fp32 master weights (DeepSpeed keeps them for every 16-bit run)

PHASES = ("both", "backward", "step")
COUNTERS = ("allocated", "reserved", "device")
FIELDS = ("weights", "gradients", "optimizer", "buffers", "activations", "logits", "overhead")
