"""The package's import graph: no cycle at any level, and the light commands never import torch.

Every import counts, including those inside functions (the lazy ones that keep `--help` fast) and
under `if TYPE_CHECKING:`: a cycle hidden in a function body still means two modules that cannot be
understood (or split) one without the other.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "finetune"


def package_modules(package: Path = PACKAGE) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, whether it is a package's __init__)."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        modules[".".join(parts)] = (path, is_package)
    return modules


def _owning_module(name: str, modules: dict) -> str | None:
    """The longest prefix of `name` that is one of our modules (`finetune.x.Thing` -> `finetune.x`)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, path: Path, is_package: bool, modules: dict) -> set[str]:
    """Our modules that `module` imports anywhere in its body."""
    here = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(_owning_module(alias.name, modules) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = here.split(".")
                base = parts[:len(parts) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                # `from finetune.run.launch import supervision` imports the submodule itself.
                found.add(submodule if submodule in modules else _owning_module(source, modules))
    found.discard(None)
    found.discard(module)
    return found


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    modules = package_modules(package)
    return {name: imports_of(name, path, is_package, modules) for name, (path, is_package) in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (iterative depth-first search; grey = on the current path)."""
    colour = dict.fromkeys(graph, "white")
    for start in sorted(graph):
        if colour[start] != "white":
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        colour[start] = "grey"
        while stack:
            child = next(stack[-1], None)
            if child is None:
                colour[path.pop()] = "black"
                stack.pop()
            elif colour.get(child) == "grey":
                return path[path.index(child):] + [child]
            elif colour.get(child) == "white":
                colour[child] = "grey"
                path.append(child)
                stack.append(iter(sorted(graph[child])))
    return None


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The same imports between the top level's folders and modules (`finetune.plan.x` -> `finetune.plan`);
    the package's own __init__ is left out (it names the version, nothing imports through it)."""
    def folder(module: str) -> str:
        return ".".join(module.split(".")[:2])

    folders: dict[str, set[str]] = {}
    for module, imported in graph.items():
        if "." not in module:
            continue
        edges = folders.setdefault(folder(module), set())
        edges.update(folder(other) for other in imported if "." in other and folder(other) != folder(module))
    return folders


def test_no_folder_imports_itself_through_another():
    """plan/ -> train/ -> plan/ is a loop even when no two modules form one: the folders can no longer be read
    (or moved) one without the other. The arrows point down the workflow, toward the light core."""
    cycle = find_cycle(folder_graph(import_graph()))
    assert cycle is None, "folder-level import cycle: " + " -> ".join(cycle)


def test_the_walk_sees_function_level_relative_and_submodule_imports(tmp_path):
    """The graph is only as good as its walk: a cycle through a lazy import, a relative import and a
    `from package import submodule` is found."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from pkg.sub import b\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "b.py").write_text("from . import c\n")
    (package / "sub" / "c.py").write_text("import os\nfrom ..a import f\n")
    graph = import_graph(package)
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.sub.c"} and graph["pkg.sub.c"] == {"pkg.a"}
    assert find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.sub.c", "pkg.a"]
    (package / "sub" / "c.py").write_text("import os\n")
    assert find_cycle(import_graph(package)) is None
    (package / "sub" / "c.py").write_text("def g():\n    import pkg.a\n")  # pkg.a -> sub.b -> sub.c -> pkg.a
    (package / "a.py").write_text("def f():\n    from pkg.sub import b\n")
    (package / "d.py").write_text("from pkg.sub import c\n")  # a module-level loop, and a folder-level one:
    (package / "sub" / "c.py").write_text("def g():\n    from pkg import e\n")
    (package / "e.py").write_text("")
    (package / "sub" / "b.py").write_text("from pkg import d\n")  # pkg.sub -> pkg.d -> pkg.sub, no module loop
    graph = import_graph(package)
    assert find_cycle(graph) is None
    assert find_cycle(folder_graph(graph)) == ["pkg.sub", "pkg.d", "pkg.sub"]


# The packages whose __init__ is their API (`from finetune.recipe import Recipe`): the only pass-throughs.
FACADES = {"finetune.lint.deepspeed", "finetune.plan", "finetune.recipe"}


def pass_throughs(package: Path = PACKAGE) -> list[str]:
    """`module: name from source` for each name a module imports from one of ours and never uses, and each
    `__all__` outside FACADES: a second door to a name its module defines (issue 39: run_dir re-exported
    names.py, layout re-exported run_dir, the launch package its modules). Importing a submodule for what
    its import does (lint rules register themselves) is not a pass-through."""
    modules = package_modules(package)
    found = []
    for module, (path, _) in modules.items():
        if module in FACADES:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
        for node in ast.walk(tree):  # names in string annotations ("Recipe", "Optional[Checkpoint]")
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isprintable():
                try:
                    used |= {n.id for n in ast.walk(ast.parse(node.value, mode="eval")) if isinstance(n, ast.Name)}
                except SyntaxError:
                    pass
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
                found.append(f"{module}: __all__")
            if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith(package.name):
                continue
            found += [f"{module}: {alias.asname or alias.name} from {node.module}" for alias in node.names
                      if f"{node.module}.{alias.name}" not in modules and (alias.asname or alias.name) not in used]
    return found


def test_each_name_is_imported_from_the_module_that_defines_it():
    """A name passed through a module that does not use it is a second door: callers import it from the
    module that defines it (finetune.rundir.names for a run directory's files, not run_dir or layout)."""
    assert pass_throughs() == []


def test_the_pass_through_check_sees_a_re_export(tmp_path):
    package = tmp_path / "finetune"
    (package / "rundir").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "rundir" / "__init__.py").write_text("")
    (package / "rundir" / "names.py").write_text('RECIPE_FILE = "recipe.yaml"\n')
    (package / "rundir" / "layout.py").write_text("from finetune.rundir import names\n"
                                                  "def f() -> \"RECIPE_FILE\":\n    return names\n")
    (package / "rundir" / "run_dir.py").write_text(
        "from finetune.rundir.names import RECIPE_FILE  # noqa: F401 (re-exported)\n__all__ = []\n")
    assert pass_throughs(package) == ["finetune.rundir.run_dir: RECIPE_FILE from finetune.rundir.names",
                                      "finetune.rundir.run_dir: __all__"]


HEAVY = ("torch", "deepspeed", "transformers", "peft", "bitsandbytes", "accelerate", "datasets")


@pytest.mark.parametrize("argv", [
    ["--help"],
    ["lint", "recipes", "ds_configs"],
    ["render", "recipes/llama3/8b_qlora_2x12gb.yaml"],
    ["plan", "recipes/llama3/8b_qlora_2x12gb.yaml"],
    ["schema"],
], ids=lambda argv: argv[0])
def test_light_commands_never_import_heavy_libraries(argv):
    code = (f"import sys, runpy; sys.argv = ['finetune'] + {argv!r}\n"
            "try:\n    runpy.run_module('finetune.cli', run_name='__main__')\nexcept SystemExit as exc:\n"
            "    code = exc.code\nelse:\n    code = 0\n"
            f"print('HEAVY', [m for m in {HEAVY!r} if m in sys.modules], 'EXIT', code)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert "HEAVY [] EXIT 0" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
