"""Modules stay a few hundred lines, named after what they hold; a longer one says why at its top."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_LINES = 500
REASON = "Long because"



def long_modules(root: Path = REPO) -> list[tuple[str, int]]:
    """(path, lines) of every package module over MAX_LINES whose docstring has no line starting `Long because`."""
    found = []
    for path in sorted((root / "finetune").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        lines = text.count("\n")
        if lines <= MAX_LINES:
            continue
        docstring = ast.get_docstring(ast.parse(text)) or ""
        if not any(line.strip().startswith(REASON) for line in docstring.splitlines()):
            found.append((path.relative_to(root).as_posix(), lines))
    return found


def test_long_modules_say_why():
    unexplained = long_modules()
    assert not unexplained, (f"modules over {MAX_LINES} lines without a `{REASON} ...` line in their docstring "
                             f"(split them along their parts, or say why not): {unexplained}")


def test_the_check_reads_line_counts_and_reasons(tmp_path):
    package = tmp_path / "finetune"
    package.mkdir()
    body = "x = 1\n" * (MAX_LINES + 1)
    (package / "short.py").write_text('"""Short."""\n')
    (package / "long.py").write_text('"""A table.\n"""\n' + body)
    (package / "reasoned.py").write_text('"""A table.\n\nLong because it is one table.\n"""\n' + body)
    assert long_modules(tmp_path) == [("finetune/long.py", MAX_LINES + 3)]
