"""Write recipes/data/colours.jsonl and its images (recipes/data/images/*.png): the tiny vision-language
recipes' data (finetune.builtin_vision.example_rows: 8 flat colour squares, 16 rows).

    python scripts/make_vision_data.py
"""

from __future__ import annotations

import json
from pathlib import Path

from finetune.builtin_vision import example_rows
from finetune.fsutil import write_atomic

DATA = Path(__file__).resolve().parent.parent / "recipes" / "data"


def main() -> None:
    rows = example_rows(DATA)
    write_atomic(DATA / "colours.jsonl", "".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {DATA / 'colours.jsonl'} ({len(rows)} rows) and {len(list((DATA / 'images').glob('*.png')))} images")


if __name__ == "__main__":
    main()
