"""Rows that crashed or hung the data readers are named data errors in every command that reads them (issue 40
items 1-2, issue 34 item 17): a row nested 20,000 levels deep (SIGSEGV in pyarrow's JSON reader), NaN and
Infinity (an orjson traceback in a .json file), a 6 GB line without a newline (eval --data read it for minutes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from finetune.cli import app
from finetune.data.fastcheck import MAX_NESTING, NESTED_TOO_DEEP, clean_counts, deep_lines, nested_too_deep
from finetune.data.formats import RowSpec
from finetune.data.sources import Source
from finetune.data.validate import validate
from tests.fuzzing import time_limit

GOOD = '{"instruction": "Add 2 and 3.", "output": "5"}\n'


def nested(levels: int) -> str:
    """An alpaca row whose extra column nests `levels` levels (the row's own object is one of them)."""
    inner = levels - 1
    return '{"instruction": "a", "output": "b", "x": ' + "[" * inner + "]" * inner + "}\n"


def problems(path: Path, fmt: str = "alpaca") -> list[str]:
    with time_limit(60):
        return validate([Source(str(path), "train", RowSpec(fmt))]).messages()


def test_the_depth_bound_is_exact_and_skips_strings():
    assert not nested_too_deep(nested(MAX_NESTING).encode()) and nested_too_deep(nested(MAX_NESTING + 1).encode())
    assert not nested_too_deep(('{"a": "' + "[" * 500 + '\\"' + "{" * 500 + '"}').encode())  # brackets in a string
    data = (GOOD + nested(MAX_NESTING) + nested(20_000) + GOOD + nested(MAX_NESTING + 1)).encode()
    assert deep_lines(data, first_line=10) == [12, 14]
    many_turns = '{"messages": [' + ", ".join(['{"role": "user", "content": "[{"}'] * 200) + "]}"
    assert deep_lines(many_turns.encode()) == []  # 400 brackets on the line, 3 levels deep


def test_the_bulk_reader_never_sees_a_deep_row():
    assert clean_counts((GOOD * 3).encode(), RowSpec("alpaca")) is not None
    assert clean_counts((GOOD * 3 + nested(20_000)).encode(), RowSpec("alpaca")) is None  # SIGSEGV before


@pytest.mark.parametrize("levels", [MAX_NESTING + 1, 5_000, 20_000])
def test_a_deep_jsonl_row_is_named_by_line(tmp_path, levels):
    path = tmp_path / "d.jsonl"
    path.write_text(GOOD * 3 + nested(levels) + GOOD)
    assert problems(path) == [f"{path}:4: {NESTED_TOO_DEEP}"]


@pytest.mark.parametrize("text, where", [
    ("[" + GOOD.strip() + ", " + nested(200).strip() + "]", "row 2: "),
    ("[" + nested(5_000).strip() + "]", ""),  # past orjson's 1,024 levels: no row can be named
])
def test_a_deep_json_array_is_named(tmp_path, text, where):
    path = tmp_path / "d.json"
    path.write_text(text)
    assert problems(path) == [f"{path}: {where}{NESTED_TOO_DEEP}"]


@pytest.mark.parametrize("name, text, where", [
    ("a.json", '[{"instruction": "a", "output": "b", "score": NaN}]', ":1: "),
    ("o.json", '{"instruction": ["a"], "output": ["b"], "score": [Infinity]}', ":1: "),
    ("l.jsonl", GOOD + '{"instruction": "a", "output": "b", "score": -Infinity}\n', ":2: "),
    ("n.jsonl", GOOD + '{"instruction": "a", "output": "b", "m": [{"x": 1.5}, {"x": NaN}]}\n', ":2: "),
])
def test_nan_and_infinity_are_a_named_data_error(tmp_path, name, text, where):
    path = tmp_path / name
    path.write_text(text)
    found = problems(path)
    assert len(found) == 1 and found[0].startswith(f"{path}{where}not valid JSON: `"), found
    assert "is not a JSON number" in found[0]


@pytest.fixture
def recipe_with(tmp_path, tiny_cache, monkeypatch):
    """recipe_with(data text, suffix) -> recipe path training the built-in model on that data."""
    monkeypatch.setenv("FINETUNE_CACHE", str(tiny_cache))

    def write(text: str, suffix: str = ".jsonl") -> Path:
        (tmp_path / f"data{suffix}").write_text(text)
        recipe = tmp_path / "r.yaml"
        recipe.write_text(f'model: {{name_or_path: "builtin:tiny-llama"}}\ndata: {{path: data{suffix}, format: alpaca}}\n'
                          f"output_dir: {tmp_path / 'runs' / 'r'}\n")
        return recipe
    return write


SHAPES = {"deep": (GOOD + nested(20_000), ".jsonl", NESTED_TOO_DEEP, 2),  # (text, suffix, message, row)
          "nan": ('[{"instruction": "a", "output": "b", "score": NaN}]', ".json", "`NaN`", 1),
          "no newline": ("x" * (2**20 + 10), ".jsonl", "is longer than 1 MiB", 1)}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("command", ["train", "prepare", "data show", "eval"])
def test_every_command_that_reads_the_data_names_the_row(recipe_with, no_launch, monkeypatch, command, shape):
    import finetune.data.fastcheck as fastcheck

    monkeypatch.setattr(fastcheck, "MAX_LINE", 2**20)  # the 64 MiB cap, scaled to a test
    text, suffix, needle, row = SHAPES[shape]
    recipe = recipe_with(text, suffix)
    data = recipe.parent / f"data{suffix}"
    if command == "eval":  # a run directory is its recipe.yaml; the file is read before any model loads
        (recipe.parent / "run").mkdir()
        (recipe.parent / "run" / "recipe.yaml").write_text(recipe.read_text().replace("data.", f"{recipe.parent}/data."))
        args = ["eval", recipe.parent / "run", "--data", data]
    else:
        args = [*command.split(), recipe] + {"train": ["--dry-run"], "data show": ["--row", row]}.get(command, [])
    with time_limit(120):
        result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 1, result.output[-2000:]
    assert "Traceback" not in result.output and needle in result.output, result.output[-2000:]
    assert str(data) in result.output or data.name in result.output


def test_the_bulk_reader_is_handed_memory_arrow_owns(monkeypatch):
    """A Python-owned buffer whose last reference Arrow's read-ahead thread drops during interpreter shutdown
    aborts the process (exit 134, "terminate called without an active exception"; issue 34 item 10)."""
    import pyarrow as pa

    handed = []
    real = pa.BufferReader
    monkeypatch.setattr(pa, "BufferReader", lambda source: handed.append(source) or real(source))
    assert clean_counts((GOOD * 3).encode(), RowSpec("alpaca")) is not None
    assert len(handed) == 1 and isinstance(handed[0], pa.Buffer) and handed[0].is_mutable  # allocate_buffer's
