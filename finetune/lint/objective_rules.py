"""Recipe rules about the objective (R118, R119, R121): the settings it reads, the data and training keys TRL's
trainers ignore, GRPO's rewards and groups. What each objective reads is finetune.objectives' table.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

from finetune import objectives
from finetune.lint.deepspeed.context import RawFinding
from finetune.lint.recipe_rules import written_here, rule
from finetune.recipe import LoadedRecipe

# Which keys of its section each objective reads: training passes exactly these to TRL (each objective's module in
# finetune.train: config_kwargs; tests/test_objectives.py builds the TRL kwargs and compares).
SECTION_KEYS = {o.name: o.keys for o in objectives.OBJECTIVES.values() if o.section}
SECTIONS = sorted({o.section for o in objectives.OBJECTIVES.values() if o.section})


@rule
def objective_keys(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    r = loaded.recipe
    record = objectives.get(r.objective)
    for section in SECTIONS:
        written = loaded.raw.get(section)
        if not isinstance(written, dict) or not written:
            continue
        readers = [o.name for o in objectives.OBJECTIVES.values() if o.section == section]
        if record.section != section:
            yield RawFinding("R118", "error", (section,), f"`{section}` is only read by objective {', '.join(readers)}",
                             f"set objective: {readers[0]}" + (f" (or {', '.join(readers[1:])})" if readers[1:] else "")
                             + ", or remove the section")
            continue
        for key in written:
            if key not in record.keys:
                users = objectives.users_of(section, key)
                yield RawFinding("R118", "error", (section, key),
                                 f"`{section}.{key}` does nothing with objective: {r.objective}"
                                 + (f" (it is read by {', '.join(users)})" if users else ""), "remove it")
    if record.section == "preference":
        loss = r.preference.loss_type
        if "loss_type" in record.keys and loss is not None and loss not in record.losses:
            yield RawFinding("R118", "error", ("preference", "loss_type"), f"loss_type {loss!r} is not a {r.objective} loss",
                             f"use one of {', '.join(record.losses)}")
        if "reference" in record.keys:
            yield from _reference_mode(loaded)


def _reference_mode(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    r = loaded.recipe
    ref = r.preference.reference
    if ref.mode == "adapter_disabled" and r.method == "full":
        yield RawFinding("R118", "error", ("preference", "reference", "mode"),
                         "a full fine-tune has no adapter to switch off: its reference is a second model",
                         "set preference.reference.mode: model (or precomputed)")
    if ref.name_or_path is not None and ref.mode != "model":
        yield RawFinding("R118", "error", ("preference", "reference", "name_or_path"),
                         f"preference.reference.name_or_path is only loaded with mode: model (mode is {ref.mode})",
                         "remove it, or set preference.reference.mode: model")


def _raw(loaded: LoadedRecipe, key: tuple):
    node = loaded.raw
    for part in key:
        node = node.get(part) if isinstance(node, dict) else None
    return node


@rule
def trl_ignored_keys(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    record = objectives.get(loaded.recipe.objective)
    if not record.uses_trl:
        return
    ignored = dict(objectives.TRL_IGNORED)
    if not record.data_formats:
        ignored[("data", "format")] = (f"its rows are recognised by their columns ({'/'.join(record.columns)})")
    # Written by this file (or --set): a DPO recipe may extend an SFT one whose data section it replaces.
    for key, why in ignored.items():
        if written_here(loaded, *key) and _raw(loaded, key) != "auto":  # auto asks for nothing (finetune.plan.auto)
            yield RawFinding("R119", "error", key, f"`{'.'.join(key)}` is not used with objective: "
                             f"{loaded.recipe.objective}: {why}", "remove it")
    data = loaded.recipe.data
    blocks = [("data", "sources", i) for i in range(len(data.sources))] if data.sources else [("data",)]
    for key, block in zip(blocks, data.sources or [data]):
        if record.data_formats and block.format not in record.data_formats:
            yield RawFinding("R116", "error", (*key, "format"),
                             f"objective {record.name} reads formats {', '.join(record.data_formats)}, not {block.format}",
                             f"set format: {record.data_formats[0]}")


_KIND_NAMES = {"messages": "chat messages (through the chat template)", "alpaca": "Alpaca prompts",
               "text": "plain text"}


@rule
def continued_prompt_format(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    """A preference run continuing an SFT run's adapter should prompt as the SFT run trained (issue 34: SFT on
    alpaca, then DPO on text rows, changed the prompt format silently)."""
    from finetune.data.show import prompt_kind, sft_prompt_kind
    from finetune.rundir.errors import RunDirError
    from finetune.rundir.run_dir import RunDir

    r = loaded.recipe
    if objectives.get(r.objective).section != "preference" or r.model.adapter is None:
        return
    adapter = Path(r.model.adapter).expanduser()
    run = next((RunDir(p) for p in (adapter, adapter.parent) if RunDir(p).is_run()), None)
    try:
        before = sft_prompt_kind(run.recipe().data.source_formats()) if run is not None else None
    except RunDirError:
        before = None
    now = prompt_kind(r) if before is not None else None
    if before is None or now is None or before == now or (before == "text" and now == "alpaca"):
        return
    yield RawFinding("R120", "warning", ("model", "adapter"),
                     f"{run.path} trained on {_KIND_NAMES[before]}, these {r.objective} rows are {_KIND_NAMES[now]}: "
                     "the model learns a second prompt format (and chat prompts it with this one)",
                     {"messages": "write the rows' prompt, chosen and rejected as lists of {role, content} messages",
                      "alpaca": "write each text prompt as the Alpaca prompt (### Instruction: ... ### Response:)",
                      "text": "write the rows as plain text"}[before])


@rule
def prompt_format_without_grpo(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    record = objectives.get(loaded.recipe.objective)
    data = loaded.recipe.data
    blocks = [("data", "sources", i) for i in range(len(data.sources))] if data.sources else [("data",)]
    for key, block in zip(blocks, data.sources or [data]):
        if record.name == "sft" and block.format not in record.data_formats:
            users = [o.name for o in objectives.OBJECTIVES.values() if block.format in o.data_formats]
            yield RawFinding("R116", "error", (*key, "format"), f"format {block.format} is read by objective "
                             f"{', '.join(users)} only", f"set objective: {users[0]}, or another format")


# ------------------------------------------------------------------------------------------------
# GRPO (R121): checked without importing anything the recipe names


@rule
def grpo_rewards(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    from finetune.rewards import syntax_problem

    r = loaded.recipe
    if not objectives.get(r.objective).generates:
        return
    rewards = r.grpo.rewards
    if not rewards:
        yield RawFinding("R121", "error", ("grpo", "rewards"), "objective grpo needs at least one reward function",
                         "add grpo.rewards: [{function: exact_match}] or your own `module:function` (README: GRPO)")
    for i, spec in enumerate(rewards):
        key = ("grpo", "rewards", i)
        problem = syntax_problem(spec.function)
        if problem:
            yield RawFinding("R121", "error", (*key, "function"), problem)
            continue
        yield from _reward_settings(loaded, spec, key)
    if rewards and all(s.weight == 0 for s in rewards):
        yield RawFinding("R121", "error", ("grpo", "rewards"), "every reward has weight 0: every completion scores 0 "
                         "and GRPO learns nothing", "give at least one reward a non-zero weight")
    yield from _groups(loaded)


def _reward_settings(loaded: LoadedRecipe, spec, key: tuple) -> Iterator[RawFinding]:
    if spec.weight == 0 and len(loaded.recipe.grpo.rewards) > 1:
        yield RawFinding("R121", "warning", (*key, "weight"), f"reward {spec.function} has weight 0: it is computed "
                         "and logged but does not change the training", "remove it, or give it a weight")
    reads = objectives.REWARD_SETTINGS.get(spec.function, frozenset())
    written = loaded.raw.get("grpo", {}).get("rewards", [])
    item = written[key[-1]] if isinstance(written, list) and key[-1] < len(written) else {}
    for setting in objectives.REWARD_SETTING_KEYS:
        if isinstance(item, dict) and setting in item and setting not in reads:
            yield RawFinding("R121", "warning", (*key, setting), f"`{setting}` is not read by reward {spec.function}",
                             "remove it")
    if spec.function == "regex":
        if spec.pattern is None:
            yield RawFinding("R121", "error", (*key, "pattern"), "reward regex needs a `pattern`")
        else:
            try:
                re.compile(spec.pattern)
            except re.error as exc:
                yield RawFinding("R121", "error", (*key, "pattern"), f"pattern is not a regular expression ({exc})")
    if spec.function == "length" and spec.target is None:
        yield RawFinding("R121", "error", (*key, "target"), "reward length needs a `target` (tokens)")


def _groups(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    if loaded.recipe.world_size is not None:
        for key, message, fix in group_problems(loaded.recipe, loaded.recipe.world_size):
            yield RawFinding("R121", "error", key, message, fix)


def group_problems(r, world: int) -> list[tuple[tuple[str, ...], str, str]]:
    """(key, message, fix) when TRL's GRPOConfig would refuse the batch: a step's generation batch (micro batch
    x accumulation x processes completions), and an evaluation batch (micro batch x processes), must hold
    whole groups of num_generations completions of one prompt. finetune.run.preflight asks again once the
    process count is known."""
    t, n = r.training, r.grpo.num_generations
    out = []
    batch = t.micro_batch_size * t.gradient_accumulation_steps * world
    if batch % n:
        out.append((("grpo", "num_generations"),
                    f"a step generates {batch} completions (micro_batch_size {t.micro_batch_size} x "
                    f"gradient_accumulation_steps {t.gradient_accumulation_steps} x {world} processes), not a "
                    f"multiple of num_generations {n}: TRL refuses it",
                    "make micro_batch_size x gradient_accumulation_steps x processes a multiple of num_generations"))
    if r.data.validation_split > 0 and (t.micro_batch_size * world) % n:
        out.append((("data", "validation_split"),
                    f"evaluation generates micro_batch_size {t.micro_batch_size} x {world} processes completions "
                    f"at once, not a multiple of num_generations {n}: TRL refuses it",
                    "make micro_batch_size x processes a multiple of num_generations, or set validation_split: 0"))
    return out


@rule
def reward_model_adapter(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    r = loaded.recipe
    if objectives.get(r.objective).score_head and r.model.adapter is not None:
        # An SFT adapter is a causal-LM adapter; the reward model is a sequence classifier with a new head.
        yield RawFinding("R120", "error", ("model", "adapter"),
                         "a reward model starts a new score head on its base: an SFT adapter cannot be continued",
                         "merge the SFT run (finetune merge RUN -o DIR) and set model.name_or_path: DIR")


@rule
def grpo_reference_with_adapter(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    r = loaded.recipe
    if objectives.get(r.objective).reference == "beta" and r.model.adapter is not None and r.grpo.beta > 0:
        # trl 1.16 GRPOTrainer: a PEFT policy's reference is the model with its adapter switched off (is_peft_model).
        yield RawFinding("R118", "warning", ("grpo", "beta"),
                         "with model.adapter, GRPO's KL reference is the base model without the SFT adapter "
                         "(TRL switches the adapter off), not the SFT model",
                         "merge the SFT run (finetune merge) and start from it, or set grpo.beta: 0")
