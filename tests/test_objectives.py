"""finetune.objectives, the one table of objectives: lint's keys are exactly what training passes to TRL, the
TRL names exist, and the rows of TRL's objectives go through the one validation mechanism (mixtures too)."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest

from finetune import objectives
from finetune.lint import LintOptions, lint_paths
from finetune.recipe import Recipe, load_recipe
from finetune.run.preflight import Preflight, dataset_step

# A value other than the default for every key of the objectives' sections.
CHANGED = {
    "preference": {"beta": 0.5, "loss_type": None, "label_smoothing": 0.2, "max_completion_length": 16,
                   "reference": {"mode": "precomputed"}, "simpo_gamma": 1.0, "cpo_alpha": 0.5,
                   "desirable_weight": 2.0, "undesirable_weight": 2.0},
    "grpo": {"num_generations": 4, "max_completion_length": 16, "temperature": 0.7, "beta": 0.04, "loss_type": "grpo",
             "scale_rewards": "none", "num_iterations": 2, "epsilon": 0.1,
             "rewards": [{"function": "exact_match", "weight": 2.0}], "vllm": "colocate"},
}


def _recipe(objective: str, section: dict | None = None) -> Recipe:
    record = objectives.get(objective)
    raw = {"model": {"name_or_path": "m"}, "data": {"path": "d"}, "objective": objective, "method": "full"}
    if section is not None:
        raw[record.section] = section
    return Recipe.model_validate(raw)


@pytest.mark.parametrize("name", [o.name for o in objectives.OBJECTIVES.values() if o.section])
def test_lint_keys_are_exactly_the_keys_training_passes_to_trl(name):
    from finetune.lint.objective_rules import SECTION_KEYS
    from finetune.train.objective_steps import config_kwargs

    record = objectives.get(name)
    base = config_kwargs(_recipe(name))
    read = set()
    for key, value in CHANGED[record.section].items():
        if key == "loss_type" and record.section == "preference":
            value = record.losses[1] if len(record.losses) > 1 else None
            if value is None:
                continue  # orpo and simpo have no loss choice: the schema's values are dpo's and kto's
        if config_kwargs(_recipe(name, {key: value})) != base:
            read.add(key)
    assert read == set(SECTION_KEYS[name]) == set(record.keys), (name, read ^ set(record.keys))


@pytest.mark.parametrize("name", objectives.TRL)
def test_trl_classes_exist_and_take_the_keys(name):
    pytest.importorskip("trl")
    from finetune.train.objective_steps import config_kwargs
    from finetune.train.preference import trl_classes

    config_class, trainer_class = trl_classes(_recipe(name))
    assert (config_class.__name__, trainer_class.__name__) == (objectives.get(name).trl_config,
                                                               objectives.get(name).trl_trainer)
    fields = {f.name for f in dataclasses.fields(config_class)}
    section = CHANGED.get(objectives.get(name).section or "", {})
    kwargs = config_kwargs(_recipe(name, {k: v for k, v in section.items() if k != "loss_type"} if section else None))
    assert set(kwargs) <= fields, set(kwargs) - fields


PACKAGE = Path(__file__).resolve().parent.parent / "finetune"


def _names_objective(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "objective") or \
        (isinstance(node, ast.Attribute) and node.attr == "objective")


def _literal_strings(node: ast.AST) -> bool:
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts)
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def objective_literals(package: Path = PACKAGE) -> list[str]:
    """`file:line` of every comparison of an objective with a name written out (`recipe.objective == "sft"`,
    `objective in ("sft", "grpo")`) outside finetune/objectives.py."""
    found = []
    for path in sorted(package.rglob("*.py")):
        if path == package / "objectives.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            for (left, right), op in zip(zip(sides, sides[1:]), node.ops):
                if isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) and \
                        ((_names_objective(left) and _literal_strings(right)) or
                         (_names_objective(right) and _literal_strings(left))):
                    found.append(f"{path.relative_to(package.parent).as_posix()}:{node.lineno}")
    return found


def test_objectives_are_asked_their_facts_not_compared_with_names():
    """A branch on an objective reads a fact of its record (finetune.objectives: `generates`, `score_head`,
    `pretokenized`, ...): a name written out is a second table that a new objective would have to find."""
    assert objective_literals() == []


def test_the_check_finds_the_comparisons(tmp_path):
    package = tmp_path / "finetune"
    package.mkdir()
    (package / "objectives.py").write_text('objective = "sft"\nassert objective == "sft"\n')
    (package / "a.py").write_text('if recipe.objective == "grpo": pass\nif objective not in ("sft", "grpo"): pass\n'
                                  'if "reward" != r.objective: pass\nif record.generates: pass\n'
                                  'if recipe.objective in objectives.PREFERENCE: pass\n')
    assert objective_literals(package) == ["finetune/a.py:1", "finetune/a.py:2", "finetune/a.py:3"]


def test_schema_lint_plan_and_data_read_the_table():
    from finetune.plan.preference import FUSED_LOGPROB_OBJECTIVES, rows_per_example
    from finetune.recipe.schema import PREFERENCE_OBJECTIVES

    assert Recipe.model_fields["objective"].annotation.__args__ == objectives.NAMES
    assert PREFERENCE_OBJECTIVES == ("dpo", "orpo", "kto", "simpo")
    assert [rows_per_example(o) for o in ("sft", "dpo", "orpo", "kto", "simpo", "grpo", "reward")] == [1, 2, 2, 1, 2, 1, 2]
    assert FUSED_LOGPROB_OBJECTIVES == ("dpo", "kto", "grpo")
    from finetune.data.formats import FORMATS
    from finetune.data import validate  # noqa: F401 - registers the rows of TRL's objectives

    assert {"pairs", "kto", "prompts"} <= set(FORMATS)


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_preference_mixture_is_checked_and_mixed_like_sft(tmp_path):
    a = _write(tmp_path / "a.jsonl", [{"prompt": f"Q{i}", "chosen": "A", "rejected": "B"} for i in range(10)])
    b = _write(tmp_path / "b.jsonl", [{"q": "Q", "good": "A", "bad": "B"}] * 3 + [{"q": "Q", "good": "A"}])
    recipe_path = tmp_path / "r.yaml"
    recipe_path.write_text(f"model: {{name_or_path: org/m}}\nobjective: dpo\ndata:\n  sources:\n"
                           f"    - {{path: {a}, weight: 1}}\n"
                           f"    - {{path: {b}, weight: 0.5, columns: {{prompt: q, chosen: good, rejected: bad}}}}\n")
    assert [f for f in lint_paths([recipe_path], LintOptions()).findings if f.severity == "error"] == []
    result = Preflight()
    dataset_step(load_recipe(recipe_path).recipe, result)
    assert result.errors == [f"dataset {b}:4: no `bad` column (prompt/chosen/rejected rows need `q`, `good`, `bad`; "
                             "found `q`, `good`)"]
    _write(b, [{"q": "Q", "good": "A", "bad": "B"}] * 4)
    pytest.importorskip("datasets")
    from finetune.data.trl_rows import load_rows

    rows = load_rows(load_recipe(recipe_path).recipe.data, "dpo", 0)
    assert rows.column_names == ["prompt", "chosen", "rejected"] and len(rows) == 10 + 5  # b: 4 rows to 5


def test_grpo_prompts_come_from_every_prompt_format_and_keep_the_other_columns(tmp_path):
    from finetune.data.formats import to_example
    from finetune.data.sources import row_spec
    from finetune.data import validate  # noqa: F401

    chat = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}], "level": 1}
    assert to_example(chat, row_spec("messages", {}, {}, "grpo")).values == {
        "prompt": [{"role": "user", "content": "2+2?"}], "level": 1, "answer": "4"}
    share = {"conversations": [{"from": "human", "value": "hi"}]}
    assert to_example(share, row_spec("sharegpt", {}, {}, "grpo")).values == {"prompt": [{"role": "user", "content": "hi"}]}
    alpaca = {"instruction": "Add", "input": "2 2", "output": "4", "answer": "four"}
    assert to_example(alpaca, row_spec("alpaca", {}, {}, "grpo")).values["answer"] == "four"  # the row's own wins
    assert to_example({"prompt": "Say x", "target": "x"}, row_spec("prompt", {}, {}, "grpo")).values == {
        "prompt": "Say x", "target": "x"}
    data = _write(tmp_path / "p.jsonl", [{"prompt": "ok"}, {"question": "no prompt"},
                                         {"messages": [{"role": "assistant", "content": "x"}]}])
    recipe_path = tmp_path / "g.yaml"
    recipe_path.write_text(f"model: {{name_or_path: org/m}}\nobjective: grpo\ndata: {{path: {data}, format: prompt}}\n"
                           "grpo: {rewards: [{function: exact_match}]}\n")
    result = Preflight()
    dataset_step(load_recipe(recipe_path).recipe, result)
    assert result.errors == [f"dataset {data}:2: no `prompt` column (format prompt needs it; found `question`)",
                             f"dataset {data}:3: no `prompt` column (format prompt needs it; found `messages`)"]


def test_text_preference_rows_take_the_bulk_pass():
    pytest.importorskip("pyarrow")
    from finetune.data.fastcheck import clean_counts
    from finetune.data.formats import RowSpec

    good = b'{"prompt": "", "chosen": "A", "rejected": "BB"}\n{"prompt": "Q", "chosen": "A", "rejected": "B"}\n'
    counts = clean_counts(good, RowSpec("pairs"))
    assert counts is not None and [int(c) for c in counts[0]] == [3, 3]
    assert clean_counts(b'{"prompt": "Q", "chosen": " ", "rejected": "B"}\n', RowSpec("pairs")) is None  # row by row
    kto = b'{"prompt": "Q", "completion": "A", "label": true}\n'
    assert clean_counts(kto, RowSpec("kto")) is not None
    assert clean_counts(kto.replace(b"true", b"1"), RowSpec("kto")) is None
