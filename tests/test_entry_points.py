"""Entry points outside the package do not rot (issue 39): every `import finetune...` / `from finetune... import
NAME` (and `tests...`) in scripts/ and tests/ names a module that exists and a name that module defines, read from
the source with `ast` (nothing is imported: no torch, well under a second); every script runs in at least a smoke
test below or says in its docstring why not.

A script that moves a module along would otherwise fail only when someone runs it (tests/data/prepare_cases.py's
`--write` imported `tokenize_for_training` from a module that had lost it; scripts/lint_ds_snapshot.py fell back to
modules deleted two issues earlier).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from functools import lru_cache
from pathlib import Path
from typing import Iterator, Optional

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("finetune", "tests")
# Fixtures are other programs' files kept as data (a run directory holds DeepSpeed's zero_to_fp32.py).
LEFT_OUT = (REPO / "tests" / "fixtures",)


def _sources() -> list[Path]:
    files = sorted((REPO / "scripts").glob("*.py")) + sorted((REPO / "tests").rglob("*.py"))
    return [f for f in files if not any(f.is_relative_to(folder) for folder in LEFT_OUT)]


@lru_cache(maxsize=None)
def module_file(dotted: str) -> Optional[Path]:
    """finetune/a/b.py or finetune/a/b/__init__.py for `finetune.a.b`, or None."""
    base = REPO.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@lru_cache(maxsize=None)
def defined_names(path: Path) -> frozenset[str]:
    """Every name a module binds at its top level (under if / try / with too), and `*` when it has a module
    `__getattr__` (then any name may exist)."""
    names: set[str] = set()

    def bind(target: ast.AST) -> None:
        for node in ast.walk(target):
            if isinstance(node, ast.Name):
                names.add(node.id)

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name if node.name != "__getattr__" else "*")
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    bind(target)
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                bind(node.target)
            elif isinstance(node, ast.Import):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                names.update(a.asname or a.name for a in node.names)
            elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
                for block in ("body", "orelse", "finalbody"):
                    visit(getattr(node, block, []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
    visit(parsed(path).body)
    return frozenset(names)


def has_name(module: str, name: str) -> bool:
    """`from module import name` works: the module defines it, or it is a submodule."""
    path = module_file(module)
    if path is None:
        return False
    names = defined_names(path)
    return name.startswith("__") or name in names or "*" in names or module_file(f"{module}.{name}") is not None


def _ours(dotted: Optional[str]) -> bool:
    return bool(dotted) and dotted.split(".")[0] in PACKAGES


@lru_cache(maxsize=None)
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def broken_imports(tree: ast.Module, label: str) -> Iterator[str]:
    """`label:line: what` for each import of ours in `tree` that would fail, and each attribute of an imported
    module of ours (`import finetune.data.validate as v; v.NAME`, `monkeypatch.setattr(prep, "NAME", ...)`) that
    the module does not define."""
    modules: dict[str, str] = {}  # local name -> the module of ours it is bound to
    rebound: set[str] = set()  # bound to something else somewhere: not followed
    uses: list[tuple[ast.AST, str, str]] = []  # (node, local name, attribute)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not _ours(alias.name):
                    continue
                if module_file(alias.name) is None:
                    yield f"{label}:{node.lineno}: import {alias.name}: no such module"
                elif alias.asname:
                    modules[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _ours(node.module):
            if module_file(node.module) is None:
                yield f"{label}:{node.lineno}: from {node.module}: no such module"
                continue
            for alias in node.names:
                if not has_name(node.module, alias.name):
                    yield f"{label}:{node.lineno}: from {node.module} import {alias.name}: {node.module} does not define it"
                elif module_file(f"{node.module}.{alias.name}") is not None:
                    modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            rebound.add(node.id)
        elif isinstance(node, ast.arg):
            rebound.add(node.arg)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            uses.append((node, node.value.id, node.attr))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "setattr"
              and len(node.args) >= 2 and isinstance(node.args[0], ast.Name)
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            uses.append((node, node.args[0].id, node.args[1].value))
    for node, name, attribute in uses:
        module = modules.get(name) if name not in rebound else None
        if module is not None and not has_name(module, attribute):
            yield f"{label}:{node.lineno}: {name}.{attribute}: {module} does not define {attribute}"


def test_every_import_of_ours_in_scripts_and_tests_resolves():
    problems = [problem for path in _sources() for problem in broken_imports(parsed(path), str(path.relative_to(REPO)))]
    assert not problems, "\n".join(problems)


def test_the_import_check_sees_a_broken_import():
    """The checker itself: a name a module lost, a module that is gone, a stale monkeypatch target."""
    script = (
        "from finetune.data.tokenize import tokenize_for_training\n"
        "from finetune.lint.deepspeed_rules import check_config\n"
        "from finetune.data import prepare as prep\n"
        "from finetune.recipe import Recipe, parse_size\n"
        "def f(monkeypatch):\n"
        "    monkeypatch.setattr(prep, 'NO_SUCH_CONSTANT', 1)\n"
        "    monkeypatch.setattr(prep, 'BATCH', 1)\n"
    )
    found = [p.split(": ", 1)[1] for p in broken_imports(ast.parse(script), "probe.py")]
    assert found == [
        "from finetune.data.tokenize import tokenize_for_training: finetune.data.tokenize does not define it",
        "from finetune.lint.deepspeed_rules: no such module",
        "prep.NO_SUCH_CONSTANT: finetune.data.prepare does not define NO_SUCH_CONSTANT",
    ]


# ------------------------------------------------------------------------------------------------
# Every script runs in a test (the cheapest mode that still runs its code), or its docstring says why not

NOT_RUN = "Not run by the tests:"


def _string_constants(path: Path) -> Iterator[str]:
    """The string literals of a module, its docstrings left out (a usage line there runs nothing)."""
    tree = parsed(path)
    docstrings = {id(body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                  and (body := node.body) and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.value


def test_every_script_runs_in_a_test_or_says_why_not():
    literals = {text for path in (REPO / "tests").rglob("*.py") for text in _string_constants(path)}
    idle = []
    for script in sorted((REPO / "scripts").glob("*.py")):
        docstring = ast.get_docstring(parsed(script)) or ""
        if not any(script.name in text for text in literals) and NOT_RUN not in docstring:
            idle.append(script.name)
    assert not idle, f"scripts no test runs (add a smoke test here, or `{NOT_RUN} why` to the docstring): {idle}"


def load_script(name: str):
    """scripts/NAME as a module (its `if __name__ == "__main__"` block does not run)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"scripts_{Path(name).stem}", REPO / "scripts" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_main(name: str, argv: list[str], monkeypatch, capsys) -> str:
    """What scripts/NAME prints when run with `argv` (in this process: no second interpreter, no second torch)."""
    module = load_script(name)
    monkeypatch.setattr(sys, "argv", [str(REPO / "scripts" / name), *argv])
    assert module.main() in (None, 0)
    return capsys.readouterr().out


