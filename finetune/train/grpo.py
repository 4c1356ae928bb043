"""objective grpo inside the per-rank runner (finetune.train.runner): the steps of every TRL objective
(finetune.train.preference.TrlSteps), with the reward functions handed to TRL's GRPOTrainer, a few completions
written for report.html, and the prompts as the batch final_logits.safetensors is computed on.

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
from finetune.train.preference import TrlSteps


def config_kwargs(recipe: Recipe) -> dict[str, Any]:
    """GRPOConfig: TRL 1.16 has no prompt limit (data.max_length is not passed); the rewards' weights go in
    reward_weights, in the order of the reward functions (`reward_functions`)."""
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


def reward_functions(recipe: Recipe) -> list[Callable]:
    """The recipe's rewards as TRL calls them, each under its own name (TRL logs `rewards/<name>/mean`);
    their weights go to GRPOConfig.reward_weights in the same order (`config_kwargs`)."""
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


SAMPLES_PER_STEP = 4  # completions written to RUN/completions.jsonl (finetune.train.report.SAMPLES_FILE) per step


def completion_samples(run_dir, max_steps: int):
    """A TrainerCallback (rank 0) that appends SAMPLES_PER_STEP completions of the step's generation batch,
    with each reward and the advantage, to RUN/completions.jsonl at the first step, every quarter of the run and
    the last: what report.html shows beside the reward curves. It reads GRPOTrainer's `_logs` (the last
    generation batch, gathered from every rank: trl 1.16 grpo_trainer.py), set as `.trainer` after creation."""
    import json
    from pathlib import Path

    from transformers import TrainerCallback

    from finetune.rewards import text_of
    from finetune.train.report import SAMPLES_FILE

    every = max(1, max_steps // 4)

    class CompletionSamples(TrainerCallback):
        trainer = None

        def on_log(self, args, state, control, logs=None, **kwargs):
            step = state.global_step
            logs_of = getattr(self.trainer, "_logs", None)
            if not state.is_world_process_zero or logs_of is None or "reward" not in (logs or {}):
                return
            if step != 1 and step % every and step != max_steps:
                return
            prompts, completions = list(logs_of["prompt"]), list(logs_of["completion"])
            rewards = {name: list(values) for name, values in logs_of["rewards"].items()}
            advantages = list(logs_of["advantages"])
            with open(Path(run_dir) / SAMPLES_FILE, "a", encoding="utf-8") as handle:
                for i in range(min(SAMPLES_PER_STEP, len(completions))):
                    handle.write(json.dumps({
                        "step": step, "prompt": text_of(prompts[i])[-300:], "completion": text_of(completions[i])[:300],
                        "rewards": {name: values[i] for name, values in rewards.items() if i < len(values)},
                        "advantage": advantages[i] if i < len(advantages) else None}) + "\n")

    return CompletionSamples()


class GrpoSteps(TrlSteps):
    def config_kwargs(self) -> dict[str, Any]:
        return config_kwargs(self.recipe)

    def trainer_kwargs(self) -> dict[str, Any]:
        return {**super().trainer_kwargs(), "reward_funcs": reward_functions(self.recipe)}

    def make_trainer(self, model, args, train_set, eval_set, tokenizer, callbacks, model_path: str):
        samples = completion_samples(self.run_dir, args.max_steps)  # a few completions and their rewards, for report.html
        trainer = super().make_trainer(model, args, train_set, eval_set, tokenizer, [*callbacks, samples], model_path)
        samples.trainer = trainer
        return trainer

    def first_sequences(self, dataset, tokenizer, size: int) -> list[list[int]]:
        """The prompts (GRPO keeps its rows raw; the completions are generated)."""
        return [prompt_ids(dataset[i], tokenizer) for i in range(min(size, len(dataset)))]

    def summary_extra(self, log_history: list[dict[str, Any]]) -> dict[str, Any]:
        out = super().summary_extra(log_history)
        out["mean_reward"] = out["preference_metrics"].get("reward")  # TRL logs `reward`: the weighted sum, mean over the step's completions
        return out
