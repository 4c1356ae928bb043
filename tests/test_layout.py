"""tests/ mirrors the package (issue 39): the tests of finetune/data/prepare.py are tests/data/test_prepare.py, and
the end-to-end launches (2-process training runs, DeepSpeed processes) live in tests/launches/, so the fast tier is
a folder (`pytest --ignore tests/launches`) and the `slow` marker comes from the folder (tests/conftest.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
PACKAGE = TESTS.parent / "finetune"
# Folders of tests that mirror no package folder: the launches, and the checks of scripts/.
OWN_FOLDERS = ("launches", "scripts")


def test_every_test_folder_mirrors_a_package_folder():
    strays = []
    for path in sorted(TESTS.rglob("test_*.py")):
        folder = path.parent.relative_to(TESTS)
        if folder.parts and folder.parts[0] not in OWN_FOLDERS and not (PACKAGE / folder).is_dir():
            strays.append(str(path.relative_to(TESTS)))
    assert not strays, f"test files in a folder finetune/ does not have: {strays}"


def test_only_the_launches_folder_is_slow():
    """A `pytest.mark.slow` written by hand outside tests/launches/ would put a launch back into the fast tier's
    folder; inside it the mark is redundant."""
    marked = []
    for path in sorted(TESTS.rglob("*.py")):
        if path.name == "conftest.py":  # where the folder's rule gives the mark
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == "slow" and isinstance(node.value, ast.Attribute) \
                    and node.value.attr == "mark":
                marked.append(f"{path.relative_to(TESTS)}:{node.lineno}")
    assert not marked, f"the slow marker is the folder's (tests/launches/): {marked}"


def test_each_launch_module_is_collected_as_slow(pytestconfig):
    from tests.conftest import LAUNCHES

    assert LAUNCHES == TESTS / "launches" and LAUNCHES.is_dir()
    assert any(line.startswith("slow:") for line in pytestconfig.getini("markers"))
