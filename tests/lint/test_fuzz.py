"""Property-based: no document, however broken, makes `lint` raise or run past its time limit. 2,000+ random
inputs, among them the shapes of issue 40: values nested deep, NaN and infinities, a wrong type at any key of any
shipped recipe, alias bombs ("billion laughs"), duplicate keys."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from finetune.lint import LintOptions, lint_paths
from tests.conftest import REPO, run_cli
from tests.fuzzing import fuzz, time_limit

SHIPPED = sorted(p for p in (REPO / "recipes").rglob("*.yaml")) + sorted((REPO / "ds_configs").glob("*.json"))
KEYS = ["model", "name_or_path", "data", "path", "method", "lora", "r", "alpha", "deepspeed", "stage", "overrides",
        "zero_optimization", "offload_optimizer", "device", "extends", "training", "launch", "hardware", "gpus",
        "train_batch_size", "bf16", "fp16", "enabled", "auto", "quantization", "storage_dtype", "optimizer", "type"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
                    st.text(max_size=12), st.sampled_from(["auto", "3", "cpu", "nvme", "qlora", "all-linear", "24GiB"]))
deep = st.integers(1, 80).map(lambda depth: json.loads("[" * depth + "]" * depth))  # past the loader's 64 too
values = st.recursive(scalars | deep, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), inner, max_size=5)),
    max_leaves=25)
# Ten anchors of ten aliases each: 10^10 values once expanded.
ALIAS_BOMB = "\n".join(["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"] +
                       [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 10)]) + "\n"
SECONDS = 30  # one lint of one document: milliseconds; a hang fails the test instead of stalling the run


def lint_text(tmp: Path, name: str, text: str) -> None:
    path = tmp / name
    path.write_bytes(text.encode("utf-8", "surrogatepass"))
    with time_limit(SECONDS):
        result = lint_paths([path], LintOptions(world_size=2))
    for finding in result.findings:
        assert finding.line >= 1 and finding.col >= 1 and finding.severity in ("error", "warning", "info")


FUZZ = fuzz(700)


@FUZZ
@given(doc=st.dictionaries(st.sampled_from(KEYS), values, max_size=8))
def test_random_structured_documents(tmp_path_factory, doc):
    tmp = tmp_path_factory.mktemp("fz")
    lint_text(tmp, "r.yaml", json.dumps(doc, default=str))
    lint_text(tmp, "c.json", json.dumps(doc, default=str))


@FUZZ
@given(text=st.text(max_size=300))
def test_random_text(tmp_path_factory, text):
    tmp = tmp_path_factory.mktemp("fz")
    lint_text(tmp, "r.yaml", text)
    lint_text(tmp, "c.json", text)


@FUZZ
@given(data=st.data())
def test_mutated_shipped_files(tmp_path_factory, data):
    source = data.draw(st.sampled_from(SHIPPED))
    text = source.read_text()
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["delete", "insert", "replace_line", "swap_value", "append", "truncate"]))
        if not text:
            break
        i = data.draw(st.integers(0, len(text) - 1))
        if kind == "delete":
            j = data.draw(st.integers(i, min(len(text), i + 20)))
            text = text[:i] + text[j:]
        elif kind == "insert":
            text = text[:i] + data.draw(st.sampled_from([":", "-", " ", "\n", "[", "{", "&a", "*a", "!!", "'", "\t", "auto", "3"])) + text[i:]
        elif kind == "replace_line":
            lines = text.splitlines()
            k = data.draw(st.integers(0, len(lines) - 1))
            lines[k] = lines[k].split(":")[0] + ": " + json.dumps(data.draw(values), default=str)
            text = "\n".join(lines)
        elif kind == "swap_value":
            text = text.replace(data.draw(st.sampled_from(["3", "true", "bfloat16", "cpu", "2", "auto"])),
                                data.draw(st.sampled_from(["'3'", "null", "[]", "{}", "-1", "1e999", "fp4", ".nan",
                                                           "-.inf", "[" * 70 + "]" * 70, "9" * 400])), 1)
        elif kind == "append":
            text += "\n" + data.draw(st.sampled_from([ALIAS_BOMB, "method: lora\nmethod: full\n", "x: " + "[" * 5000,
                                                      "name: &n x\nextends: *n\n"]))
        else:
            text = text[:i]
    suffix = source.suffix
    lint_text(tmp_path_factory.mktemp("fz"), f"m{suffix}", text)


def key_paths(data, prefix: tuple = ()) -> list[tuple]:
    """Every key path of a mapping, sections themselves included."""
    out = []
    for key, value in data.items() if isinstance(data, dict) else ():
        out.append(prefix + (key,))
        out += key_paths(value, prefix + (key,))
    return out


RECIPES = [p for p in SHIPPED if p.suffix == ".yaml"]
WRONG = st.one_of(values, st.sampled_from([8, -1, 0, 2**70, float("nan"), float("inf"), "x" * 5000, "/dev/zero",
                                             {"path": 8}, [[[[]]]]]))


@fuzz(200)
@given(data=st.data())
def test_a_wrong_value_at_any_key_of_a_shipped_recipe(tmp_path_factory, data):
    """Any key of any section (a section itself too) of a shipped recipe given a value of another shape: the
    loader's own passes (extends, path rebasing, reward files) leave it to the schema (issue 40: `grpo.rewards:
    8` was a TypeError in lint, render, plan and train alike)."""
    from finetune.recipe.yamlio import load_yaml

    source = data.draw(st.sampled_from(RECIPES))
    doc = load_yaml(source.read_text()).data
    path = data.draw(st.sampled_from(key_paths(doc)))
    node = doc
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = data.draw(WRONG)
    folder = tmp_path_factory.mktemp("fz")
    for item in source.parent.iterdir():  # the files it extends and names, beside it as in recipes/
        if item.is_file() and item != source:
            (folder / item.name).symlink_to(item)
    lint_text(folder, "m.yaml", json.dumps(doc, default=str).replace("NaN", ".nan").replace("Infinity", ".inf"))


def test_cli_on_garbage_never_prints_a_traceback(tmp_path):
    samples = ["\x00\x01", "{{{{", "a: *nope", "- - - -", "model:\n\t- x", '{"a": 1,}', "[" * 5000]
    for i, text in enumerate(samples):
        (tmp_path / f"g{i}.yaml").write_text(text)
        (tmp_path / f"g{i}.json").write_text(text)
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00garbage")
    result = run_cli("lint", tmp_path)
    assert result.returncode == 1
    assert "Traceback" not in result.stdout + result.stderr
