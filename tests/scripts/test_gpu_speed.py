"""scripts/gpu_speed.py's report without a run: a memory row's allocations at its peak (finetune.train.memory_trace)
appear in results.md. The harness end to end on CPU: tests/launches/test_gpu_speed.py."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from tests.train_fixtures import REPO


def gpu_speed():
    spec = importlib.util.spec_from_file_location("gpu_speed", REPO / "scripts" / "gpu_speed.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_speed"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_a_memory_rows_peak_is_in_the_report():
    peak = {"steps": 2, "baseline_bytes": 3 * 2**30, "peak_bytes": 28 * 2**30, "max_memory_allocated_bytes": 28 * 2**30,
            "truncated": False, "groups": [{"owner": "transformers/loss/loss_utils.py:36 fixed_cross_entropy",
                                            "bytes": 4 * 2**30, "blocks": 2}]}
    results = {"machine": {"cpu": False, "gpus": 1, "gpu_name": "H200", "versions": {}}, "created": "today",
               "commit": "abc", "budget": 500, "elapsed": 100, "ratios": {},
               "runs": [{"name": "memory_lora_8k", "status": "ok", "memory_at_peak": peak}]}
    text = gpu_speed().markdown(results)
    assert "Live at the peak of memory_lora_8k's first 2 steps: 28.00 GiB (3.00 before the first step" in text
    assert "| transformers/loss/loss_utils.py:36 fixed_cross_entropy | 4.00 | 2 |" in text


def test_only_runs_the_named_cases_in_the_order_named(tmp_path):
    module = gpu_speed()
    cases = module.gpu_cases("model", tmp_path / "d.jsonl", tmp_path / "long.jsonl", steps=10)
    names = [c.name for c in module.selected(cases, "memory_lora,memory_qlora,lora_1x2k,8rows")]
    assert names[:2] == ["memory_lora_8k", "memory_qlora_8k"]
    assert names[2:] == [c.name for c in cases if "lora_1x2k" in c.name] + \
        ["lora_8rows_llama_factory_defaults", "lora_8rows_finetune_auto"]
    assert "memory_full_8k" not in names and "full_1x2k_finetune" not in names


def test_the_next_runs_selection_leaves_out_what_it_names_with_a_minus(tmp_path):
    """The third H200 run's command (2026-11-28): the LoRA pair with its allocator variant, the QLoRA pair, the profiled
    full 4x2k pair (both sides under the profiler), the auto pair, then a memory row; not the plain profile."""
    module = gpu_speed()
    cases = module.gpu_cases("model", tmp_path / "d.jsonl", tmp_path / "long.jsonl", steps=30)
    chosen = module.selected(cases, "lora_1x2k,full_4x2k,8rows,memory_qlora,-bench_hf_profile")
    assert [c.name for c in chosen] == [
        "lora_1x2k_finetune", "lora_1x2k_bench_hf", "lora_1x2k_finetune_default_allocator",
        "lora_1x2k_bench_hf_expandable", "lora_1x2k_finetune_no_deepspeed", "qlora_1x2k_finetune",
        "qlora_1x2k_bench_hf", "qlora_1x2k_finetune_default_allocator", "qlora_1x2k_bench_hf_expandable",
        "qlora_1x2k_finetune_no_deepspeed", "qlora_1x2k_profile_finetune", "qlora_1x2k_profile_bench_hf",
        "full_4x2k_finetune", "full_4x2k_bench_hf", "full_4x2k_finetune_auto", "full_4x2k_finetune_auto_fused_adam",
        "lora_8rows_llama_factory_defaults",
        "lora_8rows_finetune_auto", "memory_qlora_8k"]
    by_name = {c.name: c for c in chosen}
    assert by_name["full_4x2k_finetune"].profile and by_name["full_4x2k_bench_hf"].bench_args == ("--profile",)
    variant = by_name["lora_1x2k_finetune_default_allocator"]
    assert dict(variant.env) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}
    assert variant.baseline == "lora_1x2k_bench_hf" and variant.pair is None
    plain = by_name["lora_1x2k_finetune_no_deepspeed"]
    assert plain.recipe["deepspeed"] == {"enabled": False} and plain.baseline == "lora_1x2k_bench_hf"
    auto = by_name["full_4x2k_finetune_auto"]
    assert auto.profile and auto.baseline == "full_4x2k_bench_hf" and auto.recipe["method"] == "full"
    assert "micro_batch_size" not in auto.recipe["training"] and auto.recipe["training"]["max_steps"] == 14
    fused_adam = by_name["full_4x2k_finetune_auto_fused_adam"]  # the same recipe with DeepSpeed's FusedAdam
    assert fused_adam.recipe["deepspeed"] == {"overrides": {"optimizer": {"params": {"torch_adam": False}}}}
    assert {**fused_adam.recipe, "deepspeed": None, "name": None} == {**auto.recipe, "deepspeed": None, "name": None}
    assert fused_adam.profile and fused_adam.baseline == auto.baseline


def test_the_next_run_measures_padding_rows_of_every_length_and_the_allocator_on_the_baseline(tmp_path):
    """docs/gpu-acceptance.md's next command after the third H200 run: rows of every length (finetune padded to 64 by
    auto, and exact, against bench_hf), the QLoRA pair with the allocator on either side and without DeepSpeed, a
    memory row. The fixed pairs pad to a multiple of 8, as bench_hf's collator does."""
    module = gpu_speed()
    varied = module.write_varied_data(tmp_path, 200, 2048)
    words = [len(json.loads(line)["text"].split()) for line in varied.read_text().splitlines()]
    tokens = [n * module.TOKENS_PER_WORD for n in words]  # within a token or two of each row's length
    assert len(set(words)) > 150 and min(tokens) >= 1024 - 2 and max(tokens) <= 2048 - 16
    assert len({int(t) // 64 for t in tokens}) == 16  # the lengths a padded run meets
    cases = module.gpu_cases("model", tmp_path / "d.jsonl", tmp_path / "long.jsonl", steps=30, varied=varied)
    chosen = module.selected(cases, "varied,qlora_1x2k,memory_qlora,-profile")
    assert [c.name for c in chosen] == [
        "varied_lora_1x_finetune", "varied_lora_1x_bench_hf", "varied_lora_1x_finetune_exact",
        "qlora_1x2k_finetune", "qlora_1x2k_bench_hf", "qlora_1x2k_finetune_default_allocator",
        "qlora_1x2k_bench_hf_expandable", "qlora_1x2k_finetune_no_deepspeed", "memory_qlora_8k"]
    by_name = {c.name: c for c in chosen}
    assert by_name["qlora_1x2k_finetune_no_deepspeed"].recipe["method"] == "qlora"
    assert by_name["qlora_1x2k_finetune_no_deepspeed"].recipe["deepspeed"] == {"enabled": False}
    by_name["lora_1x2k_finetune"] = next(c for c in cases if c.name == "lora_1x2k_finetune")
    by_name["lora_1x2k_bench_hf_expandable"] = next(c for c in cases if c.name == "lora_1x2k_bench_hf_expandable")
    assert by_name["varied_lora_1x_finetune"].recipe["data"]["pad_to_multiple_of"] == "auto"
    assert by_name["varied_lora_1x_finetune_exact"].recipe["data"]["pad_to_multiple_of"] == 1
    assert by_name["varied_lora_1x_bench_hf"].bench_args == ("--no-deepspeed",)
    assert {c.recipe["training"]["max_steps"] for c in chosen if c.name.startswith("varied")} == {module.VARIED_STEPS}
    assert by_name["lora_1x2k_finetune"].recipe["data"]["pad_to_multiple_of"] == 8  # bench_hf's widths
    expandable = by_name["lora_1x2k_bench_hf_expandable"]
    assert dict(expandable.env) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert expandable.baseline == "lora_1x2k_finetune"
    # the second command, on the warm machine: the QLoRA pair both under the profiler, a pair of its own
    second = module.selected(cases, "qlora_1x2k_profile,liger,full_4x2k_bench_hf,memory_qlora")
    assert [c.name for c in second] == ["qlora_1x2k_profile_finetune", "qlora_1x2k_profile_bench_hf",
                                        "liger_4x2k_full_finetune", "full_4x2k_bench_hf", "memory_qlora_8k"]
    profiled = {c.name: c for c in second[:2]}
    assert profiled["qlora_1x2k_profile_finetune"].profile and not profiled["qlora_1x2k_profile_finetune"].syncs
    assert profiled["qlora_1x2k_profile_bench_hf"].bench_args == ("--profile",)
    assert {c.pair for c in second[:2]} == {"qlora_1x2k_profile"}
    assert second[0].recipe["training"] == by_name["qlora_1x2k_finetune"].recipe["training"]
    assert second[0].recipe["deepspeed"] == by_name["qlora_1x2k_finetune"].recipe["deepspeed"]
    liger = second[2]
    assert liger.recipe["training"]["loss_kernel"] == "liger" and liger.profile
    assert liger.baseline == "full_4x2k_bench_hf" and liger.recipe["training"]["micro_batch_size"] == 4
    ratios = module.ratios([
        {"name": "lora_1x2k_finetune", "tool": "finetune", "pair": "lora_1x2k", "steady_tokens_per_second": 1000,
         "step_seconds_p50": 0.3},
        {"name": "lora_1x2k_bench_hf_expandable", "tool": "bench_hf", "pair": None, "steady_tokens_per_second": 800,
         "step_seconds_p50": 0.36, "baseline": "lora_1x2k_finetune"}])
    assert ratios["lora_1x2k_bench_hf_expandable"]["ratio"] == 1.25


def test_a_finetune_case_with_a_baseline_gets_a_ratio_and_pairs_compare_median_steps_too():
    module = gpu_speed()

    def run(name, tool, pair, tps, p50, baseline=None):
        return {"name": name, "tool": tool, "pair": pair, "steady_tokens_per_second": tps, "step_seconds_p50": p50,
                "baseline": baseline}

    ratios = module.ratios([run("a_finetune", "finetune", "a", 900, 0.30), run("a_bench_hf", "bench_hf", "a", 1000, 0.33),
                            run("a_variant", "finetune", None, 1100, 0.25, baseline="a_bench_hf")])
    assert ratios["a"]["ratio"] == 0.9 and abs(ratios["a"]["p50_ratio"] - 1.1) < 1e-9
    assert ratios["a_variant"]["ratio"] == 1.1 and ratios["a_variant"]["target"] == 1.0


def test_pairs_are_also_compared_over_the_steps_both_windows_hold():
    """A case whose first steady steps ran under the census starts its window later: the same-steps ratio compares
    step k with step k (the same rows on both sides), and says so when the rows differ."""
    module = gpu_speed()

    def run(name, tool, pair, warmup, seconds, tokens, baseline=None):
        steady = {"warmup_steps": warmup, "per_step": {"seconds": seconds, "tokens": tokens}}
        return {"name": name, "tool": tool, "pair": pair, "baseline": baseline, "steady": steady,
                "steady_tokens_per_second": sum(tokens) / sum(seconds), "step_seconds_p50": sorted(seconds)[len(seconds) // 2]}

    # bench_hf's window: steps 6-12; finetune's (census first): steps 9-12. Step 9 was slow on bench_hf's side only.
    theirs = run("a_bench_hf", "bench_hf", "a", 5, [0.2, 0.2, 0.2, 0.9, 0.2, 0.2, 0.2], [100, 50, 100, 100, 100, 100, 100])
    mine = run("a_finetune", "finetune", "a", 8, [0.25, 0.25, 0.25, 0.25], [100, 100, 100, 100])
    odd = run("a_other", "finetune", None, 5, [0.2] * 7, [100] * 7, baseline="a_bench_hf")
    result = module.ratios([mine, theirs, odd])
    same = result["a"]["same_steps"]
    assert same["steps"] == [9, 12] and same["rows_match"]
    assert abs(same["ratio"] - (400 / 1.0) / (400 / 1.5)) < 1e-9  # 1.5: bench_hf's steps 9-12
    assert abs(same["median_step_ratio"] - 0.8) < 1e-9  # 0.2 / 0.25 on three of the four steps
    assert result["a_other"]["same_steps"]["rows_match"] is False  # step 7: 100 tokens against 50
    assert "steps 9-12" in module.markdown({"machine": {"cpu": True, "versions": {}}, "created": "now", "budget": 1,
                                            "elapsed": 1, "runs": [], "ratios": result})
    # runs before per_step (2026-11-28) have no same-steps figure
    old = {k: v for k, v in mine.items() if k != "steady"}
    assert module.ratios([old, theirs])["a"]["same_steps"] is None


def test_the_pairs_rows_all_fill_max_length_and_the_varied_rows_do_not(tmp_path):
    """Each step of a fixed pair has one shape (every row cut to max_length, every token trained); the varied cases
    keep text rows of every length; the memory rows stay text (their earlier corpus rows were)."""
    from transformers import PreTrainedTokenizerFast

    from finetune.builtin import build_tokenizer
    from finetune.data.formats import RowSpec
    from finetune.data.tokenize import encode_rows

    module = gpu_speed()
    build_tokenizer(tmp_path / "tokenizer", vocab_size=4096)  # the harness's tokenizer (gpu_acceptance.build_model)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "tokenizer"))
    full = module.write_full_rows(tmp_path, 6, 512)
    rows = [json.loads(line) for line in full.read_text().splitlines()]
    pieces = [p for row in encode_rows(rows, RowSpec("alpaca"), tokenizer, 512, mask_prompt=False) for p in row]
    assert [len(p["input_ids"]) for p in pieces] == [512] * 6
    assert all(-100 not in p["labels"] for p in pieces)
    varied = module.write_varied_data(tmp_path, 40, 512)
    rows = [json.loads(line) for line in varied.read_text().splitlines()]
    lengths = {len(p["input_ids"]) for row in encode_rows(rows, RowSpec("text"), tokenizer, 512, mask_prompt=False)
               for p in row}
    assert len(lengths) > 20 and max(lengths) <= 512

    cases = {c.name: c for c in module.gpu_cases("model", full, tmp_path / "long.jsonl", 30, varied)}
    assert cases["qlora_1x2k_finetune"].recipe["data"]["format"] == "alpaca"
    assert cases["qlora_1x2k_finetune"].recipe["data"]["path"] == str(full)
    assert cases["varied_lora_1x_finetune"].recipe["data"]["format"] == "text"
    assert cases["memory_lora_8k"].recipe["data"]["format"] == "text"


def test_every_gpu_case_lints_clean(tmp_path):
    """A recipe the GPU check would find wrong costs minutes of a 15-minute loan: every case's recipe, written as
    the harness writes it, against a config of the 1B shape, has no lint finding."""
    from finetune.lint import LintOptions, lint_paths

    module = gpu_speed()
    model = tmp_path / "llama-1b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                                   **module.acceptance().MODELS["llama-1b"]}))
    full, varied = module.write_full_rows(tmp_path, 4, 2048), module.write_varied_data(tmp_path, 4, 2048)
    long = module.acceptance().write_text_data(tmp_path, 2, 8192)
    paths = []
    for case in module.gpu_cases(str(model), full, long, 30, varied):
        path = tmp_path / f"{case.name}.yaml"
        path.write_text(json.dumps(case.recipe) + "\n")
        paths.append(path)
    result = lint_paths(paths, LintOptions())
    assert len(paths) > 20 and not result.errors and not result.warnings, [
        (f.rule, f.path, f.key, f.message) for f in result.errors + result.warnings]


def test_the_same_wheels_are_not_installed_again_on_a_warm_machine(tmp_path, monkeypatch):
    """Installed again, DeepSpeed's sources are newer than the ops the first command built, and FusedAdam compiled
    again inside a timed run's start-up (finetune.run.deepspeed_ops.is_built)."""
    module = gpu_speed()
    monkeypatch.setattr(module, "SITE", tmp_path / "site")
    (tmp_path / "site").mkdir()
    installs = []
    monkeypatch.setattr(module.subprocess, "run", lambda argv, check: installs.append(argv))
    monkeypatch.setattr(module, "use_site", lambda: None)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "deepspeed-0.19.8-py3-none-any.whl").write_bytes(b"x" * 10)
    lines: list[str] = []
    for _ in range(2):
        module.install_wheels(wheels, lines.append)
    assert len(installs) == 1
    assert lines[0].startswith("installed 1 wheels") and lines[1].startswith("already installed 1 wheels")
    (wheels / "trl-1.16.0-py3-none-any.whl").write_bytes(b"y")  # another set: installed
    module.install_wheels(wheels, lines.append)
    assert len(installs) == 2 and lines[2].startswith("installed 2 wheels")


def test_a_command_whose_cases_compile_no_deepspeed_op_does_not_wait_for_one():
    """Every case steps torch's fused AdamW (the pairs, and the default since finetune.render.with_torch_adam) or
    trains without DeepSpeed (`auto` LoRA / QLoRA on one GPU): only the case written with DeepSpeed's FusedAdam
    compiles an op. The H200's commands waited 71-78 s for FusedAdam's compile before their first timed run; the next
    two need none."""
    module = gpu_speed()
    every = module.every_case(cpu=False, steps=30)
    assert module.ops_to_build(every) == ["fused_adam"]
    assert module.ops_to_build(module.selected(every, "full_4x2k_finetune_auto")) == ["fused_adam"]
    assert module.ops_to_build(module.selected(every, "full_4x2k_finetune_auto,-fused_adam")) == []
    for only in ("varied,qlora_1x2k,memory_qlora,-profile", "qlora_1x2k_profile,liger,full_4x2k_bench_hf,memory_qlora",
                 "lora_1x2k,8rows_finetune_auto,memory_lora", "memory_full"):
        assert module.ops_to_build(module.selected(every, only)) == [], only


def test_the_command_starts_the_compile_only_for_cases_that_need_it(tmp_path, monkeypatch, capsys):
    """main's order on the GPU machine: the wheels, then the compile where a selected case needs it, before the
    harness (stopped here where it would detect the GPU)."""
    module = gpu_speed()
    events = []

    class Stop(Exception):
        pass

    def harness():
        raise Stop

    monkeypatch.setattr(module, "install_wheels", lambda wheels, log: events.append("install"))
    monkeypatch.setattr(module, "start_build", lambda ops, log: events.append(("build", tuple(ops))))
    monkeypatch.setattr(module, "use_site", lambda: None)
    monkeypatch.setattr(module, "acceptance", harness)
    for only, expected in (("fused_adam", ["install", ("build", ("fused_adam",))]),
                           ("varied,qlora_1x2k,memory_qlora,-profile", ["install"])):
        events.clear()
        with pytest.raises(Stop):
            module.main(["--out", str(tmp_path / "out"), "--wheels", str(tmp_path), "--only", only])
        assert events == expected, only
    assert "no DeepSpeed op to compile" in capsys.readouterr().out


def test_the_start_up_split_of_each_finetune_run_is_in_the_report():
    """Where the seconds before the first step went on the GPU machine (its process-group stage, imports included
    until they were split off, took 10-16 s on the H200)."""
    startup = {"tokenize": {"seconds": 0.01, "cached": True}, "launch": 7.1, "imports": 9.2, "process_group": 1.4,
               "data": 0.9, "model": 0.1, "trainer": 0.0, "deepspeed_init": 0.8, "first_step": None}
    results = {"machine": {"cpu": False, "gpus": 1, "gpu_name": "H200", "versions": {}}, "created": "today",
               "commit": "abc", "budget": 500, "elapsed": 100, "ratios": {},
               "runs": [{"name": "lora_1x2k_finetune", "status": "ok", "startup": startup},
                        {"name": "lora_1x2k_bench_hf", "status": "ok"}]}
    text = gpu_speed().markdown(results)
    assert ("| case | tokenize | launch | imports | process group | data | model | trainer | deepspeed init | "
            "first step |") in text
    assert "| lora_1x2k_finetune | 0.0 | 7.1 | 9.2 | 1.4 | 0.9 | 0.1 | 0.0 | 0.8 | - |" in text
    assert "| lora_1x2k_bench_hf |" not in text.split("Start-up of the finetune runs")[1]


def test_list_prints_a_commands_cases_and_a_selection_of_none_stops_before_anything_is_built(tmp_path, capsys):
    """The prepared commands are checked here, not on the GPU's clock: --list prints what `--only` runs, and an
    `--only` that selects nothing (a name the --cpu cases do not have) exits 2 naming the cases, before the wheels,
    the model or the output folder."""
    module = gpu_speed()
    assert module.main(["--list", "--only", "liger,full_4x2k_bench_hf,memory_qlora"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["liger_4x2k_full_finetune\tfinetune", "full_4x2k_bench_hf\tbench_hf\t--profile",
                     "memory_qlora_8k\tfinetune"]
    out = tmp_path / "speed"
    assert module.main(["--cpu", "--out", str(out), "--only", "varied,qlora"]) == 2
    err = capsys.readouterr().err
    assert "selects none of the --cpu cases: tiny_lora_plain_finetune, tiny_lora_plain_bench_hf_profile" in err
    assert not out.exists()


def test_a_rehearsal_runs_the_gpu_cases_shrunk_onto_the_cpu(tmp_path, capsys):
    """--rehearse: the GPU cases with their settings (pairs, allocator and DeepSpeed variants, memory rows), the
    lengths shrunk and the weights in float32 for the tiny model on a CPU; only Liger-Kernel (CUDA) is left out.
    (The prepared commands rehearsed for real: tests/launches/test_gpu_speed.py, the full tier.)"""
    module = gpu_speed()
    on_gpu = {c.name: c for c in module.every_case(cpu=False, steps=10)}
    rehearsed = {c.name: c for c in module.every_case(cpu=False, steps=10, rehearse=True)}
    assert set(on_gpu) - set(rehearsed) == {"liger_4x2k_full_finetune"} and set(rehearsed) <= set(on_gpu)
    length, long_length = module.REHEARSAL_LENGTHS
    for name, case in rehearsed.items():
        gpu = on_gpu[name]
        assert (case.tool, case.bench_args, case.env, case.pair, case.baseline) == \
            (gpu.tool, gpu.bench_args, gpu.env, gpu.pair, gpu.baseline)
        assert case.recipe["model"]["dtype"] == "float32" and gpu.recipe["model"]["dtype"] == "bfloat16"
        assert case.recipe["data"]["max_length"] == (long_length if name.startswith("memory_") else length)
        assert case.recipe["training"] == gpu.recipe["training"]
        if case.recipe["method"] == "qlora":
            assert case.recipe["quantization"] == {"compute_dtype": "float32", "storage_dtype": "float32"}
    assert module.main(["--list", "--rehearse", "--only", "liger,full_4x2k_bench_hf,memory_qlora"]) == 0
    assert capsys.readouterr().out.splitlines() == ["full_4x2k_bench_hf\tbench_hf\t--profile",
                                                    "memory_qlora_8k\tfinetune"]
    assert module.main(["--list", "--rehearse", "--only", "liger"]) == 2
    assert "selects none of the --rehearse cases" in capsys.readouterr().err
