"""`finetune plan` against published GPU memory measurements (tests/data/plan_corpus.json, issue 14),
and the calibrated terms: the three memory counters, the cited constants, peft's modules_to_save
copies, torch's foreach AdamW, and what the text says about the run a recipe makes.

    python scripts/plan_corpus.py --summary     # the error distribution these tests pin
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest

from finetune.plan.archs import BY_NAME, arch_from_config
from finetune.plan import GiB, MiB, Setup, plan, plan_recipe
from finetune.plan.loss import loss_working_set
from finetune.plan.constants import CUBLAS_WORKSPACE, CUDA_CONTEXT
from finetune.plan.planner import is_hopper, nccl_buffer_bytes
from finetune.recipe import load_recipe
from tests.conftest import REPO, run_cli


def _script():
    spec = importlib.util.spec_from_file_location("plan_corpus", REPO / "scripts" / "plan_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def corpus_rows():
    script = _script()
    corpus = script.load()
    return corpus, script.evaluate(corpus), script


# ----------------------------------------------------------------------------------------------
# The corpus itself


def test_corpus_cases_name_their_source_measure_and_settings(corpus_rows):
    corpus, rows, _ = corpus_rows
    cases = corpus["cases"]
    assert len(cases) >= 60
    assert len({c["id"] for c in cases}) == len(cases)
    for source in corpus["sources"].values():
        # a published source by its address; this project's own GPU runs by their folder in this repository
        assert source["url"].startswith("https://") or (REPO / source["url"]).is_dir(), source["url"]
        assert source["commit"] and source["file"]
        assert source["measure"] in ("max_memory_allocated", "max_memory_reserved", "nvidia-smi", "unspecified",
                                     "capacity")
        assert source["measure_note"] and source["settings_from"]
    for case in cases:
        assert case["source"] in corpus["sources"] and case["row"] and case["measured_gib"] > 0
        assert {"method", "seq_len", "micro_batch", "gpus_per_node"} <= set(case["settings"])
    models = {c["model"] for c in cases}
    families = {m.split("-")[0].split(".")[0] for m in models}
    assert {"qwen", "yi", "llama", "deepseek"} <= families
    assert {c["settings"]["method"] for c in cases} == {"full", "lora", "qlora"}


def test_own_gpu_runs_cite_their_results_file_and_its_figure(corpus_rows):
    """This project's acceptance runs: each case names a results file in this repository, and its measured
    figure is that file's max_memory_allocated for the run (the largest rank)."""
    import json

    corpus, _, _ = corpus_rows
    own = [c for c in corpus["cases"] if c["source"] == "finetune-gpu-acceptance"]
    assert own
    for case in own:
        results = json.loads((REPO / case["file"]).read_text())
        run = next(r for r in results["runs"] if r["name"] == case["row"])
        peak = run["peak_memory_bytes"]  # one figure, or one per rank (scripts/gpu_speed.py's speed rows)
        assert case["commit"] and case["measured_gib"] == round((max(peak) if isinstance(peak, list) else peak) / GiB, 3)


def test_acceptance_results_become_cases_only_when_they_measured_training_alone(corpus_rows, tmp_path):
    """scripts/acceptance_to_corpus.py: an `ok` run whose peak the runner read over training alone becomes a
    case the planner can be judged on; a failed run, or one read after the verification forward, does not."""
    import copy
    import json

    corpus, _, script = corpus_rows
    spec = importlib.util.spec_from_file_location("acceptance_to_corpus", REPO / "scripts" / "acceptance_to_corpus.py")
    convert = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convert)
    shapes = corpus["models"]["acceptance-llama-1b"]["config"]
    run = {"name": "llama-1b_lora_z0_sdpa_1gpu", "model": "llama-1b", "method": "lora", "stage": 0, "offload": False,
           "packing": False, "attn": "sdpa", "gpus": 1, "status": "ok", "dtype": "bfloat16", "max_length": 2048,
           "micro_batch": 1, "peak_memory_bytes": 6 * GiB, "peak_memory_scope": "training"}
    results = {"commit": "abc1234", "loss_kernel": "default", "models": {"llama-1b": shapes},
               "machine": {"gpu_name": "NVIDIA H100 80GB HBM3"},
               "runs": [run, {**run, "name": "old", "peak_memory_scope": None},
                        {**run, "name": "failed", "status": "failed"}]}
    models, cases = convert.cases_from(results, "docs/gpu_acceptance/x.json")
    assert [c["row"] for c in cases] == ["llama-1b_lora_z0_sdpa_1gpu"]
    assert cases[0]["measured_gib"] == 6.0 and cases[0]["commit"] == "abc1234" and cases[0]["holdout"]
    mine = copy.deepcopy(corpus)
    assert convert.add(mine, models, cases) == [cases[0]["id"]]
    assert convert.add(mine, models, cases) == []  # once
    (row,) = [r for r in script.evaluate(mine) if r["id"] == cases[0]["id"]]
    assert row["view"] == "allocated" and row["error"] is not None
    # the planner's allocated figure for these settings is the one `finetune plan` gives the recipe (the 2026-11-24
    # tables: 5.61 GiB for this run; 5.59 since ZeRO-0's 16-bit gradients are made after the loss, "Tenth pass")
    assert row["predicted_gib"] == pytest.approx(5.59, abs=0.01)
    # what only the run's plan knew (recorded by the harness as plan_setup) becomes the case's settings
    planned = {**run, "name": "planned", "plan_setup": {"lora_dropout": 0.0, "full_rows": True, "deepspeed": False,
                                                        "reduce_bucket_size": 4194304}}
    _, (case,) = convert.cases_from({**results, "runs": [planned]}, "docs/gpu_acceptance/x.json")
    assert case["settings"]["lora_dropout"] == 0.0 and case["settings"]["full_rows"] is True
    assert "reduce_bucket_size" not in case["settings"]  # no DeepSpeed: no bucket
    # a results file outside the repository cannot be cited
    outside = tmp_path / "results.json"
    outside.write_text(json.dumps(results))
    assert convert.main([str(outside), "--dry-run"]) == 2


