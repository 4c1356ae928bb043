"""One definition of each thing in the package (issue 10): found by reading the source, since a second
copy works just as well as the first until the two drift apart."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "finetune"
MODULES = sorted(PACKAGE.rglob("*.py"))


def _trees():
    for path in MODULES:
        yield path.relative_to(PACKAGE.parent).as_posix(), ast.parse(path.read_text(encoding="utf-8"), str(path))


@pytest.mark.parametrize("name", ["Checkpoint"])
def test_one_class_of_the_name(name):
    defined = [where for where, tree in _trees() for node in ast.walk(tree)
               if isinstance(node, ast.ClassDef) and node.name == name]
    assert defined == ["finetune/rundir/checkpoint.py"]


def test_the_builtin_prefix_is_spelled_in_one_place():
    """Everything else asks finetune.builtin (is_builtin, builtin_name, BUILTIN_PREFIX)."""
    spelled = [f"{where}:{node.lineno}" for where, tree in _trees() for node in ast.walk(tree)
               if isinstance(node, ast.Constant) and node.value == "builtin:"]
    assert [place.split(":")[0] for place in spelled] == ["finetune/builtin.py"], spelled


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

    unknown = r"unknown built-in model `builtin:tiny-gpt` \(known: builtin:tiny-llama\)"
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
    ours = {name for name in _error_classes() if name == "FinetuneError" or _derives_from_finetune_error(name, _error_classes())}
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
