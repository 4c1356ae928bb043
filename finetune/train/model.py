"""Tokenizer, base model (dtype, attention, 4-bit) and the LoRA adapter, as a recipe describes them.

Order matters under ZeRO-3: the runner creates TrainingArguments(deepspeed=...) before calling
`load_model`, so from_pretrained sees the DeepSpeed config (a weak reference transformers keeps) and
builds the model inside deepspeed.zero.Init, each rank holding only its shard. A 4-bit model is not
built under zero.Init (transformers skips it for quantized models); the DeepSpeed engine partitions
it later, which is why the 4-bit storage dtype must equal the dtype of the other weights (lint R101).
"""

from __future__ import annotations

from typing import Any

from finetune import objectives
from finetune.recipe import Recipe


def torch_dtype(name: str):
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def quantization_config(recipe: Recipe):
    """BitsAndBytesConfig for method: qlora (None otherwise)."""
    if recipe.method != "qlora":
        return None
    from transformers import BitsAndBytesConfig

    q = recipe.quantization
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=q.quant_type,
        bnb_4bit_use_double_quant=q.double_quant,
        bnb_4bit_compute_dtype=torch_dtype(q.compute_dtype),
        # The packed 4-bit weights are stored in tensors of this dtype; ZeRO-3 flattens and shards
        # them together with the other weights, so it must be the model dtype there.
        bnb_4bit_quant_storage=torch_dtype(q.storage_dtype),
    )


def load_model(recipe: Recipe, model_path: str):
    """The base causal LM in the recipe's dtype and attention kernel (4-bit for qlora)."""
    from transformers import AutoModelForCausalLM

    from finetune.train import moe
    from finetune.train.vlm_model import is_vlm, load_vlm

    kwargs = {**model_kwargs(recipe), **moe.load_kwargs(recipe, model_path)}
    if recipe.model.rope_scaling is not None:
        from finetune.train.parallel import rope_scaled_config

        kwargs["config"] = rope_scaled_config(model_path, recipe.model)
        moe.apply_config_overrides(kwargs["config"], recipe, model_path)
    else:  # config attributes as keyword arguments: transformers applies them before building the model
        kwargs.update(moe.config_overrides(recipe, model_path))
    if is_vlm(recipe):  # its image-text class: AutoModelForCausalLM would leave the tower out (issue 38)
        return load_vlm(model_path, kwargs)
    return AutoModelForCausalLM.from_pretrained(model_path, **kwargs)


def model_kwargs(recipe: Recipe) -> dict[str, Any]:
    """from_pretrained's keyword arguments for the recipe: dtype, attention kernel, revision, 4-bit."""
    m = recipe.model
    kwargs: dict[str, Any] = {
        "dtype": torch_dtype(m.dtype),
        "attn_implementation": m.attn_implementation,
        "trust_remote_code": m.trust_remote_code,
    }
    if m.revision:
        kwargs["revision"] = m.revision
    quant = quantization_config(recipe)
    if quant is not None:
        # No device_map: bitsandbytes' quantizer places the model on the current CUDA device (set
        # per rank by TrainingArguments) or on the CPU.
        kwargs["quantization_config"] = quant
    return kwargs


def lora_config(recipe: Recipe, model=None):
    """peft's LoraConfig for the recipe; `model` (the loaded base) decides a mixture of experts' targets."""
    from peft import LoraConfig

    from finetune.train.moe import peft_targets
    from finetune.train.vlm_model import lora_kwargs

    lora = recipe.lora
    vision = lora_kwargs(recipe)  # a VLM: the tower and projector out of "all-linear" unless opted in
    return LoraConfig(
        # A reward model's score head is new: SEQ_CLS makes peft train and save it (modules_to_save `score`).
        task_type="SEQ_CLS" if objectives.get(recipe.objective).score_head else "CAUSAL_LM",
        r=lora.r,
        # An integer when it is one: the schema types alpha as a float, and adapter_config.json's `32.0` is refused by
        # Ollama's adapter import, which reads lora_alpha as an unsigned integer (issue 36, finetune.serve).
        lora_alpha=int(lora.alpha) if float(lora.alpha).is_integer() else lora.alpha,
        lora_dropout=lora.dropout,
        # Dense models: peft expands "all-linear" to every nn.Linear (and 4-bit Linear) but the output head.
        # Mixtures of experts: finetune names the modules (and the experts, as target_parameters) itself.
        **peft_targets(recipe, model),
        # a VLM: the tower and projector out of "all-linear" unless opted in (finetune.train.vlm_model)
        modules_to_save=vision.get("modules_to_save", lora.modules_to_save),
        exclude_modules=vision.get("exclude_modules"),
        use_rslora=lora.rslora,
        use_dora=lora.dora,
        bias=lora.bias,
    )


def enable_checkpointing(model, reentrant: bool = False, offload: bool = False) -> None:
    """Gradient checkpointing under the name this transformers has: activation_checkpointing_enable (5.x;
    the old name warns "will be removed in v6") or gradient_checkpointing_enable. `offload`: the checkpointed
    inputs in pinned host memory (5.x only)."""
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, **({"offload": True} if offload else {}))
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def prepare_model(model, recipe: Recipe):
    """Gradient checkpointing, then (lora/qlora) the PEFT adapter. Returns the model to train."""
    from finetune.train.vlm_model import freeze_for_full, text_inputs_require_grads
    from finetune.vision_models import is_vlm_config

    t = recipe.training
    # read from the loaded model, not the recipe's reference: a hub id would be looked up again (with the Hub's
    # retries, 23 s where it cannot be reached)
    vlm = is_vlm_config(model.config.to_dict())
    if vlm and recipe.vision.freeze_tower:
        text_inputs_require_grads(model)  # not the frozen tower's patch embedding too (finetune.train.vlm_model)
    if t.gradient_checkpointing:
        from finetune.render import reentrant_checkpointing
        from finetune.train.dist import has_accelerator

        # pinned host memory (training.activation_offload); without an accelerator the activations are host memory
        # already, and transformers 5.23 would still ask for pinned memory, which a CPU-only torch cannot give
        enable_checkpointing(model, reentrant_checkpointing(recipe), offload=t.activation_offload and has_accelerator())
    if recipe.method == "full":
        if vlm:
            freeze_for_full(model, recipe)  # the tower and projector train only when the recipe says so
        return model
    from peft import get_peft_model

    if t.gradient_checkpointing:
        # With a frozen base the embeddings' output does not require grad; checkpointed blocks then
        # see inputs without grad. This hook makes the embedding output require grad so gradients
        # reach the adapters inside the checkpointed blocks (needed for reentrant checkpointing,
        # harmless for non-reentrant).
        model.enable_input_require_grads()
    # No peft.prepare_model_for_kbit_training: it casts every non-4-bit weight to float32, which
    # breaks ZeRO-3's uniform dtype; the 4-bit path here needs only the hook above.
    return get_peft_model(model, lora_config(recipe, model))


def count_parameters(model) -> tuple[int, int]:
    """(trainable, total); under ZeRO-3 a partitioned parameter reports its full size as ds_numel."""
    trainable = total = 0
    for param in model.parameters():
        n = getattr(param, "ds_numel", None) or param.numel()
        if param.__class__.__name__ == "Params4bit":
            n *= param.element_size() * 2  # packed: two 4-bit weights per byte of the storage dtype
        total += n
        if param.requires_grad:
            trainable += n
    return trainable, total

