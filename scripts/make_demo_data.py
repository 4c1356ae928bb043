"""Write recipes/data/demo_instructions.jsonl (alpaca) and demo_chats_sharegpt.jsonl (ShareGPT), the
demo data sets, from finetune.builtin.demo_examples() and demo_conversations().

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

from finetune.builtin import write_demo_jsonl, write_demo_sharegpt

TARGET = Path(__file__).resolve().parent.parent / "recipes" / "data" / "demo_instructions.jsonl"
CHATS = TARGET.parent / "demo_chats_sharegpt.jsonl"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the shipped file instead of writing it")
    parser.add_argument("-o", "--output", type=Path, default=TARGET)
    parser.add_argument("--chats", type=Path, default=CHATS, help="where the ShareGPT chats go")
    args = parser.parse_args()
    writers = [(write_demo_jsonl, args.output), (write_demo_sharegpt, args.chats)]
    if args.check:
        stale = 0
        for write, target in writers:
            with tempfile.TemporaryDirectory() as tmp:
                write(Path(tmp) / "fresh.jsonl")
                fresh = (Path(tmp) / "fresh.jsonl").read_text()
            if not target.is_file() or target.read_text() != fresh:
                print(f"{target} is out of date: run python scripts/make_demo_data.py", file=sys.stderr)
                stale += 1
        return 1 if stale else 0
    for write, target in writers:
        print(f"wrote {write(target)} examples to {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
