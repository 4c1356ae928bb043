"""`finetune init`: a starter recipe for a model and a data file (issue 24: your own data in five minutes).

The data format is read off the file's first row (the columns each format reads, or the names other data
sets give them: finetune.data.formats.SYNONYMS), so the recipe is right before anything is trained; the
rest are the documented defaults, written out where a newcomer will want to change them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Optional

from finetune import objectives
from finetune.errors import FinetuneError


class StarterError(FinetuneError, ValueError):
    """Why no recipe can be written (one line)."""


def guess_objective(row: Mapping[str, Any]) -> tuple[str, str, dict[str, str]]:
    """(objective, format, columns) that read `row`: prompt/chosen/rejected rows are DPO's, prompt/completion/label
    rows KTO's, a prompt with no answer column GRPO's (issue 34: init trained SFT on `chosen`); else SFT's format."""
    from finetune.data.formats import SYNONYMS

    if not isinstance(row, Mapping):
        raise StarterError(f"the first row is {type(row).__name__}, not an object with named columns")
    keys = set(row)
    prompt = "prompt" if "prompt" in keys else next((k for k in row if k.lower() in SYNONYMS["instruction"]), None)
    renamed = {} if prompt in (None, "prompt") else {"prompt": prompt}
    if prompt and {"chosen", "rejected"} <= keys:
        return "dpo", "alpaca", renamed
    if prompt and {"completion", "label"} <= keys and str(row["label"]).lower() in ("true", "false"):
        return "kto", "alpaca", renamed
    answers = {k for k in row if k == "output" or k.lower() in SYNONYMS["output"]}
    others = keys - {prompt} - answers
    if prompt and not answers and not others & {"text", "messages", "conversations", "input"}:
        return "grpo", "prompt", renamed
    return ("sft", *guess_format(row))


def guess_format(row: Mapping[str, Any]) -> tuple[str, dict[str, str]]:
    """(format, columns) that read `row`: the columns mapping names the row's own column names."""
    from finetune.data.formats import SYNONYMS

    if not isinstance(row, Mapping):
        raise StarterError(f"the first row is {type(row).__name__}, not an object with named columns")
    keys = list(row)

    def pick(name: str, conversation: bool = False) -> Optional[str]:
        for key in keys:
            if key == name or key.lower() in SYNONYMS.get(name, ()):
                if not conversation or isinstance(row[key], (list, str)):
                    return key
        return None

    if "conversations" in row and isinstance(row["conversations"], list):
        return "sharegpt", {}
    chat = pick("messages", conversation=True)
    if chat is not None and isinstance(row[chat], list):
        first = row[chat][0] if row[chat] else {}
        if isinstance(first, Mapping) and "from" in first and "value" in first:
            return "sharegpt", ({} if chat == "conversations" else {"messages": chat})
        return "messages", ({} if chat == "messages" else {"messages": chat})
    instruction, output = pick("instruction"), pick("output")
    if instruction and output:
        columns = {k: v for k, v in (("instruction", instruction), ("output", output)) if k != v}
        return "alpaca", columns
    text = pick("text")
    if text:
        return "text", ({} if text == "text" else {"text": text})
    raise StarterError(f"cannot tell the format from the columns {', '.join(f'`{k}`' for k in keys) or 'none'}: "
                       "alpaca needs instruction + output, messages a list of {role, content}, sharegpt "
                       "`conversations`, text a `text` column (give --format and write `columns:` by hand)")


