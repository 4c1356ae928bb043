"""Write recipes/data/colours.jsonl and its images (recipes/data/images/*.png): the tiny vision-language
recipes' data (finetune.builtin_vision.example_rows: 8 flat colour squares, 16 rows).

    python scripts/make_vision_data.py
    python scripts/make_vision_data.py --out DIR   # elsewhere (the tests compare it with the shipped files)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

from finetune.builtin_vision import example_rows
from finetune.fsutil import write_atomic

DATA = Path(__file__).resolve().parent.parent / "recipes" / "data"


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DATA, help="the folder (default recipes/data)")
    out = parser.parse_args(argv).out
    rows = example_rows(out)
    write_atomic(out / "colours.jsonl", "".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {out / 'colours.jsonl'} ({len(rows)} rows) and {len(list((out / 'images').glob('*.png')))} images")


if __name__ == "__main__":
    main()
