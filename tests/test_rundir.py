"""finetune.rundir.run_dir.RunDir: the one owner of a run directory's layout (issue 19 item 1)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from finetune.rundir.run_dir import (
    ADAPTER_CONFIG, RECIPE_FILE, NotARunDir, RunDir, RunDirError, find_adapter, no_adapter_message,
    not_a_run_dir_message,
)

PACKAGE = Path(__file__).resolve().parent.parent / "finetune"


def test_the_file_names_are_spelled_once():
    """`recipe.yaml` and `adapter_config.json` appear as string constants only in finetune/rundir/names.py."""
    spelled = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in (RECIPE_FILE, ADAPTER_CONFIG):
                spelled.setdefault(node.value, set()).add(path.relative_to(PACKAGE).as_posix())
    assert spelled == {RECIPE_FILE: {"rundir/names.py"}, ADAPTER_CONFIG: {"rundir/names.py"}}


def test_adapter_is_found_in_the_run_or_the_folder_itself(tmp_path):
    run = tmp_path / "run"
    (run / "adapter").mkdir(parents=True)
    assert find_adapter(run) is None and RunDir(run).adapter() is None
    (run / "adapter" / ADAPTER_CONFIG).write_text("{}")
    assert find_adapter(run) == run / "adapter" and find_adapter(run / "adapter") == run / "adapter"
    assert no_adapter_message(tmp_path) == f"no {ADAPTER_CONFIG} in {tmp_path} or {tmp_path / 'adapter'}"


def test_not_a_run_directory_has_one_error_and_one_message(tmp_path):
    with pytest.raises(NotARunDir) as info:
        RunDir(tmp_path).require()
    assert str(info.value) == not_a_run_dir_message(tmp_path)
    with pytest.raises(NotARunDir):
        RunDir(tmp_path).recipe()


@pytest.mark.parametrize("text", ["model: [unclosed\n", "- a list\n", "model: {name_or_path: x}\nmethod: lorra\n",
                                  "\x00\x01 binary", "a: &x [*x]\n"])
def test_a_corrupt_recipe_is_one_line_naming_the_file(tmp_path, text):
    (tmp_path / RECIPE_FILE).write_text(text, encoding="utf-8", errors="surrogateescape")
    run = RunDir(tmp_path)
    assert run.is_run()
    with pytest.raises(RunDirError) as info:
        run.recipe()
    message = str(info.value)
    assert message.startswith(f"{tmp_path / RECIPE_FILE}: cannot read the run's recipe") and "\n" not in message
