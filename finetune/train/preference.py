"""TRL's preference objectives (dpo, orpo, kto, simpo) inside the per-rank runner, and the steps every TRL objective
shares (`TrlSteps`: finetune.train.grpo and finetune.train.reward change what differs for theirs); which trainer
and which recipe keys is finetune.objectives' table.

The runner (finetune.train.runner) stays the spine: the same process group, DeepSpeed config, callbacks,
checkpoints, resume and save_weights. The steps (finetune.train.objective_steps) swap what differs from SFT:

- arguments: TRL's config (a TrainingArguments subclass) with the recipe's `preference` keys;
- datasets: raw rows (prompt/chosen/rejected, or prompt/completion/label for kto), as text or as chat
  messages. TRL tokenizes them itself (its chat-template handling, EOS, truncation), so no SFT tokenizing;
- model: a fresh LoRA adapter is handed to TRL as a `peft_config` (TRL wraps the model; the reference is
  the same model with the adapter switched off). A continued adapter (`model.adapter`) is loaded trainable;
  TRL then copies it into a frozen adapter named `ref`, so the reference is the SFT policy, not the bare base;
- the reference for full fine-tunes: a second model loaded after TrainingArguments, so under ZeRO-3 it is built
  partitioned like the policy, and TRL wraps it in a DeepSpeed inference engine with the same config
  (trl.models.prepare_deepspeed). `reference.mode: precomputed` has TRL compute the reference log-probs once,
  before training, and keeps no reference in memory.

Which trainer (trl 1.16): DPOTrainer and KTOTrainer are in `trl`; ORPOTrainer and CPOTrainer in
`trl.experimental`. SimPO is CPOTrainer with loss_type "simpo" (cpo_alpha 0: no NLL term).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from finetune import objectives
from finetune.recipe import Recipe

# What summary.json keeps, first and last value: the reward statistics every preference trainer logs, and
# the objective's own terms (ORPO's NLL and log odds, KTO's KL estimate; GRPO's reward, KL, completion length).
METRIC_PREFIXES = ("rewards/", "logps/")
METRIC_NAMES = ("nll_loss", "log_odds_ratio", "log_odds_chosen", "kl", "reward", "reward_std", "accuracy", "margin",
                "completions/mean_length")


def columns(recipe: Recipe) -> tuple[str, ...]:
    return objectives.get(recipe.objective).columns


def trl_classes(recipe: Recipe) -> tuple[Any, Any]:
    import importlib
    import warnings

    record = objectives.get(recipe.objective)
    with warnings.catch_warnings():
        # trl.experimental warns on import that its API may change; the pinned floor is what we test.
        warnings.simplefilter("ignore")
        module = importlib.import_module(record.trl_module)
    return getattr(module, record.trl_config), getattr(module, record.trl_trainer)


# One function per objective: the TRL config keys the recipe sets, only those the objective reads (lint R118
# refuses the others; tests/test_objectives.py checks that these read exactly objectives' `keys`).


def _beta(p) -> dict[str, Any]:
    return {"beta": p.beta} if p.beta is not None else {}


def _dpo(recipe: Recipe) -> dict[str, Any]:
    p = recipe.preference
    out = {"max_length": recipe.data.max_length, **_beta(p)}
    if p.loss_type is not None:
        out["loss_type"] = [p.loss_type]
    return {**out, "precompute_ref_log_probs": p.reference.mode == "precomputed", "label_smoothing": p.label_smoothing}


def _kto(recipe: Recipe) -> dict[str, Any]:
    p = recipe.preference
    out = {"max_length": recipe.data.max_length, **_beta(p)}
    if p.loss_type is not None:
        out["loss_type"] = p.loss_type
    return {**out, "precompute_ref_log_probs": p.reference.mode == "precomputed",
            "desirable_weight": p.desirable_weight, "undesirable_weight": p.undesirable_weight}


def _orpo(recipe: Recipe) -> dict[str, Any]:
    p = recipe.preference
    out = {"max_length": recipe.data.max_length, **_beta(p)}
    if p.max_completion_length is not None:
        out["max_completion_length"] = p.max_completion_length
    return out


def _simpo(recipe: Recipe) -> dict[str, Any]:
    p = recipe.preference
    return {**_orpo(recipe), "loss_type": "simpo", "simpo_gamma": p.simpo_gamma, "cpo_alpha": p.cpo_alpha,
            "label_smoothing": p.label_smoothing}


CONFIG_KWARGS = {"dpo": _dpo, "kto": _kto, "orpo": _orpo, "simpo": _simpo}


def config_kwargs(recipe: Recipe) -> dict[str, Any]:
    """The TRL config keys the recipe sets for its preference objective."""
    return CONFIG_KWARGS[recipe.objective](recipe)


# ------------------------------------------------------------------------------------------------
# Data


def load_rows(recipe: Recipe):
    """The objective's rows as a `datasets.Dataset` in TRL's column names (finetune.data.preference: the row
    formats preflight checked every local row with, sources mixed like SFT's)."""
    from finetune.data.trl_rows import load_rows as read

    seed = recipe.training.seed if recipe.data.seed is None else recipe.data.seed
    return read(recipe.data, recipe.objective, seed)


def split_rows(recipe: Recipe):
    """(train, eval or None): the rows with data.validation_split held out, seeded like SFT's split_eval."""
    dataset = load_rows(recipe)
    if recipe.data.validation_split <= 0:
        return dataset, None
    parts = dataset.train_test_split(test_size=recipe.data.validation_split, seed=recipe.training.seed, shuffle=True)
    return parts["train"], parts["test"]


# ------------------------------------------------------------------------------------------------
# Models


def adapter_dir(reference: str) -> Path:
    """model.adapter: an SFT run directory (its adapter/) or the adapter directory itself."""
    from finetune.data.tokenize import DataError
    from finetune.rundir.adapter import find_adapter, no_adapter_message

    found = find_adapter(reference)
    if found is None:
        raise DataError(f"model.adapter: {no_adapter_message(reference)} (give an SFT run directory or an adapter directory)")
    return found


def prepare_policy(model, recipe: Recipe, model_path: str) -> tuple[Any, Any, Any]:
    """(model, peft_config for TRL or None, reference model or None).

    Gradient checkpointing is left to the Trainer (training_args.json has it): TRL adjusts its kwargs for
    PEFT under ZeRO-3 (reentrant, trl#2514) and enables input gradients for the frozen embeddings."""
    reference = load_reference(recipe, model_path)
    if recipe.method == "full":
        return model, None, reference
    if recipe.model.adapter is None:
        from finetune.train.model import lora_config

        return model, lora_config(recipe, model), reference
    from peft import PeftModel

    adapter = str(adapter_dir(recipe.model.adapter))
    return PeftModel.from_pretrained(model, adapter, is_trainable=True), None, reference


def load_reference(recipe: Recipe, model_path: str):
    """The reference model for reference.mode: model (dpo, kto), else None.

    Loaded after TrainingArguments exist, like the policy: under ZeRO-3 from_pretrained builds it inside
    zero.Init, partitioned, and TRL wraps it with the engine's config (trl.models.prepare_deepspeed)."""
    if objectives.get(recipe.objective).reference != "preference" or recipe.preference.reference.mode != "model":
        return None
    from finetune.builtin import resolve_model_path
    from finetune.train.model import load_model

    source = recipe.preference.reference.name_or_path
    reference = load_model(recipe, resolve_model_path(source) if source else model_path)
    reference.eval()
    return reference


def _counting_pairs(trainer_class):
    """`trainer_class` counting the tokens of batches without `input_ids` (ORPO, CPO/SimPO: chosen_* and
    rejected_*), which transformers' Trainer skips with a warning every step: the run then ended with
    "0 tokens/s" and a report of 0 tokens trained (issue 24). Non-padding tokens of both answers, each
    with its prompt, as the Trainer counts a DPO batch."""

    class Counted(trainer_class):
        def _track_num_input_tokens(self, inputs):
            if not hasattr(inputs, "items"):
                # GRPO's batch is its raw prompt rows (a list): the tokens are generated inside the step, and
                # TRL logs their count (completions/mean_length); transformers would warn here every step.
                return
            masks = [value for key, value in inputs.items()
                     if key.endswith("attention_mask") and not key.startswith("prompt")]
            if "input_ids" in inputs or not masks or self.args.include_num_input_tokens_seen == "no":
                return super()._track_num_input_tokens(inputs)
            import torch

            seen = torch.as_tensor(sum(int(m.sum()) for m in masks), device=self.args.device, dtype=torch.int64)
            self.state.num_input_tokens_seen += self.accelerator.gather(seen).sum().item()

    Counted.__name__ = Counted.__qualname__ = trainer_class.__name__
    return Counted


def padded(rows: list[list[int]], pad_id: int) -> dict[str, Any]:
    """Token rows right-padded with an attention mask: the batch final_logits.safetensors is computed on."""
    import torch

    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, :len(r)] = 1
    return {"input_ids": ids, "attention_mask": mask}


