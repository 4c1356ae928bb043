"""One definition of each thing in the package (issue 10): found by reading the source, since a second
copy works just as well as the first until the two drift apart."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "finetune"
MODULES = sorted(PACKAGE.rglob("*.py"))


@functools.lru_cache(maxsize=1)
def _parsed() -> tuple:
    return tuple((path.relative_to(PACKAGE.parent).as_posix(), ast.parse(path.read_text(encoding="utf-8"), str(path)))
                 for path in MODULES)


def _trees():
    yield from _parsed()


@pytest.mark.parametrize("name", ["Checkpoint"])
def test_one_class_of_the_name(name):
    defined = [where for where, tree in _trees() for node in ast.walk(tree)
               if isinstance(node, ast.ClassDef) and node.name == name]
    assert defined == ["finetune/rundir/checkpoint.py"]


def test_the_builtin_prefix_is_spelled_in_one_place():
    """Everything else asks finetune.builtin (is_builtin, builtin_name, BUILTIN_PREFIX); the constant lives with the
    other reference names, where finetune.vision_models reads it without importing finetune.builtin."""
    spelled = [f"{where}:{node.lineno}" for where, tree in _trees() for node in ast.walk(tree)
               if isinstance(node, ast.Constant) and node.value == "builtin:"]
    assert [place.split(":")[0] for place in spelled] == ["finetune/recipe/references.py"], spelled


def test_the_collectives_have_one_home():
    """torch.distributed is imported only by finetune/train/dist.py (the runner and the preemption
    callback share its barrier, all_gather and rank helpers)."""
    importers = set()
    for where, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import) and any(a.name == "torch.distributed" for a in node.names):
                importers.add(where)
            if isinstance(node, ast.ImportFrom) and node.module == "torch" and any(a.name == "distributed" for a in node.names):
                importers.add(where)
    assert importers == {"finetune/train/dist.py"}


def test_no_private_name_is_imported_from_another_module():
    private = [f"{where}:{node.lineno} {node.module}.{alias.name}" for where, tree in _trees() for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("finetune")
               for alias in node.names if alias.name.startswith("_") and not alias.name.startswith("__")]
    assert private == []


def test_every_reader_of_a_builtin_name_answers_alike():
    from finetune.plan.from_recipe import resolve_model
    from finetune.plan.setup import PlanError
    from finetune.run.preflight import Preflight, model_step
    from tests.conftest import hub_recipe

    unknown = r"unknown built-in model `builtin:tiny-gpt` \(known: builtin:tiny-llama, builtin:tiny-qwen2\.5, .*\)"
    with pytest.raises(PlanError, match=unknown):
        resolve_model("builtin:tiny-gpt")
    result = Preflight()
    model_step(hub_recipe(model={"name_or_path": "builtin:tiny-gpt"}), result)
    assert len(result.errors) == 1 and re.search(unknown, result.errors[0])
    arch, params, _ = resolve_model("builtin:tiny-llama")
    assert arch.name == "builtin:tiny-llama" and params > 0


_BUILTIN_BASES = {"Exception", "ValueError", "RuntimeError", "TypeError", "KeyError", "OSError", "LookupError"}


def _error_classes() -> dict[str, tuple[str, list[str]]]:
    """Class name -> (module, base names) of every exception class the package defines."""
    classes = {}
    for where, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
                classes[node.name] = (where, bases)

    def is_error(name: str, seen=()) -> bool:
        if name in _BUILTIN_BASES or name == "FinetuneError":
            return True
        return name in classes and name not in seen and any(is_error(b, seen + (name,)) for b in classes[name][1])

    return {name: info for name, info in classes.items() if any(is_error(b) for b in info[1])}


def _derives_from_finetune_error(name: str, classes: dict) -> bool:
    bases = classes.get(name, ("", []))[1]
    return "FinetuneError" in bases or any(_derives_from_finetune_error(b, classes) for b in bases if b in classes)


def test_every_error_of_the_package_has_the_one_base():
    """finetune.errors.FinetuneError carries the exit code; the CLI maps it in one place (cli.common.handled)."""
    classes = _error_classes()
    assert len(classes) >= 18
    loose = sorted(f"{where}:{name}" for name, (where, _) in classes.items()
                   if name != "FinetuneError" and not _derives_from_finetune_error(name, classes))
    assert loose == []


def test_no_command_catches_a_finetune_error_itself():
    """A command that catches (and rewords) one of these would be a second mapping beside handled()."""
    classes = _error_classes()
    ours = {name for name in classes if name == "FinetuneError" or _derives_from_finetune_error(name, classes)}
    caught = []
    for where, tree in _trees():
        if not where.startswith("finetune/cli/"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ExceptHandler) and node.type is not None:
                types = node.type.elts if isinstance(node.type, ast.Tuple) else [node.type]
                names = {t.id if isinstance(t, ast.Name) else getattr(t, "attr", "") for t in types}
                if names & ours and not (where == "finetune/cli/common.py" and names == {"FinetuneError"}):
                    caught.append(f"{where}:{node.lineno} {sorted(names & ours)}")
    assert caught == []


def test_the_cli_maps_each_error_to_its_lines_and_exit_code(capsys):
    import typer

    from finetune.cli.common import handled
    from finetune.recipe.loading import Problem, RecipeProblem
    from finetune.run.slurm import SlurmError

    def raising(exc):
        def command():
            raise exc
        return handled(command)

    for exc, code, err in [
        (SlurmError("pass --gpus-per-node"), 2, "error: pass --gpus-per-node\n"),
        (RecipeProblem([Problem("r.yaml", 3, 5, "lora.r", "must be > 0", rule="R004")]), 1, None),
    ]:
        with pytest.raises(typer.Exit) as stopped:
            raising(exc)()
        assert stopped.value.exit_code == code
        shown = capsys.readouterr().err
        assert shown == (err if err is not None else exc.problems[0].render() + "\n")


# ----------------------------------------------------------------------------------------------
# One definition of each constant (issue 19)
#
# "Defined" means bound to a name where a reader looks for a fact: an assignment at module level
# (also inside a module-level `if`/`try`) or in a class body (dataclass and pydantic defaults), or a
# parameter's default value. The facts counted are strings of 6 or more characters and collections
# (tuple, list, set, frozenset(...)) of 2 or more strings; sets compare without order. Docstrings,
# messages and other literals inside expressions are uses, not definitions, and are not counted here.

# File names the run directory holds: finetune/rundir/names.py is their one home (issue 19 item 1), checked
# on its own below.
RUN_DIR_FILES = {"recipe.yaml", "deepspeed.json", "training_args.json", "report.html", "loss.png",
                 "finetune_recipe.yaml", "adapter_config.json"}


def _fact(node) -> object:
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) >= 6:
        return node.value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("frozenset", "set", "tuple") \
            and len(node.args) == 1:
        return _fact(node.args[0])
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) >= 2 and \
            all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
        values = tuple(e.value for e in node.elts)
        return tuple(sorted(values)) if isinstance(node, ast.Set) else values
    return None


def _definitions(tree: ast.Module):
    """(fact, line) for every definition in one module."""
    def body_of(statements):
        for node in statements:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                yield node.value
            elif isinstance(node, ast.ClassDef):
                yield from body_of(node.body)
            elif isinstance(node, ast.If):
                yield from body_of(node.body + node.orelse)
            elif isinstance(node, ast.Try):
                yield from body_of(node.body + node.orelse + node.finalbody)

    values = list(body_of(tree.body))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            values += node.args.defaults + [d for d in node.args.kw_defaults if d is not None]
    for value in values:
        fact = _fact(value)
        if fact is not None:
            yield fact, value.lineno


def _defined_where() -> dict:
    where_defined: dict = {}
    for where, tree in _trees():
        for fact, line in _definitions(tree):
            where_defined.setdefault(fact, []).append(f"{where}:{line}")
    return where_defined


def _defined_twice() -> dict:
    return {fact: places for fact, places in _defined_where().items() if len({p.split(":")[0] for p in places}) > 1}


def test_no_constant_is_defined_in_two_modules():
    """A second definition works as well as the first until one of them changes: the second module imports it."""
    assert {fact: places for fact, places in _defined_twice().items() if fact not in RUN_DIR_FILES} == {}


def test_the_definition_walk_counts_what_it_says(tmp_path):
    tree = ast.parse('''
A = "recipe.yaml"
B: tuple = ("prompt", "chosen")
S = frozenset({"b", "a"})
SHORT = "abc"
if True:
    C = ["x", "y"]
class K:
    name: str = "alpaca-ish"
def f(x="default-value", *, y=("p", "q")):
    local = "not a definition"
    return "nor a use"
''')
    assert sorted((fact for fact, _ in _definitions(tree)), key=repr) == sorted([
        "recipe.yaml", ("prompt", "chosen"), ("a", "b"), ("x", "y"), "alpaca-ish", "default-value", ("p", "q")], key=repr)


_FILE_NAME = re.compile(r"^[\w.-]+\.(json|jsonl|yaml|yml|png|html|txt|csv|parquet|safetensors|bin|pt|lock|log)$")


def _file_name_spellings() -> dict:
    """file name defined as a constant -> places in other modules that spell it as a literal."""
    defined = {fact: places for fact, places in _defined_where().items()
               if isinstance(fact, str) and _FILE_NAME.match(fact)}
    spelled: dict = {}
    for where, tree in _trees():
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in defined and id(node) not in docstrings and \
                    where not in {place.split(":")[0] for place in defined[node.value]}:
                spelled.setdefault(node.value, []).append(f"{where}:{node.lineno}")
    return spelled


def test_a_file_name_constant_is_spelled_only_where_it_is_defined():
    """Once a module names a file (`ARROW_MARKER = "dataset_info.json"`), the others import the name."""
    spelled = {name: places for name, places in _file_name_spellings().items() if name not in RUN_DIR_FILES}
    assert spelled == {}


def test_run_directory_file_names_have_one_home():
    """finetune/rundir/names.py (issue 19 item 1); the other modules import them."""
    assert {name: places for name, places in _defined_twice().items() if name in RUN_DIR_FILES} == {}
    assert {name: places for name, places in _file_name_spellings().items() if name in RUN_DIR_FILES} == {}
