"""objective sft inside the per-rank runner (finetune.train.runner): next-token loss on data the launcher tokenized.

The steps every objective's module has (finetune.train.objective_steps), as SFT takes them:
- arguments: transformers' TrainingArguments as rendered (training_args.json);
- datasets: the tokenized data memory-mapped from the cache (finetune.run.start made it before launch), split,
  batched by our collator (packing, padding-free, Ulysses' slices, a VLM's pixels), which counts the tokens on the
  host when no data-loader adapter collates in its place (finetune.train.counting);
- model: the base model, then a fresh LoRA adapter and gradient checkpointing (finetune.train.model.prepare_model);
- trainer: transformers' Trainer (logging a MoE router's aux loss);
- fixed batch: the first training sequences, for final_logits.safetensors;
- after training: a VLM's image processor saved beside the tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from finetune.recipe import Recipe


def fixed_batch(dataset, pad_token_id: int, size: int, tokens: int) -> dict[str, Any]:
    """The first `size` training examples (a packed block's one by one), each cut to `tokens` tokens and
    right-padded with an attention mask: a batch every attention kernel reads the same way."""
    from finetune.data.packing import Collator, split_packed

    examples: list[dict[str, list[int]]] = []
    for i in range(len(dataset)):
        examples += split_packed(dataset[i])
        if len(examples) >= size:
            break
    rows = [{k: v[:tokens] for k, v in e.items()} for e in examples[:size]]
    return Collator(pad_token_id, always_mask=True)(rows)


class SftSteps:
    def __init__(self, recipe: Recipe, run_dir: Path):
        self.recipe, self.run_dir = recipe, run_dir
        self.collator = self.images = self.image_processor = None

    @property
    def host_counts(self) -> bool:
        """Our collator counts the batches' tokens on the host (finetune.train.counting); Ulysses' data-loader
        adapter collates its own, so the Trainer counts those (a sync per batch)."""
        return self.recipe.parallel.sequence == 1

    def config_kwargs(self) -> dict[str, Any]:
        return {}  # no TRL config: training_args.json is all

    def arguments(self, training_arguments_class, kwargs: dict[str, Any]):
        return training_arguments_class(**kwargs)

    def datasets(self, tokenizer, model_path: str, is_main: bool, args_kwargs: dict[str, Any], on_cpu: bool):
        """(train, eval or None): tokenized by the launcher before this process started (finetune.run.start):
        memory-mapped, never made here."""
        from finetune.data.cache_root import tokenized_root
        from finetune.data.packing import make_collator, width_limit
        from finetune.data.prepare import load_prepared, mix_report
        from finetune.data.spec import DataSpec
        from finetune.data.tokenize import split_eval
        from finetune.rundir.names import DATA_MIX_FILE
        from finetune.train import parallel
        from finetune.train.moe import moe_identity
        from finetune.train.vlm_model import vision_collator

        recipe = self.recipe
        spec = DataSpec.of(recipe)
        dataset = load_prepared(spec, tokenizer, tokenized_root())
        if is_main:  # the run directory says what it trained on: rows per source, dropped, mixed
            from finetune.fsutil import write_atomic

            report = mix_report(spec, tokenizer, tokenized_root())
            write_atomic(self.run_dir / DATA_MIX_FILE, json.dumps(report, indent=2) + "\n")
        train_set, eval_set = split_eval(dataset, recipe.data.validation_split, recipe.training.seed)
        collator = make_collator(tokenizer.pad_token_id, recipe.model.attn_implementation, recipe.data.packing,
                                 recipe.data.padding_free, counts=self.host_counts,
                                 bucket=recipe.data.pad_to_multiple_of,
                                 limit=width_limit(recipe.data.max_length),
                                 mask_padding=moe_identity(model_path) is not None)
        collator = parallel.wrap_collator(collator, args_kwargs, tokenizer.pad_token_id, recipe, on_cpu)
        self.images, self.image_processor = vision_collator(recipe, model_path, tokenizer)  # a VLM: pixels too (issue 38)
        self.collator = self.images or collator
        return train_set, eval_set

    def load_model(self, model_path: str, tokenizer):
        from finetune.train.model import load_model

        return load_model(self.recipe, model_path)

    def prepare(self, model, model_path: str):
        from finetune.train.model import prepare_model

        return prepare_model(model, self.recipe)

    def make_trainer(self, model, args, train_set, eval_set, tokenizer, callbacks, model_path: str):
        from transformers import Trainer

        from finetune.train.counting import CountingTrainer
        from finetune.train.moe import logging_aux_loss, moe_identity

        base = CountingTrainer if self.host_counts else Trainer
        trainer_class = logging_aux_loss(base) if moe_identity(model_path) else base
        return trainer_class(model=model, args=args, train_dataset=train_set, eval_dataset=eval_set,
                             data_collator=self.collator, processing_class=tokenizer, callbacks=callbacks)

    def fixed_batch(self, trainer, train_set, pad_token_id: int, size: int, tokens: int) -> dict[str, Any]:
        return fixed_batch(train_set, pad_token_id, size, tokens)

    def save_beside_tokenizer(self, folder: Path) -> None:
        """The processor as trained (its image-size limits) beside the tokenizer, for a VLM."""
        if self.image_processor is not None:
            from finetune.train.vlm_model import save_processor_files

            save_processor_files(self.image_processor, self.images.vm, folder)

    def summary_extra(self, log_history: list[dict[str, Any]]) -> dict[str, Any]:
        return {"objective": self.recipe.objective}

    def summary_line(self, summary: dict[str, Any]) -> Optional[str]:
        return None
