"""GRPO and reward models without training (fast): the `grpo` section, lint R121, every reward error before
launch as one line naming the function, the built-in rewards, TRL's GRPO config, the planner's generation
terms, the resume key. The real runs are in tests/launches/test_grpo.py (slow).
"""

from __future__ import annotations

import json
import textwrap

import pytest

from finetune.lint import LintOptions, lint_paths
from finetune.recipe import RecipeProblem, load_recipe
from finetune.run.preflight import Preflight, rewards_step
from tests.conftest import REPO

TINY = REPO / "recipes" / "tiny"


def grpo_recipe(tmp_path, rewards: str, extra: str = "", rows: list | None = None):
    data = tmp_path / "prompts.jsonl"
    rows = rows if rows is not None else [{"prompt": "What is 2+2?", "answer": "4"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = tmp_path / "g.yaml"
    path.write_text(f"model: {{name_or_path: org/m}}\nobjective: grpo\ndata: {{path: {data}, format: prompt}}\n"
                    f"grpo:\n  rewards:\n{textwrap.indent(rewards, '    ')}{extra}")
    return path


def findings(path):
    return [(f.rule, f.severity, f.key, f.message) for f in lint_paths([path], LintOptions()).findings if f.rule == "R121"]


def preflight_errors(path) -> list[str]:
    result = Preflight()
    rewards_step(load_recipe(path).recipe, result)
    return result.errors


def test_grpo_section_is_validated_like_every_other(tmp_path):
    path = grpo_recipe(tmp_path, "- {function: exact_match}\n", "  num_generations: 1\n  loss_type: ppo\n  epsilon: 2\n")
    with pytest.raises(RecipeProblem) as info:
        load_recipe(path)
    assert {p.key for p in info.value.problems} == {"grpo.num_generations", "grpo.loss_type", "grpo.epsilon"}


def test_lint_checks_reward_paths_and_weights_without_importing(tmp_path):
    bad = grpo_recipe(tmp_path, "- {function: exact_mtch}\n- {function: 'no_such_module_xyz:'}\n"
                                "- {function: 'pkg.mod:fn', weight: 0}\n- {function: regex}\n- {function: length}\n"
                                "- {function: regex, pattern: '('}\n")
    found = {(key, severity): message for _, severity, key, message in findings(bad)}
    assert "did you mean `exact_match`?" in found[("grpo.rewards.0.function", "error")]
    assert "is not `package.module:function` or `file.py:function`" in found[("grpo.rewards.1.function", "error")]
    assert ("grpo.rewards.2.weight", "warning") in found  # weight 0: logged, not trained on
    assert found[("grpo.rewards.3.pattern", "error")] == "reward regex needs a `pattern`"
    assert found[("grpo.rewards.4.target", "error")] == "reward length needs a `target` (tokens)"
    assert "not a regular expression" in found[("grpo.rewards.5.pattern", "error")]
    none = grpo_recipe(tmp_path, "[]\n")
    assert [f[2] for f in findings(none)] == ["grpo.rewards"]
    zero = grpo_recipe(tmp_path, "- {function: exact_match, weight: 0}\n")
    assert any("every reward has weight 0" in f[3] for f in findings(zero))
    groups = grpo_recipe(tmp_path, "- {function: exact_match}\n",
                         "  num_generations: 3\ntraining: {micro_batch_size: 2}\nlaunch: {procs_per_node: 2}\n")
    assert any("4 completions" in f[3] and "multiple of num_generations 3" in f[3] for f in findings(groups))
    evaluated = grpo_recipe(tmp_path, "- {function: exact_match}\n", "  num_generations: 4\ntraining: "
                            "{micro_batch_size: 1, gradient_accumulation_steps: 2}\nlaunch: {procs_per_node: 2}\n")
    text = evaluated.read_text().replace("format: prompt}", "format: prompt, validation_split: 0.1}")
    evaluated.write_text(text)
    assert [f[2] for f in findings(evaluated)] == ["data.validation_split"]
    sft = tmp_path / "sft.yaml"
    sft.write_text("model: {name_or_path: org/m}\ndata: {path: d.jsonl}\ngrpo: {num_generations: 4}\n")
    assert ("R118", "error", "grpo") in [(f.rule, f.severity, f.key) for f in lint_paths([sft], LintOptions()).findings]


def test_every_reward_error_is_one_line_naming_the_function_before_launch(tmp_path, monkeypatch):
    module = tmp_path / "my_rewards.py"
    module.write_text(textwrap.dedent("""
        def good(prompts, completions, answer, **kwargs):
            return [float(c == a) for c, a in zip(completions, answer)]
        def no_kwargs(completions):
            return [0.0] * len(completions)
        def too_few(prompts, completions, **kwargs):
            return [1.0]
        def not_a_list(prompts, completions, **kwargs):
            return 1.0
        def strings(prompts, completions, **kwargs):
            return ["high"] * len(completions)
        def raises(prompts, completions, **kwargs):
            raise KeyError("solution")
        NOT_CALLABLE = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    cases = {
        "my_rewards:good": None,
        "my_rewards.py:good": None,  # a file relative to the recipe
        "no_such_module_xyz:fn": "reward no_such_module_xyz:fn: cannot import module `no_such_module_xyz`",
        "my_rewards:missing": "reward my_rewards:missing: module `my_rewards` has no function `missing`",
        "my_rewards:NOT_CALLABLE": "reward my_rewards:NOT_CALLABLE: `NOT_CALLABLE` is a int, not a function",
        "my_rewards:no_kwargs": "reward my_rewards:no_kwargs: wrong signature",
        "my_rewards:too_few": "reward my_rewards:too_few: returned 1 value(s) for 2 completions",
        "my_rewards:not_a_list": "reward my_rewards:not_a_list: returned float, expected a list of floats",
        "my_rewards:strings": "reward my_rewards:strings: returned a str ('high'), expected a float",
        "my_rewards:raises": "reward my_rewards:raises: raised KeyError on the first data row",
        "missing.py:fn": "reward ",
        "number_match": None,
    }
    for function, expected in cases.items():
        errors = preflight_errors(grpo_recipe(tmp_path, f"- function: {function}\n"))
        if expected is None:
            assert errors == [], (function, errors)
        else:
            assert len(errors) == 1 and errors[0].startswith(expected) and "\n" not in errors[0], (function, errors)
    missing_file = preflight_errors(grpo_recipe(tmp_path, "- function: missing.py:fn\n"))
    assert missing_file == [f"reward {tmp_path / 'missing.py'}:fn: no file {tmp_path / 'missing.py'}"]
    no_column = preflight_errors(grpo_recipe(tmp_path, "- {function: exact_match, column: solution}\n"))
    assert no_column == ["reward exact_match: the data has no `solution` column (set the reward's `column`)"]


def test_vllm_is_refused_where_it_cannot_run(tmp_path):
    import importlib.util

    from finetune.run.doctor import checks_for_recipe
    from finetune.run.machine import Facts

    recipe = load_recipe(grpo_recipe(tmp_path, "- {function: exact_match}\n", "  vllm: colocate\n")).recipe
    facts = Facts(python="3.11", platform="linux", packages={})  # a machine without a GPU
    failed = {c.name: c.message for c in checks_for_recipe(recipe, facts) if c.status == "fail"}
    assert failed["vllm.gpu"] == "grpo.vllm: colocate needs a CUDA GPU; none is visible here"
    if importlib.util.find_spec("vllm") is None:
        assert failed["vllm"] == "grpo.vllm: colocate needs vllm, which is not installed"
    off = load_recipe(grpo_recipe(tmp_path, "- {function: exact_match}\n")).recipe
    assert not any(c.name.startswith("vllm") for c in checks_for_recipe(off, facts))


def test_builtin_rewards():
    from finetune import rewards
    from finetune.recipe import RewardSection

    def score(spec: dict, completions, **columns):
        fn = rewards.builtin(RewardSection(**spec))
        return fn(prompts=["p"] * len(completions), completions=completions,
                  completion_ids=[[0] * len(c) for c in completions], **columns)

    assert score({"function": "exact_match"}, [" Paris. ", "paris  is it", [{"role": "assistant", "content": "PARIS"}]],
                 answer=["Paris"] * 3) == [1.0, 0.0, 1.0]
    assert score({"function": "number_match"}, ["so 1,234.", "#### 12", "none"], answer=["The answer is 1234"] * 2 + ["x"]) \
        == [1.0, 0.0, None]
    assert score({"function": "regex", "pattern": r"^\d+$"}, ["42", "4 2"]) == [1.0, 0.0]
    assert score({"function": "length", "target": 4}, ["abcd", "ab", "abcdefgh"]) == [0.0, -0.5, -1.0]
    assert score({"function": "think_format"}, ["<think>x</think> 4", "4", "<think>x</think>"]) == [1.0, 0.0, 0.0]


def test_grpo_trl_config_reads_the_section_and_the_rewards_weights(write_recipe):
    from finetune.train.grpo import config_kwargs

    recipe = load_recipe(TINY / "grpo_lora_zero3.yaml").recipe
    kwargs = config_kwargs(recipe)
    assert kwargs["num_generations"] == 4 and kwargs["reward_weights"] == [1.0, 0.1] and kwargs["beta"] == 0.02
    assert kwargs["use_vllm"] is False and kwargs["remove_unused_columns"] is False
    assert "max_length" not in kwargs  # GRPOConfig has no prompt limit in trl 1.16


def test_plan_counts_generation_and_the_grpo_reference(tmp_path):
    from finetune.plan import plan_recipe

    lora = plan_recipe(load_recipe(TINY / "grpo_lora_zero3.yaml").recipe)
    names = {t.name: t for t in lora.terms}
    assert "generation KV cache" in names and "weights gathered for generation" in names
    # builtin:tiny-llama: 4 layers, 2 kv heads x 32; 8 completions x (prompt + 16) tokens, fp32
    setup = lora.setup
    assert names["generation KV cache"].bytes == 2 * 4 * 2 * 32 * 4 * 8 * setup.seq_len
    assert not any("reference" in t.name for t in lora.terms)  # LoRA: the adapter is switched off
    full = plan_recipe(load_recipe(TINY / "grpo_full_zero2.yaml").recipe)
    assert any(t.name == "reference model" for t in full.terms)  # beta > 0, full: a frozen copy


def test_resume_key_covers_the_grpo_section():
    from finetune.rundir.resume_key import changed_fields, resume_fields

    base = {"objective": "grpo", "method": "lora", "grpo": {"num_generations": 4, "rewards": [{"function": "a:b"}]}}
    changed = {**base, "grpo": {"num_generations": 8, "rewards": [{"function": "a:b"}]}}
    assert [c.split(":")[0] for c in changed_fields(resume_fields(base, 2), resume_fields(changed, 2))] == ["grpo"]


def test_shipped_grpo_and_reward_recipes_lint_clean_and_plan():
    from finetune.plan import plan_recipe

    paths = [TINY / "grpo_lora_zero3.yaml", TINY / "grpo_full_zero2.yaml", TINY / "reward_full_zero2.yaml",
             REPO / "recipes" / "qwen2.5" / "7b_grpo_lora_8xh100.yaml"]
    for path in paths:
        assert [f for f in lint_paths([path], LintOptions()).findings if f.severity != "info"] == [], path
        assert plan_recipe(load_recipe(path).recipe).terms, path


def test_every_grpo_and_reward_tiny_recipe_is_trained_by_a_slow_test():
    from tests.launches.test_grpo import TRAINED

    shipped = {p.stem for p in TINY.glob("*.yaml") if load_recipe(p).recipe.objective in ("grpo", "reward")}
    assert shipped == set(TRAINED)


def test_a_reward_model_does_not_continue_an_sft_adapter(tmp_path):
    path = tmp_path / "rm.yaml"
    path.write_text(f"model: {{name_or_path: org/m, adapter: {tmp_path}}}\nobjective: reward\ndata: {{path: d.jsonl}}\n")
    assert ("R120", "error", "model.adapter") in [(f.rule, f.severity, f.key) for f in lint_paths([path], LintOptions()).findings]


def test_grpo_from_an_sft_adapter_with_a_kl_term_says_what_the_reference_is(tmp_path):
    path = grpo_recipe(tmp_path, "- {function: exact_match}\n", "  beta: 0.04\n")
    path.write_text(path.read_text().replace("name_or_path: org/m}", f"name_or_path: org/m, adapter: {tmp_path}}}"))
    found = [(f.rule, f.severity, f.key) for f in lint_paths([path], LintOptions()).findings]
    assert ("R118", "warning", "grpo.beta") in found


def test_preflight_checks_the_groups_once_the_process_count_is_known(tmp_path):
    path = grpo_recipe(tmp_path, "- {function: exact_match}\n", "  num_generations: 4\ntraining: {micro_batch_size: 1}\n")
    result = Preflight()
    rewards_step(load_recipe(path).recipe, result, world_size=2)  # procs_per_node: auto -> 2 processes at launch
    assert result.errors[0].startswith("grpo.num_generations: a step generates 2 completions")
    result = Preflight()
    rewards_step(load_recipe(path).recipe, result, world_size=4)
    assert result.errors == []


def test_plan_scores_grpo_through_trls_fused_head_and_a_reward_model_through_its_score_head():
    from finetune.plan import plan_recipe
    from finetune.plan.loss import fused_logprob_loss

    grpo = plan_recipe(load_recipe(TINY / "grpo_lora_zero3.yaml").recipe)  # trl 1.16: model(..., fused_lm_head=True)
    assert grpo.field_bytes("logits") == fused_logprob_loss(grpo.setup)[0]
    reward = plan_recipe(load_recipe(TINY / "reward_full_zero2.yaml").recipe)
    assert reward.field_bytes("logits") == 2 * 4 * reward.setup.micro_batch * reward.setup.seq_len  # no vocabulary
    assert "reward: chosen + rejected rows" in reward.setup.describe()
