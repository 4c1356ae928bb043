"""Malformed input reaches every CLI entry point as a finding or a one-line error (issue 13, inputs).

Deep nesting, 400-digit numbers, file names longer than the OS allows, run names that climb out
of the runs directory: none of them may end in a traceback, a signal, or seconds of work.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest

from finetune.lint import LintOptions, lint_paths
from finetune.recipe import RecipeProblem, load_recipe
from finetune.recipe.yamlio import MAX_DEPTH, DocumentError, load_json, load_yaml
from tests.conftest import MINIMAL, run_cli

BOMB = "x: " + "[" * 100_000 + "]" * 100_000  # 200 KB; signal 11 in the composer before the fix


def _lint_seconds(path: Path) -> tuple[float, list]:
    """Fastest of three lints (the first import of the rules is not the input's cost), and the findings."""
    lint_paths([path], LintOptions(world_size=2))
    timings = []
    for _ in range(3):
        started = time.perf_counter()
        result = lint_paths([path], LintOptions(world_size=2))
        timings.append(time.perf_counter() - started)
    return min(timings), result.findings


@pytest.mark.parametrize("depth", [500, 20_000, 100_000])
def test_deep_flow_nesting_is_refused_fast_with_r001(tmp_path, depth):
    path = tmp_path / "deep.yaml"
    path.write_text("x: " + "[" * depth + "]" * depth)
    seconds, findings = _lint_seconds(path)
    assert [f.rule for f in findings] == ["R001"]
    assert f"deeper than {MAX_DEPTH} levels" in findings[0].message
    assert findings[0].line == 1 and findings[0].col > MAX_DEPTH  # points into the brackets
    assert seconds < 0.2, f"{seconds:.3f} s"


@pytest.mark.parametrize("text", [
    "[" * 100_000 + "]" * 100_000,  # json module: RecursionError
    '{"a": ' * 500 + "1" + "}" * 500,  # within Python's recursion limit: json reads it, lint must not
    '{"a":\t' * 500 + "1" + "}" * 500,  # a tab: JSON but not YAML, so no positions from the YAML side
])
def test_deep_deepspeed_json_is_refused_fast(tmp_path, text):
    path = tmp_path / "ds.json"
    path.write_text(text)
    seconds, findings = _lint_seconds(path)
    assert [f.rule for f in findings] == ["DS001"], findings
    assert f"deeper than {MAX_DEPTH} levels" in findings[0].message
    assert seconds < 0.2, f"{seconds:.3f} s"


def test_depth_limit_is_exact_for_yaml_and_json():
    ok = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert load_yaml(ok).data is not None and load_json(ok).data is not None
    deep = "{a: " * (MAX_DEPTH + 1) + "1" + "}" * (MAX_DEPTH + 1)
    with pytest.raises(DocumentError, match="deeper than"):
        load_yaml(deep)


def test_block_nesting_by_indentation_is_refused_fast():
    text = "".join(" " * i + "a:\n" for i in range(1500)) + " " * 1500 + "1\n"  # 1.1 MB
    started = time.perf_counter()
    with pytest.raises(DocumentError, match="deeper than") as exc:
        load_yaml(text)
    assert exc.value.line == MAX_DEPTH + 2
    assert time.perf_counter() - started < 0.2


def test_nesting_bomb_in_a_subprocess_exits_1_without_a_signal(tmp_path):
    (tmp_path / "bomb.yaml").write_text(BOMB)
    for command in (["lint", tmp_path / "bomb.yaml"], ["plan", tmp_path / "bomb.yaml"]):
        result = run_cli(*command)
        assert result.returncode == 1, (command, result.returncode, result.stderr[-500:])
        assert "Traceback" not in result.stderr and "deeper than 64 levels" in result.stdout + result.stderr


# ----------------------------------------------------------------------------------------------
# Absurd numbers and names


HUGE = "9" * 400


@pytest.mark.parametrize("key", ["training.micro_batch_size", "training.gradient_accumulation_steps",
                                 "training.max_steps", "data.max_length", "launch.nodes", "launch.procs_per_node",
                                 "hardware.gpus", "deepspeed.reduce_bucket_size", "training.seed"])
def test_400_digit_integers_are_a_finding(write_recipe, key):
    with pytest.raises(RecipeProblem) as exc:
        load_recipe(write_recipe(), [f"{key}={HUGE}"])
    found = exc.value.problems
    assert [(p.rule, p.key) for p in found] == [("R004", key)]
    assert len(found[0].render()) < 2 * len(HUGE) + 300  # the value is shortened, not echoed twice


@pytest.mark.parametrize("value", [".inf", ".nan", "1e400"])
def test_infinite_floats_are_a_finding(write_recipe, value):
    with pytest.raises(RecipeProblem) as exc:
        load_recipe(write_recipe(), [f"training.epochs={value}"])
    assert exc.value.problems[0].key == "training.epochs"


def test_lint_and_plan_on_400_digit_micro_batch_exit_1_in_one_line(write_recipe):
    recipe = write_recipe(MINIMAL.replace("org/some-model", "llama-3-8b") + "hardware: {gpus: 2, gpu_memory: 24GiB}\n")
    for command in ("lint", "plan"):
        result = run_cli(command, recipe, "--set", f"training.micro_batch_size={HUGE}")
        assert result.returncode == 1, result.stderr[-800:]
        assert "Traceback" not in result.stderr and "OverflowError" not in result.stderr
        assert "training.micro_batch_size" in result.stdout + result.stderr


def test_planner_reports_overflow_as_plan_error():
    from finetune import plan as planner

    recipe = planner.recipe_without_file(planner.flag_overrides(model="llama-3-8b", method="lora", seq_len=2048))
    setup = planner.setup_from_recipe(recipe, 1, 24 * 2**30)
    with pytest.raises(planner.PlanError, match="too large to plan"):
        planner.plan(dataclasses.replace(setup, micro_batch=10**400))  # past the schema, e.g. from Python


def test_300_character_extends_is_r003_not_oserror(write_recipe):
    path = write_recipe("extends: " + "a" * 300 + ".yaml\n" + MINIMAL)
    with pytest.raises(RecipeProblem) as exc:
        load_recipe(path)
    [problem] = exc.value.problems
    assert problem.rule == "R003" and problem.key == "extends" and "cannot be opened" in problem.message
    result = run_cli("lint", path)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "R003" in result.stdout


@pytest.mark.parametrize("key", ["data.path", "model.name_or_path", "model.tokenizer", "launch.hostfile",
                                 "deepspeed.nvme_path", "output_dir"])
def test_path_component_too_long_to_stat_is_a_finding(write_recipe, key):
    with pytest.raises(RecipeProblem) as exc:
        load_recipe(write_recipe(), [f"{key}=./{'d' * 300}.jsonl"])
    assert [(p.rule, p.key) for p in exc.value.problems] == [("R004", key)]
    assert "path component of 306 bytes" in exc.value.problems[0].message


def test_300_character_data_path_through_lint_and_train(write_recipe, tmp_path):
    path = write_recipe(MINIMAL.replace("org/some-dataset", "d" * 300 + ".jsonl"))
    for command in (("lint",), ("train", "--dry-run")):
        result = run_cli(*command, path)
        assert result.returncode == 1, result.stderr[-800:]
        assert "Traceback" not in result.stderr and "data.path" in result.stdout + result.stderr
    result = run_cli("lint", tmp_path / ("x" * 300 + ".yaml"))
    assert result.returncode == 2 and "Traceback" not in result.stderr and "no such file" in result.stderr


@pytest.mark.parametrize("name", ["../../x", "a/b", "..", ".", "a\\b", ""])
def test_run_name_with_path_separators_is_a_finding(write_recipe, name):
    path = write_recipe(MINIMAL + f"name: {json.dumps(name)}\n")
    with pytest.raises(RecipeProblem) as exc:
        load_recipe(path)
    [problem] = exc.value.problems
    assert problem.key == "name" and problem.rule == "R004" and problem.line == 5
    assert "path separators" in problem.message


def test_plain_run_names_still_load(write_recipe):
    assert load_recipe(write_recipe(MINIMAL + "name: llama3-8b_qlora.v2\n")).recipe.name == "llama3-8b_qlora.v2"


def test_plan_model_name_too_long_to_stat_is_one_line():
    result = run_cli("plan", "--model", "a" * 300)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert len(result.stderr.splitlines()) == 1 and "path component of 300 bytes" in result.stderr


def test_path_longer_than_path_max_is_a_finding(write_recipe):
    with pytest.raises(RecipeProblem) as exc:
        load_recipe(write_recipe(), ["data.path=./" + "a/" * 2100 + "x.jsonl"])
    assert [(p.rule, p.key) for p in exc.value.problems] == [("R004", "data.path")]
    assert "Linux allows 4095" in exc.value.problems[0].message


@pytest.mark.parametrize("command", [("schema", "-o", "{long}"), ("train", "{recipe}", "--output-dir", "{long}", "--dry-run"),
                                     ("slurm", "{recipe}", "-o", "{long}"), ("schema", "-o", "{missing}")])
def test_output_paths_the_os_refuses_are_one_line(write_recipe, tmp_path, command):
    from typer.testing import CliRunner

    from finetune.cli import app

    names = {"long": str(tmp_path / ("o" * 300)), "recipe": str(write_recipe()), "missing": str(tmp_path / "no" / "such" / "x")}
    (tmp_path / "no").write_text("a file where a folder should be")
    result = CliRunner().invoke(app, [part.format(**names) for part in command])
    assert result.exit_code in (1, 2), result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.stderr.startswith("error: ") and len(result.stderr.splitlines()) == 1


@pytest.mark.parametrize("value", ["9" * 100_000, "a" * 100_000])
@pytest.mark.parametrize("key", ["training.max_steps", "model.name_or_path", "data.format", "lora.r"])
def test_a_huge_set_value_is_not_echoed_whole(write_recipe, key, value):
    """Issue 25 item 10: a 100k-digit --set value was repeated whole (100 KB of output)."""
    from typer.testing import CliRunner

    from finetune.cli import app

    result = CliRunner().invoke(app, ["lint", str(write_recipe()), "--set", f"{key}={value}"])
    assert result.exit_code == 1 and len(result.output) < 1000, len(result.output)
    assert "100,0" in result.output  # says how long the value was


HUB = "model: {name_or_path: org/m}\ndata: {path: org/d}\n"


@pytest.mark.parametrize("text", [
    HUB + "objective: grpo\ngrpo: {rewards: 8}\n", HUB + "objective: grpo\ngrpo: {rewards: {function: 'r.py:f'}}\n",
    HUB + "objective: grpo\ngrpo: 8\n", "model: {name_or_path: org/m}\ndata: {sources: 8}\n",
    "model: {name_or_path: org/m}\ndata: [1, 2]\n", "model: 8\ndata: {path: org/d}\n",
])
def test_every_recipe_shape_reaches_the_schema(write_recipe, text):
    """The loader's own passes (path rebasing, reward files, extends) walk nothing the schema has not seen
    (issue 40: `grpo.rewards: 8` was a TypeError in lint, render, plan and train alike)."""
    path = write_recipe(text)
    with pytest.raises(RecipeProblem) as exc:
        load_recipe(path)
    assert all(p.rule in ("R004", "R005") for p in exc.value.problems), exc.value.lines()


def test_an_alias_bomb_is_refused_before_any_value_is_built(write_recipe, monkeypatch):
    """Counted per shared node (a few hundred), not by building 200,000 values first (2 s on a busy box: the
    issue-40 mutant that ran lint past 10 s)."""
    from finetune.recipe import yamlio
    from tests.lint.test_fuzz import ALIAS_BOMB

    built = []
    monkeypatch.setattr(yamlio._Builder, "build", lambda *args: built.append(args))
    findings = lint_paths([write_recipe(MINIMAL + ALIAS_BOMB)], LintOptions()).findings
    assert [f.rule for f in findings] == ["R001"] and "alias bomb" in findings[0].message
    assert built == []


def test_plan_trace_of_a_model_transformers_cannot_build_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_model", "hidden_size": 64,
                                                      "num_hidden_layers": 2, "num_attention_heads": 4,
                                                      "intermediate_size": 128, "vocab_size": 100}))
    from typer.testing import CliRunner

    from finetune.cli import app

    result = CliRunner().invoke(app, ["plan", "--trace", "--model", str(tmp_path), "--method", "full"])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output[-2000:]
    assert result.output.strip().splitlines()[-1].startswith("error: --trace cannot build model_type 'no_such_model'")