def test_bench_lint_times_one_lint_of_the_shipped_files(monkeypatch, capsys):
    out = run_main("bench_lint.py", ["--runs", "1", "--no-torch"], monkeypatch, capsys)
    assert "finetune lint recipes ds_configs (" in out and "median" in out and "target: lint median < 0.5 s:" in out


def test_bench_loss_kernels_give_the_same_loss_on_a_tiny_head():
    bench = load_script("bench_loss.py")
    default, chunked = (bench.measure(kernel, 96, 512, 16, "float32", False) for kernel in ("default", "chunked"))
    assert chunked["loss"] == pytest.approx(default["loss"], rel=1e-5)
    assert default["chunks"] == 1 and chunked["chunks"] >= 1


ALLOCATE_64MIB = "import time; block = b'x' * (64 << 20); time.sleep(0.3)"  # b'x' * n touches every page


def test_bench_merge_builds_its_models_and_samples_a_child(tmp_path):
    bench = load_script("bench_merge.py")
    bench.build_base(tmp_path / "base", "tiny")
    bench.build_adapter(tmp_path / "adapter", tmp_path / "base", r=2, size="tiny")
    assert bench.compare(tmp_path / "base", tmp_path / "base") == 21  # 2 layers x 9 tensors + embeddings, norm, head
    measured = bench.run_measured([sys.executable, "-c", ALLOCATE_64MIB], "probe")
    assert measured["anon"] >= 64 << 20 and measured["maxrss"] >= 64 << 20


def test_bench_tokenize_sides_agree_and_its_watch_sums_the_process_tree(tmp_path, tiny_dir, monkeypatch):
    import datasets
    from transformers import AutoTokenizer

    bench = load_script("bench_tokenize.py")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))  # the reference side's cache
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_dir))
    data = tmp_path / "alpaca.jsonl"
    bench.write_rows(data, "alpaca", 24)
    counts = []
    for name, run in (("ours", bench.run_finetune), ("reference", bench.run_reference)):
        (tmp_path / name).mkdir()
        counts.append(run(data, "alpaca", tokenizer, 64, 1, tmp_path / name))
    assert counts[0] == counts[1] and counts[0]["sequences"] > 0 and counts[0]["trained_tokens"] > 0
    # The child only waits for its own child, which holds the memory: the sum over the tree sees it.
    grandchild = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {ALLOCATE_64MIB!r}])"
    watched = bench.watch(subprocess.Popen([sys.executable, "-c", grandchild]))
    assert watched["peak_rss"] >= 64 << 20 and watched["peak_anon"] >= 64 << 20 and watched["seconds"] > 0.3


def test_bench_validate_finds_the_bad_rows_of_a_small_file(monkeypatch, capsys):
    out = run_main("bench_validate.py", ["--size", "64KiB", "--no-datasets", "--no-json"], monkeypatch, capsys)
    found = [line.split("found: ", 1)[1] for line in out.splitlines() if "found: " in line]
    assert found[0] == "[]" and len(found) == 3, out
    assert all("`output`" in line and ".jsonl:" in line for line in found[1:]), out


def test_lint_ds_snapshot_writes_the_findings_of_a_few_configs(tmp_path, monkeypatch, capsys):
    import json

    out = run_main("lint_ds_snapshot.py", [str(tmp_path / "few.json"), "--count", "20"], monkeypatch, capsys)
    findings = json.loads((tmp_path / "few.json").read_text())
    corpus = len(list((REPO / "tests" / "ds_corpus").glob("*.json")))
    assert len(findings) == 20 + 7 * corpus + 7 * 4  # 7 contexts x (the corpus, 4 documents that are no mapping)
    assert f"{len(findings)} configs" in out and sum(map(len, findings)) > 0


def test_plan_trace_sweep_setups_are_ones_the_planner_accepts():
    """The trace of one setup takes seconds (tests/plan/trace/test_trace.py traces small ones); its random setups are planned."""
    import random

    from finetune.plan import plan

    sweep = load_script("plan_trace_sweep.py")
    rng = random.Random(11)
    for _ in range(8):
        setup = sweep.random_setup(rng)
        assert plan(setup).memory_views["allocated"] > 0, setup.describe()
