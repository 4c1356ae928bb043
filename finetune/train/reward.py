"""objective reward inside the per-rank runner (finetune.train.runner): a reward model trained with TRL's
RewardTrainer on prompt/chosen/rejected rows, through the steps of every TRL objective
(finetune.train.preference.TrlSteps). What differs: the model is the base with a one-score head (sequence
classification), and TRL's config reads only the length limit.
"""

from __future__ import annotations

from typing import Any

from finetune.recipe import Recipe
from finetune.train.preference import TrlSteps


def config_kwargs(recipe: Recipe) -> dict[str, Any]:
    """RewardConfig: the length limit; the loss is Bradley-Terry, with nothing to choose."""
    return {"max_length": recipe.data.max_length}


def load_reward_model(recipe: Recipe, model_path: str, pad_token_id: int):
    """The base model with a one-score head (AutoModelForSequenceClassification, num_labels 1, as TRL's
    RewardTrainer wants it). The head reads the last non-pad token, so the config needs the pad id."""
    from transformers import AutoModelForSequenceClassification

    from finetune.train.model import model_kwargs

    model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=1, **model_kwargs(recipe))
    model.config.pad_token_id = pad_token_id
    return model


class RewardSteps(TrlSteps):
    def config_kwargs(self) -> dict[str, Any]:
        return config_kwargs(self.recipe)

    def load_model(self, model_path: str, tokenizer):
        return load_reward_model(self.recipe, model_path, tokenizer.pad_token_id)
