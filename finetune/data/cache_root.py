"""Where finetune keeps what it builds once and reuses: `FINETUNE_CACHE`, by default `~/.cache/finetune`.

    CACHE/models/      the built-in tiny models (finetune.builtin), built on first use
    CACHE/tokenized/   tokenized datasets, one entry per recipe data, tokenizer and version (finetune.data.prepare)

`finetune prepare` on a CPU machine and the launch on the GPUs find the same entries when they share
FINETUNE_CACHE; the launcher passes it to every node (finetune.run.launch.commands.PROPAGATED_ENV).
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    root = os.environ.get("FINETUNE_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "finetune"


def tokenized_root() -> Path:
    """The tokenized cache: what the launcher and `finetune prepare` write and the ranks and `finetune eval` read."""
    return cache_root() / "tokenized"
