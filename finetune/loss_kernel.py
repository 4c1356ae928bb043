"""`training.loss_kernel`: how the causal-LM loss is computed.

- default: transformers' own forward. The head computes the logits of every token, and
  ForCausalLMLoss upcasts them to fp32 (about 12 bytes per token and vocabulary entry at the
  start of backward: 1.5 MB per token for a 128k vocabulary).
- chunked (`use_chunked_loss`): the head and the cross-entropy run over chunks of tokens, each
  under torch.utils.checkpoint. No more than one chunk's logits exist at a time, in forward and
  in backward (which recomputes that chunk's logits). Works on any device, under PEFT and ZeRO-3.
- liger: Liger-Kernel's fused linear cross-entropy (Triton, CUDA only), switched on by the
  Trainer's own `use_liger_kernel` (dsconfig.render_training_args); nothing here.

Torch is imported inside functions. The number of chunks is the planner's arithmetic (finetune.chunks).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

from finetune.data.tokenize import IGNORE_INDEX
from finetune.errors import FinetuneError


class LossKernelError(FinetuneError):
    """The model cannot use the chosen loss kernel (one line for a human)."""


def _chunk_loss_sum(head, hidden, targets, softcap: Optional[float], ignore_index: int):
    import torch.nn.functional as F

    logits = head(hidden)
    if softcap is not None:  # Gemma 2's final_logit_softcapping, applied as transformers does
        logits = (logits / softcap).tanh() * softcap
    return F.cross_entropy(logits.float(), targets, ignore_index=ignore_index, reduction="sum")


def chunked_causal_lm_loss(hidden, head, labels, num_chunks: int, num_items_in_batch: Any = None,
                           ignore_index: int = IGNORE_INDEX, shift_labels=None, softcap: Optional[float] = None):
    """The value of transformers' ForCausalLMLoss(head(hidden), labels), one chunk of tokens at a time.

    Same reduction: the sum over non-ignored tokens divided by num_items_in_batch when the Trainer
    passes it (gradient accumulation counts the tokens of all micro batches), else their mean.
    """
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = shift_labels.reshape(-1).to(hidden.device)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for h, t in zip(hidden.tensor_split(num_chunks), targets.tensor_split(num_chunks)):
        # Non-reentrant checkpoint: the chunk's logits are dropped after forward and recomputed in
        # backward, calling the head module again, so ZeRO-3's gather hooks and LoRA layers run.
        total = total + checkpoint(_chunk_loss_sum, head, h, t, softcap, ignore_index, use_reentrant=False)
    if num_items_in_batch is None:
        return total / (targets != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


# Config attributes of heads that do more than a linear layer (+ softcapping): chunking them would
# silently change the loss.
_UNSUPPORTED_HEAD_SCALING = ("logit_scale", "logits_scaling", "output_multiplier_scale")


def causal_lm(model):
    """The transformers *ForCausalLM inside `model` (a PEFT model or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def use_chunked_loss(model, num_chunks: int) -> None:
    """Make the causal LM inside `model` compute its training loss in `num_chunks` chunks.

    Its forward is replaced on the instance (not the class): in training, with labels, it runs the
    decoder (`base_model`) as transformers' forward does, then `chunked_causal_lm_loss` with the
    output head, and returns the loss without logits. Evaluation and generation keep the original
    forward. PEFT calls the inner model's `forward` attribute, so the adapter wrappers stay around it.
    """
    from transformers.modeling_outputs import CausalLMOutputWithPast

    lm = causal_lm(model)
    decoder = getattr(lm, "base_model", lm)
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if decoder is lm or head is None:
        raise LossKernelError(f"training.loss_kernel: chunked needs a decoder and an output head; "
                              f"{type(lm).__name__} has no separate ones (use loss_kernel: default)")
    config = lm.config
    scaled = [name for name in _UNSUPPORTED_HEAD_SCALING if getattr(config, name, None) not in (None, 1, 1.0)]
    if scaled:
        raise LossKernelError(f"training.loss_kernel: chunked does not support {type(lm).__name__}'s "
                              f"`{scaled[0]}` (use loss_kernel: default)")
    softcap = getattr(config, "final_logit_softcapping", None)
    original = lm.forward

    # The original's signature stays visible (inspect follows __wrapped__): the Trainer reads it to
    # keep dataset columns and to decide whether to pass num_items_in_batch.
    @functools.wraps(original)
    def forward(*args, labels=None, logits_to_keep=0, **kwargs):
        if labels is None or args or not lm.training:
            return original(*args, labels=labels, logits_to_keep=logits_to_keep, **kwargs)
        # transformers passes the same kwargs to the decoder and to the loss; so does this.
        router = _returns_router_logits(lm, kwargs)
        outputs = decoder(**kwargs, **({"output_router_logits": True} if router else {}))
        loss = chunked_causal_lm_loss(outputs.last_hidden_state, lm.get_output_embeddings(), labels, num_chunks,
                                      num_items_in_batch=kwargs.get("num_items_in_batch"),
                                      ignore_index=kwargs.get("ignore_index", IGNORE_INDEX),
                                      shift_labels=kwargs.get("shift_labels"), softcap=softcap)
        if router:
            from transformers.modeling_outputs import MoeCausalLMOutputWithPast

            aux = router_aux_loss(lm, outputs.router_logits, kwargs.get("attention_mask"))
            return MoeCausalLMOutputWithPast(loss=loss + lm.router_aux_loss_coef * aux.to(loss.device), aux_loss=aux,
                                             logits=None, past_key_values=outputs.past_key_values,
                                             hidden_states=outputs.hidden_states, attentions=outputs.attentions)
        return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=outputs.past_key_values,
                                      hidden_states=outputs.hidden_states, attentions=outputs.attentions)

    lm.forward = forward


def _returns_router_logits(lm, kwargs: dict) -> bool:
    """A mixture of experts adds its router's load-balancing loss when asked for its router logits (the
    forward's argument, else config.output_router_logits): transformers' MoE forwards do, so this one does too."""
    if not hasattr(lm, "router_aux_loss_coef"):
        return False
    asked = kwargs.get("output_router_logits")
    return bool(asked if asked is not None else getattr(lm.config, "output_router_logits", False))


def router_aux_loss(lm, router_logits, attention_mask):
    """The model's own load_balancing_loss_func (each MoE modeling module has one), as its forward calls it."""
    import sys

    balance = sys.modules[type(lm).__module__].load_balancing_loss_func
    return balance(router_logits, lm.num_experts, lm.num_experts_per_tok, attention_mask)
