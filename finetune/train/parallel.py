"""Sequence and tensor parallelism in the per-rank runner (recipe keys `parallel.sequence`, `parallel.tensor`).

Ulysses SP (DeepSpeed ALST) is switched on through `TrainingArguments.parallelism_config`: transformers hands
it to accelerate, whose Accelerator._prepare_deepspeed registers DeepSpeed's UlyssesSPAttentionHF in place of
the attention kernel, passes its mpu to deepspeed.initialize and wraps the train data loader in
UlyssesSPDataLoaderAdapter; Trainer.compute_loss then averages the per-rank shard losses by their token
counts (transformers/integrations/deepspeed.py deepspeed_sp_compute_loss). What that machinery expects from
us, and this module provides:
- the ParallelismConfig object itself (training_args.json can hold only its JSON, finetune.render);
- batches with `position_ids` (the adapter refuses a batch without them: after the all-to-all they are the
  only causal structure left, the attention mask is dropped) whose length is a multiple of sp (the adapter
  cuts each row into sp equal slices and refuses any other length).
AutoTP needs nothing here: it is `tensor_parallel.autotp_size` in the DeepSpeed JSON.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from finetune.errors import FinetuneError

# Keys of a flattened (padding-free) batch for flash attention's varlen call. They describe the whole
# sequence, while each SP rank holds a slice; the adapter would also try to slice them (1-D). Without them
# flash attention finds the examples from the gathered position_ids (DeepSpeed's ulysses_sp.py notes this).
_WHOLE_SEQUENCE_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


class ParallelError(FinetuneError):
    """A parallel.* setting this run's processes cannot carry out (one line, no traceback)."""


def parallelism_config(spec: Optional[dict[str, Any]], world_size: int):
    """accelerate's ParallelismConfig from training_args.json's `parallelism_config` (None: no SP)."""
    if not spec:
        return None
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    spec = dict(spec)
    handler = DeepSpeedSequenceParallelConfig(**spec.pop("sp_handler", {}))
    sp = int(spec["sp_size"])
    if world_size % sp:
        raise ParallelError(f"parallel.sequence: {sp} does not divide the {world_size} processes of this run")
    # accelerate sets the engine's train_batch_size to micro x accumulation x data_parallel_size
    # (dp_replicate x dp_shard, both 1 unless given): the data-parallel size must be named when there is one.
    dp = world_size // sp
    if dp > 1:
        spec.setdefault("dp_shard_size", dp)
    return ParallelismConfig(sp_handler=handler, **spec)


def training_arguments(args_kwargs: dict[str, Any], world_size: int) -> dict[str, Any]:
    """training_args.json's kwargs with `parallelism_config` turned into the object TrainingArguments takes."""
    out = dict(args_kwargs)
    spec = out.pop("parallelism_config", None)
    config = parallelism_config(spec, world_size)
    if config is not None:
        out["parallelism_config"] = config
        import warnings

        # transformers' Ulysses loss (deepspeed_sp_compute_loss) warns on every step and rank; nothing to act on
        warnings.filterwarnings("ignore", message=r"torch\.distributed\.nn\.functional\.all_gather is deprecated",
                                category=FutureWarning)
    return out


