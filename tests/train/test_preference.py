"""Preference objectives without training (fast): recipe keys and ranges, lint R118-R120, every row checked
before launch, the planner's preference terms, TRL's config keys, summary metrics, the shipped data.

The real runs are in tests/launches/test_preference.py (slow).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.lint import LintOptions, lint_paths
from finetune.run.preflight import Preflight, dataset_step, model_step
from finetune.recipe import RecipeProblem, load_recipe
from tests.conftest import MINIMAL, REPO

TINY = REPO / "recipes" / "tiny"
DPO = MINIMAL + "objective: dpo\n"


def rules_of(path):
    return [(f.rule, f.severity, f.key) for f in lint_paths([path], LintOptions()).findings]


# ------------------------------------------------------------------------------------------------
# Recipe


def test_objective_defaults_to_sft_and_preference_values_are_range_checked(write_recipe):
    assert load_recipe(write_recipe()).recipe.objective == "sft"
    bad = DPO + "preference:\n  beta: -1\n  label_smoothing: 0.5\n  loss_type: sigmod\n  reference: {mode: twin}\n"
    with pytest.raises(RecipeProblem) as info:
        load_recipe(write_recipe(bad))
    problems = {p.key: p for p in info.value.problems}
    assert set(problems) == {"preference.beta", "preference.label_smoothing", "preference.loss_type",
                             "preference.reference.mode"}
    assert problems["preference.beta"].line == 7 and "greater than 0" in problems["preference.beta"].message
    assert "did you mean 'sigmoid'" in problems["preference.loss_type"].message
    with pytest.raises(RecipeProblem) as info:
        load_recipe(write_recipe(MINIMAL + "objective: ppo\n"))
    assert info.value.problems[0].key == "objective"


def test_adapter_and_reference_paths_are_relative_to_the_recipe(tmp_path, write_recipe):
    (tmp_path / "sft" / "adapter").mkdir(parents=True)
    path = write_recipe(DPO.replace("model:\n", "model:\n  adapter: ./sft\n")
                        + "method: full\npreference:\n  reference: {mode: model, name_or_path: ./sft}\n")
    recipe = load_recipe(path).recipe
    assert recipe.model.adapter == str(tmp_path / "sft")
    assert recipe.preference.reference.name_or_path == str(tmp_path / "sft")


# ------------------------------------------------------------------------------------------------
# Lint


def test_preference_keys_the_objective_does_not_read_are_errors(write_recipe):
    assert ("R118", "error", "preference") in rules_of(write_recipe(MINIMAL + "preference: {beta: 0.2}\n"))
    found = rules_of(write_recipe(DPO + "preference:\n  simpo_gamma: 1.0\n  loss_type: apo_zero_unpaired\n"))
    assert ("R118", "error", "preference.simpo_gamma") in found
    assert ("R118", "error", "preference.loss_type") in found  # a kto loss under dpo
    found = rules_of(write_recipe(MINIMAL + "objective: orpo\npreference: {reference: {mode: model}}\n"))
    assert ("R118", "error", "preference.reference") in found  # ORPO is reference-free
    found = rules_of(write_recipe(DPO + "method: full\n"))
    assert ("R118", "error", "preference.reference.mode") in found  # no adapter to switch off
    assert rules_of(write_recipe(DPO + "method: full\npreference: {reference: {mode: precomputed}}\n")) == []


def test_sft_data_keys_are_errors_under_a_preference_objective(write_recipe):
    text = DPO.replace("  path: org/some-dataset\n", "  path: org/some-dataset\n  format: messages\n  packing: true\n"
                                                   "  pad_to_multiple_of: 64\n")
    found = rules_of(write_recipe(text + "training: {loss_kernel: chunked}\n"))
    assert {("R119", "error", "data.format"), ("R119", "error", "data.packing"),
            ("R119", "error", "data.pad_to_multiple_of"), ("R119", "error", "training.loss_kernel")} <= set(found)
    # inherited from an SFT recipe it extends: that data section is the parent's business
    write_recipe(MINIMAL.replace("  path: org/some-dataset\n", "  path: org/some-dataset\n  format: alpaca\n"),
                 name="sft.yaml")
    assert rules_of(write_recipe("extends: sft.yaml\nobjective: dpo\n", name="dpo.yaml")) == []


def test_model_adapter_rules(tmp_path, write_recipe):
    full = DPO.replace("model:\n", "model:\n  adapter: ./sft\n") + "method: full\npreference: {reference: {mode: model}}\n"
    assert ("R120", "error", "model.adapter") in rules_of(write_recipe(full))
    missing = write_recipe(DPO.replace("model:\n", "model:\n  adapter: ./nowhere\n") + "lora: {r: 4}\n")
    assert {("R120", "info", "model.adapter"), ("R120", "warning", "lora")} <= set(rules_of(missing))
    sft = write_recipe(MINIMAL.replace("model:\n", "model:\n  adapter: ./sft\n"), name="sft.yaml")
    assert ("R120", "error", "model.adapter") in rules_of(sft)  # the SFT runner would ignore it


def test_shipped_preference_recipes_lint_clean():
    paths = [*TINY.glob("*.yaml"), REPO / "recipes" / "llama3" / "8b_dpo_qlora_2x12gb.yaml"]
    preference = [p for p in paths if load_recipe(p).recipe.objective != "sft"]
    assert len(preference) >= 6
    for path in preference:
        assert [f for f in lint_paths([path], LintOptions()).findings if f.severity != "info"] == [], path


# ------------------------------------------------------------------------------------------------
# Rows, checked before launch


def preflight_errors(tmp_path, objective: str, rows: list, suffix: str = ".jsonl", raw: str | None = None) -> list[str]:
    data = tmp_path / f"data{suffix}"
    data.write_text(raw if raw is not None else "".join(json.dumps(r) + "\n" for r in rows))
    recipe_path = tmp_path / "r.yaml"
    recipe_path.write_text(f"model: {{name_or_path: org/m}}\nobjective: {objective}\ndata: {{path: {data}}}\n")
    result = Preflight()
    dataset_step(load_recipe(recipe_path).recipe, result)
    return result.errors


def test_shipped_preference_data_passes_every_row(tmp_path):
    for name, objective in (("demo_preference.jsonl", "dpo"), ("demo_kto.jsonl", "kto")):
        recipe_path = tmp_path / f"{objective}.yaml"
        recipe_path.write_text(f"model: {{name_or_path: org/m}}\nobjective: {objective}\n"
                               f"data: {{path: {REPO / 'recipes' / 'data' / name}}}\n")
        result = Preflight()
        dataset_step(load_recipe(recipe_path).recipe, result)
        assert result.errors == [] and "all look right" in result.notes[0], result.notes
    assert "320 kto row(s)" in result.notes[0]


def test_every_bad_row_is_named_by_file_and_line(tmp_path):
    good = {"prompt": "Q", "chosen": "A", "rejected": "B"}
    chat = {"prompt": [{"role": "user", "content": "Q"}], "chosen": [{"role": "assistant", "content": "A"}],
            "rejected": [{"role": "assistant", "content": "B"}]}
    rows = [good] * 30 + [{"prompt": "Q", "chosen": "A"}, {**good, "chosen": 3}, {**chat, "rejected": "B"},
                          {**chat, "chosen": [{"role": "assistant"}]}, chat, {**good, "rejected": ""}]
    errors = preflight_errors(tmp_path, "dpo", rows)
    data = tmp_path / "data.jsonl"
    assert errors == [
        f"dataset {data}:31: no `rejected` column (prompt/chosen/rejected rows need `prompt`, `chosen`, `rejected`; found `prompt`, `chosen`)",
        f"dataset {data}:32: `chosen` must be text or a list of {{role, content}} messages, got int",
        f"dataset {data}:33: mixes text and message lists (`prompt` is messages, `chosen` is messages, `rejected` is text): "
        "use one form for the whole row",
        f"dataset {data}:34: `chosen`[0] must be an object with text `role` and `content`",
        f"dataset {data}:36: `rejected` is empty",
    ]  # row 31 is past the 20 rows SFT's preflight samples


def test_kto_rows_need_a_boolean_label_and_csv_cells_are_read_as_json(tmp_path):
    errors = preflight_errors(tmp_path, "kto", [{"prompt": "Q", "completion": "A", "label": 1},
                                                {"prompt": "Q", "chosen": "A", "rejected": "B"}])
    assert "`label` must be true or false, got int 1" in errors[0]
    assert "paired rows are for dpo, orpo, simpo and reward" in errors[1]
    csv_text = 'prompt,completion,label\nQ,A,true\n"[{""role"": ""user"", ""content"": ""Q""}]",A,false\n'
    errors = preflight_errors(tmp_path, "kto", [], suffix=".csv", raw=csv_text)
    assert len(errors) == 1 and "data.csv:3: mixes text and message lists" in errors[0]  # the file line, as for SFT rows
    assert preflight_errors(tmp_path, "kto", [], suffix=".json", raw='[{"prompt": "Q", "completion": "A", "label": false}]') == []
    assert "not valid JSON" in preflight_errors(tmp_path, "orpo", [], raw='{"prompt": "Q"\n')[0]


def test_a_missing_sft_adapter_stops_preflight(tmp_path):
    recipe_path = tmp_path / "r.yaml"
    recipe_path.write_text(f"model: {{name_or_path: org/m, adapter: {tmp_path / 'sft'}}}\nobjective: dpo\ndata: {{path: org/d}}\n")
    result = Preflight()
    model_step(load_recipe(recipe_path).recipe, result)
    assert any(e.startswith(f"model.adapter {tmp_path / 'sft'}: no adapter_config.json") for e in result.errors)
    (tmp_path / "sft" / "adapter").mkdir(parents=True)
    (tmp_path / "sft" / "adapter" / "adapter_config.json").write_text("{}")
    result = Preflight()
    model_step(load_recipe(recipe_path).recipe, result)
    assert not any(e.startswith("model.adapter") for e in result.errors)


def test_the_shipped_data_is_what_the_script_writes():
    done = subprocess.run([sys.executable, "scripts/make_preference_data.py", "--check"], cwd=REPO, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr


# ------------------------------------------------------------------------------------------------
# Plan


def _plan(write_recipe, extra: str, name: str = "r.yaml", micro_batch: int = 4):
    from finetune.plan import plan_recipe

    text = ("model:\n  name_or_path: builtin:tiny-llama\n  dtype: float32\ndata: {path: org/d, max_length: 64}\n"
            f"training: {{micro_batch_size: {micro_batch}}}\nlaunch: {{procs_per_node: 2}}\n" + extra)
    return plan_recipe(load_recipe(write_recipe(text, name)).recipe)


def test_pairs_double_the_rows_and_dpo_scores_through_trls_logprob_tiles(write_recipe):
    from finetune.plan.loss import fused_logprob_loss

    sft = _plan(write_recipe, "", micro_batch=8)
    dpo = _plan(write_recipe, "objective: dpo\n")
    orpo = _plan(write_recipe, "objective: orpo\n")
    kto = _plan(write_recipe, "objective: kto\n")
    assert dpo.setup.micro_batch == orpo.setup.micro_batch == 8 and kto.setup.micro_batch == 4
    # activations of 4 pairs are those of 8 SFT rows; ORPO's full logits too
    assert orpo.field_bytes("activations") == sft.field_bytes("activations")

    def saved(result):  # what the forward keeps (backward's own working set depends on the loss buffers)
        return {t.name: t.bytes for t in result.terms if t.field == "activations" and "recompute" not in t.name}

    assert saved(dpo) == saved(sft) and saved(kto) == saved(_plan(write_recipe, "", name="s4.yaml"))
    assert orpo.field_bytes("logits") == sft.field_bytes("logits") == 8 * 64 * 768 * 12
    # DPO: one 512-token x 768-vocab fp32 tile each way + the fp32 hidden gradient of 512 tokens x 128
    assert dpo.field_bytes("logits") == fused_logprob_loss(dpo.setup)[0] == 2 * 512 * 768 * 4 + 512 * 128 * 4
    assert "dpo: chosen + rejected rows" in dpo.setup.describe()


def test_a_full_fine_tune_reference_adds_its_weights_partitioned_under_zero3(write_recipe):
    params = 787_584  # builtin:tiny-llama
    base = "method: full\nobjective: dpo\n"
    pre = _plan(write_recipe, base + "preference: {reference: {mode: precomputed}}\ndeepspeed: {stage: 3}\n")
    z3 = _plan(write_recipe, base + "preference: {reference: {mode: model}}\ndeepspeed: {stage: 3}\n")
    z2 = _plan(write_recipe, base + "preference: {reference: {mode: model}}\ndeepspeed: {stage: 2}\n")
    pre2 = _plan(write_recipe, base + "preference: {reference: {mode: precomputed}}\ndeepspeed: {stage: 2}\n")
    assert z3.field_bytes("weights") - pre.field_bytes("weights") == params * 4 // 2
    assert z2.field_bytes("weights") - pre2.field_bytes("weights") == params * 4
    lora = _plan(write_recipe, "objective: dpo\n")
    assert not any("reference" in t.name for t in lora.terms)  # the adapter is switched off: no copy


def test_lint_p001_sees_the_doubled_rows(write_recipe):
    text = ("model: {name_or_path: meta-llama/Meta-Llama-3-8B-Instruct}\nmethod: qlora\ndata: {path: org/d, max_length: 4096}\n"
            "training: {micro_batch_size: 1}\ndeepspeed: {stage: 3}\nhardware: {gpus: 2, gpu_memory: 24GiB}\n")
    # about 16.4 GiB per GPU for SFT (upper bound 20.7), 25.4 GiB with a pair per micro batch (bound 32.2):
    # finetune plan; P001 decides on the bound
    sft = [f.rule for f in lint_paths([write_recipe(text, "sft.yaml")], LintOptions()).findings]
    dpo = [f.rule for f in lint_paths([write_recipe(text + "objective: orpo\n", "dpo.yaml")], LintOptions()).findings]
    assert "P001" not in sft and "P001" in dpo


# ------------------------------------------------------------------------------------------------
# TRL's config keys, the summary


def test_trl_config_gets_only_the_keys_the_objective_reads(write_recipe):
    from finetune.train.preference import config_kwargs

    def kwargs(extra: str) -> dict:
        return config_kwargs(load_recipe(write_recipe(MINIMAL + extra)).recipe)

    assert kwargs("objective: dpo\npreference: {beta: 0.2, loss_type: ipo}\n") == {
        "max_length": 2048, "beta": 0.2, "loss_type": ["ipo"], "precompute_ref_log_probs": False, "label_smoothing": 0.0}
    assert kwargs("objective: simpo\npreference: {max_completion_length: 32}\n") == {
        "max_length": 2048, "max_completion_length": 32, "loss_type": "simpo", "simpo_gamma": 0.5, "cpo_alpha": 0.0,
        "label_smoothing": 0.0}
    assert kwargs("objective: kto\npreference: {reference: {mode: precomputed}, desirable_weight: 1.5}\n") == {
        "max_length": 2048, "precompute_ref_log_probs": True, "desirable_weight": 1.5, "undesirable_weight": 1.0}
    assert kwargs("objective: orpo\n") == {"max_length": 2048}


def test_trl_configs_accept_those_keys():
    pytest.importorskip("trl")
    import dataclasses

    from finetune.train.preference import trl_classes
    from finetune.recipe import Recipe

    for objective, keys in (("dpo", {"beta", "loss_type", "precompute_ref_log_probs", "label_smoothing"}),
                            ("kto", {"beta", "loss_type", "precompute_ref_log_probs", "desirable_weight",
                                     "undesirable_weight"}),
                            ("orpo", {"beta", "max_completion_length"}),
                            ("simpo", {"beta", "max_completion_length", "loss_type", "simpo_gamma", "cpo_alpha",
                                       "label_smoothing"})):
        recipe = Recipe.model_validate({"model": {"name_or_path": "m"}, "data": {"path": "d"}, "objective": objective})
        fields = {f.name for f in dataclasses.fields(trl_classes(recipe)[0])}
        assert keys | {"max_length"} <= fields, (objective, keys - fields)


def test_summary_keeps_first_and_last_of_the_training_metrics():
    from finetune.train.preference import metric_summary, summary_line

    history = [{"loss": 0.69, "rewards/margins": 0.0, "rewards/accuracies": 0.0, "logps/chosen": -40.0, "step": 1},
               {"eval_loss": 0.6, "eval_rewards/margins": 9.0, "step": 2},
               {"loss": 0.35, "rewards/margins": 1.5, "rewards/accuracies": 0.75, "logps/chosen": -41.5, "step": 3},
               {"train_loss": 0.5, "step": 3}]
    metrics = metric_summary(history)
    assert metrics == {"rewards/margins": {"first": 0.0, "last": 1.5}, "rewards/accuracies": {"first": 0.0, "last": 0.75},
                       "logps/chosen": {"first": -40.0, "last": -41.5}}
    assert summary_line(metrics) == "rewards/margins 0.000 -> 1.500, rewards/accuracies 0.000 -> 0.750"


def test_every_preference_tiny_recipe_is_trained_by_a_slow_test():
    from tests.launches.test_preference import TRAINED

    shipped = {p.stem for p in TINY.glob("*.yaml") if load_recipe(p).recipe.objective in ("dpo", "orpo", "kto", "simpo")}
    assert shipped == set(TRAINED)


def test_chat_prompts_a_preference_run_with_the_chat_template_and_eval_says_what_it_cannot_score(tmp_path):
    from finetune.data.formats import chat_format
    from finetune.use.evaluate import EvalError, eval_rows
    from finetune.recipe import Recipe

    recipe = Recipe.model_validate({"model": {"name_or_path": "m"}, "data": {"path": "d"}, "objective": "dpo"})
    assert chat_format(recipe) == "messages"
    with pytest.raises(EvalError, match="objective: dpo: its preference rows have no loss to score"):
        eval_rows(tmp_path, recipe, None, None, print)


def test_the_run_directory_records_the_adapter_and_reference_as_absolute_paths(tmp_path, monkeypatch):
    from finetune.recipe import Recipe
    from finetune.rundir.layout import resolved_recipe

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "sft").mkdir(parents=True)
    recipe = Recipe.model_validate({"model": {"name_or_path": "org/m", "adapter": "runs/sft"}, "data": {"path": "org/d"},
                                    "objective": "dpo", "preference": {"reference": {"mode": "model", "name_or_path": "runs/sft"}}})
    data = resolved_recipe(recipe, tmp_path / "runs" / "dpo")
    assert data["model"]["adapter"] == data["preference"]["reference"]["name_or_path"] == str(tmp_path / "runs" / "sft")
    assert data["model"]["name_or_path"] == "org/m"  # a hub id stays one


def test_resume_key_covers_the_objective_and_its_settings():
    """A DPO run resumed with another beta (or as SFT) is refused; an SFT run's key is as before."""
    from finetune.rundir.resume_key import changed_fields, resume_fields

    base = {"model": {"name_or_path": "builtin:tiny-llama"}, "method": "lora", "data": {"path": "d.jsonl"},
            "objective": "dpo", "preference": {"beta": 0.1, "loss_type": "sigmoid"}}
    other = {**base, "preference": {"beta": 0.5, "loss_type": "sigmoid"}}
    changes = changed_fields(resume_fields(base, 2), resume_fields(other, 2))
    assert changes == ['preference: {"beta": 0.1, "loss_type": "sigmoid"} -> {"beta": 0.5, "loss_type": "sigmoid"}']
    assert "objective: dpo -> unset" in changed_fields(resume_fields(base, 2), resume_fields({**base, "objective": "sft"}, 2))
    sft = {**base, "objective": "sft"}
    assert not {"objective", "preference", "model.adapter"} & set(resume_fields(sft, 2))
    adapter = {**sft, "model": {"name_or_path": "builtin:tiny-llama", "adapter": "/runs/sft/adapter"}}
    assert changed_fields(resume_fields(sft, 2), resume_fields(adapter, 2)) == ["model.adapter: unset -> /runs/sft/adapter"]


