"""One definition of each thing in the package (issue 10): found by reading the source, since a second
copy works just as well as the first until the two drift apart."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "finetune"
MODULES = sorted(PACKAGE.rglob("*.py"))


def _trees():
    for path in MODULES:
        yield path.relative_to(PACKAGE.parent).as_posix(), ast.parse(path.read_text(encoding="utf-8"), str(path))


@pytest.mark.parametrize("name", ["Checkpoint"])
def test_one_class_of_the_name(name):
    defined = [where for where, tree in _trees() for node in ast.walk(tree)
               if isinstance(node, ast.ClassDef) and node.name == name]
    assert defined == ["finetune/checkpoint.py"]
