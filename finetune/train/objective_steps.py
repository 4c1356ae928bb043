"""Which module of finetune.train trains an objective: finetune.objectives names it (`Objective.train_module`),
and each holds a steps class the runner (finetune.train.runner) calls in the same order:

    sft.py          sft
    preference.py   dpo, orpo, kto, simpo (and `TrlSteps`, what every TRL objective shares)
    grpo.py         grpo: reward functions, generated completions
    reward.py       reward: a one-score head

The steps: `arguments` (TrainingArguments or TRL's config), `datasets` (train, eval), `load_model`, `prepare`
(adapter, reference), `make_trainer`, `fixed_batch` (for final_logits.safetensors), `save_beside_tokenizer`,
`summary_extra` and `summary_line` (summary.json and the console), with `host_counts` (who counts the tokens).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from finetune import objectives
from finetune.recipe import Recipe
from finetune.train import grpo, preference, reward, sft

STEPS = {"sft": sft.SftSteps, "preference": preference.PreferenceSteps, "grpo": grpo.GrpoSteps,
         "reward": reward.RewardSteps}


def steps_of(recipe: Recipe, run_dir: Optional[Path] = None):
    """The steps of the recipe's objective, for one run."""
    return STEPS[objectives.get(recipe.objective).train_module](recipe, run_dir)


def config_kwargs(recipe: Recipe) -> dict[str, Any]:
    """The TRL config keys the recipe sets for its objective (none for sft)."""
    return steps_of(recipe).config_kwargs()