def test_next_steps_after_a_preference_run_do_not_offer_eval(tmp_path):
    """eval scores a perplexity on SFT rows; after DPO it would only say it cannot, so it is not suggested."""
    from finetune.cli.train import next_steps_lines
    from finetune.train.report import next_steps

    assert any("finetune eval" in line for line in next_steps_lines(tmp_path, ["adapter"]))
    assert not any("finetune eval" in line for line in next_steps_lines(tmp_path, ["adapter"], "dpo"))
    assert not any("finetune eval" in command for _, command in next_steps(tmp_path, {"objective": "dpo", "output": "adapter"}))
    assert any("finetune eval" in command for _, command in next_steps(tmp_path, {"objective": "sft", "output": "adapter"}))


def test_preference_rows_refuse_unknown_roles_and_name_a_null_column():
    """Issue 25 item 10: a role SFT refuses was trained in preference rows; a null column was "missing"."""
    from finetune.data.formats import RowProblem, RowSpec
    from finetune.data.preference import pairs

    def problem(row):
        with pytest.raises(RowProblem) as info:
            pairs(row, RowSpec("pairs"))
        return str(info.value)

    turn = lambda role, text: [{"role": role, "content": text}]  # noqa: E731
    row = {"prompt": turn("narrator", "Once"), "chosen": turn("assistant", "a"), "rejected": turn("assistant", "b")}
    assert problem(row) == "`prompt`[0]: unknown role `narrator` (known: system, user, assistant, tool)"
    assert problem({"prompt": "q", "chosen": None, "rejected": "b"}) == "`chosen` is null"
    assert problem({"prompt": "q", "rejected": "b"}).startswith("no `chosen` column")


