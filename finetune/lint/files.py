"""Which files `finetune lint DIR` reads: recipes and DeepSpeed configs, not what finetune wrote or other JSON.

A project folder holds runs/ and merged/ beside its recipes: `finetune lint .` read every JSON there as a DeepSpeed
config (a tokenizer's, a model's config.json, trainer_state.json: 123 files, 259 errors, issue 34). Walking a folder,
lint now skips
- run directories (recipe.yaml with the run's deepspeed.json and training_args.json) and merged models
  (finetune_recipe.yaml) below the folder it was given: finetune's output; name one to lint it,
- JSON that is not a DeepSpeed config: not an object, or an object whose top-level keys are mostly not DeepSpeed's.
A file named on the command line is always linted.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from finetune.suggest import NEAR, closest

RECIPE_SUFFIXES = (".yaml", ".yml")
DS_SUFFIXES = (".json",)
_READ_LIMIT = 4 * 1024 * 1024  # a DeepSpeed config is a few KB; a larger JSON in a folder is data
# What a folder walk skips: (one, several).
RUN = ("run directory", "run directories")
MERGED = ("merged model", "merged models")
OTHER_JSON = ("JSON file that is not a DeepSpeed config", "JSON files that are not DeepSpeed configs")


@dataclass
class Found:
    files: list[Path] = field(default_factory=list)
    skipped: dict[tuple[str, str], int] = field(default_factory=dict)  # what was skipped -> how many

    def skip(self, what: tuple[str, str]) -> None:
        self.skipped[what] = self.skipped.get(what, 0) + 1


def discover(paths: Iterable[Path]) -> Found:
    """Files to lint: the given files, and recipes/configs found recursively in given directories."""
    found = Found()
    for path in paths:
        path = Path(path)
        if not path.is_dir():
            found.files.append(path)
            continue
        for root, dirs, files in os.walk(path):
            here = Path(root)
            kept = []
            for name in sorted(dirs):
                if name.startswith((".", "__")) or name == "node_modules":
                    continue
                kind = output_kind(here / name)
                if kind:
                    found.skip(kind)
                else:
                    kept.append(name)
            dirs[:] = kept
            for name in sorted(files):
                if name.startswith(".") or not name.endswith(RECIPE_SUFFIXES + DS_SUFFIXES):
                    continue
                if name.endswith(DS_SUFFIXES) and not looks_like_deepspeed(here / name):
                    found.skip(OTHER_JSON)
                    continue
                found.files.append(here / name)
    found.files = list(dict.fromkeys(found.files))
    return found


def output_kind(folder: Path) -> tuple[str, str] | None:
    """RUN or MERGED for a folder finetune wrote, else None."""
    from finetune.rundir.names import MERGED_RECIPE, RUN_INPUTS

    try:
        if all((folder / name).is_file() for name in RUN_INPUTS):
            return RUN
        if (folder / MERGED_RECIPE).is_file():
            return MERGED
    except OSError:
        return None
    return None


def looks_like_deepspeed(path: Path) -> bool:
    """Whether a JSON file found in a folder is meant as a DeepSpeed config: at least half of its top-level keys are
    DeepSpeed's (or a misspelling of one). A file that does not parse counts when it names a DeepSpeed section."""
    from finetune.lint.deepspeed.schema import COMMON_MISNAMES, INTERNAL_NAMES, REMOVED_TOP, TOP

    try:
        if path.stat().st_size > _READ_LIMIT or not path.is_file():
            return False
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    known = set(TOP) | set(REMOVED_TOP) | set(COMMON_MISNAMES) | set(INTERNAL_NAMES)
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return any(f'"{key}"' in text for key in TOP)
    if not isinstance(data, dict) or not data:
        return False
    ours = [k for k in data if k in known or closest(k, TOP, cutoff=NEAR)]
    return 2 * len(ours) >= len(data)


def skipped_text(skipped: dict[tuple[str, str], int]) -> str:
    """'skipped 2 run directories, 1 merged model, ...' (empty when nothing was skipped)."""
    if not skipped:
        return ""
    parts = [f"{n} {one if n == 1 else several}" for (one, several), n in skipped.items()]
    return "skipped " + ", ".join(parts) + " (name a file or folder to lint it)"