def test_no_case_holds_more_than_its_gpus(corpus_rows):
    """A figure per GPU in GiB can be no larger than the card. The Qwen README's "G" read as GiB broke
    this (its 7B full-parameter row: 162.0 on two A100-80G at 1,024 tokens); read as 10^9 bytes
    (published_gb, the table's own figure per GPU, kept beside its GiB value) none does."""
    corpus, _, _ = corpus_rows
    card = {"A100": 80, "H100": 80, "A100-SXM4-80G": 80}
    for case in corpus["cases"]:
        if "published_gb" in case:
            assert case["measured_gib"] == round(case["published_gb"] * 1e9 / 2**30, 3)
        size = card.get(case["settings"].get("gpu_type") or "")
        if size and corpus["sources"][case["source"]]["measure"] != "capacity":
            assert case["measured_gib"] <= size, case["id"]
    over_in_gib = [c for c in corpus["cases"] if c.get("published_gb", 0) > 80]
    assert [c["id"] for c in over_in_gib] == ["qwen-readme/069"]  # 81.0 per GPU: the row that settles the unit


def test_holdout_is_a_third_chosen_by_source(corpus_rows):
    corpus, _, _ = corpus_rows
    held = [c for c in corpus["cases"] if c["holdout"]]
    assert 0.3 <= len(held) / len(corpus["cases"]) <= 0.45
    for case in corpus["cases"]:
        assert case["holdout"] == corpus["sources"][case["source"]]["holdout"]


def test_plan_runs_on_every_case(corpus_rows):
    _, rows, _ = corpus_rows
    assert [r["id"] for r in rows if r["error"] is None] == []