@pytest.mark.parametrize("name", ["dpo_lora_zero3", "orpo_lora", "simpo_lora", "kto_lora", "reward_full_zero2",
                                  "grpo_lora_zero3"])
def test_data_show_prints_each_sequence_trl_makes_of_a_row(name):
    """Issue 34: `data show` refused every preference recipe. It now shows what the objective's TRL code makes of
    the row: the chosen and rejected answers (kto: the completion) as the trained tokens after the prompt; a
    reward model's sequences whole; a GRPO prompt with nothing trained."""
    from finetune.builtin import resolve_model_path
    from finetune.data.show import TRAINED_END, TRAINED_START
    from finetune.tokenizer import load_tokenizer
    from finetune.train.show_rows import show_rows

    recipe = load_recipe(TINY / f"{name}.yaml").recipe
    tokenizer = load_tokenizer(recipe, resolve_model_path(recipe.model.name_or_path))
    first = json.loads(recipe.data.path and Path(recipe.data.path).read_text().splitlines()[0])
    shown = show_rows(recipe, tokenizer)
    if recipe.objective == "grpo":
        assert len(shown) == 1 and shown[0].trained == 0 and first["instruction"] in shown[0].text
        return
    answers = [first["chosen"], first["rejected"]] if "chosen" in first else [first["completion"]]
    assert [s.where.split()[1] for s in shown] == (["chosen", "rejected"] if "chosen" in first else ["completion"])
    for one, answer in zip(shown, answers):
        content = answer[-1]["content"] if isinstance(answer, list) else answer
        if recipe.objective == "reward":
            assert one.trained == 0 and content in one.text
        else:
            assert one.trained > 0 and f"{TRAINED_START}{content}" in one.text and one.text.endswith(TRAINED_END)