def starter_recipe(model: str, data: Path, recipe_path: Path, fmt: str, columns: dict[str, str],
                   method: str = "lora", tiny: bool = False, objective: str = "sft", answer: Optional[str] = None,
                   rows: Optional[int] = None) -> str:
    """The YAML text of a recipe in `recipe_path` that trains `model` on `data` (`tiny`: a built-in model,
    trained on a CPU) with `objective` (grpo: rewarded against the `answer` column when the rows have one)."""
    relative = os.path.relpath(Path(data).absolute(), Path(recipe_path).absolute().parent)
    if not relative.startswith((".", "/")):
        relative = "./" + relative  # a path, never read as a hub id
    flow = ", ".join(f"{k}: {v}" for k, v in columns.items())
    record = objectives.get(objective)
    lines = [
        f"# Written by `finetune init` for {data} ("
        + (f"format {fmt}" if record.format_decides else f"objective {objective}: {_ROWS[objective]}") + ", read off its first row).",
        "# Only what differs from the documented defaults is here (README: Recipe reference). Next:",
        f"#   finetune lint {recipe_path} && finetune data show {recipe_path}",
        f"#   finetune plan {recipe_path} --gpus 1 --gpu-memory 24GiB",
        f"#   finetune train {recipe_path}",
        f"name: {Path(recipe_path).stem}",
        "model:",
        f'  name_or_path: "{model}"' + ("   # quoted: a `builtin:` name holds a colon" if tiny else ""),
        "  dtype: " + ("float32            # a CPU has no fast bf16; the built-in model is tiny" if tiny else "bfloat16"),
        f"method: {method}",
    ]
    lines += _objective_lines(objective, answer, tiny)
    lines += ["data:", f"  path: {relative}"] + ([f"  format: {fmt}"] if record.reads_data_format else [])
    if columns:
        lines.append(f"  columns: {{{flow}}}   # the format's column: this file's column")
    lines += [
        f"  max_length: {128 if tiny else 2048}         # tokens per example; longer ones are cut",
        "training:",
        f"  epochs: {epochs_for(rows, objective)}" + (f"                  # {epochs_note(rows, objective)}" if rows else ""),
        "  micro_batch_size: 4" if tiny else "  micro_batch_size: 1",
        "  gradient_accumulation_steps: 1" if tiny else "  gradient_accumulation_steps: 8",
        "  learning_rate: " + _LEARNING_RATES[record.uses_trl][tiny],
        "deepspeed:",
        "  stage: 2",
    ]
    if tiny:
        lines += ["launch:", "  cpu_procs: 2               # without a GPU: two CPU processes"]
    return "\n".join(lines) + "\n"


_ROWS = {"dpo": "prompt/chosen/rejected rows", "kto": "prompt/completion/label rows", "grpo": "prompts only"}
# SFT: LoRA's usual 2e-4 (the tiny random model learns at 3e-3, recipes/demo.yaml). TRL's objectives move a
# trained policy a little: 5e-5 with LoRA (the tiny DPO recipe uses 5e-3).
_LEARNING_RATES = {False: {False: "2.0e-4", True: "3.0e-3"}, True: {False: "5.0e-5", True: "5.0e-3"}}
# An epoch of a small file is a few optimizer steps: the demo learns its 307 rows in 117 steps (3 epochs of 8 rows
# a step: loss 7.1 -> 2.4), so init gives small files the epochs that make about MIN_STEPS steps.
MIN_STEPS = 100
MAX_EPOCHS = 10
ROWS_PER_STEP = 8  # the recipe below: 4 rows x 2 CPU processes (tiny), or 1 row x 8 accumulation on one GPU
GENERATIONS = 8  # grpo: those 8 rows are 8 completions of one prompt


def epochs_for(rows: Optional[int], objective: str = "sft") -> int:
    """Epochs that give `rows` rows about MIN_STEPS optimizer steps (at most MAX_EPOCHS)."""
    if not rows:
        return 1
    return max(1, min(MAX_EPOCHS, -(-MIN_STEPS // steps(rows, 1, objective))))


def steps(rows: int, epochs: int, objective: str = "sft") -> int:
    per_step = ROWS_PER_STEP // GENERATIONS if objectives.get(objective).generates else ROWS_PER_STEP
    return max(1, -(-rows * epochs // per_step))


def epochs_note(rows: int, objective: str = "sft") -> str:
    """`307 rows x 3 = 116 steps`, and why when one epoch would be too few."""
    epochs = epochs_for(rows, objective)
    note = f"{rows} rows x {epochs} = {steps(rows, epochs, objective)} steps"
    if epochs > 1:
        note += f" (1 epoch: {steps(rows, 1, objective)} steps, too few to learn)"
    return note


def _objective_lines(objective: str, answer: Optional[str], tiny: bool) -> list[str]:
    record = objectives.get(objective)
    if objective in objectives.PREFERENCE:
        # The objectives that read the same rows (dpo's: orpo, simpo and reward). The reference is the model with the
        # adapter switched off (LoRA), so no second copy.
        same = [o.name for o in objectives.OBJECTIVES.values() if o.row_format == record.row_format and o is not record]
        return [f"objective: {objective}" + (f"                   # or {', '.join(same)}: the same rows" if same else ""),
                "preference:", "  beta: 0.1"]
    if not record.generates:
        return []
    if answer is None:
        rewards = ["    - {function: length, target: 64}   # a start: replace with your own (README: GRPO)"]
    else:
        rewards = [f"    - {{function: number_match, column: {answer}}}   # the last number of the answer column",
                   f"    - {{function: exact_match, column: {answer}, weight: 0.5}}"]
    return ["objective: grpo", "grpo:",
            f"  num_generations: {GENERATIONS}              # completions per prompt: a step's {ROWS_PER_STEP} rows are one group",
            f"  max_completion_length: {32 if tiny else 256}", "  rewards:", *rewards]
