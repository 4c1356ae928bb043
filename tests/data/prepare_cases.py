"""Cases for the tokenizing equivalence test (tests/data/test_prepare.py) and their fingerprints.

Each case is a data section over the shipped data (recipes/data/) or over generated rows that exercise one
branch of tokenizing (formats, per-turn masks, `"train": false`, `weight: 0`, think masking, EOS, truncation,
dropped rows, text splitting, packing, weighted mixtures with seeds). `fingerprint` hashes what training gets:
every row's input_ids, labels and position_ids, and the batches each collator makes of them.

tests/golden/tokenize_equivalence.json holds the fingerprints of the implementation before issue 20 (one
process, Python lists): the parallel Arrow path must reproduce them token for token. `python -m
tests.data.prepare_cases --write` rewrites the file from today's path (finetune.data.prepare.tokenize_for_training);
`git diff tests/golden` then shows what a change to tokenizing moved (nothing, on 2026-11-27).
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "recipes" / "data"
GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "tokenize_equivalence.json"
# A template with {% generation %} blocks: the assistant turns are located by render_jinja_template instead of
# by rendering prefixes (the built-in tiny model's template has none).
GENERATION_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}"
    "{% else %}{{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
WORDS = ("the cat sat on a mat while seven quiet engineers wrote long careful notes about tokens and "
         "packing boundaries in many small files").split()


def _words(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def write_generated(folder: Path) -> dict[str, Path]:
    """Generated sources (deterministic) in `folder`: name -> file."""
    rng = random.Random(20)
    folder.mkdir(parents=True, exist_ok=True)
    files = {}

    def write(name: str, rows: list[dict[str, Any]]) -> None:
        files[name] = folder / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(r) + "\n" for r in rows))

    alpaca = []
    for i in range(120):
        row = {"instruction": _words(rng, 1, 12), "output": _words(rng, 1, 30)}
        if i % 3 == 0:
            row["input"] = _words(rng, 1, 8)
        if i % 17 == 0:  # a prompt longer than max_length: nothing left to train, dropped
            row["instruction"] = _words(rng, 120, 160)
        alpaca.append(row)
    write("alpaca", alpaca)
    texts = [{"text": _words(rng, 1, 200)} for _ in range(60)] + [{"text": "cat"}]
    write("text", texts)
    chats = []
    for i in range(80):
        turns = []
        for t in range(rng.randint(1, 3)):
            turns.append({"role": "user", "content": _words(rng, 1, 10)})
            answer = _words(rng, 1, 20)
            if (i + t) % 4 == 0:
                answer = f"<think>{_words(rng, 1, 15)}</think>{answer}"
            turn = {"role": "assistant", "content": answer}
            if (i + t) % 5 == 1:
                turn["train"] = False
            elif (i + t) % 7 == 2:
                turn["weight"] = 0
            turns.append(turn)
        if all(t.get("train") is False or t.get("weight") == 0 for t in turns if t["role"] == "assistant"):
            turns[-1].pop("train", None)
            turns[-1].pop("weight", None)
        row = {"messages": turns}
        if i % 6 == 0:
            row["system"] = _words(rng, 2, 8)
        if i % 23 == 0:  # a first user turn longer than max_length: dropped
            turns[0]["content"] = _words(rng, 150, 180)
        chats.append(row)
    write("messages", chats)
    sharegpt = [{"conversations": [{"from": "human", "value": _words(rng, 1, 10)},
                                   {"from": "gpt", "value": _words(rng, 1, 25)}]} for _ in range(50)]
    write("sharegpt", sharegpt)
    return files


def section_dict(**overrides: Any) -> dict[str, Any]:
    base = {"path": None, "format": "alpaca", "split": "train", "columns": {}, "roles": {}, "sources": None,
            "seed": 0, "think": "train", "chat_template": None, "max_length": 128, "packing": False,
            "padding_free": False, "validation_split": 0.0, "mask_prompt": True}
    return {**base, **overrides}


def _section(**overrides: Any):
    """The finetune.data.spec.DataSpec of a data section with `overrides`."""
    from finetune.data.spec import DataSpec

    return DataSpec.from_section(section_dict(**overrides))


def cases(folder: Path) -> dict[str, tuple[Any, str]]:
    """name -> (data spec, tokenizer variant: "builtin" or "generation")."""
    g = write_generated(folder)
    demo, chats = str(SHIPPED / "demo_instructions.jsonl"), str(SHIPPED / "demo_chats_sharegpt.jsonl")
    out: dict[str, tuple[Any, str]] = {
        "shipped_alpaca": (_section(path=demo), "builtin"),
        "shipped_alpaca_packed": (_section(path=demo, packing=True, max_length=256), "builtin"),
        "shipped_alpaca_unmasked_short": (_section(path=demo, mask_prompt=False, max_length=24), "builtin"),
        "shipped_sharegpt": (_section(path=chats, format="sharegpt"), "builtin"),
        "shipped_sharegpt_generation": (_section(path=chats, format="sharegpt", max_length=64), "generation"),
        "shipped_sharegpt_packed": (_section(path=chats, format="sharegpt", packing=True, max_length=512), "builtin"),
        "alpaca_truncated": (_section(path=str(g["alpaca"]), max_length=64), "builtin"),
        "alpaca_packed": (_section(path=str(g["alpaca"]), max_length=200, packing=True), "builtin"),
        "text_split": (_section(path=str(g["text"]), format="text", max_length=48), "builtin"),
        "text_packed": (_section(path=str(g["text"]), format="text", max_length=100, packing=True), "builtin"),
        "messages_masks": (_section(path=str(g["messages"]), format="messages", max_length=96), "builtin"),
        "messages_think_mask": (_section(path=str(g["messages"]), format="messages", think="mask"), "builtin"),
        "messages_generation_think": (_section(path=str(g["messages"]), format="messages", think="mask"), "generation"),
        "messages_unmasked": (_section(path=str(g["messages"]), format="messages", mask_prompt=False), "builtin"),
        "sharegpt_generated": (_section(path=str(g["sharegpt"]), format="sharegpt", max_length=40), "builtin"),
    }
    weighted = [{"path": str(g["alpaca"]), "format": "alpaca", "weight": 3},
                {"path": str(g["sharegpt"]), "format": "sharegpt", "weight": 1},
                {"path": str(g["text"]), "format": "text", "weight": 2}]
    for seed in (0, 7):
        out[f"mixture_weights_seed{seed}"] = (_section(sources=weighted, seed=seed, max_length=64), "builtin")
    sampled = [{"path": str(g["messages"]), "format": "messages", "samples": 30},
               {"path": demo, "format": "alpaca", "samples": 250}]
    out["mixture_samples_packed"] = (_section(sources=sampled, seed=3, max_length=160, packing=True), "builtin")
    out["mixture_plain"] = (_section(sources=[{"path": demo, "format": "alpaca"}, {"path": chats, "format": "sharegpt"}],
                                     seed=5), "builtin")
    return out


def tokenizer_for(variant: str, tiny_dir: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_dir))
    if variant == "generation":
        tokenizer.chat_template = GENERATION_TEMPLATE
    return tokenizer


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, separators=(",", ":")).encode()).hexdigest()[:20]


def fingerprint(dataset, pad_token_id: int) -> dict[str, Any]:
    """What training gets from `dataset`: its rows, and the batches of 3 each collator makes (in order)."""
    import torch

    from finetune.data.packing import Collator, FlatteningCollator

    rows = [{k: [int(x) for x in row[k]] for k in sorted(row)} for row in dataset]
    batches: dict[str, list[Any]] = {"padded": [], "flat": [], "flash": []}
    # always_mask: the padded layout these digests were taken of (rows of one length now go unpadded: test_packing)
    collators = {"padded": Collator(pad_token_id, always_mask=True), "flat": FlatteningCollator(False),
                 "flash": FlatteningCollator(True)}
    for start in range(0, len(rows), 3):
        for name, collate in collators.items():
            batch = collate(rows[start:start + 3])
            batches[name].append({k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in sorted(batch.items())})
    return {"sequences": len(rows), "tokens": sum(len(r["input_ids"]) for r in rows),
            "columns": sorted(rows[0]) if rows else [], "rows": _digest(rows),
            **{f"collated_{name}": _digest(value) for name, value in batches.items()}}


def compute(folder: Path, tiny_dir: Path, tokenize_for_training) -> dict[str, Any]:
    out = {}
    for name, (section, variant) in cases(folder / "sources").items():
        tokenizer = tokenizer_for(variant, tiny_dir)
        lines: list[str] = []
        dataset = tokenize_for_training(section, tokenizer, folder / "cache", log=lines.append)
        report = [line.replace(str(folder / "sources"), "GEN").replace(str(SHIPPED), "SHIPPED")
                  for line in lines if line.startswith("data: ")]
        out[name] = {**fingerprint(dataset, tokenizer.pad_token_id), "report": report}
    return out


if __name__ == "__main__":
    import sys
    import tempfile

    from finetune.builtin import ensure_builtin_model
    from finetune.data.prepare import tokenize_for_training

    with tempfile.TemporaryDirectory() as tmp:
        tiny = ensure_builtin_model("builtin:tiny-llama", Path(tmp) / "models")
        result = compute(Path(tmp), tiny, tokenize_for_training)
    if "--write" in sys.argv:
        GOLDEN.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(json.dumps({k: (v["sequences"], v["tokens"]) for k, v in result.items()}))
