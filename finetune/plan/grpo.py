"""What GRPO (recipe `objective: grpo`) adds to a plan beside the other TRL objectives' terms
(finetune.plan.preference): the generation phase, where each GPU generates its completions before the step.
"""

from __future__ import annotations

import math

from finetune.plan.params import four_bit_bytes
from finetune.plan.setup import Setup, Term


def generation_terms(setup: Setup) -> list[Term]:
    """GRPO's generation phase (trl GRPOTrainer with transformers' generate): each GPU generates its whole
    generation batch at once (micro_batch x gradient_accumulation_steps completions), with a KV cache of
    2 (K, V) x layers x kv_heads x head_dim per token; under ZeRO-3 TRL first gathers every weight
    (ds3_gather_for_generation, ms-swift #7986). Counted on top of the training peak: conservative, as the
    two phases do not overlap in time."""
    if not setup.generation_sequences or setup.arch is None:
        return []
    arch = setup.arch
    head_dim = arch.head_dim or arch.hidden // arch.heads
    per_token = 2 * arch.layers * arch.kv_heads * head_dim * setup.element_bytes
    tokens = setup.generation_sequences * setup.seq_len
    terms = [Term("activations", "generation KV cache", per_token * tokens,
                  note=f"{setup.generation_sequences} completions x {setup.seq_len:,} tokens x 2 x {arch.layers} layers "
                       f"x {arch.kv_heads} kv heads x {head_dim} x {setup.element_bytes} B")]
    if setup.deepspeed and setup.stage == 3 and setup.world > 1:
        size = four_bit_bytes(setup.params) if setup.method == "qlora" else setup.params * setup.element_bytes
        gathered = size - math.ceil(size / setup.world)
        terms.append(Term("weights", "weights gathered for generation", gathered,
                          note=f"ZeRO-3: the other {setup.world - 1}/{setup.world} of the weights, gathered while generating"))
    return terms