def _answered_sequence(row: dict[str, Any]) -> list[int]:
    if "chosen_input_ids" in row:  # ORPO/CPO tokenize prompt + chosen as one sequence
        return list(row["chosen_input_ids"])
    answer = row["chosen_ids"] if "chosen_ids" in row else row["completion_ids"]  # DPO / KTO: answer alone
    if "prompt_ids" not in row:  # RewardTrainer tokenizes prompt + chosen as one sequence
        return list(answer)
    return list(row["prompt_ids"]) + list(answer)


# ------------------------------------------------------------------------------------------------
# Summary


def metric_summary(log_history: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """{metric: {first, last}} of the preference metrics the trainer logged during training (not eval)."""
    out: dict[str, dict[str, float]] = {}
    for entry in log_history:
        if "loss" not in entry:
            continue
        for key, value in entry.items():
            if not (key.startswith(METRIC_PREFIXES) or key in METRIC_NAMES) or not isinstance(value, (int, float)):
                continue
            slot = out.setdefault(key, {"first": float(value)})
            slot["last"] = float(value)
    return out


def summary_line(metrics: dict[str, dict[str, float]]) -> str:
    parts = [f"{name} {metrics[name]['first']:.3f} -> {metrics[name]['last']:.3f}"
             for name in ("rewards/margins", "rewards/accuracies", "reward", "kl", "completions/mean_length",
                          "accuracy", "margin") if name in metrics]
    return ", ".join(parts) or "no reward metrics logged"


# ------------------------------------------------------------------------------------------------
# The steps (finetune.train.objective_steps)


class TrlSteps:
    """The steps of a TRL objective's run; a subclass sets `config_kwargs` and changes what its objective does
    differently (finetune.train.grpo, finetune.train.reward)."""

    host_counts = False  # TRL's trainers collate their own batches: the Trainer counts their tokens

    def __init__(self, recipe: Recipe, run_dir: Path):
        self.recipe, self.run_dir = recipe, run_dir
        self.peft_config = self.ref_model = None

    def config_kwargs(self) -> dict[str, Any]:
        raise NotImplementedError

    def arguments(self, training_arguments_class, kwargs: dict[str, Any]):
        """TRL's config class (a TrainingArguments subclass) with the objective's keys."""
        return trl_classes(self.recipe)[0](**{**kwargs, **self.config_kwargs()})

    def datasets(self, tokenizer, model_path: str, is_main: bool, args_kwargs: dict[str, Any], on_cpu: bool):
        """Raw rows: TRL's trainer tokenizes them (chat template, EOS, truncation) and collates."""
        return split_rows(self.recipe)

    def load_model(self, model_path: str, tokenizer):
        from finetune.train.model import load_model

        return load_model(self.recipe, model_path)

    def prepare(self, model, model_path: str):
        """The adapter is TRL's to add (peft_config), or continued from model.adapter; maybe a reference model."""
        model, self.peft_config, self.ref_model = prepare_policy(model, self.recipe, model_path)
        return model

    def trainer_kwargs(self) -> dict[str, Any]:
        """What the objective's trainer takes beyond the common arguments."""
        return {"ref_model": self.ref_model} if objectives.get(self.recipe.objective).reference == "preference" else {}

    def make_trainer(self, model, args, train_set, eval_set, tokenizer, callbacks, model_path: str):
        trainer_class = _counting_pairs(trl_classes(self.recipe)[1])
        return trainer_class(model=model, args=args, train_dataset=train_set, eval_dataset=eval_set,
                             processing_class=tokenizer, callbacks=callbacks, peft_config=self.peft_config,
                             **self.trainer_kwargs())

    def first_sequences(self, dataset, tokenizer, size: int) -> list[list[int]]:
        """prompt + chosen (kto: prompt + completion) of the first tokenized rows, as the SFT runner's first
        training sequences are."""
        return [_answered_sequence(dataset[i]) for i in range(min(size, len(dataset)))]

    def fixed_batch(self, trainer, train_set, pad_token_id: int, size: int, tokens: int) -> dict[str, Any]:
        rows = self.first_sequences(trainer.train_dataset, trainer.processing_class, size)
        return padded([r[:min(self.recipe.data.max_length, tokens)] for r in rows], pad_token_id)

    def save_beside_tokenizer(self, folder: Path) -> None:
        pass

    def summary_extra(self, log_history: list[dict[str, Any]]) -> dict[str, Any]:
        """summary.json's keys for the objective: which one, and the preference metrics' first and last values."""
        return {"objective": self.recipe.objective, "preference_metrics": metric_summary(log_history)}

    def summary_line(self, summary: dict[str, Any]) -> Optional[str]:
        return summary_line(summary["preference_metrics"]) if summary.get("preference_metrics") else None


class PreferenceSteps(TrlSteps):
    def config_kwargs(self) -> dict[str, Any]:
        return config_kwargs(self.recipe)
