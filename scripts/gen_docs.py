"""Regenerate the generated parts of README.md from the code: the recipe reference (from the
pydantic schema) and the lint rule table (from the rule modules).

    python scripts/gen_docs.py           # rewrite README.md between the markers
    python scripts/gen_docs.py --check   # exit 1 if README.md is stale
"""

from __future__ import annotations

import json
import sys
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from finetune.recipe import Recipe, section_model

README = Path(__file__).resolve().parent.parent / "README.md"


def _type_name(annotation: Any) -> str:
    text = str(annotation).replace("typing.", "").replace("NoneType", "null").replace("finetune.recipe.schema.", "")
    for prefix in ("<class '", "'>"):
        text = text.replace(prefix, "")
    return text.replace("Literal", "one of ").replace("Optional", "optional ").replace("Union", "")


def _default(field: Any) -> str:
    if field.is_required():
        return "**required**"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return ""
    return "`" + json.dumps(value) + "`"


def recipe_reference() -> str:
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for name, field in Recipe.model_fields.items():
        section = section_model(field.annotation)
        if section is None:
            lines.append(f"| `{name}` | {_type_name(field.annotation)} | {_default(field)} | {field.description or ''} |")
            continue
        lines += _section_rows(name, field, section)
    return "\n".join(lines)


def _section_rows(name: str, field: Any, section: Any) -> list[str]:
    """A section's heading row and its keys; a section inside it (preference.reference) the same way, and the
    keys of a list of sections (data.sources[]) as rows of their own."""
    lines = [f"| **`{name}`** | section | | {field.description or ''} |"]
    for sub, subfield in section.model_fields.items():
        inner = section_model(subfield.annotation)
        if inner is not None and _list_item_model(subfield.annotation) is None:
            lines += _section_rows(f"{name}.{sub}", subfield, inner)
            continue
        lines.append(f"| `{name}.{sub}` | {_type_name(subfield.annotation)} | {_default(subfield)} | {subfield.description or ''} |")
        item = _list_item_model(subfield.annotation)
        for key, itemfield in (item.model_fields.items() if item else ()):
            lines.append(f"| `{name}.{sub}[].{key}` | {_type_name(itemfield.annotation)} | {_default(itemfield)} | {itemfield.description or ''} |")
    return lines


def _list_item_model(annotation: Any):
    """The model of a `list[Model]` (optional or not) field: its keys get rows of their own."""
    for arg in typing.get_args(annotation) or ():
        for inner in typing.get_args(arg) or (arg,):
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                return inner
    return None


def rule_table() -> str:
    from finetune.lint import PLAN_RULES, deepspeed, parallel_rules, recipe_rules, vision_rules  # noqa: F401 (they add to RULES)

    rules = {**recipe_rules.RULES, **deepspeed.RULES, **PLAN_RULES}
    lines = ["| id | what it catches |", "|---|---|"]
    lines += [f"| {rule} | {text} |" for rule, text in sorted(rules.items())]
    return "\n".join(lines)


SECTIONS = {"recipe-reference": recipe_reference, "lint-rules": rule_table}


def render(text: str) -> str:
    for name, build in SECTIONS.items():
        start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
        if start not in text or end not in text:
            continue
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        text = f"{head}{start}\n{build()}\n{end}{tail}"
    return text


def main(argv: list[str]) -> int:
    current = README.read_text()
    fresh = render(current)
    if "--check" in argv:
        if fresh != current:
            print("README.md is stale: run python scripts/gen_docs.py")
            return 1
        return 0
    README.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