def without_offload_on_cpu(args_kwargs: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    """training.activation_offload on a machine without an accelerator: nothing to move off a device (and no pinned
    memory to move it into, which transformers' offload asks for), so the Trainer gets plain checkpointing."""
    from finetune.train.dist import has_accelerator

    for key in ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"):
        kwargs = args_kwargs.get(key)
        if isinstance(kwargs, dict) and kwargs.get("offload") and not has_accelerator():
            args_kwargs = {**args_kwargs, key: {k: v for k, v in kwargs.items() if k != "offload"}}
            log("training.activation_offload: no accelerator here, the activations are in host memory already")
    return args_kwargs


def sequence_parallel_size(args_kwargs: dict[str, Any]) -> int:
    spec = args_kwargs.get("parallelism_config") or {}
    return int(spec.get("sp_size", 1)) if isinstance(spec, dict) else int(getattr(spec, "sp_size", 1) or 1)


class SequenceParallelCollator:
    """Wraps a collator so its batches suit Ulysses: position_ids on every row, width a multiple of sp.

    Padding is at the end of each row: pad tokens, labels -100, attention mask 0, position ids continuing
    from 0 as a separate trailing sequence (what the packing collators do with their padding), so no real
    token attends to it or is scored on it.
    """

    def __init__(self, inner: Callable[[list[dict[str, Any]]], dict[str, Any]], sp: int, pad_token_id: int,
                 width: Optional[int] = None):
        self.inner, self.sp, self.pad_token_id = inner, sp, pad_token_id
        self.width = None if width is None else -(-width // sp) * sp

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        batch = {k: v for k, v in self.inner(rows).items() if k not in _WHOLE_SEQUENCE_KEYS}
        ids = batch["input_ids"]
        count, width = ids.shape
        if "position_ids" not in batch:
            batch["position_ids"] = torch.arange(width, dtype=torch.long).expand(count, width).clone()
        pad = (self.width - width) if self.width is not None and self.width > width else -width % self.sp
        if pad:
            fills = {"input_ids": self.pad_token_id, "labels": -100, "attention_mask": 0}
            for key, value in list(batch.items()):
                if not torch.is_tensor(value) or value.dim() != 2 or value.shape[1] != width:
                    continue
                if key == "position_ids":
                    tail = torch.arange(pad, dtype=value.dtype).expand(count, pad)
                else:
                    tail = torch.full((count, pad), fills.get(key, 0), dtype=value.dtype)
                batch[key] = torch.cat([value, tail], dim=1)
        return batch


def wrap_collator(collator, args_kwargs: dict[str, Any], pad_token_id: int, recipe, on_cpu: bool):
    """The SP collator, or `collator` itself without SP.

    On gloo (the CPU accelerator) every batch is padded to one width: the adapter all-gathers each rank's
    batch into buffers of that rank's length, which NCCL accepts and gloo refuses ("ProcessGroupGloo::allgather:
    invalid tensor size", deepspeed 0.19.8). On a GPU each batch keeps its own length (a multiple of sp).
    """
    sp = sequence_parallel_size(args_kwargs)
    if sp == 1:
        return collator
    d = recipe.data
    width = d.max_length * (recipe.training.micro_batch_size if d.padding_free else 1) if on_cpu else None
    return SequenceParallelCollator(collator, sp, pad_token_id, width)


def rope_scaled_config(model_path: str, model_section):
    """The model's config with `model.rope_scaling` merged into its rope_parameters (transformers 5 keeps
    rope_theta there too, so the section is merged, not substituted); max_position_embeddings grows to the
    scaled length, which transformers' yarn and llama3 read beside original_max_position_embeddings."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path, revision=model_section.revision,
                                        trust_remote_code=model_section.trust_remote_code)
    scaling = {k: v for k, v in model_section.rope_scaling.model_dump().items() if v is not None}
    original = scaling.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    config.rope_parameters = {**(getattr(config, "rope_parameters", None) or {}), **scaling}
    config.max_position_embeddings = max(config.max_position_embeddings, int(original * scaling["factor"]))
    return config


def use_tiled_mlp(model, shards: Optional[int] = None) -> int:
    """DeepSpeed ALST's TiledMLP on every gated MLP (gate_proj, up_proj, down_proj, act_fn: Llama, Qwen2, Mistral,
    Gemma...), as DeepSpeed's TiledMLP docstring patches LlamaMLP, but per instance and after PEFT (the LoRA-wrapped
    projections are what runs). Returns how many MLPs were patched.

    `shards`: slices per call (default ceil(tokens / hidden_size)); agreed across ranks (max), because under ZeRO-3
    every call gathers the weights and all ranks must make the same calls."""
    import math
    import types

    import torch
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    from finetune.train.dist import process_group

    def mlp_forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    def tiled_forward(self, x):
        count = shards or math.ceil(x.shape[-2] / x.shape[-1])
        dist = process_group()
        if dist is not None and dist.get_world_size() > 1 and shards is None:
            agreed = torch.tensor(count, device=x.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            count = int(agreed.item())
        compute_params = [p for p in self.parameters() if p.requires_grad]
        return TiledMLP.apply(mlp_forward, self, x, count, compute_params)

    patched = 0
    for module in model.modules():
        if all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            module.forward = types.MethodType(tiled_forward, module)
            patched += 1
    if not patched:
        raise ParallelError(f"training.tiled_mlp: {type(model).__name__} has no gated MLP (gate_proj, up_proj, down_proj) "
                            "to tile; set training.tiled_mlp: false")
    return patched


def apply_tiled_mlp(model, training) -> int:
    """use_tiled_mlp when the recipe's training.tiled_mlp asks for it (0 MLPs patched otherwise)."""
    return use_tiled_mlp(model, training.tiled_mlp_shards) if training.tiled_mlp else 0