# What the planner reaches today (`python scripts/plan_corpus.py --summary`). These pin the
# calibration: a change that makes any of them worse fails here. Issue 14's target is below.
# The Qwen README's DeepSpeed rows with their real 16-bit loss (loss_dtype) raised these from the
# previous commit's 10.5% / 65 / 52: their slopes now match, a fixed offset they share is unexplained.
# ZeRO-3's 16-bit flatten copy in the step (measured on CPU with DeepSpeed's own optimizer) then moved
# the Qwen README's full fine-tunes closer (59 / 25 under by >15% to 58 / 24), and GPTQ's dequantized
# weights saved for backward (auto-gptq's torch path, measured on CPU) its Q-LoRA rows: medians 12.6% /
# 8.9% to 11.2% / 7.9%. ms-swift's peft 0.7.1 keeps LoRA adapters in bf16 (adapter_dtype, a correction
# read from its requirements and peft's code, not a fit): its rows lost their fp32 input copies, 11.2% /
# 19.3% to 11.4% / 19.4%. The Qwen README's "G" read as 10^9 bytes, not GiB (its 7B full-parameter row
# totals 162.0 on 2 GPUs at 1,024 tokens, more than two A100-80Gs hold (160 GiB); tests/data/plan_corpus.json
# sources.qwen-readme.measure_note): all 11.4% to 9.3%, calibration 8.0% to 5.8%. Then DeepSpeed read and
# measured whole (tests/plan/test_planner.py test_whole_deepspeed_step_on_one_rank_against_the_plan): one ZeRO-3 rank
# gathers nothing, the step releases gathered parameters first, ZeRO-1/2's step flattens a 16-bit copy;
# corrections that move the Qwen ZeRO-3 full fine-tunes further under: all 9.3% / 60 to 9.6% / 64.
# The allocator's rounding of each weight tensor by its documented rules (finetune/plan/allocator.py, instead of
# 1 MiB per tensor over 10 MiB) moved the median of all cases from 11.2% to 11.5%; the cache a run keeps of its
# earlier, shorter longest batches without expandable segments (`allocator history`, ms-swift's rows and its
# scripts: they train on the data's own lengths) then to 9.0%, and under-predictions by >10% from 73 to 39
# (holdout 41 to 8): it over-predicts ms-swift's longest rows instead (docs/plan.md, "The allocator").
# With both branches' terms: all 7.7%, calibration 4.9%, held out 13.9%. Then (docs/plan.md, "Fifth pass"):
# the history keeps the loss blocks of the earlier records only (the rules' replay serves the activations'
# blocks again), bitsandbytes < 0.43.2 keeps every 4-bit input under non-reentrant checkpointing (ms-swift's
# bnb rows), GPTQ's own quantization state, no fragmentation on activations saved without checkpointing:
# all 6.7%, calibration 4.4%, held out 9.2%. Two cases crossed -15%: the Qwen README's 1.8B GPTQ Q-LoRA at 512
# tokens (its constants were bitsandbytes' fp32 absmax, 3 x GPTQ's: -14.x% to -15.8%) and ms-swift's 1.8B
# full fine-tune at 2,048 tokens (35.11 GiB, above its own 4,096-token row: -14.4% to -16.3%).
# This project's first GPU row (an H100 full fine-tune, held out, within 0.01%; no term changed): all 6.7% to
# 6.5%, held out 9.2% to 9.1%.
# unsloth's rows planned as peft's prepare_model_for_kbit_training leaves a QLoRA model (Setup.kbit_prepared, an
# inference from the rows, so the source left the held-out part: docs/plan.md, "Eighth pass"), with the same
# README's 70B row: all 6.5% to 6.0% (under >10% 27 to 21); the calibration part gained 7 rows 3-8% over
# (4.4% to 4.6%); the held-out part lost them (9.1% to 7.8%).
# This project's second GPU run (an H200, 2026-11-27: docs/gpu_acceptance/2026-11-27_h200_speed_auto_memory.json)
# added three held-out rows at 8,192 tokens without gradient checkpointing (LoRA, Q-LoRA, full ZeRO-2): the
# planner is 17-29% over on all three, and so is `finetune plan --trace` (transformers' own code on fake tensors:
# 33.75 GiB planned against 28.55 measured for the LoRA row), so the gap is in what the CUDA path keeps, not in an
# analytic term (docs/plan.md, "Ninth pass": open). No term changed: all 6.0% to 6.2%, held out 7.9% to 8.4%.
# Ninth pass closed (2026-11-28): the three rows' settings corrected (LoRA dropout 0, the reduce bucket hidden^2,
# full rows), and three CUDA-path facts read from the sources (no 4D mask for an unpadded row; peft's bitsandbytes
# LoRA takes the 16-bit input under autocast; ZeRO-2's gradient partition made after the loss buffers): the rows
# -0.0%, +0.1%, +0.0%; no other case moved. All 6.2% to 5.2%, held out 8.4% to 7.0%. Then the H200's four speed
# rows of finetune (LoRA and full 1x2k, LoRA 4x2k at ZeRO-0 with torch's AdamW, `auto` at 8 rows): +0.4%, +0.0% (the
# full row after one more fact: ZeRO-0 over a non-DeepSpeed optimizer flattens nothing), +0.1%, +0.1%. 149 cases:
# all 4.9%, held out 6.5%.
# The H200's third speed run (2026-11-28, docs/gpu_acceptance/2026-11-28_h200_speed_third*.json): two new settings
# held out, LoRA 1x2k without DeepSpeed (+0.0%) and the full 4x2k with every speed key auto (ZeRO-2, FusedAdam, no
# checkpointing: +0.1%); its repeated rows measured the same bytes and were left out. No term changed: 153 cases,
# all 4.6%, held out 5.3%.
# The H200's fourth speed run (2026-11-28, docs/gpu_acceptance/2026-11-28_h200_speed_fourth*.json): two new settings
# held out, Q-LoRA 1x2k with torch's default allocator (-0.0%) and Q-LoRA 1x2k without DeepSpeed (+0.0%); the
# repeated rows left out. No term changed: 155 cases, all 4.6%, held out 4.6%.
REACHED = {
    "all": {"median_abs_error": 0.0460, "under_10": 21, "under_15": 10},
    "calibration": {"median_abs_error": 0.0425, "under_10": 20, "under_15": 9},
    "holdout": {"median_abs_error": 0.0462, "under_10": 1, "under_15": 1},
}


@pytest.mark.parametrize("part", sorted(REACHED))
def test_corpus_error_is_no_worse_than_reached(corpus_rows, part):
    _, rows, script = corpus_rows
    got = script.summaries(rows)[part]
    want = REACHED[part]
    assert got["median_abs_error"] <= want["median_abs_error"]
    assert got["under_10"] <= want["under_10"]
    assert got["under_15"] <= want["under_15"]


def test_summaries_give_the_error_distribution(corpus_rows):
    import statistics

    _, rows, script = corpus_rows
    parts = {"all": rows, "holdout": [r for r in rows if r["holdout"]],
             "calibration": [r for r in rows if not r["holdout"]]}
    sums = script.summaries(rows)
    for part, members in parts.items():
        q = sums[part]["quantiles"]
        assert list(q) == ["min", "p5", "p25", "p50", "p75", "p95", "max"]
        assert list(q.values()) == sorted(q.values())
        assert q["p50"] == pytest.approx(statistics.median(r["error"] for r in members))
        assert q["min"] == sums[part]["worst_under"]


def test_the_bound_widths_are_the_corpus_quantiles(corpus_rows):
    """BOUND_WIDTHS (finetune/plan/constants.py) is what scripts/plan_corpus.py's method gives on the corpus
    today (`--widths`): recomputed, not tuned. In sample, each class's 95% quantile covers about 95%."""
    from finetune.plan.constants import BOUND_WIDTHS

    _, rows, script = corpus_rows
    widths = script.bound_widths(rows)
    assert widths.keys() == BOUND_WIDTHS.keys()
    for key, (width, cases) in widths.items():
        assert BOUND_WIDTHS[key][1] == cases and BOUND_WIDTHS[key][0] == pytest.approx(width, abs=0.0005), key
    assert 0.9 <= script.in_sample(rows)["coverage"] <= 1


