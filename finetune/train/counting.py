"""Tokens counted on the host, from the batches the collator built (issue 35).

transformers' `include_num_input_tokens_seen` sums each micro batch's attention mask on the GPU, gathers it
from every rank and calls `.item()`: a collective and a host sync per micro batch. Here the collator (made
with counts=True, finetune.data.packing.COUNTS_KEY) puts each batch's trained tokens and the sum of its
sequences' squared lengths (attention's FLOPs) beside the tensors, and the Trainer below takes them off
before the batch reaches the model: plain Python ints, counted per optimizer step on each rank. The ranks'
counts are summed only where a collective happens anyway (a checkpoint) and at the end. `total_flos` is
transformers' count, with the model's parameters counted once instead of once per micro batch.
"""

from __future__ import annotations

from typing import Any, Optional

from transformers import Trainer

from finetune.data.packing import COUNTS_KEY


class CountingTrainer(Trainer):
    """transformers' Trainer that takes the host-side counts off each batch (training and evaluation alike) and
    adds the training batches' to `counted` (this rank's, since this process started)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.counted = [0, 0]  # trained tokens, sum of squared sequence lengths
        self._parameters: Optional[tuple[int, int]] = None  # (id of the model, its parameters less embeddings)

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """transformers' count for `total_flos` (6 x input tokens x parameters less embeddings), the parameters
        counted once per model: the Trainer's own walks every module and parameter for each micro batch (1.7 ms at
        the Llama-3.2-1B shape with LoRA on a 2-core CPU), host time a micro-batch-1 step on a GPU waits for."""
        main = getattr(self.model, "main_input_name", "input_ids")
        if main not in inputs or not hasattr(self.model, "num_parameters"):
            return 0
        if self._parameters is None or self._parameters[0] != id(self.model):
            self._parameters = (id(self.model), self.model.num_parameters(exclude_embeddings=True))
        return 6 * inputs[main].numel() * self._parameters[1]

    def training_step(self, model, inputs: dict[str, Any], num_items_in_batch=None):
        tokens, squares = inputs.pop(COUNTS_KEY, (0, 0))
        self.counted[0] += tokens
        self.counted[1] += squares
        return super().training_step(model, inputs, num_items_in_batch)

    def prediction_step(self, model, inputs: dict[str, Any], *args, **kwargs):
        inputs.pop(COUNTS_KEY, None)
        return super().prediction_step(model, inputs, *args, **kwargs)
