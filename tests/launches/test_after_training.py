"""After one real run (the session's shared SFT run: the tiny LoRA + ZeRO-2 recipe, 12 steps at a high learning
rate, 2 CPU processes, the real `finetune train`): its report.html, loss plot and "next" lines, chat from the
adapter and from the merged model, eval against the base. The fine-tuned model is clearly better than its base
on the demo data. The fast checks of chat, eval and the report are in tests/use/test_after_training.py; the
resumed run's report in tests/launches/test_resume.py.

    python -m pytest tests/launches/test_after_training.py
"""

from __future__ import annotations

import json

import pytest

from tests.train_fixtures import REPO, assert_run_report


STEPS = 12
PROMPTS = ("Name a primary colour.", "What is the capital of France?")


@pytest.fixture(scope="module")
def trained(shared_sft_run):
    """(run directory, `finetune train` result) of one short real run (the session's shared SFT run)."""
    return shared_sft_run


def test_a_run_writes_its_plot_and_report_and_says_what_next(trained):
    run_dir, result = trained
    assert_run_report(run_dir, STEPS)
    assert f"finetune chat {run_dir}" in result.stderr
    assert f"finetune merge {run_dir} -o merged/{run_dir.name}" in result.stderr
    assert "report.html" in result.stderr
    mode = (run_dir / "final_logits.safetensors").stat().st_mode & 0o777
    assert mode == (run_dir / "summary.json").stat().st_mode & 0o777  # not safetensors' private 0600


def test_chat_gives_the_same_greedy_text_from_the_adapter_and_from_the_merged_model(trained, tmp_path, cli):
    run_dir, _ = trained
    merged = tmp_path / "merged"
    done = cli("merge", run_dir, "-o", merged)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (merged / "finetune_recipe.yaml").is_file()  # the merged model knows the run's prompt format
    prompts = [arg for p in PROMPTS for arg in ("--prompt", p)]
    # After 12 steps the model may well answer a whole prompt with EOS at once; a response cut
    # mid-sentence (plain-text continuation) makes it produce tokens, so the comparison has text.
    cut = "### Instruction:\nWhat is the capital of Russia?\n\n### Response:\nThe capital of"
    for args in ([*prompts], ["--format", "text", "--prompt", cut]):
        from_adapter = cli("chat", run_dir, *args, "--max-new-tokens", 16)
        from_merged = cli("chat", merged, *args, "--max-new-tokens", 16)
        assert from_adapter.returncode == 0, from_adapter.stderr[-3000:]
        assert from_merged.returncode == 0, from_merged.stderr[-3000:]
        assert from_merged.stdout == from_adapter.stdout
    assert from_adapter.stdout.strip(), "the continuation produced no text: nothing was compared"


def test_eval_scores_the_fine_tuned_model_below_its_base(trained, cli):
    run_dir, _ = trained
    result = cli("eval", run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    scores = json.loads((run_dir / "eval.json").read_text())
    assert scores["tuned"]["loss"] < scores["base"]["loss"] - 1.0, scores
    assert scores["tuned"]["tokens"] == scores["base"]["tokens"] > 0
    assert scores["held_out"] is False and "no validation split" in result.stderr
    assert f"{scores['tuned']['loss']:.4f}" in result.stdout and f"{scores['base']['loss']:.4f}" in result.stdout

    sample = run_dir.parent / "five.jsonl"
    rows = (REPO / "recipes" / "data" / "demo_instructions.jsonl").read_text().splitlines()[:5]
    sample.write_text("\n".join(rows) + "\n")
    on_file = cli("eval", run_dir, "--data", sample)
    assert on_file.returncode == 0, on_file.stderr[-3000:]
    assert json.loads((run_dir / "eval-five.json").read_text())["sequences"] == 5  # its own file (issue 24)
    assert json.loads((run_dir / "eval.json").read_text()) == scores  # the run's own numbers stay