def test_bound_classes_nest_and_fall_back():
    from finetune.plan import bound

    setup = _qlora_8b()
    assert bound.class_keys(setup) == ("one shape / qlora / ZeRO-0/1/2", "one shape / qlora", "one shape", "all")
    vary = replace(setup, shapes_vary=True, expandable_segments=False, deepspeed=False)
    assert bound.class_keys(vary)[0] == "shapes vary / qlora / no DeepSpeed"
    # Expandable segments tile one segment per pool: varying shapes do not leave earlier segments behind.
    assert bound.history(replace(vary, expandable_segments=True)) == "one shape"
    widths = {"one shape / qlora": (0.25, 12), "all": (0.5, 40)}
    assert bound.width_for(setup, widths) == (0.25, "one shape / qlora", 12)
    assert bound.width_for(vary, widths) == (0.5, "all", 40)
    assert bound.widths_from([(("a", "all"), 1.1)] * 3 + [(("b", "all"), 1.5)], min_cases=3) == \
        {"a": (pytest.approx(0.1), 3), "all": (pytest.approx(0.44), 4)}


def test_split_separates_what_the_planner_estimates():
    """bound.split: per phase, the allocator's part of a counter and, of it, the estimated kinds of term
    (activations, the loss blocks, overhead); the rest (weights, gradients, optimizer, buffers) is counted."""
    from finetune.plan import bound

    result = plan(replace(_qlora_8b(), seq_len=2048))
    views = result.memory_views
    for view in ("allocated", "reserved", "nvidia_smi"):
        parts = bound.split(result.terms, view)
        counters = bound.VIEW_COUNTERS[view]
        assert max(p for p, _ in parts.values()) == views["reserved" if view == "nvidia_smi" else view]
        for phase, (planned, uncertain) in parts.items():
            assert planned == result.phase_bytes(phase, counters)
            assert uncertain == sum(t.bytes for t in result.terms if t.phase in ("both", phase)
                                    and t.counter in counters and t.field in ("activations", "logits", "overhead"))
            assert 0 < uncertain < planned


