"""`finetune eval RUN --tasks`: lm-evaluation-harness on the shipped demo task, offline, prompted as `finetune chat`
prompts the run. In-process on a run directory with a random (non-zero) adapter of the tiny model; the check on a
real trained run is in tests/launches/test_benchmark.py.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import REPO

pytest.importorskip("lm_eval", reason="lm-evaluation-harness: pip install 'finetune[eval]'")

TASKS = REPO / "benchmarks"


@pytest.fixture(scope="module")
def adapter_run(tiny_dir, tmp_path_factory):
    """A run directory of the demo recipe whose adapter is random (LoRA B not zero), as training leaves one."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tests.train_fixtures import write_run_dir

    run_dir = tmp_path_factory.mktemp("bench") / "run"
    write_run_dir(REPO / "recipes" / "demo.yaml", run_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir))
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    peft.save_pretrained(str(run_dir / "adapter"))
    return run_dir


def test_eval_tasks_prompts_as_chat_does_and_writes_base_and_fine_tuned(adapter_run, tiny_dir, tiny_cache,
                                                                       monkeypatch, no_network, one_thread):
    """One `finetune eval RUN --tasks benchmarks` (both shipped tasks, base and fine-tuned): lm-eval's requests carry
    `finetune chat`'s prompt ids and the answers as training tokenizes them; the numbers land beside the loss eval."""
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer
    from typer.testing import CliRunner

    from finetune.cli import app
    from finetune.data.tokenize import IGNORE_INDEX, tokenize_examples
    from finetune.use.conversation import Conversation

    monkeypatch.setenv("FINETUNE_CACHE", str(tiny_cache))
    seen = []
    original = HFLM._loglikelihood_tokens

    def spy(self, requests, **kwargs):
        seen.extend(requests)
        return original(self, requests, **kwargs)

    monkeypatch.setattr(HFLM, "_loglikelihood_tokens", spy)
    (adapter_run / "eval.json").write_text(json.dumps({"data": "earlier", "base": {"loss": 1.0}}))
    (adapter_run / "report.html").write_text("<html></html>")
    result = CliRunner().invoke(app, ["eval", str(adapter_run), "--tasks", str(TASKS), "--limit", "3",
                                      "--device", "cpu"])
    assert result.exit_code == 0, result.output[-3000:]

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_dir))  # the run's tokenizer: its base's
    rows = [json.loads(line) for line in (TASKS / "demo_qa.jsonl").read_text().splitlines()[:3]]
    assert len(seen) == 2 * 3 * 4  # two models, three questions, a request per choice
    for row in rows:
        prompt_ids = Conversation(tokenizer, "alpaca").prompt_ids(row["question"])  # what `finetune chat` sends
        asked = {(args[1], tuple(continuation)) for args, context, continuation in seen if context == prompt_ids}
        expected = set()
        for choice in row["choices"]:  # each answer as training tokenizes it after this prompt, without its EOS
            (trained,) = tokenize_examples([{"instruction": row["question"], "output": choice}], tokenizer, "alpaca", 64)
            prompt = [t for t, label in zip(trained["input_ids"], trained["labels"]) if label == IGNORE_INDEX]
            assert prompt == prompt_ids
            expected.add((choice, tuple(trained["input_ids"][len(prompt):-1])))
        assert asked == expected, row["question"]

    record = json.loads((adapter_run / "eval.json").read_text())
    assert record["data"] == "earlier"  # the loss eval's numbers stay
    tasks = record["benchmarks"]["tasks"]
    assert set(tasks) == {"demo_qa", "demo_qa_exact"} and tasks["demo_qa"]["samples"] == 3
    assert set(tasks["demo_qa"]["metrics"]) == {"acc", "acc_norm"}
    for values in tasks["demo_qa"]["metrics"].values():
        assert 0 <= values["base"] <= 1 and 0 <= values["fine_tuned"] <= 1 and values["fine_tuned_stderr"] is not None
    assert set(tasks["demo_qa_exact"]["metrics"]["exact_match"]) >= {"base", "fine_tuned"}
    assert "demo_qa_exact" in result.stdout and "exact_match" in result.stdout
    assert "demo_qa" in (adapter_run / "report.html").read_text()
    assert not no_network


def test_task_files_are_checked_before_any_model_loads(tmp_path):
    from finetune.use.benchmark import task_config, task_files
    from finetune.use.evaluate import EvalError

    (tmp_path / "empty").mkdir()
    cases = {
        "no such file or folder": lambda: task_files([tmp_path / "missing.yaml"]),
        "no *.yaml task file": lambda: task_files([tmp_path / "empty"]),
    }
    (tmp_path / "group.yaml").write_text("group: mine\ntask: [a, b]\n")
    cases["no `task:` name"] = lambda: task_config(tmp_path / "group.yaml")
    (tmp_path / "far.yaml").write_text("task: far\ndataset_path: json\ndataset_kwargs: {data_files: {test: gone.jsonl}}\n")
    cases["does not exist"] = lambda: task_config(tmp_path / "far.yaml")
    (tmp_path / "url.yaml").write_text("task: url\ndataset_path: json\ndataset_kwargs: {data_files: https://x/y.jsonl}\n")
    cases["reads local files only"] = lambda: task_config(tmp_path / "url.yaml")
    for expected, call in cases.items():
        with pytest.raises(EvalError, match=expected.replace("*", r"\*")):
            call()
    config = task_config(TASKS / "demo_qa.yaml")
    assert config["dataset_kwargs"]["data_files"]["test"] == str(TASKS / "demo_qa.jsonl")  # from the task's folder


def test_a_task_lm_eval_cannot_build_is_one_line_before_the_model_loads(adapter_run, tmp_path, monkeypatch):
    from finetune.use import benchmark
    from finetune.use.evaluate import EvalError

    (tmp_path / "rows.jsonl").write_text('{"question": "q", "answer": "a"}\n')
    (tmp_path / "bad.yaml").write_text("task: bad\ndataset_path: json\ndataset_kwargs: {data_files: {test: rows.jsonl}}\n"
                                       "test_split: test\noutput_type: nonsense\ndoc_to_text: '{{question}}'\n"
                                       "doc_to_target: '{{answer}}'\n")
    monkeypatch.setattr("finetune.use.chat.load_chat_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(EvalError, match=r"lm-eval could not run the tasks \(bad\)"):
        benchmark.benchmark(adapter_run, [tmp_path / "bad.yaml"], log=lambda s: None)


def test_a_chat_run_is_prompted_with_its_template_and_scored_on_the_trained_tokens(tiny_dir):
    """format: messages: lm-eval's context is `finetune chat`'s prompt and its continuation the tokens the training
    row holds after it (the answer inside the rendered chat, not tokenized apart)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.data.tokenize import tokenize_examples
    from finetune.use.benchmark import prompted_lm
    from finetune.use.chat import ChatModel
    from finetune.use.conversation import Conversation

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir)).eval()
    lm = prompted_lm(ChatModel(model, tokenizer, "messages", "cpu", "tiny"), 2)
    question, answer = "Name a primary colour.", "Red is one."
    context, continuation = lm._encode_pair(lm.apply_chat_template([{"role": "user", "content": question}]), answer)
    assert context == Conversation(tokenizer, "messages").prompt_ids(question)
    (row,) = tokenize_examples([{"messages": [{"role": "user", "content": question},
                                              {"role": "assistant", "content": answer}]}], tokenizer, "messages", 64)
    assert row["input_ids"][:len(context) + len(continuation)] == context + continuation
    assert tokenizer.decode(continuation).strip() == answer