def test_a_preference_runs_prompt_format_is_named_and_a_change_from_its_sft_run_is_flagged(tmp_path):
    """Issue 34: SFT on the Alpaca prompt, then DPO on text rows, changed the prompt format silently, and chat
    said "messages (as the run trained)". Lint (R120, so preflight too) says so; chat names the rows' format."""
    from finetune.rundir.layout import write_run_dir
    from finetune.data.show import trained_format
    from finetune.use.chat import format_why

    sft = write_run_dir(load_recipe(TINY / "lora_zero3.yaml"), tmp_path / "runs" / "sft", world_size=2)
    (tmp_path / "text.jsonl").write_text(json.dumps({"prompt": "What is 7 plus 0?", "chosen": "7.", "rejected": "No."}) + "\n")
    recipe = tmp_path / "dpo.yaml"
    recipe.write_text(f"extends: {TINY / 'dpo_lora_zero3.yaml'}\nmodel: {{adapter: {sft}}}\ndata: {{path: text.jsonl}}\n")
    found = [f for f in lint_paths([recipe], LintOptions()).findings if f.rule == "R120" and f.severity == "warning"]
    assert len(found) == 1 and "trained on Alpaca prompts, these dpo rows are plain text" in found[0].message
    loaded = load_recipe(recipe).recipe
    assert trained_format(loaded) == "text" and format_why(loaded) == "as the run trained: its text prompts as written"
    messages = load_recipe(TINY / "dpo_lora_zero3.yaml").recipe
    assert trained_format(messages) == "messages" and "its rows were chat messages" in format_why(messages)
    recipe.write_text(f"extends: {TINY / 'dpo_lora_zero3.yaml'}\nmodel: {{adapter: {sft}}}\n")  # chat rows: they differ too
    assert [f.rule for f in lint_paths([recipe], LintOptions()).findings if f.severity == "warning"] == ["R120"]
