"""After the run, without training: `finetune chat` and `finetune eval` on run directories written by the real
writer, the report without matplotlib, the "next" lines and --help. The checks on a real trained run are in
tests/launches/test_after_training.py.

    python -m pytest tests/use/test_after_training.py
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli
from tests.train_fixtures import REPO, TINY_RECIPES, write_run_dir

RECIPE = TINY_RECIPES / "lora_zero2.yaml"


def test_chat_prompts_an_alpaca_run_exactly_as_it_trained():
    """The first turn's ids are the masked prompt of the training row; a second turn follows whole examples."""
    from finetune.use.conversation import Conversation
    from finetune.builtin import ensure_builtin_model
    from finetune.data.tokenize import IGNORE_INDEX, tokenize_examples
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_builtin_model("builtin:tiny-llama")))
    example = {"instruction": "Name a primary colour.", "output": "Red."}
    (row,) = tokenize_examples([example], tokenizer, "alpaca", 64)
    prompt = [t for t, label in zip(row["input_ids"], row["labels"]) if label == IGNORE_INDEX]
    conversation = Conversation(tokenizer, "alpaca")
    assert conversation.prompt_ids(example["instruction"]) == prompt
    reply = row["input_ids"][len(prompt):-1]  # the response without its EOS
    conversation.add(example["instruction"], "Red.", reply)
    second = conversation.prompt_ids("And another?")
    assert second[:len(row["input_ids"])] == row["input_ids"]  # the first turn, as the training example
    assert second[len(row["input_ids"])] == tokenizer.bos_token_id
    conversation.reset()
    assert conversation.prompt_ids(example["instruction"]) == prompt


def test_eval_reads_a_data_file_as_the_mixtures_source_with_that_path(tmp_path):
    """`--data FILE` of a run mixing alpaca and ShareGPT: the ShareGPT file scored as chats, another
    file needs --format, an unknown --format is a usage error."""
    from finetune.use.evaluate import EvalError, eval_rows, file_spec
    from finetune.recipe import load_recipe
    from finetune.builtin import ensure_builtin_model
    from finetune.data.tokenize import tokenize_examples
    from transformers import AutoTokenizer

    run_dir = tmp_path / "run"
    write_run_dir(TINY_RECIPES / "mix_alpaca_sharegpt.yaml", run_dir)
    recipe = load_recipe(run_dir / "recipe.yaml").recipe
    chats = REPO / "recipes" / "data" / "demo_chats_sharegpt.jsonl"
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_builtin_model("builtin:tiny-llama")))
    rows, described, _ = eval_rows(run_dir, recipe, tokenizer, chats, log=print)
    lines = [json.loads(line) for line in chats.read_text().splitlines()]
    assert described == str(chats) and rows == tokenize_examples(lines, tokenizer, "sharegpt", 96)

    copy = tmp_path / "more_chats.jsonl"
    copy.write_text(chats.read_text())
    with pytest.raises(EvalError, match=r"not one of the run's sources.*demo_instructions.jsonl: alpaca, "
                                        r"demo_chats_sharegpt.jsonl: sharegpt.*--format"):
        eval_rows(run_dir, recipe, tokenizer, copy, log=print)
    assert eval_rows(run_dir, recipe, tokenizer, copy, log=print, fmt="sharegpt")[0] == rows
    recipe.data.sources = recipe.data.sources[1:]  # one source: its format, whatever the file's path
    assert file_spec(copy, recipe.data).format == "sharegpt"

    result = run_cli("eval", run_dir, "--data", copy, "--format", "chatml")
    assert result.returncode == 2 and "--format chatml: unknown format (known: alpaca, " in result.stderr
    assert "Traceback" not in result.stderr


def test_chat_with_a_run_that_has_no_model_yet_names_its_checkpoints(tmp_path):
    run_dir = tmp_path / "run"
    write_run_dir(RECIPE, run_dir)
    (run_dir / "checkpoint-4").mkdir()
    (run_dir / "checkpoint-8").mkdir()
    result = run_cli("chat", run_dir, "--prompt", "hi")
    assert result.returncode == 1
    assert "no adapter/ or model/ yet" in result.stderr and f"finetune convert {run_dir}/checkpoint-8" in result.stderr
    assert "Traceback" not in result.stderr


def test_chat_with_a_missing_base_says_so(tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tmp_path / "gone")}))
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    result = run_cli("chat", adapter, "--prompt", "hi")
    assert result.returncode == 1 and "base model" in result.stderr and "--base" in result.stderr
    assert "Traceback" not in result.stderr


def test_chat_refuses_a_gpu_too_small_with_the_plans_estimate():
    from finetune.use.chat import ChatError, Source, check_gpu_fits
    from finetune.recipe import load_recipe

    recipe = load_recipe(REPO / "recipes" / "llama3" / "8b_qlora_2x12gb.yaml").recipe
    recipe.method = "lora"  # a 16-bit 8B base: about 15 GiB of weights
    with pytest.raises(ChatError, match=r"needs about 1[45]\.\d GiB .*finetune plan.*12\.0 GiB free.*--device cpu"):
        check_gpu_fits(Source(model="meta-llama/Meta-Llama-3-8B-Instruct", recipe=recipe), 12 * 2**30, "RTX 4070")
    check_gpu_fits(Source(model="x", recipe=recipe), 40 * 2**30, "A100")  # fits: no error


def test_plot_without_matplotlib_is_reported_and_the_report_still_written(tmp_path, monkeypatch):
    import builtins

    from finetune.train.report import write_run_report

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    notes = write_run_report(tmp_path, [{"step": 1, "loss": 2.0, "learning_rate": 1e-3}])
    assert notes and "pip install matplotlib" in notes[0]
    assert not (tmp_path / "loss.png").exists()
    assert "pip install matplotlib" in (tmp_path / "report.html").read_text()


def test_version_and_help_examples_keep_their_lines():
    assert run_cli("--version").stdout.startswith("finetune 0.")
    lint_help = run_cli("lint", "--help").stdout
    assert "\n      $ finetune lint recipes ds_configs\n" in lint_help
    render_help = run_cli("render", "--help").stdout
    example = next(line.split()[3] for line in render_help.splitlines() if "$ finetune render" in line)
    assert (REPO / example).is_file(), example
    schema_help = run_cli("schema", "--help").stdout
    assert "\n      $ finetune schema -o recipe.schema.json\n" in schema_help
