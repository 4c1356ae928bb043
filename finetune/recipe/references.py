"""What a recipe's model and data references name: a local path or a hub id.

Preflight reads local data and model directories and asks the hub about the rest; the run directory
(finetune.rundir.layout) records local paths absolute. Both decide with these functions.
"""

from __future__ import annotations

from pathlib import Path

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
