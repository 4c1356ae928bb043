"""`finetune lint` end to end: recipe rules, positions, reporters, exit codes, the shipped gallery."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.lint import LintOptions, lint_paths, report
from finetune.lint.recipe_rules import RULES as RECIPE_RULES
from tests.conftest import MINIMAL, REPO, run_cli


def rules_of(path, **options):
    result = lint_paths([path], LintOptions(**options))
    return [(f.rule, f.severity, f.key) for f in result.findings]


def test_shipped_recipes_and_templates_lint_clean():
    result = run_cli("lint", "--strict", "recipes", "ds_configs")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 errors, 0 warnings" in result.stdout


def test_clean_minimal_recipe(write_recipe):
    assert rules_of(write_recipe()) == []


def test_qlora_zero3_storage_dtype(write_recipe):
    path = write_recipe(MINIMAL + "method: qlora\nquantization:\n  storage_dtype: float32\ndeepspeed:\n  stage: 3\n")
    found = rules_of(path)
    assert ("R101", "error", "quantization.storage_dtype") in found
    result = lint_paths([path])
    r101 = next(f for f in result.findings if f.rule == "R101")
    assert (r101.line, r101.col) == (7, 3)  # points at the storage_dtype line


def test_qlora_zero3_matching_dtypes_is_clean(write_recipe):
    path = write_recipe(MINIMAL + "method: qlora\ndeepspeed:\n  stage: 3\n")
    assert [r for r in rules_of(path) if r[0] == "R101"] == []


@pytest.mark.parametrize("method,severity", [("full", "error"), ("lora", "warning")])
def test_zero3_without_gather_on_save(write_recipe, method, severity):
    path = write_recipe(MINIMAL + f"method: {method}\ndeepspeed:\n  stage: 3\n  gather_16bit_weights_on_model_save: false\n")
    assert ("R102", severity, "deepspeed.gather_16bit_weights_on_model_save") in rules_of(path)


def test_zero3_gather_disabled_through_overrides(write_recipe):
    path = write_recipe(MINIMAL + "method: full\ndeepspeed:\n  stage: 3\n  overrides:\n"
                        "    zero_optimization:\n      stage3_gather_16bit_weights_on_model_save: false\n")
    assert any(r[0] == "R102" and r[1] == "error" for r in rules_of(path))


@pytest.mark.parametrize("gpu", ["P40", "Tesla V100-SXM2-32GB", "T4", "RTX 2080 Ti"])
def test_bf16_on_gpu_without_bf16(write_recipe, gpu):
    path = write_recipe(MINIMAL + f"hardware:\n  gpus: 1\n  gpu_type: {gpu}\n")
    assert ("R103", "error", "model.dtype") in rules_of(path)


@pytest.mark.parametrize("gpu", ["A100", "H100", "RTX 4070", "L40S"])
def test_bf16_on_ampere_or_newer_is_fine(write_recipe, gpu):
    path = write_recipe(MINIMAL + f"hardware:\n  gpus: 1\n  gpu_type: {gpu}\n")
    assert not any(r[0] == "R103" for r in rules_of(path))


def test_reentrant_checkpointing_with_lora(write_recipe):
    base = MINIMAL + "training:\n  gradient_checkpointing_reentrant: true\n"
    assert ("R104", "warning", "training.gradient_checkpointing_reentrant") in rules_of(write_recipe(base))
    # LoRA under ZeRO-3 is always reentrant (what TRL forces, what DeepSpeed < 0.19.3 needs): true is right
    # there, an explicit false is a warning that it is not what runs (issue 24).
    z3 = write_recipe(base + "deepspeed:\n  stage: 3\n", name="z3.yaml")
    assert not [f for f in rules_of(z3) if f[0] == "R104"]
    z3_false = write_recipe(MINIMAL + "training:\n  gradient_checkpointing_reentrant: false\ndeepspeed:\n  stage: 3\n",
                            name="z3f.yaml")
    assert ("R104", "warning", "training.gradient_checkpointing_reentrant") in rules_of(z3_false)


def test_offload_with_client_optimizer(write_recipe):
    path = write_recipe(MINIMAL + "training:\n  optimizer: adamw_bnb_8bit\ndeepspeed:\n  offload_optimizer: cpu\n")
    assert ("R105", "error", "training.optimizer") in rules_of(path)


def test_trust_remote_code_warns(write_recipe):
    path = write_recipe(MINIMAL.replace("org/some-model", "org/some-model\n  trust_remote_code: true"))
    assert ("R106", "warning", "model.trust_remote_code") in rules_of(path)
    result = run_cli("lint", path)
    assert result.returncode == 0  # warnings pass...
    assert run_cli("lint", "--strict", path).returncode == 1  # ...unless --strict


def test_offload_at_wrong_stage(write_recipe):
    assert ("R107", "error", "deepspeed.offload_optimizer") in rules_of(
        write_recipe(MINIMAL + "deepspeed:\n  stage: 0\n  offload_optimizer: cpu\n"))
    assert ("R107", "error", "deepspeed.offload_param") in rules_of(
        write_recipe(MINIMAL + "deepspeed:\n  stage: 2\n  offload_param: cpu\n", name="b.yaml"))


def test_nvme_without_path(write_recipe):
    path = write_recipe(MINIMAL + "deepspeed:\n  stage: 3\n  offload_param: nvme\n")
    assert ("R108", "error", "deepspeed.offload_param") in rules_of(path)


def test_local_dataset_checks(write_recipe, tmp_path):
    missing = write_recipe("model: {name_or_path: org/m}\ndata: {path: ./nope.jsonl}\n")
    assert ("R109", "error", "data.path") in rules_of(missing)  # its folder is here: a typo (issue 24)
    elsewhere = write_recipe("model: {name_or_path: org/m}\ndata: {path: ./box/nope.jsonl}\n", name="e.yaml")
    assert ("R109", "warning", "data.path") in rules_of(elsewhere)  # data that lives on the training box
    (tmp_path / "d.txt").write_text("x")
    wrong = write_recipe("model: {name_or_path: org/m}\ndata: {path: ./d.txt}\n", name="w.yaml")
    assert ("R109", "error", "data.path") in rules_of(wrong)


def test_data_sources_and_mixture(write_recipe, tmp_path):
    (tmp_path / "a.jsonl").write_text('{"instruction": "a", "output": "b"}\n')
    path = write_recipe("model: {name_or_path: org/m}\ndata:\n  think: mask\n  sources:\n"
                        "    - {path: ./a.jsonl, weight: 3, samples: 4, roles: {bot: assistant}}\n"
                        "    - {path: ./a.jsonl, columns: {instrution: q}}\n"
                        "    - {path: ./gone.jsonl, format: sharegpt, weight: 1}\n")
    found = rules_of(path)
    assert ("R115", "error", "data.sources.0.samples") in found
    assert ("R115", "error", "data.sources.1.path") in found
    assert ("R116", "warning", "data.sources.0.roles") in found
    assert ("R116", "error", "data.sources.1.columns.instrution") in found
    assert ("R117", "warning", "data.sources.1.path") in found
    assert ("R109", "error", "data.sources.2.path") in found
    assert not [f for f in found if f[2] == "data.think"]  # a sharegpt source is there
    alone = write_recipe("model: {name_or_path: org/m}\ndata: {path: ./a.jsonl, think: mask}\n", name="t.yaml")
    assert ("R116", "warning", "data.think") in rules_of(alone)
    both = write_recipe("model: {name_or_path: org/m}\ndata: {path: ./a.jsonl, sources: [{path: ./a.jsonl}]}\n", name="b.yaml")
    assert [f for f in rules_of(both) if f[0] == "R004"]


def test_eval_without_split_and_ignored_sections(write_recipe):
    path = write_recipe(MINIMAL + "method: full\nlora:\n  r: 8\nquantization:\n  quant_type: fp4\ntraining:\n  eval_steps: 10\n")
    found = rules_of(path)
    assert ("R110", "warning", "training.eval_steps") in found
    assert ("R111", "warning", "lora") in found and ("R111", "warning", "quantization") in found


def test_procs_exceed_declared_gpus(write_recipe):
    path = write_recipe(MINIMAL + "launch:\n  procs_per_node: 4\nhardware:\n  gpus: 2\n")
    assert ("R112", "error", "launch.procs_per_node") in rules_of(path)


@pytest.mark.parametrize("mode", ["packing", "padding_free"])
def test_packing_with_a_model_without_position_ids(write_recipe, tmp_path, mode):
    model = tmp_path / "bloom"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "bloom"}))
    recipe = f"model:\n  name_or_path: ./bloom\ndata:\n  path: org/d\n  {mode}: true\n"
    assert ("R114", "error", f"data.{mode}") in rules_of(write_recipe(recipe))
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert rules_of(write_recipe(recipe)) == []  # every attention kernel keeps Llama's examples apart
    remote = recipe.replace("./bloom\n", "./bloom\n  trust_remote_code: true\n")
    assert ("R114", "warning", f"data.{mode}") in rules_of(write_recipe(remote))


def test_models_listed_without_position_ids_really_take_none():
    """R114's list matches the installed transformers: those causal LMs' forward has no position_ids."""
    import inspect

    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from finetune.lint.recipe_rules import NO_POSITION_IDS_MODEL_TYPES

    def takes_position_ids(model_type):
        cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
        return "position_ids" in inspect.signature(cls.forward).parameters

    assert not any(takes_position_ids(t) for t in NO_POSITION_IDS_MODEL_TYPES)
    assert all(takes_position_ids(t) for t in ("llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3", "gpt2"))


def test_every_recipe_rule_is_documented():
    source = (REPO / "finetune" / "lint" / "recipe_rules.py").read_text()
    used = set(re.findall(r'"(R1\d\d)"', source))
    assert used <= set(RECIPE_RULES)


def test_schema_errors_become_findings_with_positions(write_recipe):
    path = write_recipe(MINIMAL + "lora:\n  rr: 16\n")
    result = lint_paths([path])
    assert [(f.rule, f.line, f.col, f.fix) for f in result.findings] == [("R002", 6, 3, "did you mean `r`?")]


def test_rendered_config_findings_point_into_the_recipe(write_recipe):
    # A DeepSpeed problem reached through `overrides` is reported at the override's line.
    path = write_recipe(MINIMAL + "deepspeed:\n  overrides:\n    zero_optimization:\n      reduce_bucket_sise: 1000\n")
    result = lint_paths([path])
    found = [f for f in result.findings if f.rule.startswith("DS")]
    assert found, result.findings
    assert found[0].line == 8 and found[0].key.startswith("deepspeed.overrides.zero_optimization")


def test_directories_are_searched_recursively(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "deep.yaml").write_text("model: {name_or_path: x}\n")  # data missing
    (tmp_path / "a" / "ok.json").write_text('{"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 1}')
    (tmp_path / "a" / "notes.txt").write_text("ignored")
    result = lint_paths([tmp_path])
    assert sorted(p.rsplit("/", 1)[-1] for p in result.files) == ["deep.yaml", "ok.json"]
    assert any(f.rule == "R005" for f in result.findings)


def test_a_project_folder_lints_its_recipes_and_deepspeed_configs_not_finetunes_outputs(tmp_path):
    """Issue 34: `finetune lint .` read every JSON under runs/ and merged/ as a DeepSpeed config (123 files, 259
    errors). Run directories and merged models below the folder are skipped, so is JSON that is not a DeepSpeed
    config, and the summary says how many; a run directory named on the command line is linted, and clean."""
    from finetune.recipe import load_recipe
    from finetune.rundir.layout import write_run_dir

    recipe = tmp_path / "demo.yaml"
    recipe.write_text((REPO / "recipes" / "demo.yaml").read_text().replace("data/demo", str(REPO / "recipes/data/demo")))
    run = write_run_dir(load_recipe(recipe), tmp_path / "runs" / "demo", world_size=2)
    (run / "tokenizer").mkdir()
    (run / "tokenizer" / "tokenizer_config.json").write_text('{"model_max_length": 64, "pad_token": "<pad>"}')
    merged = tmp_path / "merged" / "demo"
    merged.mkdir(parents=True)
    (merged / "finetune_recipe.yaml").write_text((run / "recipe.yaml").read_text())
    (merged / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 64}')
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 1}')
    (tmp_path / "rows.json").write_text('[{"instruction": "a", "output": "b"}]')
    (tmp_path / "trainer_state.json").write_text('{"global_step": 3, "train_batch_size": 4, "log_history": []}')

    result = lint_paths([tmp_path])
    assert sorted(Path(p).name for p in result.files) == ["demo.yaml", "ds.json"]
    assert result.errors == []
    assert report.render(result).splitlines()[-1].endswith(
        "; skipped 2 JSON files that are not DeepSpeed configs, 1 merged model, 1 run directory "
        "(name a file or folder to lint it)")
    named = lint_paths([run])
    assert sorted(Path(p).name for p in named.files) == ["deepspeed.json", "recipe.yaml"]
    assert [f for f in named.findings if f.severity != "info"] == []


def test_json_and_github_formats(write_recipe):
    path = write_recipe(MINIMAL + "lora:\n  rr: 16\n")
    out = run_cli("lint", "--format", "json", path)
    assert out.returncode == 1
    payload = json.loads(out.stdout)
    assert payload["errors"] == 1 and payload["findings"][0]["rule"] == "R002"
    assert payload["findings"][0]["line"] == 6
    gh = run_cli("lint", "--format", "github", path)
    assert gh.stdout.startswith(f"::error file={path},line=6,col=3,title=R002::")


def test_usage_errors_exit_2(tmp_path):
    assert run_cli("lint", tmp_path / "nope.yaml").returncode == 2
    assert run_cli("lint", "--format", "xml", REPO / "recipes").returncode == 2
    assert run_cli("lint", "--gpu-memory", "lots", REPO / "recipes").returncode == 2


def test_no_traceback_on_bad_input(write_recipe):
    path = write_recipe("model: [unclosed\n")
    result = run_cli("lint", path)
    assert result.returncode == 1
    assert "Traceback" not in result.stdout + result.stderr
    assert f"{path}:2:1: error R001: invalid YAML" in result.stdout
    assert "started at line 1, column 8" in result.stdout


def test_lint_never_imports_heavy_libraries():
    code = ("import sys, runpy; sys.argv = ['finetune', 'lint', 'recipes', 'ds_configs'];\n"
            "try:\n    runpy.run_module('finetune.cli', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch', 'deepspeed', 'transformers', 'peft', 'bitsandbytes') if m in sys.modules]\n"
            "print('HEAVY', heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert "HEAVY []" in out.stdout, out.stdout + out.stderr


def test_schema_errors_do_not_hide_run_time_rules(write_recipe):
    # One pass reports the typo AND the QLoRA + ZeRO-3 dtype mismatch (checked without the bad key).
    path = write_recipe(MINIMAL + "method: qlora\nquantization:\n  storage_dtype: float32\ndeepspeed:\n  stage: 3\n"
                        "lora:\n  rr: 3\ntraining:\n  learning_rate: lots\n")
    found = rules_of(path)
    assert ("R002", "error", "lora.rr") in found
    assert ("R004", "error", "training.learning_rate") in found
    assert ("R101", "error", "quantization.storage_dtype") in found


def test_no_hf_lints_json_for_plain_deepspeed_initialize(tmp_path):
    """Without the HF Trainer nothing fills "auto": bf16 "auto" is dropped by DeepSpeed (bf16 stays off)."""
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
                                  "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2}}))
    with_hf = run_cli("lint", "--world-size", "2", config)
    assert with_hf.returncode == 0, with_hf.stdout
    plain = run_cli("lint", "--no-hf", "--world-size", "2", config)
    assert plain.returncode == 1 and "DS175" in plain.stdout and "bf16.enabled" in plain.stdout
    both = run_cli("lint", "--no-hf", "--recipe", REPO / "recipes" / "demo.yaml", config)
    assert both.returncode == 2 and "--no-hf" in both.stderr
