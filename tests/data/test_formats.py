"""Chat formats and per-turn loss masks (finetune.data.formats + finetune.data.tokenize), and the mixing
arithmetic (finetune.data.mix). Masks are checked label by label: -100 exactly where a token must not train."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune.data.formats import Chat, RowProblem, RowSpec, to_example
from finetune.data.mix import MixError, Share, mixture, pick, spec_problems, targets
from finetune.data.prepare import tokenize_for_training
from finetune.data.spec import DataSpec
from finetune.data.tokenize import IGNORE_INDEX, DataError, tokenize_examples
from tests.train_fixtures import REPO, cache_dir

DEMO = REPO / "recipes" / "data" / "demo_instructions.jsonl"


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from finetune.builtin import ensure_builtin_model

    return AutoTokenizer.from_pretrained(str(ensure_builtin_model("builtin:tiny-llama", cache_dir(tmp_path_factory))))


def trained_runs(tokenizer, row) -> list[str]:
    """The trained stretches of a row, decoded: one per contiguous run of labels != -100."""
    runs, current = [], []
    for token, label in zip(row["input_ids"], row["labels"]):
        if label == IGNORE_INDEX:
            if current:
                runs.append(tokenizer.decode(current))
            current = []
        else:
            assert label == token  # a trained position predicts its own token (the model shifts)
            current.append(token)
    if current:
        runs.append(tokenizer.decode(current))
    return runs


# ------------------------------------------------------------------------------------------------
# Formats: rows -> conversations


def test_sharegpt_roles_tool_calls_and_the_system_column():
    row = {"system": "Be brief.", "conversations": [
        {"from": "human", "value": "Weather in Oslo?"},
        {"from": "function_call", "value": json.dumps({"name": "weather", "arguments": {"city": "Oslo"}})},
        {"from": "observation", "value": "-3C"},
        {"from": "gpt", "value": "It is -3C."}]}
    chat = to_example(row, RowSpec("sharegpt"))
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert chat.messages[2]["tool_calls"] == [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}]
    assert "content" not in chat.messages[2]
    assert chat.train == [False, False, True, False, True]


def test_messages_keep_openai_keys_and_the_per_message_switch():
    row = {"messages": [{"role": "user", "content": "hi"},
                        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                        {"role": "tool", "content": "42", "tool_call_id": "c1"},
                        {"role": "assistant", "content": "a bad answer", "train": False},
                        {"role": "user", "content": "again"},
                        {"role": "assistant", "content": "good", "weight": 1}]}
    chat = to_example(row, RowSpec("messages"))
    assert chat.train == [False, True, False, False, False, True]
    assert chat.messages[2] == {"role": "tool", "content": "42", "tool_call_id": "c1"}
    assert "train" not in chat.messages[3]  # the switch is not shown to the template


def test_columns_and_roles_rename_a_sources_fields():
    row = {"dialog": [{"speaker": "customer", "text": "hi"}, {"speaker": "agent", "text": "hello"}]}
    spec = RowSpec("messages", {"messages": "dialog", "role": "speaker", "content": "text"},
                   {"customer": "user", "agent": "assistant"})
    assert to_example(row, spec) == Chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
                                         [False, True])
    alpaca = to_example({"prompt": "p", "completion": "c"}, RowSpec("alpaca", {"instruction": "prompt", "output": "completion"}))
    assert alpaca.response == "c" and "p" in alpaca.prompt


@pytest.mark.parametrize("row,needle", [
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0]: unknown role `robot`"),
    ({"messages": [{"role": "user", "content": "x"}]}, "no assistant turn to train on"),
    ({"messages": [{"role": "assistant", "content": "x", "train": "no"}]}, "messages[0].train must be true or false"),
    ({"messages": [{"role": "assistant", "content": 3}]}, "messages[0].content must be text, got int"),
    ({"instruction": "x", "output": ""}, "`output` is empty: nothing to train on"),
])
def test_row_problems_name_the_key(row, needle):
    fmt = "alpaca" if "instruction" in row else "messages"
    with pytest.raises(RowProblem) as info:
        to_example(row, RowSpec(fmt))
    assert needle in str(info.value)


# ------------------------------------------------------------------------------------------------
# Masks, label by label


CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of Peru?"},
                {"role": "assistant", "content": "Lima."}, {"role": "user", "content": "And of Chile?"},
                {"role": "assistant", "content": "Santiago."}]


def test_every_assistant_turn_trains_and_ends_with_eos(tokenizer):
    [row] = tokenize_examples([{"messages": CONVERSATION}], tokenizer, "messages", 256)
    assert trained_runs(tokenizer, row) == ["Lima.</s>", "Santiago.</s>"]
    # The label of the last token of each assistant turn is EOS: the model learns to stop after every turn.
    ends = [i for i in range(1, len(row["labels"])) if row["labels"][i] != IGNORE_INDEX
            and (i + 1 == len(row["labels"]) or row["labels"][i + 1] == IGNORE_INDEX)]
    assert [row["labels"][i] for i in ends] == [tokenizer.eos_token_id] * 2
    assert sum(label != IGNORE_INDEX for label in row["labels"]) == sum(
        len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in ("Lima.</s>", "Santiago.</s>"))


CHATS = [[("Capital of Peru?", "Lima."), ("And of Chile?", "Santiago.")],
         [("Name a colour.", "Red."), ("Another one?", "Blue.")],
         [("Two plus two?", "Four.")],
         [("Say hello.", "Hello there.")]]


def _train_tiny_on_chats(tokenizer, model_dir: Path, eos_trained: bool, steps: int = 40):
    """The tiny model trained in full on CHATS through tokenize_examples (format messages); with
    eos_trained False, the label of every EOS is masked (the control)."""
    import torch
    from transformers import AutoModelForCausalLM

    from finetune.data.packing import Collator

    torch.manual_seed(0)
    rows = tokenize_examples([{"messages": [{"role": role, "content": text} for turn in chat
                                            for role, text in zip(("user", "assistant"), turn)]} for chat in CHATS],
                             tokenizer, "messages", 96)
    if not eos_trained:
        rows = [{**r, "labels": [IGNORE_INDEX if t == tokenizer.eos_token_id else t for t in r["labels"]]} for r in rows]
    batch = Collator(tokenizer.pad_token_id)(rows)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 4 rows of 40 tokens: a second thread only waits (8x slower on a busy 2-core box)
    try:
        for _ in range(steps):
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        torch.set_num_threads(threads)
    return model.eval(), loss.item()


def _greedy(model, tokenizer, turns: list[tuple[str, str]], question: str, limit: int = 24) -> list[int]:
    import torch

    messages = [{"role": role, "content": text} for turn in turns for role, text in zip(("user", "assistant"), turn)]
    prompt = tokenizer.apply_chat_template(messages + [{"role": "user", "content": question}],
                                           add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=limit, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return out[0, ids.shape[1]:].tolist()


def test_a_model_trained_on_these_labels_stops_after_each_assistant_turn(tokenizer, tmp_path_factory):
    """Generation, not only labels: greedy decoding after a first and after a second user turn emits the
    answer, then EOS, well before max_new_tokens; the same training with EOS masked never stops."""
    from finetune.builtin import ensure_builtin_model

    model_dir = ensure_builtin_model("builtin:tiny-llama", cache_dir(tmp_path_factory))
    model, loss = _train_tiny_on_chats(tokenizer, model_dir, eos_trained=True)
    assert loss < 0.1, loss
    for turns, question, answer in (([], "Capital of Peru?", "Lima."), ([CHATS[0][0]], "And of Chile?", "Santiago."),
                                    ([CHATS[1][0]], "Another one?", "Blue.")):
        new = _greedy(model, tokenizer, turns, question)
        assert new[-1] == tokenizer.eos_token_id and len(new) < 24, tokenizer.decode(new)
        assert tokenizer.decode(new[:-1]).strip() == answer

    control, _ = _train_tiny_on_chats(tokenizer, model_dir, eos_trained=False)
    for turns, question, _answer in (([], "Capital of Peru?", None), ([CHATS[0][0]], "And of Chile?", None)):
        new = _greedy(control, tokenizer, turns, question)
        assert tokenizer.eos_token_id not in new and len(new) == 24, tokenizer.decode(new)


def test_a_turn_switched_off_stays_in_the_context_but_out_of_the_loss(tokenizer):
    messages = [dict(m) for m in CONVERSATION]
    messages[2]["train"] = False
    [row] = tokenize_examples([{"messages": messages}], tokenizer, "messages", 256)
    assert trained_runs(tokenizer, row) == ["Santiago.</s>"]
    assert "Lima." in tokenizer.decode(row["input_ids"])


def test_sharegpt_masks_match_the_messages_format(tokenizer):
    sharegpt = {"conversations": [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]],
                                   "value": m["content"]} for m in CONVERSATION]}
    [a] = tokenize_examples([sharegpt], tokenizer, "sharegpt", 256)
    [b] = tokenize_examples([{"messages": CONVERSATION}], tokenizer, "messages", 256)
    assert a == b


def test_think_spans_train_or_are_masked(tokenizer):
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>two and two</think>4"}]
    [trained] = tokenize_examples([{"messages": messages}], tokenizer, "messages", 256)
    [masked] = tokenize_examples([{"messages": messages}], tokenizer, "messages", 256, think="mask")
    assert trained["input_ids"] == masked["input_ids"]
    assert "two and two" in "".join(trained_runs(tokenizer, trained))
    runs = trained_runs(tokenizer, masked)
    assert "two" not in "".join(runs) and runs[-1].endswith("4</s>")


def test_a_generation_template_gives_the_same_masks(tokenizer):
    from finetune.builtin import CHAT_TEMPLATE

    tok = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    # The built-in template with the assistant's content and EOS marked as {% generation %} blocks.
    tok.chat_template = (
        "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}"
        "{% else %}{{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    assert tok.apply_chat_template(CONVERSATION, tokenize=False) == tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert CHAT_TEMPLATE == tokenizer.chat_template
    [expected] = tokenize_examples([{"messages": CONVERSATION}], tokenizer, "messages", 256)
    [got] = tokenize_examples([{"messages": CONVERSATION}], tok, "messages", 256)
    assert got == expected
    mask = tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)["assistant_masks"]
    assert [1 if label != IGNORE_INDEX else 0 for label in got["labels"]] == mask


# ------------------------------------------------------------------------------------------------
# Mixing arithmetic


def test_weights_keep_the_largest_weighted_source_whole():
    shares = targets([300, 40], [3, 1], [None, None], ["a", "b"])
    assert shares == [Share(300, 300), Share(40, 100)]
    assert shares[1].describe() == "repeated 2.50x"
    shares = targets([100, 1000], [3, 1], [None, None], ["a", "b"])
    assert shares == [Share(100, 100), Share(1000, 33)] and shares[1].describe() == "a random 3% subset"


def test_samples_are_exact_and_mix_with_weights():
    assert targets([10, 50, 8], [None, 2, 1], [25, None, None], list("abc")) == [Share(10, 25), Share(50, 50), Share(8, 25)]
    assert targets([5, 5], [None, None], [None, None], ["a", "b"]) == [Share(5, 5), Share(5, 5)]


def test_repetition_uses_every_example_before_any_twice():
    import random
    from collections import Counter

    counts = Counter(pick(10, 25, random.Random(0)))
    assert sorted(counts.values()) == [2] * 5 + [3] * 5
    assert len(set(pick(10, 4, random.Random(0)))) == 4


def test_mixture_is_deterministic_for_a_seed_and_shuffled():
    shares = [Share(300, 300), Share(40, 100)]
    first = mixture(shares, 42)
    assert first == mixture(shares, 42) and first != mixture(shares, 43)
    assert sum(1 for s, _ in first if s == 1) == 100 and len(first) == 400
    assert first[:300] != [(0, i) for i in range(300)]


def test_bad_specifications():
    assert spec_problems([1, None], [None, None]) == [(1, "has neither weight nor samples while other sources have a "
                                                          "weight; give every source a weight (or samples)")]
    assert spec_problems([1], [5]) == [(0, "give either weight or samples, not both")]
    with pytest.raises(MixError, match=r"data.sources\[1\] \(b\): no example left to mix"):
        targets([5, 0], [1, 1], [None, None], ["a", "b"])


# ------------------------------------------------------------------------------------------------
# Two sources through tokenize_for_training


def _two_sources(tmp_path, **weights):
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": f"Say {i}."},
                                                           {"from": "gpt", "value": f"{i}."}]}) + "\n" for i in range(40)))
    return {"path": None, "format": "alpaca", "split": "train", "chat_template": None, "max_length": 64,
            "packing": False, "mask_prompt": True, "seed": 7, "think": "train",
            "sources": [{"path": str(DEMO), "format": "alpaca", "weight": weights.get("a", 3)},
                        {"path": str(chats), "format": "sharegpt", "weight": weights.get("b", 1)}]}


def test_a_weighted_mixture_is_tokenized_reported_and_cached(tmp_path, tokenizer, monkeypatch):
    import finetune.data.prepare as data

    section = DataSpec.from_section(_two_sources(tmp_path))
    lines: list[str] = []
    dataset = tokenize_for_training(section, tokenizer, tmp_path / "cache", log=lines.append)
    demo_rows = len(DEMO.read_text().splitlines())
    assert len(dataset) == demo_rows + round(demo_rows / 3)
    report = [line for line in lines if line.startswith("data: ")]
    assert report == [f"data: {DEMO} (alpaca): {demo_rows} rows -> {demo_rows} examples; {demo_rows} in the mixture (all)",
                      f"data: {tmp_path / 'chats.jsonl'} (sharegpt): 40 rows -> 40 examples; {round(demo_rows / 3)} in the "
                      f"mixture (repeated {round(demo_rows / 3) / 40:.2f}x)"]
    # Cached: the same report again, from mix.json, and no source is read.
    monkeypatch.setattr(data, "load_raw", lambda *a, **k: pytest.fail("the cache was not used"))
    again: list[str] = []
    assert tokenize_for_training(section, tokenizer, tmp_path / "cache", log=again.append)[0] == dataset[0]
    assert [line for line in again if line.startswith("data: ")] == report
    assert DataSpec.from_section(_two_sources(tmp_path, b=2)).cache_key(tokenizer) != section.cache_key(tokenizer)
    assert DataSpec.from_section({**_two_sources(tmp_path), "seed": 8}).cache_key(tokenizer) != section.cache_key(tokenizer)


def test_truncation_drops_are_counted_per_source(tmp_path, tokenizer):
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"instruction": "word " * 80, "output": "yes"}) + "\n"
                    + json.dumps({"instruction": "hi", "output": "yes"}) + "\n")
    lines: list[str] = []
    tokenize_for_training(DataSpec.from_section({**_two_sources(tmp_path), "sources": [{"path": str(long), "format": "alpaca"}]}),
                          tokenizer, tmp_path / "cache", log=lines.append)
    assert f"data: {long} (alpaca): 2 rows -> 1 examples, 1 dropped (nothing left to train within max_length 64); " \
           f"1 in the mixture (all)" in lines


def test_a_saved_datasets_folder_is_a_source(tmp_path, tokenizer):
    """The hub code path (datasets' own loading) with a local save_to_disk folder: no hub here."""
    import datasets

    rows = [{"instruction": "Add 1 and 1.", "output": "2"}] * 3
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dd"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    for folder in ("dd", "ds"):
        section = DataSpec.from_section(
            {**_two_sources(tmp_path), "sources": [{"path": str(tmp_path / folder), "format": "alpaca", "split": "train"}]})
        assert len(tokenize_for_training(section, tokenizer, tmp_path / "cache", log=lambda m: None)) == 3


def test_a_bad_mixture_is_a_data_error(tmp_path, tokenizer):
    section = _two_sources(tmp_path)
    section["sources"][1]["weight"] = None
    with pytest.raises(DataError, match=r"data.sources\[1\] .*has neither weight nor samples"):
        tokenize_for_training(DataSpec.from_section(section), tokenizer, tmp_path / "cache", log=lambda m: None)


# ------------------------------------------------------------------------------------------------
# The recipe's data section, as the rest of finetune reads it


def test_sources_in_a_recipe_rebase_paths_replace_the_parents_path_and_key_the_resume():
    from finetune.data.formats import chat_format
    from finetune.rundir.resume_key import resume_fields
    from finetune.recipe import load_recipe
    from finetune.rundir.layout import resolved_recipe

    mixed = load_recipe(REPO / "recipes" / "tiny" / "mix_alpaca_sharegpt.yaml").recipe
    assert mixed.data.path is None  # base.yaml's path is replaced by the sources
    # Relative to the recipe's folder, as data.path is.
    assert [Path(s.path).resolve() for s in mixed.data.sources] == [DEMO, DEMO.parent / "demo_chats_sharegpt.jsonl"]
    resolved = resolved_recipe(mixed, REPO / "runs" / "x")
    assert all(s["path"].startswith("/") for s in resolved["data"]["sources"])
    fields = resume_fields(resolved, 2)
    assert fields["data.sources"][1]["weight"] == 1 and fields["data.bytes"] > DEMO.stat().st_size
    assert chat_format(mixed) == "messages"
    single = load_recipe(REPO / "recipes" / "tiny" / "lora_zero2.yaml").recipe
    # A run directory written before data.sources existed resumes: the new keys are absent when unset.
    assert not [k for k in resume_fields(resolved_recipe(single, REPO / "runs" / "y"), 2)
                if k in ("data.sources", "data.seed", "data.think", "data.columns", "data.roles")]
    assert chat_format(single) == "alpaca"