def for_this_run(checkpoint: Optional[str], ds_config: dict[str, Any], args_kwargs: dict[str, Any],
                 log: Callable[[str], None], engine: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
    """The DeepSpeed config and TrainingArguments kwargs as this run's processes need them: a checkpoint of another
    process count converted (finetune.train.universal), Ulysses' ParallelismConfig object, no activation offload
    without an accelerator. `engine` False (deepspeed.enabled: false): the Trainer gets no DeepSpeed config.
    Collective (every rank calls it)."""
    from finetune.train import universal
    from finetune.train.dist import world_size

    world = world_size()
    if not engine:
        return ds_config, without_offload_on_cpu(training_arguments(args_kwargs, world), log)
    ds_config = universal.prepare_resume(checkpoint, ds_config, world, universal.converts_here(ds_config), log)
    args_kwargs = training_arguments({**args_kwargs, "deepspeed": ds_config}, world)
    if sequence_parallel_size(args_kwargs) > 1:
        resume_through_ulysses()
    return ds_config, without_offload_on_cpu(args_kwargs, log)


def resume_through_ulysses() -> None:
    """transformers' Trainer resumes mid-epoch with accelerate's skip_first_batches(train_dataloader, n), which reads
    the loader's `dataset` and sampler; under Ulysses the Trainer's loader is DeepSpeed's UlyssesSPDataLoaderAdapter,
    which has neither (issue 34: every resume of a parallel.sequence run failed with AttributeError on rank 0).
    transformers.trainer's name is pointed at skip_batches for this process."""
    import transformers.trainer

    transformers.trainer.skip_first_batches = skip_batches


def skip_batches(dataloader, num_batches: int = 0):
    """accelerate's skip_first_batches, and for a UlyssesSPDataLoaderAdapter the same skip done where the batches
    come from. The adapter turns each batch of the loader it wraps (one per rank of the group, all-gathered) into
    sp micro batches, one per rank's batch in rank order: the Trainer's n micro batches are n // sp batches of that
    loader, skipped by accelerate without reading them, then n % sp micro batches of the next (every rank of the
    group skips the same, so their all-gathers stay paired)."""
    from accelerate import skip_first_batches
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    if not isinstance(dataloader, UlyssesSPDataLoaderAdapter):
        return skip_first_batches(dataloader, num_batches)
    whole, part = divmod(num_batches, dataloader.sp_world_size)
    resumed = UlyssesSPDataLoaderAdapter(skip_first_batches(dataloader.dl, whole), dataloader.sp_rank,
                                         dataloader.sp_group, dataloader.sp_world_size, dataloader.device)
    for _ in range(part):
        next(resumed)
    return resumed
