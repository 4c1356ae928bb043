"""What a TRL objective (recipe `objective`) adds to a plan: rows per example, TRL's log-prob kernel and the
reference model (GRPO's generation phase: finetune.plan.grpo). The rest of the memory model is the SFT one
(finetune.plan.activations).

Read off TRL 1.16:
- DPO, ORPO and SimPO (CPOTrainer) run chosen and rejected as one concatenated batch of 2 x micro_batch
  rows, so everything sized by rows (activations, masks, logits) doubles; KTO runs its completions as one
  batch (1 x) plus a KL batch of mismatched completions under no_grad, which saves nothing for backward.
- DPO, KTO and GRPO score tokens through TRL's fused LM head (trl.trainer.utils.add_fused_lm_head, kernel
  trl/kernels/chunked_logprob.py): fp32 tiles of at most 4,096 tokens x 32,768 vocabulary entries, never the
  full logits. ORPO and CPO compute full logits like SFT.
- A reference model (reference.mode: model) is a second, frozen copy of the weights: partitioned 1/N under
  ZeRO-3 (trl.models.prepare_deepspeed keeps stage 3), whole on every GPU otherwise (it sets stage 0 there).
  LoRA's adapter_disabled and precomputed log-probs keep none, except that a continued adapter (model.adapter)
  is copied by TRL into a frozen `ref` adapter, so that the reference is the SFT model.
"""

from __future__ import annotations

import math

from finetune import objectives
from finetune.plan.params import four_bit_bytes
from finetune.plan.setup import Setup, Term

FUSED_LOGPROB_OBJECTIVES = tuple(o.name for o in objectives.OBJECTIVES.values() if o.fused_logprob)
SCORE_HEAD_OBJECTIVES = tuple(o.name for o in objectives.OBJECTIVES.values() if o.score_head)
TOKEN_TILE = 4096  # trl/kernels/chunked_logprob.py TOKEN_CHUNK_SIZE
VOCAB_TILE = 32768  # trl/trainer/utils.py _CHUNKED_LOGPROB_CHUNK_SIZE


def rows_per_example(objective: str) -> int:
    """Sequences one preference example puts through the trained forward (see the module docstring)."""
    return objectives.get(objective).rows_per_example


def reference_terms(setup: Setup, trainable: int) -> list[Term]:
    """The reference's weights per GPU: a frozen model (reference.mode: model), or TRL's frozen `ref` copy of
    a continued adapter (model.adapter with adapter_disabled); nothing when the adapter is just switched off."""
    if setup.reference_adapter:
        size = trainable * setup.element_bytes
        if setup.deepspeed and setup.stage == 3:
            return [Term("weights", f"reference adapter 1/{setup.world}", math.ceil(size / setup.world),
                         note="TRL's frozen `ref` copy of the continued adapter, partitioned by ZeRO-3")]
        return [Term("weights", "reference adapter", size, note="TRL's frozen `ref` copy of the continued adapter")]
    if not setup.reference_model:
        return []
    if setup.method == "qlora":
        size, what = four_bit_bytes(setup.params), "4-bit"
    else:
        size, what = setup.params * setup.element_bytes, setup.dtype
    if setup.deepspeed and setup.stage == 3:
        return [Term("weights", f"reference model 1/{setup.world}", math.ceil(size / setup.world),
                     note=f"frozen {what} copy, partitioned by ZeRO-3")]
    return [Term("weights", "reference model", size, note=f"frozen {what} copy on every GPU")]


def has_reference_model(recipe) -> bool:
    """A frozen second copy of the weights: preference.reference.mode: model (dpo, kto), or GRPO with beta > 0
    on a full fine-tune (TRL's GRPOTrainer builds one from the policy's path; with LoRA it switches the
    adapter off instead)."""
    record = objectives.get(recipe.objective)
    if record.reference == "preference":
        return recipe.preference.reference.mode == "model"
    if record.reference == "beta":
        return recipe.grpo.beta > 0 and recipe.method == "full"
    return False