def _bound_methods():
    spec = importlib.util.spec_from_file_location("plan_bound_methods", REPO / "scripts" / "plan_bound_methods.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bound_methods_compare_like_the_shipped_validation(corpus_rows):
    """scripts/plan_bound_methods.py with the whole of reserved as the scale is the shipped method: the same
    leave-one-source-out and in-sample figures as scripts/plan_corpus.py."""
    _, rows, script = corpus_rows
    methods = _bound_methods()
    shipped, loso = methods.evaluate(rows, share=1.0), script.leave_one_source_out(rows)
    assert shipped["coverage"] == loso["coverage"]
    assert shipped["median_over"] == pytest.approx(loso["median_over"], abs=1e-4)
    covered = lambda v: {k: s["covered"] for k, s in v["sources"].items()}  # noqa: E731
    assert covered(shipped) == covered(loso)
    assert shipped["in_sample_coverage"] == script.in_sample(rows)["coverage"]


def test_a_margin_on_the_uncertain_part_alone_covers_fewer_cases(corpus_rows):
    """docs/plan.md, "The bound": the corpus' largest misses are setups whose estimated part is 5-10% of the plan
    (the Qwen README's ZeRO-3 rows), so a width on the uncertain part alone bounds fewer cases leave-one-source-out
    than the shipped width on the whole. If this fails, the point estimate's misses have moved into its estimated
    terms: run scripts/plan_bound_methods.py and decide the bound's method again."""
    _, rows, _ = corpus_rows
    methods = _bound_methods()
    assert methods.evaluate(rows, share=0.0)["covered"] < methods.evaluate(rows, share=1.0)["covered"]


def test_the_shipped_share_is_the_fitted_one(corpus_rows):
    """The 95% quantile regression of the relative miss on the uncertain and exact shares of the plan puts the
    width on the whole (share 1), the shipped method: the corpus' 95% quantile does not grow with the uncertain
    share. Like BOUND_WIDTHS, recomputed, not chosen: when it moves, decide the bound's method again
    (scripts/plan_bound_methods.py; docs/plan.md, "The bound")."""
    _, rows, _ = corpus_rows
    methods = _bound_methods()
    assert methods.quantile_regression_share([r for r in rows if r["error"] is not None]) == 1.0


# Issue 21's targets (scripts/plan_corpus.py --summary prints them). Met: the point estimate's median |error|
# (5.96%) and mean (+2.6%: the Qwen README's rows -2.7%, ms-swift's +12.5%), and the bound's median above the
# measurement leaving a source out (10.3%). Not met: the bound covers 81.0% of the cases leave-one-source-out.
# Without the Qwen README the "one shape" class is its 10 other cases (unsloth's 7, PEFT's 2, this project's
# H100 row), none as far under as the README's 1.8B, ZeRO-3 and multinode rows; unsloth's rows, 12-22% under
# before they were planned as prepare_model_for_kbit_training leaves the model, had widened it (93.6% then).
# The H200's three long-context rows (above) moved the median from 5.96% to 6.2%, and their ninth pass to 5.2%.
MET_TARGETS = [
    "point estimate median |error| <= 6%",
    "point estimate mean error within +-3%",
    "bound <= 20% above measured at the median (leave-one-source-out)",
]
OPEN_TARGETS = [
    "bound >= measured in >= 95% of cases (leave-one-source-out)",
]


@pytest.mark.parametrize("target", MET_TARGETS)
def test_issue_21_targets_met(corpus_rows, target):
    _, rows, script = corpus_rows
    assert script.targets(rows)[target][1]


@pytest.mark.parametrize("target", OPEN_TARGETS)
@pytest.mark.xfail(strict=True, reason="issue 21's targets are not met yet: see docs/plan.md, 'The bound'")
def test_issue_21_targets(corpus_rows, target):
    _, rows, script = corpus_rows
    assert script.targets(rows)[target][1]


def test_issue_21_target_names_are_the_scripts(corpus_rows):
    _, rows, script = corpus_rows
    assert sorted(script.targets(rows)) == sorted(MET_TARGETS + OPEN_TARGETS)


def test_allocator_history_only_without_expandable_segments_and_up_to_the_gpu():
    from finetune.plan.constants import HISTORY_RECORDS

    base = replace(_qlora_8b(), deepspeed=False, seq_len=4096)
    names = lambda r: {t.name: t for t in r.terms}  # noqa: E731
    assert "allocator history" not in names(plan(base))  # one shape
    assert "allocator history" not in names(plan(replace(base, shapes_vary=True)))  # expandable segments
    vary = plan(replace(base, shapes_vary=True, expandable_segments=False))
    history = names(vary)["allocator history"]
    loss = names(vary)["loss working set"]
    assert history.counter == "reserved" and history.phase == "backward"
    # The loss blocks of the earlier records only (planner.history_base): not the activations, not the
    # dequantized 4-bit weight (the same size every step).
    assert history.bytes == pytest.approx(loss.bytes * sum(HISTORY_RECORDS), rel=1e-6)
    assert vary.memory_views["allocated"] == plan(base).memory_views["allocated"]
    gpu = vary.memory_views["nvidia_smi"] - history.bytes // 2  # the cache is freed before an allocation fails
    capped = plan(replace(vary.setup, gpu_memory=gpu))
    assert capped.memory_views["nvidia_smi"] == pytest.approx(gpu, abs=1024) and names(capped)["allocator history"].bytes


def test_before_calibration_the_corpus_error_was_larger(corpus_rows, monkeypatch):
    """The figures of the commit that added the corpus (before calibration): 137 planned cases, median
    14.6%, 76 under-predicted by more than 10%. Today's planner is better on both counts."""
    _, rows, script = corpus_rows
    now = script.summaries(rows)["all"]
    assert now["median_abs_error"] < 0.146 and now["under_10"] / now["cases"] < 76 / 137


# ----------------------------------------------------------------------------------------------
# The three counters, and which one `fits` uses


def _qlora_8b(**kw):
    arch = BY_NAME["llama-3-8b"]
    return Setup(arch=arch, params=arch.total_params, method="qlora", lora_r=64, stage=2, seq_len=512,
                 micro_batch=1, **kw)


def test_counters_are_ordered_and_fits_uses_the_upper_bound():
    result = plan(_qlora_8b(gpus_per_node=2, gpu_type="A100"))
    views = result.memory_views
    assert views["allocated"] < views["reserved"] < views["nvidia_smi"] == result.per_gpu["total"]
    # Outside PyTorch: the CUDA context and NCCL's buffers are exactly the nvidia-smi - reserved gap.
    assert views["nvidia_smi"] - views["reserved"] == CUDA_CONTEXT + nccl_buffer_bytes(2)
    # The bound widens the allocator's part (reserved) and adds what lies outside PyTorch as planned.
    width, klass, cases = result.bound_width
    assert klass == "one shape / qlora / ZeRO-0/1/2" and cases >= 10 and 0 < width < 1
    bounds = result.upper_bounds
    assert bounds["reserved"] == int(views["reserved"] * (1 + width))
    assert bounds["nvidia_smi"] == result.upper_bound == bounds["reserved"] + views["nvidia_smi"] - views["reserved"]
    # Between the estimate and the bound: the estimate would fit, the bound does not, and `fits` says no.
    between = replace(result.setup, gpu_memory=(views["nvidia_smi"] + result.upper_bound) // 2)
    assert plan(between).fits is False and plan(between).headroom < 0
    assert plan(replace(result.setup, gpu_memory=result.upper_bound)).fits is True
    doc = plan(replace(result.setup, gpu_memory=12 * GiB)).to_json()
    assert {k: doc["memory"][k] for k in ("allocated_peak", "reserved_peak", "nvidia_smi", "fits_uses")} == \
        {"allocated_peak": views["allocated"], "reserved_peak": views["reserved"], "nvidia_smi": views["nvidia_smi"],
         "fits_uses": "upper_bound"}
    assert doc["memory"]["upper_bound"] == result.upper_bound and doc["memory"]["upper_bounds"] == bounds
    assert doc["memory"]["upper_bound_class"] == klass and doc["fits"] == doc["memory"]["upper_bound_fits"]


def test_cli_text_names_the_three_counters_and_the_bound():
    out = run_cli("plan", "--model", "llama-3-8b", "--method", "qlora", "--gpu-memory", "16GiB")
    assert out.returncode == 0, out.stderr
    for needle in ("as torch.cuda.max_memory_allocated", "as torch.cuda.max_memory_reserved", "as nvidia-smi",
                   "upper bound (nvidia-smi)", "`fits` uses this one", "fits under the upper bound"):
        assert needle in out.stdout
    # 12 GiB: the estimate (11.2 GiB) would fit, the bound (13.0) does not: exit 3, and the text says both. (The loss
    # and the engine written: left auto, the plan would choose the chunked loss and the plain Trainer, which fit.)
    out = run_cli("plan", "--model", "llama-3-8b", "--method", "qlora", "--gpu-memory", "12GiB",
                  "--set", "training.loss_kernel=default", "--set", "deepspeed.enabled=true")
    assert out.returncode == 3 and "does NOT fit: the upper bound" in out.stdout and "the estimate" in out.stdout


def test_cited_constants():
    # CublasHandlePool.cpp: 4096 KiB x 8 on sm90, 4096 KiB x 2 + 16 KiB x 8 elsewhere.
    assert CUBLAS_WORKSPACE == {"hopper": 4096 * 8 * 1024, "other": 4096 * 1024 * 2 + 16 * 1024 * 8}
    assert (is_hopper("H100"), is_hopper("NVIDIA H200"), is_hopper("A100"), is_hopper("RTX 4070"),
            is_hopper(None)) == (True, True, False, False, True)
    assert CUDA_CONTEXT == 426 * MiB
    assert nccl_buffer_bytes(1) == 0 and nccl_buffer_bytes(2) == int(1.0955 * GiB) - 934 * MiB
    assert nccl_buffer_bytes(2) < nccl_buffer_bytes(4) < nccl_buffer_bytes(8) == nccl_buffer_bytes(64)
    hopper = plan(_qlora_8b(gpu_type="H100")).memory_views["allocated"]
    ampere = plan(_qlora_8b(gpu_type="A100")).memory_views["allocated"]
    assert hopper - ampere == 2 * (CUBLAS_WORKSPACE["hopper"] - CUBLAS_WORKSPACE["other"])


# ----------------------------------------------------------------------------------------------
# Terms the corpus showed wrong


def test_modules_to_save_copies_keep_the_model_dtype_like_peft():
    """Without DeepSpeed, peft upcasts LoRA adapters to fp32 but deep-copies modules_to_save in the
    model's dtype: the planned trainable bytes equal the real model's."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(hidden_size=64, intermediate_size=176, num_attention_heads=4, num_key_value_heads=2,
               num_hidden_layers=2, vocab_size=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear",
                                             modules_to_save=["embed_tokens", "lm_head"]))
    real = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    arch = arch_from_config({**cfg, "model_type": "llama"}, "tiny")
    result = plan(Setup(arch=arch, params=arch.total_params, method="lora", lora_r=8, deepspeed=False,
                        modules_to_save=("embed_tokens", "lm_head")))
    trainable = next(t.bytes for t in result.terms if t.name == "trainable")
    assert trainable == real
    assert result.per_gpu["gradients"] == real  # gradients in each parameter's dtype


def test_foreach_adamw_allocates_one_moment_sized_temporary():
    """torch's foreach AdamW (HF's default optimizer before torch 2.8) allocates the square root of
    every second moment at once in its step; the fused one does not. Measured with torch on CPU."""
    import torch

    from tests.plan.test_planner import LiveBytes

    params = [torch.nn.Parameter(torch.randn(n, dtype=torch.bfloat16)) for n in (4096, 1024, 512)]
    for p in params:
        p.grad = torch.randn_like(p)
    peaks = {}
    for impl in ("foreach", "fused"):
        opt = torch.optim.AdamW(params, lr=1e-3, **{impl: True})
        opt.step()  # states exist before the measured step
        states = {s.untyped_storage().data_ptr() for st in opt.state.values() for s in st.values()
                  if isinstance(s, torch.Tensor)}
        live = LiveBytes({p.untyped_storage().data_ptr() for p in params} | states)
        with live.mode:
            opt.step()
        peaks[impl] = live.peak
    moment_bytes = sum(p.numel() * p.element_size() for p in params)
    assert peaks["foreach"] >= moment_bytes > peaks["fused"]
    arch = BY_NAME["llama-3-8b"]
    base = Setup(arch=arch, params=arch.total_params, method="full", deepspeed=False)
    step = {impl: plan(replace(base, optimizer_impl=impl)).phase_bytes("step", ("allocated",))
            for impl in ("fused", "foreach")}
    assert step["foreach"] - step["fused"] == arch.total_params * 2


def test_torch20_foreach_adamw_keeps_two_moment_sized_temporaries():
    """PyTorch 2.0's _multi_tensor_adamw (the Qwen README's stack) took the square root of every second
    moment and then allocated `denom = _foreach_add(exp_avg_sq_sqrt, eps)` beside it; torch >= 2.1 adds
    eps in place. The same foreach op sequence, measured on CPU, peaks at two moments' bytes."""
    import torch

    from tests.plan.test_planner import LiveBytes

    moments = [torch.rand(n, dtype=torch.bfloat16) for n in (4096, 1024, 512)]
    moment_bytes = sum(m.numel() * m.element_size() for m in moments)
    peaks = {}
    for version in ("2.0", "2.1+"):
        live = LiveBytes({m.untyped_storage().data_ptr() for m in moments})
        with live.mode:
            sqrt = torch._foreach_sqrt(moments)
            torch._foreach_div_(sqrt, 0.5)
            denom = torch._foreach_add(sqrt, 1e-8) if version == "2.0" else torch._foreach_add_(sqrt, 1e-8)
            del sqrt, denom
        peaks[version] = live.peak
    assert peaks == {"2.0": 2 * moment_bytes, "2.1+": moment_bytes}
    arch = BY_NAME["llama-3-8b"]
    base = Setup(arch=arch, params=arch.total_params, method="full", deepspeed=False)
    step = {impl: plan(replace(base, optimizer_impl=impl)).phase_bytes("step", ("allocated",))
            for impl in ("foreach", "foreach_torch20")}
    assert step["foreach_torch20"] - step["foreach"] == arch.total_params * 2


