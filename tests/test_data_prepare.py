"""Issue 20: the training set is tokenized before the ranks start, on every core, into a flat Arrow cache.

The equivalence test compares the parallel Arrow path with the fingerprints of the path it replaced
(tests/golden/tokenize_equivalence.json, written by tests/data_prepare_cases.py from the one-process,
Python-list implementation): same input_ids, labels, position_ids, and the same batches from every collator.
"""

from __future__ import annotations

import json

import pytest

from finetune.data import prepare as prep
from tests import data_prepare_cases as cases


@pytest.fixture(scope="module")
def golden():
    return json.loads(cases.GOLDEN.read_text())


@pytest.fixture(scope="module")
def computed(tmp_path_factory, tiny_dir):
    return cases.compute(tmp_path_factory.mktemp("prepare"), tiny_dir, prep.tokenize_for_training)


@pytest.mark.parametrize("name", sorted(json.loads(cases.GOLDEN.read_text())))
def test_the_prepared_rows_are_the_old_rows_token_for_token(name, golden, computed):
    assert computed[name] == golden[name]


@pytest.mark.parametrize("name", ["alpaca_truncated", "messages_generation_think", "text_packed", "mixture_samples_packed"])
def test_several_processes_give_the_same_rows(name, golden, tmp_path, tiny_dir, monkeypatch):
    """Workers split the rows (and the blocks) between them; the result does not depend on how."""
    monkeypatch.setattr(prep, "MIN_ROWS_PER_PROC", 10)
    monkeypatch.setattr(prep, "BATCH", 16)  # several batches per worker
    monkeypatch.setattr(prep, "CHUNK_ROWS", 40)  # several maps per source
    section, variant = cases.cases(tmp_path / "sources")[name]
    tokenizer = cases.tokenizer_for(variant, tiny_dir)
    lines: list[str] = []
    dataset = prep.tokenize_for_training(section, tokenizer, tmp_path / "cache", log=lines.append, num_proc=2)
    assert any("2 processes" in line for line in lines)
    got = cases.fingerprint(dataset, tokenizer.pad_token_id)
    assert got == {k: v for k, v in golden[name].items() if k != "report"}
