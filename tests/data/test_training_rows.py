"""Training data: formats, prompt masking, truncation, packing, the collator and the tokenization cache.

Uses the built-in tiny model's tokenizer (built once per session into pytest's temp directory).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from finetune.data.formats import RowSpec, alpaca
from finetune.data.prepare import tokenize_for_training
from finetune.data.spec import DataSpec
from finetune.data.packing import Collator, pack
from finetune.data.tokenize import IGNORE_INDEX, DataError, load_raw, split_eval, tokenize_examples
from tests.train_fixtures import REPO

DEMO = REPO / "recipes" / "data" / "demo_instructions.jsonl"


def format_alpaca(example: dict) -> tuple[str, str]:
    """(prompt, response) of one alpaca row, read by the format the tokenizer uses (finetune.data.formats)."""
    prompted = alpaca(example, RowSpec())
    return prompted.prompt, prompted.response


@pytest.fixture(scope="session")
def tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_dir))


def _section(path, **section):
    return {"path": str(path), "format": "alpaca", "split": "train", "chat_template": None, "max_length": 64,
            "packing": False, "mask_prompt": True, **section}


def _data(path, **section):
    return DataSpec.from_section(_section(path, **section))


def trained_text(tokenizer, row):
    return tokenizer.decode([t for t, l in zip(row["input_ids"], row["labels"]) if l != IGNORE_INDEX])


# ------------------------------------------------------------------------------------------------
# Formats and masking


def test_alpaca_trains_on_the_response_and_eos_only(tokenizer):
    example = {"instruction": "What is 2 plus 3?", "input": "", "output": "2 plus 3 is 5."}
    [row] = tokenize_examples([example], tokenizer, "alpaca", 64)
    prompt, response = format_alpaca(example)
    assert tokenizer.decode(row["input_ids"], skip_special_tokens=False) == f"<s>{prompt}{response}</s>"
    assert trained_text(tokenizer, row) == "2 plus 3 is 5.</s>"
    n_prompt = len(tokenizer(prompt)["input_ids"])
    assert row["labels"][:n_prompt] == [IGNORE_INDEX] * n_prompt
    assert row["labels"][n_prompt:] == row["input_ids"][n_prompt:]


def test_alpaca_input_field_goes_into_the_prompt():
    prompt, response = format_alpaca({"instruction": "Reverse.", "input": "a b", "output": "b a"})
    assert "### Input:\na b" in prompt and response == "b a"
    prompt, _ = format_alpaca({"instruction": "Reverse.", "output": "b a"})
    assert "### Input" not in prompt


def test_alpaca_without_masking_trains_everything(tokenizer):
    example = {"instruction": "Hi", "input": "", "output": "Hello."}
    [row] = tokenize_examples([example], tokenizer, "alpaca", 64, mask_prompt=False)
    assert row["labels"] == row["input_ids"]


def test_messages_train_on_assistant_turns_only(tokenizer):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is the capital of Peru?"},
                {"role": "assistant", "content": "The capital of Peru is Lima."},
                {"role": "user", "content": "And of Chile?"},
                {"role": "assistant", "content": "Santiago."}]
    [row] = tokenize_examples([{"messages": messages}], tokenizer, "messages", 128)
    trained = trained_text(tokenizer, row)
    assert trained == "The capital of Peru is Lima.</s>Santiago.</s>"
    assert "Chile" not in trained and "<|assistant|>" not in trained


def test_messages_with_a_template_that_rewrites_history_is_refused(tokenizer):
    tok = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    # Renders only the last message: a shorter conversation is not a prefix of the longer one.
    tok.chat_template = "{{ messages[-1]['content'] }}{% if add_generation_prompt %}>{% endif %}"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    with pytest.raises(DataError, match="example 0: the chat template renders earlier turns differently"):
        tokenize_examples([{"messages": messages}], tok, "messages", 64)


def test_text_is_split_not_truncated(tokenizer):
    text = " ".join(["red green blue"] * 40)
    rows = tokenize_examples([{"text": text}], tokenizer, "text", 16)
    assert len(rows) > 2 and all(len(r["input_ids"]) <= 16 for r in rows)
    assert all(r["labels"] == r["input_ids"] for r in rows)
    joined = [t for r in rows for t in r["input_ids"]]
    assert joined == tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]


def test_truncation_keeps_max_length_and_drops_examples_with_no_response_left(tokenizer):
    long_prompt = {"instruction": "word " * 50, "input": "", "output": "yes"}
    short = {"instruction": "Hi", "input": "", "output": "one two three four five six seven eight nine"}
    limit = len(tokenizer(format_alpaca(short)[0])["input_ids"]) + 3  # room for 3 response tokens
    rows = tokenize_examples([long_prompt, short], tokenizer, "alpaca", limit)
    assert len(rows) == 1
    assert len(rows[0]["input_ids"]) == limit
    assert sum(label != IGNORE_INDEX for label in rows[0]["labels"]) == 3


def test_bad_examples_name_the_index(tokenizer):
    with pytest.raises(DataError, match="example 1: `output` must be text, got int"):
        tokenize_examples([{"instruction": "a", "output": "b"}, {"instruction": "a", "output": 3}], tokenizer, "alpaca", 64)
    with pytest.raises(DataError, match="example 0: `messages` must be a list of turns, got text that is not JSON"):
        tokenize_examples([{"messages": "hello"}], tokenizer, "messages", 64)


# ------------------------------------------------------------------------------------------------
# Packing and batching


def test_packing_keeps_whole_examples_with_restarting_positions(tokenizer):
    examples = [json.loads(line) for line in DEMO.read_text().splitlines()[:40]]
    rows = tokenize_examples(examples, tokenizer, "alpaca", 64)
    blocks = pack(rows, 64)
    assert len(blocks) < len(rows)
    assert all(len(b["input_ids"]) <= 64 for b in blocks)
    assert [t for b in blocks for t in b["input_ids"]] == [t for r in rows for t in r["input_ids"]]
    starts = sum(b["position_ids"].count(0) for b in blocks)
    assert starts == len(rows)
    for b in blocks:  # the first token of each example is never a label
        assert all(b["labels"][i] == IGNORE_INDEX for i, p in enumerate(b["position_ids"]) if p == 0)
    trained = sum(l != IGNORE_INDEX for b in blocks for l in b["labels"])
    assert trained == sum(l != IGNORE_INDEX for r in rows for l in r["labels"][1:])


def test_collator_pads_to_a_multiple_of_8_with_masks(tokenizer):
    rows = [{"input_ids": [1, 5, 6], "labels": [-100, 5, 6]}, {"input_ids": [1, 7, 8, 9, 10], "labels": [-100, -100, 8, 9, 10]}]
    batch = Collator(tokenizer.pad_token_id)(rows)
    assert batch["input_ids"].shape == (2, 8)
    assert batch["attention_mask"][0].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert batch["labels"][0].tolist() == [-100, 5, 6] + [-100] * 5
    assert batch["input_ids"][0, 3:].tolist() == [tokenizer.pad_token_id] * 5
    assert "position_ids" not in batch


def test_packed_examples_do_not_see_each_other(tokenizer, tiny_dir):
    """The logits of a packed block equal those of each example run alone (block-diagonal mask)."""
    import torch
    from transformers import AutoModelForCausalLM

    examples = [json.loads(line) for line in DEMO.read_text().splitlines()[:3]]
    rows = tokenize_examples(examples, tokenizer, "alpaca", 64)
    [block] = pack(rows, 128)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32, attn_implementation="sdpa").eval()
    batch = Collator(tokenizer.pad_token_id)([block])
    assert "attention_mask" not in batch
    with torch.no_grad():
        # use_cache=False as in training: with a KV cache transformers skips the packed-sequence mask.
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
        offset = 0
        for row in rows:
            alone = model(input_ids=torch.tensor([row["input_ids"]])).logits[0]
            torch.testing.assert_close(packed[offset:offset + len(row["input_ids"])], alone, rtol=1e-4, atol=1e-4)
            offset += len(row["input_ids"])


# ------------------------------------------------------------------------------------------------
# Loading and the cache


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
def test_local_files_load(tmp_path, suffix):
    import datasets

    records = [{"instruction": f"q{i}", "input": "", "output": f"a{i}"} for i in range(5)]
    path = tmp_path / f"d{suffix}"
    ds = datasets.Dataset.from_list(records)
    {".jsonl": lambda: ds.to_json(str(path), lines=True), ".json": lambda: path.write_text(json.dumps(records)),
     ".csv": lambda: ds.to_csv(str(path), index=False), ".parquet": lambda: ds.to_parquet(str(path))}[suffix]()
    loaded = load_raw(str(path))
    assert len(loaded) == 5 and loaded[3]["output"] == "a3"


def test_missing_and_unsupported_files(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_raw(str(tmp_path / "nope.jsonl"))
    bad = tmp_path / "data.txt"
    bad.write_text("x")
    with pytest.raises(DataError, match="unsupported data file type `.txt`"):
        load_raw(str(bad))


def test_wrong_format_names_the_columns(tmp_path, tokenizer):
    with pytest.raises(DataError, match=f"{DEMO}:1: no `messages` column .*found `instruction`, `input`, `output`\\); did you mean format: alpaca\\?"):
        tokenize_for_training(_data(DEMO, format="messages"), tokenizer, tmp_path, log=lambda m: None)


def test_tokenized_data_is_cached_by_data_and_tokenizer(tmp_path, tokenizer, monkeypatch):
    import finetune.data.prepare as data

    section = _data(DEMO)
    first = tokenize_for_training(section, tokenizer, tmp_path, log=lambda m: None)
    assert len(first) == len(DEMO.read_text().splitlines())
    monkeypatch.setattr(data, "load_raw", lambda *a, **k: pytest.fail("the cache was not used"))
    again = tokenize_for_training(section, tokenizer, tmp_path, log=lambda m: None)
    assert again[5] == first[5]
    assert not list(tmp_path.glob(".*.partial"))
    # Anything that changes the tokens changes the key.
    key = section.cache_key(tokenizer)
    assert replace(section, max_length=32).cache_key(tokenizer) != key
    assert replace(section, packing=True).cache_key(tokenizer) != key
    assert replace(section, mask_prompt=False).cache_key(tokenizer) != key
    other = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    other.chat_template = "{{ messages }}"
    assert section.cache_key(other) != key


def test_tokenizing_reports_rows_at_the_progress_interval(tmp_path, tokenizer, monkeypatch):
    import finetune.data.prepare as data
    from finetune.progress_env import PROGRESS_ENV

    lines: list[str] = []
    monkeypatch.setenv(PROGRESS_ENV, "0")  # after every chunk of rows
    monkeypatch.setattr(data, "CHUNK_ROWS", 100)
    tokenize_for_training(_data(DEMO), tokenizer, tmp_path / "every", log=lines.append)
    count = len(DEMO.read_text().splitlines())
    progress = [line.split(" (")[0] for line in lines if line.startswith("tokenizing: ")]
    assert progress == [f"tokenizing: {n}/{count} rows" for n in range(100, count, 100)]
    assert "rows/s, about" in next(line for line in lines if line.startswith("tokenizing: "))
    monkeypatch.setenv(PROGRESS_ENV, "3600")  # the demo data takes well under an hour: no line
    lines.clear()
    tokenize_for_training(_data(DEMO), tokenizer, tmp_path / "hourly", log=lines.append)
    assert not [line for line in lines if line.startswith("tokenizing: ")] and lines


def test_cache_key_follows_the_data_file(tmp_path, tokenizer):
    path = tmp_path / "d.jsonl"
    path.write_text('{"instruction": "a", "input": "", "output": "b"}\n')
    key = _data(path).cache_key(tokenizer)
    path.write_text('{"instruction": "a", "input": "", "output": "changed"}\n')
    assert _data(path).cache_key(tokenizer) != key


def test_eval_split_is_seeded(tmp_path, tokenizer):
    dataset = tokenize_for_training(_data(DEMO), tokenizer, tmp_path, log=lambda m: None)
    train, held = split_eval(dataset, 0.1, seed=3)
    assert 0.09 * len(dataset) <= len(held) <= 0.11 * len(dataset) + 1
    assert len(train) + len(held) == len(dataset)
    again_train, again_held = split_eval(dataset, 0.1, seed=3)
    assert again_held["input_ids"] == held["input_ids"]
    assert split_eval(dataset, 0.0, seed=3) == (dataset, None)


# ------------------------------------------------------------------------------------------------
# The shipped demo data


def test_demo_data_is_what_the_generator_writes():
    result = subprocess.run([sys.executable, "scripts/make_demo_data.py", "--check"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_demo_data_fits_the_demo_recipe(tokenizer):
    examples = [json.loads(line) for line in DEMO.read_text().splitlines()]
    assert 200 <= len(examples) <= 400
    rows = tokenize_examples(examples, tokenizer, "alpaca", 64)
    assert len(rows) == len(examples)  # nothing truncated away at the demo's max_length
    assert max(len(r["input_ids"]) for r in rows) < 64