def test_a_16bit_loss_keeps_half_the_bytes_of_an_autocast_one():
    """Qwen v1's remote code computes CrossEntropyLoss on the 16-bit lm_logits itself. Under
    torch.autocast (the HF Trainer without DeepSpeed) cross-entropy is on the fp32 list; with DeepSpeed
    accelerate runs no autocast and the log-softmax kept for backward stays 16-bit. The planner's
    loss term (Setup.loss_dtype) follows the element size of what torch saves."""
    import torch

    vocab, tokens = 512, 8
    labels = torch.randint(0, vocab, (tokens,))
    saved = {}
    for name, autocast in (("bfloat16", False), ("float32", True)):
        logits = torch.randn(tokens, vocab, dtype=torch.bfloat16, requires_grad=True)
        sizes = []

        def pack(t, sizes=sizes):
            sizes.append(t.element_size() if t.numel() == tokens * vocab else 0)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                torch.nn.functional.cross_entropy(logits, labels)
        saved[name] = max(sizes)
    assert saved == {"bfloat16": 2, "float32": 4}
    arch = BY_NAME["llama-3-8b"]
    base = Setup(arch=arch, params=arch.total_params, method="lora", deepspeed=False, seq_len=1024)
    got = {dtype: loss_working_set(replace(base, loss_dtype=dtype))[0] for dtype in ("float32", "bfloat16")}
    assert got["float32"] == 1024 * arch.vocab * 3 * saved["float32"]
    assert got["bfloat16"] == 1024 * arch.vocab * 3 * saved["bfloat16"]


