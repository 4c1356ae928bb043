"""GRPO and reward models inside the per-rank runner (finetune.train.runner), beside the preference objectives
of finetune.train.preference: what differs is the reward functions handed to TRL's GRPOTrainer, the reward
model's sequence-classification head, and the batch final_logits.safetensors is computed on.

GRPO (trl 1.16 GRPOTrainer): each rank generates its generation batch (micro_batch_size x
gradient_accumulation_steps completions, num_generations per prompt) with transformers' generate, scores every
completion with the recipe's rewards (finetune.rewards), turns the weighted sum into advantages within each
group, and takes the clipped policy-gradient step; with beta > 0 a KL term against the reference (the adapter
switched off for LoRA, a frozen copy for full fine-tunes, which TRL builds from the policy's path and wraps
in a DeepSpeed engine under ZeRO-3). The trainer is a transformers Trainer, so our DeepSpeed config, callbacks,
checkpoints, SIGTERM handling and resume apply unchanged.
"""

from __future__ import annotations

from typing import Any, Callable

from finetune.recipe import Recipe


def reward_functions(recipe: Recipe) -> list[Callable]:
    """The recipe's rewards as TRL calls them, each under its own name (TRL logs `rewards/<name>/mean`);
    their weights go to GRPOConfig.reward_weights in the same order (finetune.train.preference)."""
    from finetune import rewards

    out = []
    for spec, name in zip(recipe.grpo.rewards, rewards.reward_names(recipe.grpo.rewards)):
        fn = rewards.builtin(spec) if rewards.is_builtin(spec.function) else rewards.load_user(spec.function)
        out.append(rewards.named(fn, name))
    return out


def prompt_ids(row: dict[str, Any], tokenizer) -> list[int]:
    """A GRPO row's prompt as the trainer tokenizes it: the chat template with the generation prompt for
    messages, the plain text otherwise."""
    prompt = row["prompt"]
    if isinstance(prompt, list):
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def load_reward_model(recipe: Recipe, model_path: str, pad_token_id: int):
    """objective reward: the base model with a one-score head (AutoModelForSequenceClassification,
    num_labels 1, as TRL's RewardTrainer wants it). The head reads the last non-pad token, so the config
    needs the pad id."""
    from transformers import AutoModelForSequenceClassification

    from finetune.train.model import model_kwargs

    model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=1, **model_kwargs(recipe))
    model.config.pad_token_id = pad_token_id
    return model
