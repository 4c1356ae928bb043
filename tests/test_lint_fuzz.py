"""Property-based: no document, however broken, makes `lint` raise. 2,000+ random inputs."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from finetune.lint import LintOptions, lint_paths
from tests.conftest import REPO, run_cli
from tests.fuzzing import fuzz

SHIPPED = sorted(p for p in (REPO / "recipes").rglob("*.yaml")) + sorted((REPO / "ds_configs").glob("*.json"))
KEYS = ["model", "name_or_path", "data", "path", "method", "lora", "r", "alpha", "deepspeed", "stage", "overrides",
        "zero_optimization", "offload_optimizer", "device", "extends", "training", "launch", "hardware", "gpus",
        "train_batch_size", "bf16", "fp16", "enabled", "auto", "quantization", "storage_dtype", "optimizer", "type"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
                    st.text(max_size=12), st.sampled_from(["auto", "3", "cpu", "nvme", "qlora", "all-linear", "24GiB"]))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), inner, max_size=5)),
    max_leaves=25)


def lint_text(tmp: Path, name: str, text: str) -> None:
    path = tmp / name
    path.write_bytes(text.encode("utf-8", "surrogatepass"))
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
        kind = data.draw(st.sampled_from(["delete", "insert", "replace_line", "swap_value", "truncate"]))
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
                                data.draw(st.sampled_from(["'3'", "null", "[]", "{}", "-1", "1e999", "fp4"])), 1)
        else:
            text = text[:i]
    suffix = source.suffix
    lint_text(tmp_path_factory.mktemp("fz"), f"m{suffix}", text)


def test_cli_on_garbage_never_prints_a_traceback(tmp_path):
    samples = ["\x00\x01", "{{{{", "a: *nope", "- - - -", "model:\n\t- x", '{"a": 1,}', "[" * 5000]
    for i, text in enumerate(samples):
        (tmp_path / f"g{i}.yaml").write_text(text)
        (tmp_path / f"g{i}.json").write_text(text)
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00garbage")
    result = run_cli("lint", tmp_path)
    assert result.returncode == 1
    assert "Traceback" not in result.stdout + result.stderr
