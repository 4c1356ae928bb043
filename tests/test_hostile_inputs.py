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
from finetune.yamlio import MAX_DEPTH, DocumentError, load_json, load_yaml
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
