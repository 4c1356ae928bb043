"""Regenerate ds_configs/*.json from finetune.render (the same code that renders recipes).

    python scripts/gen_ds_configs.py           # rewrite the templates
    python scripts/gen_ds_configs.py --check   # exit 1 if a template drifted (CI / tests)
"""

from __future__ import annotations

import sys
from pathlib import Path

from finetune.render import TEMPLATES, dumps, render_template

OUT = Path(__file__).resolve().parent.parent / "ds_configs"


def main(argv: list[str]) -> int:
    check = "--check" in argv
    drifted = []
    for name in TEMPLATES:
        path = OUT / f"{name}.json"
        text = dumps(render_template(name))
        if check:
            if not path.exists() or path.read_text() != text:
                drifted.append(path.name)
        else:
            OUT.mkdir(exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(OUT.parent)}")
    stale = sorted(p.name for p in OUT.glob("*.json") if p.stem not in TEMPLATES)
    if check and (drifted or stale):
        print(f"ds_configs out of date: {', '.join(drifted + stale)}; run python scripts/gen_ds_configs.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