# ----------------------------------------------------------------------------------------------
# What the text says about the run a recipe makes


def test_demo_recipe_text_describes_its_processes_and_dtype():
    out = run_cli("plan", str(REPO / "recipes" / "demo.yaml"))
    assert out.returncode == 0, out.stderr
    assert "2 CPU processes" in out.stdout and "procs_per_node: auto" in out.stdout
    assert "16-bit" not in out.stdout.split("per node CPU")[0]  # a float32 model
    assert "fp32 partitions of all parameters" in out.stdout
    # The CPU side counts the planned GPUs' processes and says so (a GPU-less machine starts cpu_procs).
    assert "1 training process (1 per GPU)" in out.stdout.split("per node CPU")[1]


def test_float32_full_finetune_names_its_gradients_fp32(write_recipe):
    recipe = load_recipe(write_recipe("model:\n  name_or_path: builtin:tiny-llama\n  dtype: float32\n"
                                      "method: full\ndata:\n  path: d.jsonl\ndeepspeed:\n  stage: 2\n"), []).recipe
    names = [t.name for t in plan_recipe(recipe, gpus=2).terms]
    assert "fp32 gradient partition 1/2" in names and not any("16-bit" in n for n in names)


def test_zero3_step_counts_the_16bit_flatten_copy_of_one_sub_group():
    """stage3.py _prepare_fp32_grad_for_sub_group flattens the sub-group's 16-bit gradients into a new
    buffer before casting it to fp32 (measured with DeepSpeed's optimizer on CPU in
    tests/plan/test_planner.py::test_deepspeed_buffers_and_partitions_as_planned). Not for a float32 model (the
    cast returns the flat buffer itself) nor with the optimizer offloaded (no fp32 gradient on the GPU)."""
    arch = BY_NAME["qwen2.5-0.5b"]
    base = Setup(arch=arch, params=arch.total_params, method="full", stage=3, dtype="bfloat16",
                 sub_group_size=10**8)

    def flatten_copy(setup):
        return sum(t.bytes for t in plan(setup).terms if t.name == "16-bit gradient flatten copy")

    assert flatten_copy(base) == 10**8 * 2
    assert flatten_copy(replace(base, sub_group_size=10**10)) == arch.total_params * 2  # one sub-group
    assert flatten_copy(replace(base, dtype="float32")) == 0
    assert flatten_copy(replace(base, offload_optimizer="cpu")) == 0
    # ZeRO-1/2's step makes the same copy of its whole partition (stage_1_and_2.py step; measured whole in
    # tests/plan/test_planner.py::test_whole_deepspeed_step_on_one_rank_against_the_plan).
    assert flatten_copy(replace(base, stage=2)) == arch.total_params * 2


