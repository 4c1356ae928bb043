"""The format version of a run directory: RUN/format.json, written with the run's other inputs
(finetune.rundir.layout.run_files), copied beside the recipe into a merged model (finetune_format.json).

A release that changes how a run directory reads back (a recipe key renamed or moved) bumps FORMAT_VERSION and
registers the change in finetune.recipe.migrations, so that run directories written before it still load:
chat, eval, merge and resume read a recorded recipe through finetune.rundir.run_dir.read_recipe_data, which
applies the migrations from the recorded version on. A run directory of a version newer than this finetune knows
is refused with one line (it may hold keys this version would misread), never half-read.

Run directories written before this file existed (finetune 0.1.0 up to issue 39) have no format.json: format 1,
the format tests/fixtures/rundirs/2026-11-27 keeps.
"""

from __future__ import annotations

import json
from pathlib import Path

from finetune.errors import FinetuneError
from finetune.rundir.names import FORMAT_FILE, MERGED_FORMAT, MERGED_RECIPE

FORMAT_VERSION = 1
UNVERSIONED = 1  # a run directory without format.json


class FormatProblem(FinetuneError):
    """The format file cannot be read, or names a newer format (the readers raise it as their own error type)."""


def format_text() -> str:
    return json.dumps({"format_version": FORMAT_VERSION}) + "\n"


def format_file(recipe_path: Path) -> Path:
    """The format file that describes a recorded recipe: RUN/format.json, or finetune_format.json beside a merged
    model's finetune_recipe.yaml."""
    return recipe_path.with_name(MERGED_FORMAT if recipe_path.name == MERGED_RECIPE else FORMAT_FILE)


def recorded_version(recipe_path: Path) -> int:
    """The format version of the run directory (or merged model) that holds `recipe_path`; FormatProblem, one
    line, when the file cannot be read or names a version newer than this finetune reads."""
    path = format_file(Path(recipe_path))
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return UNVERSIONED
    except (OSError, ValueError) as exc:
        raise FormatProblem(f"{path}: cannot read the run directory's format: {exc}") from None
    try:
        version = json.loads(text)["format_version"]
    except (ValueError, TypeError, KeyError):
        version = None
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise FormatProblem(f"{path}: cannot read the run directory's format: expected {format_text().strip()}, "
                          f"got {text.strip()[:80]!r}")
    if version > FORMAT_VERSION:
        raise FormatProblem(f"{path.parent}: written by a newer finetune (run directory format {version}; this one reads "
                          f"formats up to {FORMAT_VERSION}): upgrade finetune (pip install -U finetune) to use it")
    return version
