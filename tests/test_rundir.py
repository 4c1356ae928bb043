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


def test_another_node_writing_the_shared_run_directory_is_waited_for(tmp_path):
    """Node 1 writes the shared run directory file by file, recipe.yaml last; node 0's preflight, looking in
    between, waits for it instead of calling the folder 'not empty' (seen in the two-node slurm test under load)."""
    import threading

    from finetune.run.preflight import _wait_for_another_node

    run = tmp_path / "run"
    run.mkdir()
    (run / "resume_key.json").write_text("{}")
    (run / ".deepspeed.json.x1y2.tmp").write_text("{")
    threading.Timer(0.5, lambda: (run / "recipe.yaml").write_text("model: {}\n")).start()
    _wait_for_another_node(run, timeout=20)
    assert (run / "recipe.yaml").is_file()

    # a folder with anything else in it is not a run directory being written: no wait
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    (tmp_path / "mine" / "deepspeed.json").write_text("{}")
    import time
    started = time.monotonic()
    _wait_for_another_node(tmp_path / "mine", timeout=20)
    assert time.monotonic() - started < 1
