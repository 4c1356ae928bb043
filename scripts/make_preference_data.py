"""Write the tiny preference data sets in recipes/data/ from the demo examples (finetune.builtin.demo_examples()).

    python scripts/make_preference_data.py            # rewrite the shipped files
    python scripts/make_preference_data.py --check    # exit 1 if a shipped file differs (used by tests)

demo_preference.jsonl: paired rows (prompt / chosen / rejected) as chat messages, for dpo, orpo and simpo.
demo_kto.jsonl: the same pairs unpaired (prompt / completion / label), for kto.

The rule a tiny model can pick up in a few dozen steps: the chosen answer is the demo's own answer, a full
sentence that restates the question; the rejected one dodges it (a short evasive reply) or gets it wrong (the
answer of another example). The prompts and answers use the words the built-in tokenizer was trained on.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from finetune.fsutil import write_atomic
from finetune.builtin import demo_examples

DATA = Path(__file__).resolve().parent.parent / "recipes" / "data"
PAIRED = DATA / "demo_preference.jsonl"
UNPAIRED = DATA / "demo_kto.jsonl"
SEED = 11  # issue 11
PAIRS = 160
EVASIVE = ("I do not know.", "Ask someone else.", "No.", "That is not a question.", "Maybe.")


def _prompt(example: dict[str, str]) -> str:
    return f"{example['instruction']}\n{example['input']}" if example["input"] else example["instruction"]


def paired_rows() -> list[dict]:
    rng = random.Random(SEED)
    examples = demo_examples()[:PAIRS]
    rows = []
    for i, example in enumerate(examples):
        if i % 2 == 0:
            rejected = rng.choice(EVASIVE)
        else:
            others = [e["output"] for e in examples if e["output"] != example["output"]]
            rejected = rng.choice(others)
        rows.append({"prompt": [{"role": "user", "content": _prompt(example)}],
                     "chosen": [{"role": "assistant", "content": example["output"]}],
                     "rejected": [{"role": "assistant", "content": rejected}]})
    return rows


def unpaired_rows(pairs: list[dict]) -> list[dict]:
    """Each pair gives a desirable and an undesirable row (what trl.unpair_preference_dataset does),
    interleaved so every batch sees both labels."""
    rows = []
    for pair in pairs:
        rows.append({"prompt": pair["prompt"], "completion": pair["chosen"], "label": True})
        rows.append({"prompt": pair["prompt"], "completion": pair["rejected"], "label": False})
    return rows


def render(rows: list[dict]) -> str:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def outputs() -> dict[Path, str]:
    pairs = paired_rows()
    return {PAIRED: render(pairs), UNPAIRED: render(unpaired_rows(pairs))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the shipped files instead of writing them")
    args = parser.parse_args()
    stale = []
    for path, text in outputs().items():
        if args.check:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                stale.append(path)
            continue
        write_atomic(path, text)
        print(f"wrote {text.count(chr(10))} rows to {path}")
    for path in stale:
        print(f"{path} is out of date: run python scripts/make_preference_data.py", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
