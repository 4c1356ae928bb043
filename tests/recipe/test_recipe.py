"""The recipe schema and loader: positions, did-you-mean, extends, --set, hostile YAML."""

from __future__ import annotations

import json

import pytest

from finetune.recipe import Recipe, RecipeProblem, json_schema, load_recipe, parse_size
from tests.conftest import MINIMAL, run_cli


def problems(path, overrides=None):
    with pytest.raises(RecipeProblem) as exc:
        load_recipe(path, overrides)
    return exc.value.problems


def test_minimal_recipe_has_documented_defaults(write_recipe):
    loaded = load_recipe(write_recipe())
    r = loaded.recipe
    assert r.method == "lora" and r.lora.target_modules == "all-linear"
    assert r.model.trust_remote_code is False
    assert r.training.report_to == ["tensorboard"]
    assert r.deepspeed.stage == 2 and r.deepspeed.offload_optimizer == "none"
    assert r.name == "r"  # from the file name


def test_misspelled_key_names_line_and_suggests(write_recipe):
    path = write_recipe(MINIMAL + "lora:\n  rr: 16\n  alpah: 32\n")
    found = problems(path)
    assert [(p.key, p.line, p.rule) for p in found] == [("lora.rr", 6, "R002"), ("lora.alpah", 7, "R002")]
    assert found[0].fix == "did you mean `r`?"
    assert found[1].fix == "did you mean `alpha`?"
    assert found[0].render().startswith(f"{path}:6:3: `lora.rr` unknown key")


def test_all_problems_reported_at_once(write_recipe):
    path = write_recipe(MINIMAL + "method: qlroa\ndeepspeed:\n  stage: 4\ntraining:\n  learning_rate: -1\n")
    found = problems(path)
    keys = {p.key for p in found}
    assert keys == {"method", "deepspeed.stage", "training.learning_rate"}
    method = next(p for p in found if p.key == "method")
    assert method.fix == "did you mean `qlora`?" and method.line == 5


def test_missing_required_section(write_recipe):
    found = problems(write_recipe("model:\n  name_or_path: x\n"))
    assert [(p.key, p.rule) for p in found] == [("data", "R005")]


@pytest.mark.parametrize("text,needle", [
    ("model: [1, 2\n", "invalid YAML"),
    ("!!python/object/apply:os.system ['echo hi']\n", "tag"),
    ("model: !custom {a: 1}\n", "tag"),
    ("a: 1\na: 2\n", "duplicate key `a`"),
    ("- 1\n- 2\n", "mapping"),
    ("", "empty"),
    ("a: 1\n---\nb: 2\n", "more than one YAML document"),
    ("base: &a {x: 1}\nother:\n  <<: *a\n", "merge keys"),
])
def test_hostile_or_broken_yaml_is_one_clear_problem(write_recipe, text, needle):
    found = problems(write_recipe(text))
    assert len(found) == 1 and needle in found[0].message
    assert found[0].line >= 1


def test_alias_bomb_is_refused_quickly(write_recipe):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 12):
        prev = f"*a{i - 1}"
        lines.append(f"a{i}: &a{i} [{', '.join([prev] * 10)}]")
    found = problems(write_recipe("\n".join(lines) + "\n"))
    assert "alias bomb" in found[0].message


def test_deep_nesting_is_refused(write_recipe):
    text = "a: " + "[" * 200 + "]" * 200 + "\n"
    found = problems(write_recipe(text))
    assert "nested" in found[0].message or "invalid YAML" in found[0].message


def test_extends_merges_and_child_wins(write_recipe, tmp_path):
    write_recipe(MINIMAL + "deepspeed:\n  stage: 3\n  offload_optimizer: cpu\nlora:\n  r: 8\n", name="base.yaml")
    child = write_recipe("extends: base.yaml\nlora:\n  r: 64\n", name="child.yaml")
    loaded = load_recipe(child)
    assert loaded.recipe.lora.r == 64
    assert loaded.recipe.deepspeed.stage == 3 and loaded.recipe.deepspeed.offload_optimizer == "cpu"
    # positions point at the file that wrote the key
    assert loaded.where(("lora", "r"))[0] == str(child)
    assert loaded.where(("deepspeed", "stage"))[0].endswith("base.yaml")


def test_error_in_extended_file_points_at_that_file(write_recipe):
    base = write_recipe(MINIMAL + "lora:\n  rank: 8\n", name="base.yaml")
    child = write_recipe("extends: base.yaml\n", name="child.yaml")
    found = problems(child)
    assert found[0].path == str(base) and found[0].key == "lora.rank"


