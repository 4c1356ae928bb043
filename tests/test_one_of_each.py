"""One definition of each thing in the package (issue 10): found by reading the source, since a second
copy works just as well as the first until the two drift apart."""

from __future__ import annotations

import ast
import re
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
    assert defined == ["finetune/rundir/checkpoint.py"]


def test_the_builtin_prefix_is_spelled_in_one_place():
    """Everything else asks finetune.builtin (is_builtin, builtin_name, BUILTIN_PREFIX)."""
    spelled = [f"{where}:{node.lineno}" for where, tree in _trees() for node in ast.walk(tree)
               if isinstance(node, ast.Constant) and node.value == "builtin:"]
    assert [place.split(":")[0] for place in spelled] == ["finetune/builtin.py"], spelled


def test_the_collectives_have_one_home():
    """torch.distributed is imported only by finetune/train/dist.py (the runner and the preemption
    callback share its barrier, all_gather and rank helpers)."""
    importers = set()
    for where, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import) and any(a.name == "torch.distributed" for a in node.names):
                importers.add(where)
            if isinstance(node, ast.ImportFrom) and node.module == "torch" and any(a.name == "distributed" for a in node.names):
                importers.add(where)
    assert importers == {"finetune/train/dist.py"}


def test_no_private_name_is_imported_from_another_module():
    private = [f"{where}:{node.lineno} {node.module}.{alias.name}" for where, tree in _trees() for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("finetune")
               for alias in node.names if alias.name.startswith("_") and not alias.name.startswith("__")]
    assert private == []


def test_every_reader_of_a_builtin_name_answers_alike():
    from finetune.plan.from_recipe import resolve_model
    from finetune.plan.setup import PlanError
    from finetune.run.preflight import Preflight, model_step
    from tests.conftest import hub_recipe

    unknown = r"unknown built-in model `builtin:tiny-gpt` \(known: builtin:tiny-llama\)"
    with pytest.raises(PlanError, match=unknown):
        resolve_model("builtin:tiny-gpt")
    result = Preflight()
    model_step(hub_recipe(model={"name_or_path": "builtin:tiny-gpt"}), result)
    assert len(result.errors) == 1 and re.search(unknown, result.errors[0])
    arch, params, _ = resolve_model("builtin:tiny-llama")
    assert arch.name == "builtin:tiny-llama" and params > 0
