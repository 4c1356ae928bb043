"""`finetune data show` for TRL's objectives: one row tokenized by the objective's own TRL code, each sequence it
trains with printed with its trained tokens marked (issue 34: `data show` refused DPO recipes).

    dpo, kto:      TRL's `_prepare_dataset` (prompt ids, then the chosen / rejected / completion ids it trains on)
    orpo, simpo:   TRL's `tokenize_row` (labels -100 over the prompt)
    reward:        TRL's `_prepare_dataset` (chosen and rejected whole: the score head reads the last token)
    grpo:          the prompt as generation sees it (completions are generated; the rewards read the other columns)

TRL's methods are called on a stand-in for the trainer holding the attributes they read (the tokenizer and the
config's lengths), so no model is loaded; tests/train/test_preference.py runs each on the shipped tiny recipes.
"""

from __future__ import annotations

import types
from typing import Any

from finetune import objectives
from finetune.data.show import Shown, ShowError, marked_text, nth_row
from finetune.recipe import Recipe

IGNORE = -100


def show_rows(recipe: Recipe, tokenizer, row_number: int = 1) -> list[Shown]:
    """The sequences one row becomes under the recipe's objective, as TRL tokenizes them."""
    import datasets

    from finetune.data.formats import RowProblem, to_example
    from finetune.train.objective_steps import config_kwargs
    from finetune.train.preference import trl_classes

    row, where, source = nth_row(recipe, row_number)
    try:
        values = to_example(row, source.spec).values
    except RowProblem as exc:
        raise ShowError(f"{where}: {exc}") from None
    if objectives.get(recipe.objective).generates:
        return [_prompt(values, tokenizer, where)]
    config_class, trainer_class = trl_classes(recipe)
    import tempfile

    import warnings

    with tempfile.TemporaryDirectory() as scratch, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TrainingArguments' deprecations: this config only holds lengths
        # Only the config's lengths are read: no device, no mixed precision to check for.
        args = config_class(output_dir=scratch, report_to="none", use_cpu=True, bf16=False, fp16=False,
                            **config_kwargs(recipe))
    datasets.disable_progress_bars()
    one = datasets.Dataset.from_list([values])
    if hasattr(trainer_class, "tokenize_row"):  # orpo, simpo (trl.experimental)
        return _labelled(trainer_class, args, tokenizer, one, where, recipe.data.max_length)
    # calculate_KL: KTO's KL batch pairs each prompt with another row's completion (nothing this row trains on).
    stand_in = types.SimpleNamespace(_tokenizer=tokenizer, calculate_KL=False)
    done = trainer_class._prepare_dataset(stand_in, one, tokenizer, args, "show")
    if len(done) == 0:
        raise ShowError(f"{where}: TRL drops this row (longer than data.max_length {recipe.data.max_length})")
    item = done[0]
    if "prompt_ids" not in item:  # reward: each sequence is scored whole
        return [_shown(f"{where} {name}", tokenizer, item[f"{name}_ids"], [], recipe.data.max_length)
                for name in ("chosen", "rejected")]
    parts = ("chosen", "rejected") if "chosen_ids" in item else ("completion",)
    out = []
    for name in parts:
        label = name if name != "completion" else f"completion ({'desirable' if values.get('label') else 'undesirable'})"
        out.append(_shown(f"{where} {label}", tokenizer, item["prompt_ids"], item[f"{name}_ids"], recipe.data.max_length))
    return out


def _labelled(trainer_class, args, tokenizer, one, where: str, max_length: int) -> list[Shown]:
    """ORPOTrainer / CPOTrainer: the chat template applied as their __init__ does, then tokenize_row on a stand-in
    holding what it reads (their __init__ sets these from the config)."""
    from trl.data_utils import maybe_apply_chat_template, maybe_extract_prompt

    one = one.map(maybe_extract_prompt).map(maybe_apply_chat_template, fn_kwargs={"processing_class": tokenizer})
    stand_in = types.SimpleNamespace(is_encoder_decoder=False, processing_class=tokenizer,
                                     max_length=args.max_length or 512,  # their __init__'s default
                                     max_completion_length=args.max_completion_length)
    stand_in.build_tokenized_answer = types.MethodType(trainer_class.build_tokenized_answer, stand_in)
    item = trainer_class.tokenize_row(stand_in, one[0])
    return [Shown(f"{where} {name}", "pairs", len(item[f"{name}_input_ids"]),
                  sum(1 for x in item[f"{name}_labels"] if x != IGNORE),
                  marked_text(tokenizer, item[f"{name}_input_ids"], item[f"{name}_labels"]),
                  len(item[f"{name}_input_ids"]) >= max_length)
            for name in ("chosen", "rejected")]


def _shown(where: str, tokenizer, prompt: list[int], trained: list[int], max_length: int) -> Shown:
    """prompt + trained ids, cut to max_length as TRL's collators do (keep_start)."""
    ids = (list(prompt) + list(trained))[:max_length]
    labels = ([IGNORE] * len(prompt) + list(trained))[:max_length]
    if not trained:  # a reward model's sequence: scored whole, nothing is a next-token target
        labels = [IGNORE] * len(ids)
    return Shown(where, "pairs", len(ids), sum(1 for x in labels if x != IGNORE), marked_text(tokenizer, ids, labels),
                 len(prompt) + len(trained) > max_length)


def _prompt(values: dict[str, Any], tokenizer, where: str) -> Shown:
    prompt = values["prompt"]
    # As GRPOTrainer tokenizes its prompts (trl 1.16 grpo_trainer.py _tokenize_prompts).
    if isinstance(prompt, list):
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    else:
        ids = tokenizer(text=prompt)["input_ids"]
    others = ", ".join(f"{k}: {str(v)[:60]!r}" for k, v in values.items() if k != "prompt")
    return Shown(f"{where} prompt" + (f" (to the rewards: {others})" if others else ""), "prompts", len(ids), 0,
                 marked_text(tokenizer, ids, [IGNORE] * len(ids)), False)
