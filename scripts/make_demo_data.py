"""Write recipes/data/demo_instructions.jsonl, the demo data set, from finetune.tiny.demo_examples().

    python scripts/make_demo_data.py            # rewrite the shipped file
    python scripts/make_demo_data.py --check    # exit 1 if the shipped file differs (used by tests)

The examples are generated, not downloaded: arithmetic, capitals, unit conversions, word-order
reversal and numbers in words, in answer formats a tiny model learns in a minute. The built-in tiny
model's tokenizer is trained on the same examples.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from finetune.tiny import write_demo_jsonl

TARGET = Path(__file__).resolve().parent.parent / "recipes" / "data" / "demo_instructions.jsonl"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the shipped file instead of writing it")
    parser.add_argument("-o", "--output", type=Path, default=TARGET)
    args = parser.parse_args()
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            write_demo_jsonl(Path(tmp) / "demo.jsonl")
            fresh = (Path(tmp) / "demo.jsonl").read_text()
        if not args.output.is_file() or args.output.read_text() != fresh:
            print(f"{args.output} is out of date: run python scripts/make_demo_data.py", file=sys.stderr)
            return 1
        return 0
    count = write_demo_jsonl(args.output)
    print(f"wrote {count} examples to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
