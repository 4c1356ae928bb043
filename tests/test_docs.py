"""README stays true: generated sections in sync, every command documented, CI runs its test command."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import REPO, run_cli


def test_generated_readme_sections_are_fresh():
    out = subprocess.run([sys.executable, "scripts/gen_docs.py", "--check"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_command_is_documented():
    readme = (REPO / "README.md").read_text()
    help_text = run_cli("--help").stdout
    commands = re.findall(r"^\s{2}(\w[\w-]*)\s", help_text.split("Commands:")[1], re.MULTILINE)
    assert commands
    for command in commands:
        assert f"`finetune {command}" in readme, command


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    test_command = ".venv/bin/python -m pytest -q -n auto"
    assert test_command in readme and test_command in ci
