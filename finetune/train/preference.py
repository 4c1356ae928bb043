"""TRL's objectives (dpo, orpo, kto, simpo; grpo and reward with finetune.train.grpo) inside the per-rank
runner, with TRL's trainers; which trainer and which recipe keys is finetune.objectives' table.

The runner (finetune.train.runner) stays the spine: the same process group, DeepSpeed config, callbacks,
checkpoints, resume and save_weights. This module only swaps what differs from SFT:

- the arguments class: TRL's config (a TrainingArguments subclass) with the recipe's `preference` keys;
- the data: raw rows (prompt/chosen/rejected, or prompt/completion/label for kto), as text or as chat
  messages. TRL tokenizes them itself (its chat-template handling, EOS, truncation), so no SFT tokenizing;
- the model: a fresh LoRA adapter is handed to TRL as a `peft_config` (TRL wraps the model; the reference is
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
from typing import Any

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


def arguments(recipe: Recipe, training_arguments_class, kwargs: dict[str, Any]):
    """TrainingArguments for sft; TRL's config class (a subclass) with the objective's keys otherwise."""
    if not objectives.get(recipe.objective).uses_trl:
        return training_arguments_class(**kwargs)
    return trl_classes(recipe)[0](**{**kwargs, **config_kwargs(recipe)})


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


def _grpo(recipe: Recipe) -> dict[str, Any]:
    """GRPOConfig: TRL 1.16 has no prompt limit (data.max_length is not passed); the rewards' weights go in
    reward_weights, in the order of the reward functions (finetune.train.grpo.reward_functions)."""
    g = recipe.grpo
    out = {"num_generations": g.num_generations, "max_completion_length": g.max_completion_length,
           "temperature": g.temperature, "beta": g.beta, "loss_type": g.loss_type, "scale_rewards": g.scale_rewards,
           "num_iterations": g.num_iterations, "epsilon": g.epsilon,
           "reward_weights": [float(r.weight) for r in g.rewards], "use_vllm": g.vllm != "off",
           # The runner trains with config.use_cache off (packing masks); generation wants its KV cache.
           "generation_kwargs": {"use_cache": True},
           # The recipe's columns go to the rewards: TRL must not drop the ones the model does not take.
           "remove_unused_columns": False}
    if g.vllm != "off":
        out["vllm_mode"] = g.vllm
    return out


def _reward(recipe: Recipe) -> dict[str, Any]:
    return {"max_length": recipe.data.max_length}


CONFIG_KWARGS = {"dpo": _dpo, "kto": _kto, "orpo": _orpo, "simpo": _simpo, "grpo": _grpo, "reward": _reward}


def config_kwargs(recipe: Recipe) -> dict[str, Any]:
    """The TRL config keys the recipe sets for its objective."""
    return CONFIG_KWARGS[recipe.objective](recipe)


# ------------------------------------------------------------------------------------------------
# Data


def load_rows(recipe: Recipe):
    """The objective's rows as a `datasets.Dataset` in TRL's column names (finetune.data.preference: the row
    formats preflight checked every local row with, sources mixed like SFT's)."""
    from finetune.data.preference import load_rows as read

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
    from finetune.rundir.run_dir import find_adapter, no_adapter_message

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


def make_trainer(recipe: Recipe, model, ref_model, peft_config, args, train_set, eval_set, tokenizer, callbacks):
    _, trainer_class = trl_classes(recipe)
    trainer_class = _counting_pairs(trainer_class)
    kwargs: dict[str, Any] = {"model": model, "args": args, "train_dataset": train_set, "eval_dataset": eval_set,
                              "processing_class": tokenizer, "callbacks": callbacks, "peft_config": peft_config}
    if objectives.get(recipe.objective).reference == "preference":
        kwargs["ref_model"] = ref_model
    if recipe.objective == "grpo":
        from finetune.train.grpo import reward_functions

        kwargs["reward_funcs"] = reward_functions(recipe)
    return trainer_class(**kwargs)


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


def fixed_batch(trainer, pad_id: int, size: int, max_length: int) -> dict[str, Any]:
    """prompt + chosen (kto: prompt + completion; grpo: the prompt) of the first tokenized rows, right-padded:
    the batch final_logits.safetensors is computed on, as the SFT runner's first training sequences are."""
    import torch

    dataset = trainer.train_dataset
    if "prompt" in dataset.column_names and "prompt_ids" not in dataset.column_names:  # GRPO keeps raw prompts
        from finetune.train.grpo import prompt_ids

        tokens = [prompt_ids(dataset[i], trainer.processing_class) for i in range(min(size, len(dataset)))]
    else:
        tokens = [_answered_sequence(dataset[i]) for i in range(min(size, len(dataset)))]
    rows = [t[:max_length] for t in tokens]
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


def summary_extra(recipe: Recipe, log_history: list[dict[str, Any]]) -> dict[str, Any]:
    """summary.json's keys for the objective: which one, and the preference metrics' first and last values."""
    if not objectives.get(recipe.objective).uses_trl:
        return {"objective": recipe.objective}
    metrics = metric_summary(log_history)
    out = {"objective": recipe.objective, "preference_metrics": metrics}
    if recipe.objective == "grpo":  # TRL logs `reward`: the weighted sum, mean over the step's completions
        out["mean_reward"] = metrics.get("reward")
    return out


def summary_line(metrics: dict[str, dict[str, float]]) -> str:
    parts = [f"{name} {metrics[name]['first']:.3f} -> {metrics[name]['last']:.3f}"
             for name in ("rewards/margins", "rewards/accuracies", "reward", "kl", "completions/mean_length",
                          "accuracy", "margin") if name in metrics]
    return ", ".join(parts) or "no reward metrics logged"
