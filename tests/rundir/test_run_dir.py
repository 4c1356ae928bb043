"""finetune.rundir.run_dir.RunDir: the one owner of a run directory's layout (issue 19 item 1)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from finetune.recipe.references import MODEL_CONFIG, NotAModelDir, model_dir_problem, require_model_dir
from finetune.rundir.names import ADAPTER_CONFIG, ADAPTER_WEIGHTS, RECIPE_FILE
from finetune.rundir.adapter import NotAnAdapter, adapter_weights, find_adapter, no_adapter_message
from finetune.rundir.errors import RunDirError
from finetune.rundir.run_dir import NoBaseModel, NotARunDir, RunDir, not_a_run_dir_message, resolve_base

PACKAGE = Path(__file__).resolve().parents[2] / "finetune"


def run_dir_file_names() -> set:
    """The names of finetune/rundir/names.py that are spelled like files (a dot or an underscore: `recipe.yaml`,
    `zero_checkpoint`); plain words (`model`, `logs`, `tensorboard`) are also a recipe's values and a library's keys."""
    tree = ast.parse((PACKAGE / "rundir" / "names.py").read_text(encoding="utf-8"))  # defined there, not imported
    return {node.value.value for node in tree.body if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            and ("." in node.value.value or "_" in node.value.value) and " " not in node.value.value}


def test_the_file_names_are_spelled_once():
    """Every file name a run directory holds appears as a string constant only in finetune/rundir/names.py (issue 39:
    nine were spelled where they were read or written)."""
    wanted = run_dir_file_names()
    assert {RECIPE_FILE, ADAPTER_CONFIG, "deepspeed.effective.json", "zero_checkpoint", "stopped.json"} <= wanted
    spelled = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in wanted:
                spelled.setdefault(node.value, set()).add(path.relative_to(PACKAGE).as_posix())
    assert {name: where for name, where in spelled.items() if where != {"rundir/names.py"}} == {}


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


def test_an_adapter_folder_has_one_check_and_one_error(tmp_path):
    """chat, eval, merge, export and publish ask adapter_weights whether a folder is a whole adapter (issue 39)."""
    adapter = tmp_path / "adapter"
    for made, missing in ((lambda: None, "no such adapter directory"),
                          (adapter.mkdir, f"no {ADAPTER_CONFIG} (not a PEFT adapter directory)"),
                          (lambda: (adapter / ADAPTER_CONFIG).write_text("{}"),
                           f"no {ADAPTER_WEIGHTS[0]} (or {ADAPTER_WEIGHTS[1]}): an incomplete adapter")):
        made()
        with pytest.raises(NotAnAdapter, match=f"^{adapter}: " + missing.replace("(", r"\(").replace(")", r"\)")):
            adapter_weights(adapter)
    (adapter / ADAPTER_WEIGHTS[1]).write_bytes(b"")
    assert adapter_weights(adapter) == adapter / ADAPTER_WEIGHTS[1]


def test_a_model_folder_has_one_check_and_one_wording(tmp_path):
    """preflight, chat, eval and merge word a model folder that is not one alike: WHAT PATH: why[; what to do]."""
    assert model_dir_problem(tmp_path / "gone") == "directory does not exist"
    (tmp_path / "file").write_text("")
    assert model_dir_problem(tmp_path / "file") == f"expected a model directory (with {MODEL_CONFIG}), got a file"
    assert model_dir_problem(tmp_path) == f"no {MODEL_CONFIG} in this directory (is it a Hugging Face model folder?)"
    with pytest.raises(NotAModelDir) as info:
        require_model_dir(tmp_path / "gone", "base model", "pass --base DIR")
    assert str(info.value) == f"base model {tmp_path / 'gone'}: directory does not exist; pass --base DIR"
    (tmp_path / MODEL_CONFIG).write_text("{}")
    assert model_dir_problem(tmp_path) is None and require_model_dir(tmp_path) == tmp_path


def test_the_base_of_a_recipe_a_run_and_an_adapter_is_resolved_once(tmp_path):
    """resolve_base: a recipe's model (a local folder made absolute), a run's recorded recipe's, an adapter's config."""
    from finetune.recipe import Recipe

    base = tmp_path / "base"
    base.mkdir()
    recipe = Recipe.model_validate({"model": {"name_or_path": str(base)}, "data": {"path": "x.jsonl"}})
    assert resolve_base(recipe) == str(base.resolve())
    hub = recipe.model_copy(update={"model": recipe.model.model_copy(update={"name_or_path": "org/m"})})
    assert resolve_base(hub) == "org/m"
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / ADAPTER_CONFIG).write_text('{"base_model_name_or_path": "org/m"}')
    assert resolve_base(adapter) == "org/m"
    (adapter / ADAPTER_CONFIG).write_text("{}")
    with pytest.raises(NoBaseModel, match="names no base model; pass --base"):
        resolve_base(adapter)
    (tmp_path / RECIPE_FILE).write_text(f"model: {{name_or_path: {base}}}\ndata: {{path: x.jsonl}}\n")
    assert resolve_base(RunDir(tmp_path)) == resolve_base(tmp_path) == str(base.resolve())


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


SHIPPED_RECIPES = sorted((PACKAGE.parent / "recipes").rglob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED_RECIPES, ids=lambda p: p.relative_to(PACKAGE.parent / "recipes").as_posix())
def test_a_runs_recorded_recipe_lints_as_its_recipe_and_reproduces_it(tmp_path, path, monkeypatch):
    """Issue 34: runs/X/recipe.yaml (and merge's copy) failed lint and preflight with R118 on the `preference` /
    `grpo` defaults finetune wrote. The record lints with no more findings than the recipe it came from, and
    `finetune train runs/X/recipe.yaml`, read from inside the run directory, renders and resumes as the run."""
    from finetune.lint import LintOptions, lint_paths
    from finetune.recipe import load_recipe
    from finetune.render import render_deepspeed, render_training_args
    from finetune.rundir.layout import resolved_recipe, run_files
    from finetune.rundir.resume_key import resume_fields

    monkeypatch.chdir(tmp_path)  # the record must not depend on where the command ran
    loaded = load_recipe(path)
    world = loaded.recipe.world_size or 2
    run = tmp_path / "runs" / "x"
    run.mkdir(parents=True)
    (run / RECIPE_FILE).write_text(run_files(loaded, run, world)[RECIPE_FILE])

    def findings(file):
        return {(f.rule, f.severity, f.key) for f in lint_paths([file], LintOptions()).findings if f.severity != "info"}

    assert findings(run / RECIPE_FILE) <= findings(path)
    again = load_recipe(run / RECIPE_FILE).recipe
    assert resume_fields(resolved_recipe(again, run), world) == resume_fields(resolved_recipe(loaded.recipe, run), world)
    assert render_deepspeed(again, world) == render_deepspeed(loaded.recipe, world)
    assert render_training_args(again, str(run)) == render_training_args(loaded.recipe, str(run))


def test_a_full_fine_tunes_lora_keys_do_not_block_its_resume():
    """A full run's recipe.yaml leaves out the `lora` section it never read, so its resume key no longer holds
    lora.*; a run directory written before (with them) still resumes, and a LoRA run's rank still counts."""
    from finetune.rundir.resume_key import changed_fields, resume_fields

    full = {"model": {"name_or_path": "org/m"}, "method": "full", "data": {"path": "org/d"}, "lora": {"r": 8}}
    assert not any(key.startswith("lora.") for key in resume_fields(full, 2))
    older = {**resume_fields(full, 2), "lora.r": 8, "lora.alpha": 16}
    assert changed_fields(older, resume_fields(full, 2)) == []
    lora = {**full, "method": "lora"}
    assert changed_fields(resume_fields(lora, 2), resume_fields({**lora, "lora": {"r": 16}}, 2)) == ["lora.r: 8 -> 16"]


def test_a_run_refused_while_the_holder_writes_its_line_names_the_holders_pid(tmp_path):
    """The holder writes its PID just after its flock; a run refused in between waits for that line."""
    import subprocess
    import sys

    from finetune.rundir.lock import LOCK_FILE, RunDirLocked, acquire

    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, platform, sys, time\n"
        f"fd = os.open({str(tmp_path / LOCK_FILE)!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('locked', flush=True)\n"
        "time.sleep(0.3)\n"
        "os.pwrite(fd, f'pid {os.getpid()} host {platform.node()}\\n'.encode(), 0)\n"
        "sys.stdin.read()\n")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirLocked, match=f"PID {holder.pid} on "):
            acquire(tmp_path)
    finally:
        holder.stdin.close()
        holder.wait(timeout=10)
