"""What a recorded recipe of an older run directory needs to read as today's: the one table of recipe key changes.

A release that renames or moves a recipe key bumps finetune.rundir.format.FORMAT_VERSION and adds a row here,
MIGRATIONS[v] = the steps that turn a recipe of format v into one of format v + 1. Reading a run's recipe
(finetune.rundir.run_dir.read_recipe_data: chat, eval, merge, resume, the runner) applies the rows from the
recorded version up to today's, before the schema validates it (`extra="forbid"` would otherwise refuse the
old key). No row yet: format 1 is today's.

    MIGRATIONS = {1: (Rename("training.lr", "training.learning_rate"),)}   # the shape of a row (tested)
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Rename:
    """A key moved from `old` to `new` (dotted paths); nothing happens where the recipe lacks `old`."""

    old: str
    new: str

    def apply(self, data: dict[str, Any]) -> None:
        *parents, name = self.old.split(".")
        section = _section(data, parents)
        if section is None or name not in section:
            return
        value = section.pop(name)
        *parents, name = self.new.split(".")
        target = _section(data, parents, create=True)
        if target is not None:
            target.setdefault(name, value)


MIGRATIONS: dict[int, tuple[Rename, ...]] = {}


def migrate(data: dict[str, Any], recorded: int, current: int) -> dict[str, Any]:
    """`data` (a recorded recipe of format `recorded`) as format `current` reads it; `data` itself is unchanged."""
    if recorded >= current:
        return data
    data = copy.deepcopy(data)
    for version in range(recorded, current):
        for step in MIGRATIONS.get(version, ()):
            step.apply(data)
    return data


def _section(data: dict[str, Any], path: list[str], create: bool = False):
    node: Any = data
    for part in path:
        if not isinstance(node, dict):
            return None
        if create and node.get(part) is None:
            node[part] = {}
        node = node.get(part)
    return node if isinstance(node, dict) else None
