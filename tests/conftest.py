"""Shared test fixtures. Keep this small; module-specific helpers live beside their tests."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FINETUNE = [sys.executable, "-m", "finetune.cli"]

MINIMAL = """\
model:
  name_or_path: org/some-model
data:
  path: org/some-dataset
"""


@pytest.fixture
def write_recipe(tmp_path):
    """write_recipe(text, name="r.yaml") -> Path of a recipe file in tmp_path (text is dedented)."""

    def write(text: str = MINIMAL, name: str = "r.yaml") -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
        return path

    return write


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the real `finetune` entry point in a subprocess."""
    return subprocess.run([*FINETUNE, *map(str, args)], capture_output=True, text=True, cwd=cwd or REPO, timeout=timeout)