def _gptq_forward(x, qweight, qzeros, scales, wf, bits=4, group=128):
    """auto-gptq 0.5.1 qlinear_cuda_old.QuantLinear.forward, torch path (taken from 128 rows up), for 4 bits."""
    import torch

    zeros = torch.bitwise_right_shift(torch.unsqueeze(qzeros, 2).expand(-1, -1, 32 // bits), wf.unsqueeze(0)).to(torch.int8)
    zeros = torch.bitwise_and(zeros, (2 ** bits) - 1) + 1
    zeros = zeros.reshape(-1, 1, zeros.shape[1] * zeros.shape[2])
    weight = torch.bitwise_right_shift(torch.unsqueeze(qweight, 1).expand(-1, 32 // bits, -1), wf.unsqueeze(-1)).to(torch.int8)
    weight = torch.bitwise_and(weight, (2 ** bits) - 1).reshape(-1, group, weight.shape[2])
    weight = scales.reshape(-1, 1, scales.shape[-1]) * (weight - zeros)
    return torch.matmul(x, weight.reshape(weight.shape[0] * weight.shape[1], weight.shape[2]))


def test_gptq_linear_keeps_its_dequantized_weight_for_backward():
    """A GPTQ linear under training (auto-gptq's torch path) saves its whole 16-bit dequantized weight for
    backward and peaks at 5 bytes per weight element while unpacking; the planner's GPTQ terms are those
    sizes: one layer's quantized linears saved (checkpointing) plus 3 bytes x the largest."""
    import torch

    from tests.plan.test_planner import LiveBytes

    infeat, outfeat, tokens = 512, 384, 256
    qweight = torch.randint(-2**31, 2**31 - 1, (infeat // 8, outfeat), dtype=torch.int32)
    qzeros = torch.randint(-2**31, 2**31 - 1, (infeat // 128, outfeat // 8), dtype=torch.int32)
    scales = torch.rand(infeat // 128, outfeat, dtype=torch.float16)
    wf = torch.tensor(list(range(0, 32, 4)), dtype=torch.int32).unsqueeze(0)
    x = torch.randn(tokens, infeat, dtype=torch.float16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.untyped_storage().nbytes()) or t,
                                                  lambda t: t):
        _gptq_forward(x, qweight, qzeros, scales, wf)
    elements = infeat * outfeat
    assert saved == [elements * 2]
    live = LiveBytes({t.untyped_storage().data_ptr() for t in (x, qweight, qzeros, scales, wf)})
    with live.mode:
        _gptq_forward(x, qweight, qzeros, scales, wf)
    assert elements * 5 <= live.peak < elements * 5 + elements // 64  # + the unpacked zero points

    arch = BY_NAME["qwen2.5-7b"]
    base = Setup(arch=arch, params=arch.total_params, method="qlora", dtype="float16", deepspeed=False,
                 quant_format="gptq-int4")
    terms = {t.name: t.bytes for t in plan(base).terms}
    per_layer = sum(lin.weight_numel for lin in arch.layer_linears())
    largest = max(lin.weight_numel for lin in arch.layer_linears())
    assert terms["GPTQ dequantized weights (saved)"] == per_layer * 2
    assert terms["GPTQ unpacking"] == largest * 3
    assert "dequantized 4-bit weight" not in terms
    unckpt = {t.name: t.bytes for t in plan(replace(base, gradient_checkpointing=False)).terms}
    assert unckpt["GPTQ dequantized weights (saved)"] == arch.layers * per_layer * 2
    assert "GPTQ unpacking" not in {t.name for t in plan(replace(base, quant_format="bnb-nf4")).terms}


def test_training_sets_expandable_segments_unless_the_user_did():
    """What the plan text says training does with PyTorch's allocator (finetune/run/launch/commands.py), and
    the launch line (the run log) shows it."""
    from finetune.plan.constants import TRAINING_ALLOC_CONF
    from finetune.run.launch.commands import deepspeed_env_text, plan_launch
    from tests.run.test_launch import RUN, recipe

    gpu = plan_launch(recipe(), RUN, gpu_count=2, python="python", environ={})
    assert gpu.env["PYTORCH_CUDA_ALLOC_CONF"] == TRAINING_ALLOC_CONF == "expandable_segments:True"
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in gpu.display()
    mine = plan_launch(recipe(), RUN, gpu_count=2, python="python",
                       environ={"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"})
    assert "PYTORCH_CUDA_ALLOC_CONF" not in mine.env
    # torch's newer name (PYTORCH_ALLOC_CONF) is the user's setting too: ours would otherwise win over it in torch
    # 2.13, which reads PYTORCH_CUDA_ALLOC_CONF first; other nodes of a hostfile launch get it as well
    newer = plan_launch(recipe(), RUN, gpu_count=2, python="python",
                        environ={"PYTORCH_ALLOC_CONF": "expandable_segments:False"})
    assert "PYTORCH_CUDA_ALLOC_CONF" not in newer.env
    assert deepspeed_env_text({"PYTORCH_ALLOC_CONF": "expandable_segments:False"}) == \
        "PYTORCH_ALLOC_CONF=expandable_segments:False\n"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in plan_launch(recipe(), RUN, gpu_count=0, python="python", environ={}).env
    out = run_cli("plan", "--model", "llama-3-8b", "--method", "qlora")
    assert f"training sets PYTORCH_CUDA_ALLOC_CONF={TRAINING_ALLOC_CONF} unless it or PYTORCH_ALLOC_CONF is set" \
        in out.stdout


def test_history_diagnostic_and_record_orders(corpus_rows, capsys):
    """`plan_corpus.py --history`: only varying-shape rows without expandable segments carry the term, at the
    stated multiple unless the GPU's size caps it; `--records N` orders keep the planner's order at N = 4."""
    from finetune.plan.constants import HISTORY_RECORDS

    corpus, _, script = corpus_rows
    rows = script.history_rows(corpus)
    capsys.readouterr()
    assert rows and all(corpus["sources"][r["id"].split("/")[0]]["shapes"] == "vary" for r in rows)
    assert all(r["planned_multiple"] <= sum(HISTORY_RECORDS) * (1 + 1e-6) for r in rows)
    assert sum(1 for r in rows if r["planned_multiple"] == pytest.approx(sum(HISTORY_RECORDS))) > len(rows) / 2
    for r in rows:
        assert r["without_gib"] + r["implied_multiple"] * r["transient_gib"] == pytest.approx(r["measured_gib"])
    assert script.record_lengths(8192) == [4096, 6144, 7168, 7680, 8192]
    assert script.record_lengths(512, 1) == [256, 512] and len(script.record_lengths(512, 9)) == 10
