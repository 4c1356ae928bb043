"""What a recipe's model and data references name: a local path or a hub id.

Preflight reads local data and model directories and asks the hub about the rest; the run directory
(finetune.rundir.layout) records local paths absolute. Both decide with these functions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from finetune.errors import FinetuneError

DATA_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv")  # the data file types finetune reads
MODEL_CONFIG = "config.json"  # transformers' CONFIG_NAME: what makes a folder a model directory
BUILTIN_PREFIX = "builtin:"  # a built-in tiny model (finetune.builtin): the one spelling of the prefix


def is_local(reference: str) -> bool:
    """A local path rather than a hub id (`org/name`). The recipe loader made existing relative paths absolute."""
    p = Path(reference).expanduser()
    return p.is_absolute() or reference.startswith(("./", "../", "~")) or p.suffix in DATA_SUFFIXES or p.exists()


def is_model_path(reference: str) -> bool:
    p = Path(reference).expanduser()
    return p.is_absolute() or reference.startswith(("./", "../", "~")) or p.exists()


class NotAModelDir(FinetuneError):
    """A local path given as a model that is not a transformers model directory: `require_model_dir`'s message."""


def model_dir_problem(path: Union[str, Path]) -> Optional[str]:
    """Why PATH is not a transformers model directory (the one test and wording of preflight, chat, eval and
    merge), or None when it is one."""
    path = Path(path).expanduser()
    try:
        if not path.exists():
            return "directory does not exist"
        if not path.is_dir():
            return f"expected a model directory (with {MODEL_CONFIG}), got a file"
        if not (path / MODEL_CONFIG).is_file():
            return f"no {MODEL_CONFIG} in this directory (is it a Hugging Face model folder?)"
    except OSError as exc:  # a name too long to stat, a folder that cannot be listed
        return f"cannot be read ({exc.strerror})"
    return None


def is_model_dir(path: Union[str, Path]) -> bool:
    return model_dir_problem(path) is None


def require_model_dir(path: Union[str, Path], what: str = "model", hint: str = "") -> Path:
    """PATH, or NotAModelDir: `WHAT PATH: why; hint` (what: "base model", "model.name_or_path", ...)."""
    problem = model_dir_problem(path)
    if problem is not None:
        raise NotAModelDir(f"{what} {path}: {problem}" + (f"; {hint}" if hint else ""))
    return Path(path).expanduser()


def recipe_paths(recipe) -> list[tuple[tuple, str]]:
    """(key, path) of every local file or folder a validated recipe names for a command to read: the model,
    tokenizer, adapter and reference model, each data source, the hostfile, NVMe swap folder and reward files
    (`extends` is read by the loader itself)."""
    model, data = recipe.model, recipe.data
    named = [(("model", "name_or_path"), model.name_or_path), (("model", "tokenizer"), model.tokenizer),
             (("model", "adapter"), model.adapter), (("launch", "hostfile"), recipe.launch.hostfile),
             (("deepspeed", "nvme_path"), recipe.deepspeed.nvme_path),
             (("preference", "reference", "name_or_path"), recipe.preference.reference.name_or_path)]
    sources = data.sources
    named += [(("data", "sources", i, "path"), s.path) for i, s in enumerate(sources)] if sources else [(("data", "path"), data.path)]
    for i, reward in enumerate(recipe.grpo.rewards):
        file = reward.function.rpartition(":")[0]
        if file.endswith(".py"):
            named.append((("grpo", "rewards", i, "function"), file))
    return [(key, value) for key, value in named if value and is_model_path(value)]  # `builtin:` names are not paths
