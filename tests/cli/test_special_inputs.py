"""A device, FIFO or socket as any path a command opens is one line and exit 1, before anything opens it
(issue 40 item 0: `lint --set model.name_or_path=/dev/zero` grew to 24 GB; a FIFO there hung lint, plan, init
and `train --dry-run`). Every invocation runs in-process under a time limit, so a hang fails the test."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from finetune.cli import app
from finetune.fsutil import SpecialFile, read_capped, refuse_special, special_kind
from tests.conftest import MINIMAL
from tests.fuzzing import time_limit

SECONDS = 60  # a command's imports on a busy CI box; the refusal itself is a stat()


@pytest.fixture(scope="module")
def special(tmp_path_factory):
    """{kind: path}: a FIFO, a link to /dev/zero, and a model folder whose config.json is a FIFO."""
    folder = tmp_path_factory.mktemp("special")
    os.mkfifo(folder / "fifo")
    (folder / "zero").symlink_to("/dev/zero")
    (folder / "model").mkdir()
    os.mkfifo(folder / "model" / "config.json")
    (folder / "recipe.yaml").write_text(MINIMAL.replace("org/some-dataset", "org/some-dataset\n  format: alpaca"))
    return {"fifo": folder / "fifo", "zero": folder / "zero", "model": folder / "model", "folder": folder}


def invoke(*args) -> "CliRunner":
    with time_limit(SECONDS):
        result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 1, (args, result.exit_code, result.output[-2000:])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    return result


def test_the_door_refuses_what_is_not_a_regular_file(special, tmp_path):
    assert special_kind(special["fifo"]) == "a named pipe (FIFO)"
    assert special_kind(special["zero"]) == "a character device"
    assert special_kind(special["model"]) is None and special_kind(tmp_path / "missing") is None
    with pytest.raises(SpecialFile, match="config.json is a named pipe"):
        refuse_special(special["model"], "model.name_or_path")
    for path in (special["fifo"], special["zero"], special["folder"]):
        with pytest.raises(SpecialFile, match="not a regular file"):
            read_capped(path, 1024)
    with pytest.raises(SpecialFile, match="larger than"):  # stat() says 0 bytes; the cap holds while reading
        read_capped("/proc/self/status", 16)
    (tmp_path / "ok.json").write_text("{}")
    assert read_capped(tmp_path / "ok.json", 2) == b"{}"


RECIPE_PATHS = ["model.name_or_path", "model.tokenizer", "model.adapter", "launch.hostfile", "data.path",
                "deepspeed.nvme_path", "preference.reference.name_or_path"]


@pytest.mark.parametrize("kind", ["fifo", "zero", "model"])
@pytest.mark.parametrize("key", RECIPE_PATHS)
def test_lint_names_every_recipe_path_that_is_not_a_file_or_folder(special, key, kind):
    result = invoke("lint", special["folder"] / "recipe.yaml", "--set", f"{key}={special[kind]}")
    assert f"R123 `{key}`" in result.output and ("named pipe" in result.output or "character device" in result.output)


def test_a_reward_file_that_is_a_fifo_is_r123(special, tmp_path):
    os.mkfifo(tmp_path / "rewards.py")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {name_or_path: org/m}\ndata: {path: org/d}\nobjective: grpo\n"
                      "grpo: {rewards: [{function: 'rewards.py:score'}]}\n")
    assert "R123 `grpo.rewards.0.function`" in invoke("lint", recipe).output


@pytest.mark.parametrize("name, text", [("fifo.yaml", None), ("extends.yaml", "extends: fifo\n"), ("zero.json", None)])
def test_a_recipe_extends_or_deepspeed_json_that_is_special_is_one_finding(special, tmp_path, name, text):
    target = tmp_path / name
    if name == "fifo.yaml":
        os.mkfifo(target)
    elif name == "zero.json":
        target.symlink_to("/dev/zero")
    else:
        os.mkfifo(tmp_path / "fifo")
        target.write_text(text)
    result = invoke("lint", target)
    assert ("named pipe (FIFO), not a regular file" in result.output or "character device, not a regular file" in result.output)


@pytest.mark.parametrize("kind", ["fifo", "zero", "model"])
def test_plan_refuses_a_special_model(special, kind):
    result = invoke("plan", special["folder"] / "recipe.yaml", "--set", f"model.name_or_path={special[kind]}")
    assert "not a regular file" in result.output


def test_train_dry_run_stops_at_lint_and_reads_nothing(special, no_launch, monkeypatch):
    import finetune.run.preflight as preflight

    def never(*args, **kwargs):
        raise AssertionError("a step read a path lint refused")

    for step in ("dataset_step", "chat_template_step", "model_step", "hostfile_step", "rewards_step"):
        monkeypatch.setattr(preflight, step, never)
    result = invoke("train", special["folder"] / "recipe.yaml", "--dry-run", "--set", f"model.name_or_path={special['model']}")
    assert "R123" in result.output and "preflight failed (1 problem)" in result.output


@pytest.mark.parametrize("args, needle", [
    (("data", "show", "{folder}/recipe.yaml", "--set", "model.name_or_path={model}"), "config.json is a named pipe"),
    (("data", "show", "{folder}/recipe.yaml", "--set", "data.path={fifo}", "--set", "model.name_or_path=builtin:tiny-llama"),
     "named pipe (FIFO), not a regular file"),
    (("init", "--data", "{fifo}"), "--data {fifo}: a named pipe (FIFO)"),
    (("init", "--data", "{zero}"), "a character device"),
    (("eval", "{folder}", "--data", "{fifo}"), "--data {fifo}: a named pipe (FIFO)"),
    (("chat", "{fifo}", "--prompt", "hi"), "PATH: {fifo} is a named pipe"),
    (("chat", "--base", "{model}", "--prompt", "hi"), "--base: {model}/config.json is a named pipe"),
    (("merge", "{fifo}", "-o", "{folder}/out"), "RUN_DIR: {fifo} is a named pipe"),
    (("merge", "--base", "{model}", "--adapter", "{folder}", "-o", "{folder}/out"), "--base: {model}/config.json"),
    (("convert", "{zero}", "-o", "{folder}/out"), "CHECKPOINT: {zero} is a character device"),
])
def test_every_command_refuses_a_special_input_in_one_line(special, tiny_cache, monkeypatch, args, needle):
    monkeypatch.setenv("FINETUNE_CACHE", str(tiny_cache))
    names = {k: str(v) for k, v in special.items()}
    result = invoke(*(a.format(**names) for a in args))
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle.format(**names) in errors[0], result.output
    assert not (Path(names["folder"]) / "out").exists()