def test_extends_loop_and_missing_parent(write_recipe):
    write_recipe("extends: b.yaml\n", name="a.yaml")
    b = write_recipe("extends: a.yaml\n", name="b.yaml")
    assert "loop" in problems(b)[0].message
    missing = write_recipe("extends: nope.yaml\n", name="c.yaml")
    found = problems(missing)
    assert found[0].rule == "R003" and found[0].line == 1 and "does not exist" in found[0].message


def test_set_overrides_are_yaml_typed(write_recipe):
    loaded = load_recipe(write_recipe(), ["deepspeed.stage=3", "lora.target_modules=[q_proj, v_proj]", "training.learning_rate=1e-5"])
    assert loaded.recipe.deepspeed.stage == 3
    assert loaded.recipe.lora.target_modules == ["q_proj", "v_proj"]
    assert loaded.recipe.training.learning_rate == 1e-5


def test_bad_set_overrides(write_recipe):
    path = write_recipe()
    assert problems(path, ["deepspeed.stage"])[0].rule == "R006"
    unknown = problems(path, ["deepspeed.stagee=3"])[0]
    assert unknown.key == "deepspeed.stagee" and unknown.fix == "did you mean `stage`?"
    assert unknown.path.startswith("--set")


def test_parse_size():
    assert parse_size("24GiB") == 24 * 2**30
    assert parse_size("12GB") == 12 * 10**9
    assert parse_size("1.5 TiB") == int(1.5 * 2**40)
    with pytest.raises(ValueError):
        parse_size("lots")


def test_relative_data_path_resolves_against_recipe(write_recipe, tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "d.jsonl").write_text("{}\n")
    path = write_recipe("model: {name_or_path: org/m}\ndata: {path: d.jsonl}\n", name="sub/r.yaml")
    assert load_recipe(path).recipe.data.path == str(tmp_path / "sub" / "d.jsonl")


def test_json_schema_covers_every_section_with_docs():
    schema = json_schema()
    assert set(schema["properties"]) >= {"model", "method", "lora", "quantization", "data", "training",
                                          "deepspeed", "launch", "hardware", "output_dir", "extends"}
    lora = schema["$defs"]["LoraSection"]
    assert lora["additionalProperties"] is False
    assert "description" in lora["properties"]["r"]


def test_schema_command_prints_valid_json():
    result = run_cli("schema")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["title"] == "finetune recipe"


def test_every_section_rejects_unknown_keys():
    for name, field in Recipe.model_fields.items():
        model = getattr(field.annotation, "model_config", None)
        if model is not None:
            assert model.get("extra") == "forbid", name


@pytest.mark.parametrize("text, key, suggestion", [
    ("learning_rate: 1.0e-4\n", "learning_rate", "training.learning_rate"),  # a key of another section
    ("r: 8\n", "r", "lora.r"),
    ("num_epochs: 3\n", "num_epochs", "training.epochs"),                   # other tools' names
    ("lora:\n  lora_r: 8\n", "lora.lora_r", "lora.r"),
    ("lora:\n  lora_alpha: 16\n", "lora.lora_alpha", "lora.alpha"),
    ("training:\n  lr: 1.0e-3\n", "training.lr", "training.learning_rate"),
    ("training:\n  per_device_train_batch_size: 2\n", "training.per_device_train_batch_size", "training.micro_batch_size"),
    ("training:\n  gradient_accumulation: 4\n", "training.gradient_accumulation", "training.gradient_accumulation_steps"),
    ("deepspeed:\n  zero_stage: 3\n", "deepspeed.zero_stage", "deepspeed.stage"),
    ("training:\n  learning_rat: 1.0e-3\n", "training.learning_rat", "learning_rate"),  # a typo, as before
])
def test_unknown_keys_suggest_where_the_key_lives(write_recipe, text, key, suggestion):
    path = write_recipe(MINIMAL + text)
    with pytest.raises(RecipeProblem) as info:
        load_recipe(path)
    (problem,) = info.value.problems
    assert problem.key == key and problem.rule == "R002"
    assert f"did you mean `{suggestion}`?" in problem.fix


def test_a_value_with_colon_space_is_told_to_be_quoted(write_recipe):
    path = write_recipe("model:\n  name_or_path: builtin: tiny-llama\ndata:\n  path: org/d\n")
    with pytest.raises(RecipeProblem) as info:
        load_recipe(path)
    assert 'must be quoted, e.g. `name_or_path: "builtin:tiny-llama"`' in info.value.problems[0].message
    # without the space, YAML reads builtin:tiny-llama as one string: no quotes needed
    assert load_recipe(write_recipe("model:\n  name_or_path: builtin:tiny-llama\ndata:\n  path: org/d\n")) \
        .recipe.model.name_or_path == "builtin:tiny-llama"
