"""Property-based, through the real commands: `lint`, `render` and `plan` on random recipes, `--set`
values and raw DeepSpeed JSON end with exit 0, 1 or 2, never a traceback, each within 2 s (and stopped at
LIMIT, so a hang fails the test instead of stalling the run).

In-process (typer's CliRunner) for speed; the inputs that once killed the interpreter (signal 11) or
raised deep inside the planner also run in a real subprocess, where a signal death is visible. The shapes of
issue 40 (a device or FIFO as a path, an alias bomb, NaN, a number where a list belongs) run in-process.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from finetune.cli import app
from tests.conftest import run_cli
from tests.fuzzing import fuzz, time_limit
from tests.lint.test_fuzz import ALIAS_BOMB, KEYS, values

runner = CliRunner()
SECONDS = 2.0
LIMIT = 30.0  # where a hang is stopped (TooLong, in the command: the result's exception)
BASE = "model: {name_or_path: llama-3-8b}\ndata: {path: org/data}\nhardware: {gpus: 2, gpu_memory: 24GiB}\n"
SET_KEYS = ["training.micro_batch_size", "training.gradient_accumulation_steps", "training.epochs", "training.max_steps",
            "training.learning_rate", "data.max_length", "lora.r", "lora.target_modules", "deepspeed.stage",
            "deepspeed.offload_optimizer", "deepspeed.reduce_bucket_size", "deepspeed.overrides", "launch.nodes",
            "launch.procs_per_node", "hardware.gpus", "hardware.gpu_memory", "method", "name", "extends",
            "model.name_or_path", "quantization.storage_dtype", "output_dir", "data.chat_template", "grpo.rewards",
            "data.sources", "model.tokenizer", "launch.hostfile", "deepspeed", "data"]
set_values = st.one_of(
    st.integers(-(10**30), 10**30).map(str), st.sampled_from(["9" * 400, "-" + "9" * 400, "1e999", ".inf", ".nan",
                                                              "[" * 300, "{" * 300, "a" * 300, "../../x", "", "null",
                                                              "/dev/zero", "[" * 70 + "]" * 70, "8", "{path: 8}"]),
    st.text(max_size=40), values.map(lambda v: json.dumps(v, default=str)))
# tests/lint/test_fuzz.py runs 2,000+ documents through lint alone; these add the CLI, render, plan and --set.


def invoke(*args: str):
    started = time.perf_counter()
    with time_limit(LIMIT):
        result = runner.invoke(app, [str(a) for a in args])
    seconds = time.perf_counter() - started
    allowed = (0, 1, 2, 3) if args[0] == "plan" else (0, 1, 2)  # plan's 3: it does not fit (an answer, not a crash)
    assert result.exit_code in allowed, (args, result.exit_code, result.output[-1000:])
    crash = result.exception if not isinstance(result.exception, SystemExit) else None
    assert crash is None, (args, repr(crash))
    assert "Traceback" not in result.output
    assert seconds < SECONDS, (args, seconds)
    return result


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli-fuzz")
    invoke("lint", _write(path, "warm.yaml", BASE))  # imports are not the inputs' cost
    invoke("plan", _write(path, "warm.yaml", BASE))
    return path


def _write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_bytes(text.encode("utf-8", "surrogatepass"))
    return path


@fuzz(80)
@given(sets=st.lists(st.tuples(st.sampled_from(SET_KEYS), set_values), min_size=1, max_size=3))
def test_set_values_through_lint_render_and_plan(folder, sets):
    recipe = _write(folder, "r.yaml", BASE)
    flags = [part for key, value in sets for part in ("--set", f"{key}={value}")]
    for command in ("lint", "render", "plan"):
        invoke(command, recipe, *flags)


@fuzz(40)
@given(doc=st.dictionaries(st.sampled_from(KEYS), values, max_size=8))
def test_random_recipes_through_lint_render_and_plan(folder, doc):
    recipe = _write(folder, "r.yaml", json.dumps(doc, default=str))
    for command in ("lint", "render", "plan"):
        invoke(command, recipe)


@fuzz(50)
@given(doc=st.one_of(values, st.dictionaries(st.sampled_from(KEYS), values, max_size=8)), world=st.integers(1, 2**40))
def test_random_deepspeed_json_through_lint(folder, doc, world):
    config = _write(folder, "ds.json", json.dumps(doc, default=str))
    invoke("lint", config)
    invoke("lint", config, "--world-size", str(world), "--no-hf")


@pytest.fixture(scope="module")
def fifo(tmp_path_factory):
    path = tmp_path_factory.mktemp("fifo") / "fifo"
    os.mkfifo(path)  # opening it would wait for a writer: forever
    return path


HOSTILE = {  # issue 40's shapes, each through lint, render and plan in this process
    "alias bomb": BASE + ALIAS_BOMB,
    "rewards a number": BASE + "objective: grpo\ngrpo: {rewards: 8}\n",
    "rewards a mapping": BASE + "objective: grpo\ngrpo: {rewards: {function: x.py:f}}\n",
    "sources a number": "model: {name_or_path: llama-3-8b}\ndata: {sources: 8}\n",
    "nan and inf": BASE + "training: {learning_rate: .nan, max_grad_norm: .inf, warmup_ratio: -.inf}\n",
    "deep value": BASE + "lora: {target_modules: " + "[" * 60 + "]" * 60 + "}\n",
    "duplicate key": BASE + "method: lora\nmethod: full\n",
    "device model": BASE.replace("llama-3-8b", "/dev/zero"),
    "fifo model": BASE.replace("llama-3-8b", "{fifo}"),
    "fifo data": BASE.replace("org/data", "{fifo}"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_issue_40_shapes_through_lint_render_and_plan(folder, fifo, name):
    recipe = _write(folder, "h.yaml", HOSTILE[name].replace("{fifo}", str(fifo)))
    codes = [invoke(command, recipe).exit_code for command in ("lint", "render", "plan")]
    assert codes[0] == 1, codes  # each is an error lint names


PATHOLOGICAL = {
    "bomb.yaml": "x: " + "[" * 100_000 + "]" * 100_000,
    "deep.json": "[" * 100_000 + "]" * 100_000,
    "long_extends.yaml": "extends: " + "a" * 300 + ".yaml\n" + BASE,
    "huge_int.yaml": BASE + "training: {micro_batch_size: " + "9" * 400 + "}\n",
    "name.yaml": BASE + "name: ../../x\n",
}


@pytest.mark.parametrize("name", sorted(PATHOLOGICAL))
def test_pathological_inputs_in_a_real_process(tmp_path, name):
    path = _write(tmp_path, name, PATHOLOGICAL[name])
    commands = [("lint",)] if name.endswith(".json") else [("lint",), ("render",), ("plan",)]
    for command in commands:
        started = time.perf_counter()
        result = run_cli(*command, path, timeout=60)
        assert result.returncode in (1, 2), (command, result.returncode, result.stderr[-500:])  # < 0: a signal
        assert "Traceback" not in result.stderr + result.stdout
        assert time.perf_counter() - started < 30  # process start and imports on a busy CI box; the input is < 0.2 s
