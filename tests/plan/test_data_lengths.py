"""`finetune plan RECIPE` sizes activations for the data's longest example when it is shorter than
data.max_length (finetune.plan.data_lengths), and says how it counted the tokens."""

from __future__ import annotations

import json
import math

from finetune.plan import setup_from_recipe
from finetune.plan.data_lengths import CHARS_PER_TOKEN, TEMPLATE_TOKENS
from finetune.recipe import load_recipe


def recipe(tmp_path, data: str, model: str = "meta-llama/Meta-Llama-3-8B"):
    path = tmp_path / "r.yaml"
    path.write_text(f"model: {{name_or_path: {model}}}\ndata: {data}\nhardware: {{gpus: 1}}\n")
    return load_recipe(path).recipe


def test_the_longest_example_sets_the_tokens_per_sequence(tmp_path):
    rows = [{"instruction": "q" * n, "output": "a" * n} for n in (10, 200, 400)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = recipe(tmp_path, "{path: ./d.jsonl, max_length: 4096}")
    setup = setup_from_recipe(r, data_lengths=True)
    longest = math.ceil(800 / CHARS_PER_TOKEN) + TEMPLATE_TOKENS  # 232 tokens
    # the collator's width on a GPU: data.pad_to_multiple_of (auto: 64)
    assert setup.seq_len == 256 and f"longest example ~{longest} tokens" in setup.data_note
    assert "characters/4, no tokenizer here" in setup.data_note and "padded to 256" in setup.data_note
    assert "not max_length 4096" in setup.data_note
    exact = recipe(tmp_path, "{path: ./d.jsonl, max_length: 4096, pad_to_multiple_of: 1}")
    assert setup_from_recipe(exact, data_lengths=True).seq_len == longest
    near = recipe(tmp_path, "{path: ./d.jsonl, max_length: 236}")  # never padded past max_length rounded up to 8
    assert setup_from_recipe(near, data_lengths=True).seq_len == 240
    assert setup_from_recipe(r).seq_len == 4096  # lint and the run report do not read the data
    short = recipe(tmp_path, "{path: ./d.jsonl, max_length: 64}")
    assert setup_from_recipe(short, data_lengths=True).seq_len == 64


def test_packed_rows_hub_sources_and_bad_data_keep_max_length(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    for data in ("{path: ./d.jsonl, format: text, packing: true, max_length: 512}",
                 "{sources: [{path: ./d.jsonl, format: text}, {path: org/hub-set, format: text}], max_length: 512}",
                 "{path: ./d.jsonl, format: alpaca, max_length: 512}"):
        setup = setup_from_recipe(recipe(tmp_path, data), data_lengths=True)
        assert setup.seq_len == 512 and setup.data_note == "", data


def test_the_models_own_tokenizer_counts_when_it_is_here(tmp_path):
    from finetune.builtin import ensure_builtin_model

    ensure_builtin_model("builtin:tiny-llama")
    rows = [{"instruction": "What is the capital of France?", "output": "The capital of France is Paris."}] * 5
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    setup = setup_from_recipe(recipe(tmp_path, "{path: ./d.jsonl, max_length: 512}", model='"builtin:tiny-llama"'),
                              data_lengths=True)
    assert "characters per token of tiny-llama" in setup.data_note and "on 5 rows" in setup.data_note
    assert setup.seq_len < 512


def test_rows_cut_to_max_length_one_per_micro_batch_are_planned_without_a_mask(tmp_path):
    """One SFT row per micro batch, cut to max_length (a multiple of 8): the collator pads nothing, so transformers
    builds no 4D mask and sdpa shares the key/value heads (Setup.full_rows). Anything that pads, packs or slides a
    window keeps the mask."""
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "word " * 5000}) + "\n")
    data = "{path: ./d.jsonl, format: text, max_length: 1024}"

    def full_rows(data=data, training="{micro_batch_size: 1}", model="meta-llama/Meta-Llama-3-8B") -> bool:
        path = tmp_path / "r.yaml"
        path.write_text(f"model: {{name_or_path: {model}, attn_implementation: sdpa}}\ndata: {data}\n"
                        f"training: {training}\nhardware: {{gpus: 1}}\n")
        return setup_from_recipe(load_recipe(path).recipe, data_lengths=True).full_rows

    assert full_rows()
    assert not full_rows(training="{micro_batch_size: 2}")  # rows of other lengths beside it: padded
    # rounded up to 1024 on a GPU (data.pad_to_multiple_of auto), at its end, where the causal model needs no mask
    assert full_rows(data="{path: ./d.jsonl, format: text, max_length: 1020}")
    path = tmp_path / "r.yaml"
    path.write_text("model: {name_or_path: meta-llama/Meta-Llama-3-8B, attn_implementation: sdpa}\n"
                    "data: {path: ./d.jsonl, format: text, max_length: 1020}\nhardware: {gpus: 1}\n")
    setup = setup_from_recipe(load_recipe(path).recipe, data_lengths=True)
    assert setup.seq_len == 1024 and "padded at its end to 1024: no attention mask" in setup.data_note
    # a mixture of experts' padded row gets a mask (its router would count the padding)
    assert not full_rows(model="qwen1.5-moe-a2.7b", data="{path: ./d.jsonl, format: text, max_length: 1020}")
    assert not full_rows(data="{path: ./d.jsonl, format: text, max_length: 1020, pad_to_multiple_of: 1}")
    assert not full_rows(data="{path: ./d.jsonl, format: text, max_length: 1024, packing: true}")
    assert not full_rows(data="{path: ./d.jsonl, format: text, max_length: 8192}")  # shorter than max_length
    assert not full_rows(model="mistralai/Mistral-7B-v0.1", data="{path: ./d.jsonl, format: text, max_length: 4096}")
    assert full_rows(model="mistralai/Mistral-7B-v0.1")  # within its 4,096-token window
