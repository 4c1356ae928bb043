"""The DeepSpeed checker's shape (finetune/lint/deepspeed/): registered functions over a read-only view of the
config, in ordered phases. What they find is tests/lint/test_deepspeed.py's business; this is how."""

from __future__ import annotations

import ast
import copy
import dataclasses
from pathlib import Path

import pytest

from finetune.lint.deepspeed import DSContext, check_config, view
from finetune.recipe.yamlio import load_json

CORPUS = Path(__file__).parents[1] / "ds_corpus"
RULE_MODULES = ("structure", "setup", "optimizer", "auto")


def test_every_phase_has_rules_and_each_phase_lives_in_one_module():
    """Within a phase the rules run in the order their module defines them: one module per phase keeps
    that order readable from one file."""
    for phase in view.PHASES:
        rules = view._RULES[phase]
        assert rules, phase
        assert len({fn.__module__ for fn in rules}) == 1, (phase, [fn.__module__ for fn in rules])
    assert {fn.__module__.rpartition(".")[2] for rules in view._RULES.values() for fn in rules} == set(RULE_MODULES)


def test_rule_modules_hold_functions_not_state():
    """No checker object sharing mutable state between rule files: the rule modules define no class."""
    package = Path(view.__file__).parent
    for name in RULE_MODULES:
        tree = ast.parse((package / f"{name}.py").read_text(encoding="utf-8"))
        assert not [node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)], name
        assert "self" not in {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}, name


def test_the_view_is_read_only_and_the_config_is_left_as_it_was():
    config = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"}
    seen = view.ConfigView.of(config, DSContext())
    with pytest.raises(dataclasses.FrozenInstanceError):
        seen.stage = 3  # type: ignore[misc]
    for path in sorted(CORPUS.glob("*.json")):
        doc = load_json(path.read_text(), str(path))
        before = copy.deepcopy(doc.data)
        for ctx in (DSContext(world_size=2), DSContext(world_size=2, hf_integration=False)):
            check_config(doc.data, ctx)
        assert doc.data == before, path.name
