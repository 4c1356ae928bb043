"""`finetune init`: a starter recipe for a model and a data file (issue 24: your own data in five minutes).

The data format is read off the file's first row (the columns each format reads, or the names other data
sets give them: finetune.data.formats.SYNONYMS), so the recipe is right before anything is trained; the
rest are the documented defaults, written out where a newcomer will want to change them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Optional

from finetune.errors import FinetuneError


class StarterError(FinetuneError, ValueError):
    """Why no recipe can be written (one line)."""


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
                   method: str = "lora", tiny: bool = False) -> str:
    """The YAML text of a recipe in `recipe_path` that trains `model` on `data` (`tiny`: a built-in model,
    trained on a CPU)."""
    relative = os.path.relpath(Path(data).absolute(), Path(recipe_path).absolute().parent)
    if not relative.startswith((".", "/")):
        relative = "./" + relative  # a path, never read as a hub id
    flow = ", ".join(f"{k}: {v}" for k, v in columns.items())
    lines = [
        f"# Written by `finetune init` for {data} (format {fmt}, read off its first row).",
        "# Only what differs from the documented defaults is here (README: Recipe reference). Next:",
        f"#   finetune lint {recipe_path} && finetune data show {recipe_path}",
        f"#   finetune plan {recipe_path} --gpus 1 --gpu-memory 24GiB",
        f"#   finetune train {recipe_path}",
        f"name: {Path(recipe_path).stem}",
        "model:",
        f'  name_or_path: "{model}"' + ("   # quoted: a `builtin:` name holds a colon" if tiny else ""),
        "  dtype: " + ("float32            # a CPU has no fast bf16; the built-in model is tiny" if tiny else "bfloat16"),
        f"method: {method}",
        "data:",
        f"  path: {relative}",
        f"  format: {fmt}",
    ]
    if columns:
        lines.append(f"  columns: {{{flow}}}   # the format's column: this file's column")
    lines += [
        f"  max_length: {128 if tiny else 2048}         # tokens per example; longer ones are cut",
        "training:",
        "  epochs: 1",
        "  micro_batch_size: 4" if tiny else "  micro_batch_size: 1",
        "  gradient_accumulation_steps: 1" if tiny else "  gradient_accumulation_steps: 8",
        "  learning_rate: " + ("3.0e-3" if tiny else "2.0e-4"),
        "deepspeed:",
        "  stage: 2",
    ]
    if tiny:
        lines += ["launch:", "  cpu_procs: 2               # without a GPU: two CPU processes"]
    return "\n".join(lines) + "\n"
