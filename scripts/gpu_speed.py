"""The prepared GPU check of issue 35: finetune's speed against the baseline a user would otherwise run, on one GPU,
in at most 8 minutes of wall time, results written after every run.

    bash scripts/gpu_wheels.sh                                     # here (PyPI): the wheels the GPU image lacks
    python3 scripts/gpu_speed.py --out $OUT/speed --wheels .whl    # there: one command (docs/gpu-acceptance.md)
    python scripts/gpu_speed.py --cpu --out /tmp/speed             # the same plumbing on the tiny model (CI)
    python scripts/gpu_speed.py --list --only varied,-profile       # here: the cases that command would run, in order
    python scripts/gpu_speed.py --rehearse --out /tmp/r --only varied,-profile   # here: those cases run, on the CPU

On the GPU machine it first installs the carried wheels into /tmp/site (then, where a selected case compiles it
(ops_to_build: only the case written with `torch_adam: false`), DeepSpeed's FusedAdam compiled in the background while the model and
data are built; the first timed run waits for it: on 2026-11-27 an H200 ran the first pair while it compiled, and
that pair's finetune side, launch-bound at micro batch 1, measured 0.55 of its baseline with p90 steps 4x its p50),
builds a Llama-3.2-1B-shaped model with random
weights and synthetic text (scripts/gpu_acceptance.py), then runs, in this order:
0. rows of every length at micro batch 1 without DeepSpeed (write_varied_data, VARIED_STEPS): finetune with
   data.pad_to_multiple_of auto (64 on a GPU) and with 1, against bench_hf (a multiple of 8 and a mask): what cuDNN's
   attention costs when every new length builds its plans again;
1. pairs at identical settings (data.pad_to_multiple_of 8: the widths of bench_hf's batches), `finetune train`
   against scripts/bench_hf.py (DeepSpeed ZeRO-0 both: finetune's rendered config with torch's fused AdamW, bench_hf
   LLaMA-Factory's ds_z0_config.json whose client optimizer is the Trainer's torch fused AdamW; checkpointing on,
   the default loss, 2,048 tokens, 30 steps at micro batch 1, else LONG_STEP_STEPS): LoRA 1x2k and QLoRA 1x2k (each
   also: finetune with torch's default allocator, and finetune without DeepSpeed, against the same baseline, and
   bench_hf with finetune's expandable segments against finetune; both sides count their host syncs and collectives
   per step, finetune.train.syncs; QLoRA's pair again with both sides under the profiler), full 1x2k, LoRA 4x2k,
   full 4x2k (both sides under the profiler,
   finetune.train.profile: the largest kernels where MFU is judged; then finetune with Liger-Kernel, and with the
   speed keys auto at 4 rows per step, that again with DeepSpeed's FusedAdam for torch's fused AdamW, all profiled,
   against the same baseline); each pair's ratio of steady
   tokens/s and of median step times;
2. bench_hf --no-deepspeed --profile (LoRA 1x2k): the plain Trainer's GPU-busy share and its largest kernels;
3. finetune with every speed key auto against the same recipe with LLaMA-Factory's defaults (bench_hf without
   DeepSpeed, micro batch 1 x 8 accumulation, checkpointing on, the default loss): LoRA 1x2k;
4. memory rows at 8,192 tokens (LoRA, QLoRA, full; auto) beside `finetune plan`'s prediction, for the planner's corpus.
A case that would not end inside --budget (from the durations seen so far) is recorded as not run. OUT/results.json
and OUT/results.md hold every figure (steady tokens/s, step p50/p90, MFU on the published anchors' basis, start-up,
memory), the ratios (targets: finetune / bench_hf >= 1.00 on every pair, auto / LLaMA-Factory's defaults >= 1.5),
the card, the library versions and the commit.

--cpu: the tiny built-in model on one CPU process, two cases: finetune without DeepSpeed under its profiler window and
the sync census (with a checkpoint at its last step, which tests/launches/test_gpu_speed.py then resumes) against
bench_hf --no-deepspeed --profile --syncs. Its numbers say nothing about a GPU; its sync counts are the code's.

--rehearse: the GPU cases themselves on this machine's CPU, each with its settings (the DeepSpeed and allocator
variants, the QLoRA quantization, the profiler and the sync census, the memory rows), on the tiny model in float32 at
REHEARSAL_LENGTHS (64 and 256 tokens); Liger-Kernel needs CUDA and is left out. It answers one question before a GPU
is rented: does every case of a prepared command train to its end and get its figures. None of its figures is a GPU's.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parent.parent
SITE = Path("/tmp/site")  # where the carried wheels are installed on the GPU machine


def acceptance():
    """scripts/gpu_acceptance.py as a module: models, data, machine facts, `finetune train` with nvidia-smi sampling."""
    spec = importlib.util.spec_from_file_location("gpu_acceptance", REPO / "scripts" / "gpu_acceptance.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_acceptance"] = module
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------------
# Setting up the machine


def install_wheels(wheels: Path, log) -> None:
    """pip-install the carried wheels into SITE (no index, no dependencies: the image has the rest; not again where
    SITE holds the same ones). All of them before anything imports them: `finetune doctor` imports deepspeed, which
    imports pydantic (a carried wheel); the 2026-11-28 run started it after deepspeed's wheel alone and it failed on a
    fresh machine (the whole install takes about 2 s)."""
    started = time.perf_counter()
    found = sorted(wheels.glob("*.whl"))
    carried = "".join(f"{wheel.name} {wheel.stat().st_size}\n" for wheel in found)
    marker = SITE / ".carried"
    if marker.is_file() and marker.read_text(encoding="utf-8") == carried:
        # The same wheels on a warm machine: installed again, DeepSpeed's sources would be newer than the ops the
        # first command built, and its ops would compile again (finetune.run.deepspeed_ops.is_built).
        how = "already installed"
    else:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(SITE), *map(str, found)], check=True)
        marker.write_text(carried, encoding="utf-8")
        how = "installed"
    use_site()
    log(f"{how} {len(found)} wheels in {SITE} ({time.perf_counter() - started:.0f} s)")


def ops_to_build(cases: list[Case]) -> list[str]:
    """The DeepSpeed ops the finetune cases' ranks would compile on a GPU (finetune.run.deepspeed_ops.recipe_ops),
    each recipe with its auto keys decided as on one GPU (deepspeed.enabled, the one that matters here, does not
    depend on its memory): every case steps torch's fused AdamW (finetune.render.with_torch_adam) or trains without
    DeepSpeed, and compiles nothing, but full_4x2k_finetune_auto_fused_adam (DeepSpeed's FusedAdam). Where none is
    needed the timed runs do not wait for a compile (71-78 s from the start on the H200, in each command)."""
    import tempfile

    from finetune.plan.auto import Machine, resolve
    from finetune.recipe import load_recipe
    from finetune.run.deepspeed_ops import recipe_ops

    ops: list[str] = []
    with tempfile.TemporaryDirectory() as folder:
        for case in cases:
            if case.tool != "finetune":
                continue  # bench_hf: the Trainer's AdamW as DeepSpeed's client optimizer, or no DeepSpeed
            path = Path(folder) / f"{case.name}.yaml"
            path.write_text(json.dumps(case.recipe), encoding="utf-8")  # JSON is YAML
            decided = resolve(load_recipe(path, []).recipe, Machine(gpus_per_node=1, nodes=1, on_gpu=True)).recipe
            ops += [op for op in recipe_ops("cuda", decided) if op not in ops]
    return ops


def start_build(ops: list[str], log) -> subprocess.Popen:
    """`finetune doctor --build-ops` in the background (FusedAdam, the one op `ops_to_build` can find)."""
    log(f"DeepSpeed's ops compiling for the selected cases: {', '.join(ops)}")
    return subprocess.Popen([sys.executable, "-m", "finetune.cli", "doctor", "--build-ops"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def use_site() -> None:
    """SITE and the repository on the import path of this process and of every child."""
    paths = [str(SITE), str(REPO)]
    for path in reversed(paths):
        if path not in sys.path:
            sys.path.insert(0, path)
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


# ------------------------------------------------------------------------------------------------
# The cases


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    tool: str  # finetune | bench_hf
    recipe: dict[str, Any]
    bench_args: tuple[str, ...] = ()
    pair: Optional[str] = None  # cases with the same pair are compared: finetune / bench_hf
    memory: bool = False  # a memory row: finetune plan's prediction beside the measured peaks
    profile: bool = False  # a finetune run under finetune.train.profile's window (bench_hf: its --profile)
    syncs: bool = False  # host syncs and collectives per step over the same window (finetune.train.syncs; bench_hf: --syncs)
    env: tuple[tuple[str, str], ...] = ()  # added to the run's environment
    # finetune case: the bench_hf case it is compared with (none in its pair); bench_hf case: the finetune case
    # compared with it (a baseline variant)
    baseline: Optional[str] = None
    estimate: float = 90.0  # seconds, until a run of the same tool measured one


def base_recipe(name: str, model: str, data: Path, max_length: int, steps: int, cpu: bool,
                fmt: str = "alpaca") -> dict[str, Any]:
    """What every case shares: a model, its rows (`fmt`, every token trained), a constant schedule, nothing to
    report."""
    return {
        "name": name,
        "model": {"name_or_path": model, "dtype": "float32" if cpu else "bfloat16", "attn_implementation": "sdpa"},
        "method": "lora",
        "lora": {"r": 16, "alpha": 32, "dropout": 0.0},
        "data": {"path": str(data), "format": fmt, "max_length": max_length, "mask_prompt": False},
        "training": {"max_steps": steps, "learning_rate": 1e-4, "lr_scheduler": "constant", "warmup_steps": 0,
                     "logging_steps": 10, "report_to": ["none"], "resume": False},
        "launch": {"procs_per_node": 1},
    }


def fixed(recipe: dict[str, Any], method: str = "lora", micro: int = 1, accumulation: int = 1,
          engine: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """`recipe` with every speed key written (nothing auto): identical settings for finetune and bench_hf."""
    out = json.loads(json.dumps(recipe))
    out["method"] = method
    out["training"].update(micro_batch_size=micro, gradient_accumulation_steps=accumulation,
                           gradient_checkpointing=True, loss_kernel="default")
    # the widths bench_hf's batches have (DataCollatorForSeq2Seq with pad_to_multiple_of=8, as LLaMA-Factory sets
    # it): the same shapes on both sides. Before data.pad_to_multiple_of (runs up to 2026-11-28) finetune's row of
    # one length was as long as it is, one of 8 tokens less on average.
    out["data"].setdefault("pad_to_multiple_of", 8)
    out["deepspeed"] = engine if engine is not None else {
        # ZeRO-0 with torch's fused AdamW built by DeepSpeed: the optimizer LLaMA-Factory's template gets (the Trainer's)
        "enabled": True, "stage": 0, "overrides": {"optimizer": {"params": {"torch_adam": True, "fused": True}}}}
    if method == "full":
        out.pop("lora", None)  # lint R111: ignored with method: full
    if method == "qlora":
        dtype = out["model"]["dtype"]
        out["quantization"] = {"compute_dtype": dtype, "storage_dtype": dtype}
    return out


# Steps of the cases whose steps are GPU-bound (4 x 2,048 tokens or more per step): their p90 step was their p50
# (full 4 x 2,048 on an H200: 0.2615 / 0.2624 s), so 9 steady steps measure them; `--steps` is for micro batch 1.
LONG_STEP_STEPS = 14


# Steps of the rows-of-every-length cases: their lengths fall in 16 multiples of 64 (VARIED_TOKENS), so that past the
# first ~16 steps a padded run meets lengths it has planned, while an exact one meets a new length nearly every step.
VARIED_STEPS = 60

# --rehearse: the pairs' and the memory rows' lengths on the tiny model (2,048 and 8,192 on the GPU)
REHEARSAL_LENGTHS = (64, 256)
VARIED_TOKENS = (1024, 2048)
TOKENS_PER_WORD = 1.3  # the harness's tokenizer on these words: 2,902,796 tokens from 544 rows of 4,096 (2026-11-28)


def write_full_rows(out: Path, rows: int, max_length: int) -> Path:
    """Alpaca rows whose output runs past max_length tokens, so that every row is cut to max_length exactly: each
    step of the pairs has one shape, on both sides (no padding, no mask). The runs up to 2026-11-28 trained text
    rows of about 2.6 x max_length tokens, which the text format splits into max_length pieces and a shorter rest:
    at micro batch 1 a third of their steps had a length of its own, padded to a multiple of 8 with a mask on
    bench_hf's side (another attention kernel) and exact on finetune's, and those steps set the spread of the
    1 x 2,048 pairs (p90 up to 4 x p50). Rows of every length are the varied cases' question."""
    return acceptance().write_words(out / "data" / f"full_{max_length}.jsonl", rows,
                                    lambda rng: int(1.5 * max_length / TOKENS_PER_WORD), seed=0,
                                    as_row=lambda words: {"instruction": "Continue the text.", "input": "",
                                                          "output": words})


def write_varied_data(out: Path, rows: int, max_length: int) -> Path:
    """Text rows of lengths spread evenly over VARIED_TOKENS (scaled to max_length), as SFT data has them: each micro
    batch of one row has a length of its own, where write_full_rows' are all cut to max_length."""
    low = max_length * VARIED_TOKENS[0] // VARIED_TOKENS[1]
    return acceptance().write_words(out / "data" / f"varied_{max_length}.jsonl", rows,
                                    lambda rng: int(rng.randint(low, max_length - 16) / TOKENS_PER_WORD), seed=1)


def gpu_cases(model: str, data: Path, long_data: Path, steps: int, varied: Optional[Path] = None,
              lengths: tuple[int, int] = (2048, 8192), cpu: bool = False) -> list[Case]:
    """The GPU check's cases. `lengths` (the pairs', the memory rows') and `cpu` (float32) shrink them onto the tiny
    model for --rehearse; Liger-Kernel needs CUDA, so a rehearsal leaves its case out."""
    length, long_length = lengths
    base = base_recipe("speed", model, data, length, steps, cpu=cpu)
    cases = []
    if varied is not None:
        # Rows of every length at micro batch 1, the plain Trainer's path on both sides: each new length makes
        # cuDNN's attention build its plans again on the host (finetune.data.packing.GPU_PAD_MULTIPLE). finetune with
        # data.pad_to_multiple_of auto (64: 16 lengths in VARIED_TOKENS) and with 1 (each row as long as it is),
        # against bench_hf (DataCollatorForSeq2Seq: a multiple of 8, with a mask).
        exact = fixed({**base, "name": "varied_exact", "data": {**base["data"], "path": str(varied), "format": "text",
                                                                 "pad_to_multiple_of": 1}}, "lora", 1,
                      engine={"enabled": False})
        exact["training"]["max_steps"] = VARIED_STEPS
        padded = json.loads(json.dumps({**exact, "name": "varied_padded"}))
        padded["data"]["pad_to_multiple_of"] = "auto"
        cases.append(Case("varied_lora_1x_finetune", "finetune", padded, pair="varied_lora_1x"))
        cases.append(Case("varied_lora_1x_bench_hf", "bench_hf", exact, ("--no-deepspeed",), pair="varied_lora_1x",
                          estimate=70.0))
        cases.append(Case("varied_lora_1x_finetune_exact", "finetune", exact, baseline="varied_lora_1x_bench_hf"))
    for label, method, micro in (("lora_1x2k", "lora", 1), ("full_1x2k", "full", 1), ("lora_4x2k", "lora", 4),
                                 ("qlora_1x2k", "qlora", 1), ("full_4x2k", "full", 4)):
        recipe = fixed({**base, "name": label}, method, micro)
        if micro > 1:
            recipe["training"]["max_steps"] = min(steps, LONG_STEP_STEPS)
        # The full fine-tune at 4 x 2,048 is where the issue's MFU anchor (30%) applies: both sides run under the
        # profiler (the steady windows start after the profiled steps), so a low figure comes with its kernels, and
        # which of them are finetune's shows beside the baseline's.
        profiled = label == "full_4x2k"
        # At the host-bound shape every host sync stalls the queue: both sides count theirs (finetune.train.syncs)
        # over the steps after the warm-up, left out of the steady window like the profiled ones.
        counted = label in ("lora_1x2k", "qlora_1x2k")
        cases.append(Case(f"{label}_finetune", "finetune", recipe, pair=label, profile=profiled, syncs=counted))
        cases.append(Case(f"{label}_bench_hf", "bench_hf", recipe, ("--profile",) if profiled else (), pair=label,
                          syncs=counted, estimate=70.0))
        if label in ("lora_1x2k", "qlora_1x2k"):  # the host-bound pairs (the GPU busy 17-22% of the wall)
            # finetune launches with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (less cache held; the planner
            # models it), bench_hf with torch's default. At this host-bound shape the same recipe with the default
            # allocator says what that choice costs (the H200's fourth run, median steps with the default allocator
            # and with expandable segments: finetune 0.236 / 0.317 s, bench_hf 0.316 / 0.276 s; one run each).
            cases.append(Case(f"{label}_finetune_default_allocator", "finetune", {**recipe, "name": f"{label}_cached"},
                              env=(("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False"),),
                              baseline=f"{label}_bench_hf"))
            # and the baseline with finetune's setting: the H200's third run (2026-11-28) had finetune's median step
            # 0.331 s with expandable segments and 0.257 s without, against bench_hf's 0.238 s (one run each)
            cases.append(Case(f"{label}_bench_hf_expandable", "bench_hf", recipe, baseline=f"{label}_finetune",
                              env=(("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),), estimate=70.0))
            # `auto` trains LoRA and QLoRA on one GPU without DeepSpeed (the plain Trainer, fewer host syncs per
            # step), a choice the issue asks to measure: the same recipe on that path, against the same baseline.
            cases.append(Case(f"{label}_finetune_no_deepspeed", "finetune",
                              fixed({**base, "name": f"{label}_plain"}, method, micro, engine={"enabled": False}),
                              baseline=f"{label}_bench_hf"))
        if label == "qlora_1x2k":
            # The pair that missed its target, both sides under the profiler (steps 6-8; the steady windows start
            # after them): GPU-busy time over the wall and the largest kernels of each side, what the issue asks of a
            # gap that stays; and a second sample of the pair's ratio.
            cases.append(Case(f"{label}_profile_finetune", "finetune", {**recipe, "name": f"{label}_profile"},
                              pair=f"{label}_profile", profile=True))
            cases.append(Case(f"{label}_profile_bench_hf", "bench_hf", recipe, ("--profile",), pair=f"{label}_profile",
                              estimate=70.0))
    # Liger-Kernel's fused RMSNorm, SwiGLU, rotary and linear cross-entropy (training.loss_kernel: liger, through the
    # Trainer's use_liger_kernel) on the fixed full 4 x 2,048 recipe: fewer elementwise kernels (aten::mul and copy_
    # were 23% of the kernel time there) and fewer launches, where the GPU idled 40-50% of the wall. Profiled, against
    # the same baseline (which must run in the same command for the ratio). Never run on a GPU before.
    if not cpu:
        liger = fixed({**base, "name": "liger_4x2k_full"}, "full", 4)
        liger["training"].update(loss_kernel="liger", max_steps=min(steps, LONG_STEP_STEPS))
        cases.append(Case("liger_4x2k_full_finetune", "finetune", liger, profile=True, baseline="full_4x2k_bench_hf"))
    # What a user gets at the MFU anchor's shape: the full fine-tune of 4 rows per step with every speed key auto
    # (on an H200 the fixed pair above used 28.6 of 139 GiB with checkpointing on, whose recompute MFU does not
    # count), profiled, against the same baseline.
    full_auto = json.loads(json.dumps({**base, "name": "full_4x2k_auto", "method": "full"}))
    full_auto.pop("lora")
    full_auto["training"].update(gradient_accumulation_steps=4, max_steps=min(steps, LONG_STEP_STEPS))
    cases.append(Case("full_4x2k_finetune_auto", "finetune", full_auto, profile=True, baseline="full_4x2k_bench_hf"))
    # The same with DeepSpeed's FusedAdam (`torch_adam: false`), finetune's default up to 2026-11-28 and the one
    # case that compiles an op: `auto` trains a full fine-tune through ZeRO-2 on one GPU, where both step one fp32
    # partition with one fused kernel (finetune.render.with_torch_adam); against the same baseline.
    fused_adam = json.loads(json.dumps({**full_auto, "name": "full_4x2k_auto_fused_adam"}))
    fused_adam["deepspeed"] = {"overrides": {"optimizer": {"params": {"torch_adam": False}}}}
    cases.append(Case("full_4x2k_finetune_auto_fused_adam", "finetune", fused_adam, profile=True,
                      baseline="full_4x2k_bench_hf"))
    plain = fixed({**base, "name": "lora_1x2k_plain"}, "lora", 1, engine={"enabled": False})
    cases.append(Case("lora_1x2k_bench_hf_profile", "bench_hf", plain, ("--no-deepspeed", "--profile"), estimate=70.0))
    defaults = fixed({**base, "name": "lora_1x2k_llama_factory"}, "lora", 1, 8, engine={"enabled": False})
    auto = json.loads(json.dumps({**base, "name": "lora_1x2k_auto"}))
    auto["training"]["gradient_accumulation_steps"] = 8  # the same rows per step; the speed keys left auto
    for recipe in (defaults, auto):
        recipe["training"]["max_steps"] = min(steps, LONG_STEP_STEPS)
    cases.append(Case("lora_8rows_llama_factory_defaults", "bench_hf", defaults, ("--no-deepspeed",), pair="auto"))
    cases.append(Case("lora_8rows_finetune_auto", "finetune", auto, pair="auto"))
    for method in ("lora", "qlora", "full"):
        recipe = json.loads(json.dumps({**base, "name": f"memory_{method}_8k"}))
        recipe["method"] = method
        recipe["data"] = {**recipe["data"], "path": str(long_data), "format": "text", "max_length": long_length}
        recipe["training"]["max_steps"] = 3
        if method == "qlora":
            dtype = recipe["model"]["dtype"]
            recipe["quantization"] = {"compute_dtype": dtype, "storage_dtype": dtype}
        if method == "full":
            recipe.pop("lora")
        cases.append(Case(f"memory_{method}_8k", "finetune", recipe, memory=True))
    return cases


def cpu_cases(model: str, data: Path, steps: int) -> list[Case]:
    base = base_recipe("speed-cpu", model, data, 64, steps, cpu=True)
    # a checkpoint at the last step, which tests/launches/test_gpu_speed.py resumes
    base["training"].update(save_steps=steps, resume=True)
    # micro batch 1, as the GPU's host-bound pairs, and 2 of them a step: the census sees what each micro batch
    # costs (the Trainer's NaN filter)
    plain = fixed(base, "lora", 1, 2, engine={"enabled": False})
    return [Case("tiny_lora_plain_finetune", "finetune", plain, pair="tiny_lora_plain", profile=True, syncs=True),
            Case("tiny_lora_plain_bench_hf_profile", "bench_hf", plain, ("--no-deepspeed", "--profile"), syncs=True,
                 pair="tiny_lora_plain")]


def every_case(cpu: bool, steps: int, rehearse: bool = False) -> list[Case]:
    """The cases with placeholders for the model and the data: their names and settings, before anything is built
    (what --list prints and --only is checked against on this machine, not on the GPU's clock)."""
    nowhere = Path("-")
    if cpu:
        return cpu_cases("-", nowhere, steps)
    return gpu_cases("-", nowhere, nowhere, steps, nowhere, REHEARSAL_LENGTHS if rehearse else (2048, 8192), rehearse)


def selected(cases: list[Case], only: str) -> list[Case]:
    """The cases whose name contains one of `only`'s comma-separated texts, in the order of those texts (a case in
    the order of the first text it contains), so that a short GPU loan spends its budget on what it lists first.
    A text that starts with `-` leaves out the cases whose name contains the rest."""
    wanted = [part for part in only.split(",") if part and not part.startswith("-")]
    unwanted = [part[1:] for part in only.split(",") if part.startswith("-") and len(part) > 1]
    rank = {c.name: None if any(part in c.name for part in unwanted) else
            next((i for i, part in enumerate(wanted) if part in c.name), None) for c in cases}
    return sorted((c for c in cases if rank[c.name] is not None), key=lambda c: rank[c.name])


# ------------------------------------------------------------------------------------------------
# Running one


def run_case(case: Case, machine, harness, out: Path, timeout: float) -> dict[str, Any]:
    recipe_path = out / "recipes" / f"{case.name}.yaml"
    recipe_path.parent.mkdir(parents=True, exist_ok=True)
    recipe_path.write_text(json.dumps(case.recipe, indent=2) + "\n", encoding="utf-8")  # JSON is YAML
    record: dict[str, Any] = {"name": case.name, "tool": case.tool, "pair": case.pair, "status": None,
                              "recipe": str(recipe_path), "bench_args": list(case.bench_args),
                              "env": dict(case.env), "baseline": case.baseline}
    log = out / "logs" / f"{case.name}.log"
    started = time.perf_counter()
    if case.tool == "finetune":
        run_dir = out / "runs" / case.name
        if machine.gpu_memory:  # every finetune row on a GPU: the plan beside what it measures, and a corpus case
            prediction = harness.predict(recipe_path, harness.Case("speed", case.recipe["method"], 0, False, False,
                                                                   "sdpa", 1), machine)
            record.update({k: prediction.get(k) for k in ("predicted_bytes", "predicted_allocated_bytes",
                                                          "predicted_reserved_bytes", "predicted_nvidia_smi_bytes")})
            record["predicted_fits"] = prediction.get("fits")
            record["plan_setup"] = prediction.get("plan_setup")  # what scripts/acceptance_to_corpus.py reads too
        # A memory row records what is live at its peak and who made it (finetune.train.memory_trace), outside the
        # run directory that --overwrite replaces.
        from finetune.train.memory_trace import ENV as MEMORY_TRACE
        from finetune.train.profile import ENV as PROFILE
        from finetune.train.syncs import ENV as SYNCS

        trace = out / "memory_at_peak" / f"{case.name}.json"
        profiled = out / "profile" / f"{case.name}.json"
        counted = out / "syncs" / f"{case.name}.json"
        for stale in (trace, profiled, counted):
            stale.unlink(missing_ok=True)
        extra = {**dict(case.env), **({MEMORY_TRACE: str(trace)} if case.memory else {}),
                 **({PROFILE: str(profiled)} if case.profile else {}), **({SYNCS: str(counted)} if case.syncs else {})}
        code, smi, _ = harness.train(recipe_path, run_dir, log, timeout, extra)
        record["nvidia_smi_used_bytes"] = smi
        if trace.is_file():
            record["memory_at_peak"] = json.loads(trace.read_text())
    else:
        run_dir = out / "bench" / case.name
        code = bench(recipe_path, run_dir, log, (*case.bench_args, *(("--syncs",) if case.syncs else ())), timeout,
                     dict(case.env))
    record.update(exit_code=code, seconds=round(time.perf_counter() - started, 1))
    summary_path = run_dir / "summary.json"
    if code != 0 or not summary_path.is_file():
        tail = log.read_text(errors="replace").strip().splitlines()[-6:] if log.is_file() else []
        return {**record, "status": "failed", "reason": " | ".join(tail)[-800:]}
    summary = json.loads(summary_path.read_text())
    steady = summary.get("steady") or {}
    record.update(status="ok", steps=summary.get("steps"), steady=steady, startup=summary.get("startup"),
                  auto=summary.get("auto"), deepspeed=summary.get("deepspeed"),
                  tokens_per_second=summary.get("tokens_per_second"),
                  steady_tokens_per_second=steady.get("tokens_per_second"),
                  step_seconds_p50=steady.get("step_seconds_p50"), mfu=steady.get("mfu"),
                  peak_memory_bytes=summary.get("peak_memory_bytes"),
                  max_memory_reserved_bytes=summary.get("peak_memory_reserved_bytes"),
                  profile=summary.get("profile"), syncs=summary.get("syncs"))
    if case.tool == "finetune" and case.profile:
        profiled = out / "profile" / f"{case.name}.json"
        record["profile"] = json.loads(profiled.read_text()) if profiled.is_file() else None
    if case.tool == "finetune" and case.syncs:
        counted = out / "syncs" / f"{case.name}.json"
        record["syncs"] = json.loads(counted.read_text()) if counted.is_file() else None
    if case.tool == "finetune" and machine.gpu_memory:  # what scripts/acceptance_to_corpus.py reads, as resolved
        auto = summary.get("auto") or {}
        t = case.recipe["training"]
        record.update(model="llama-1b", method=case.recipe["method"], dtype=case.recipe["model"]["dtype"], attn="sdpa",
                      stage=case.recipe.get("deepspeed", {}).get("stage", 2), offload=False, gpus=1, packing=False,
                      max_length=case.recipe["data"]["max_length"],
                      micro_batch=auto.get("training.micro_batch_size", t.get("micro_batch_size", 1)),
                      gradient_accumulation=auto.get("training.gradient_accumulation_steps",
                                                     t.get("gradient_accumulation_steps", 1)),
                      gradient_checkpointing=auto.get("training.gradient_checkpointing", t.get("gradient_checkpointing", True)),
                      loss_kernel=summary.get("loss_kernel"), peak_memory_scope=summary.get("peak_memory_scope"),
                      peak_memory_bytes=max(summary.get("peak_memory_bytes") or [0]) or None)
    if case.tool == "finetune" and not case.name.startswith("tiny_"):
        for name in ("model", "adapter", "zero_checkpoint"):  # 2.5 GB per full 1B run: the disk is 64 GiB
            shutil.rmtree(run_dir / name, ignore_errors=True)
    return record


def bench(recipe_path: Path, out: Path, log: Path, extra: tuple[str, ...], timeout: float,
          env: Optional[dict[str, str]] = None) -> int:
    log.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, str(REPO / "scripts" / "bench_hf.py"), str(recipe_path), "--out", str(out), *extra]
    with log.open("w") as handle:
        proc = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                                env={**os.environ, "TQDM_DISABLE": "1", **(env or {})})
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            acceptance_module = sys.modules.get("gpu_acceptance")
            if acceptance_module is not None:
                acceptance_module.stop_session(proc)
            return 124


# ------------------------------------------------------------------------------------------------
# Results


def same_steps(mine: dict[str, Any], theirs: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The two runs over the optimizer steps both steady windows hold (finetune.speed's `per_step`): both sides
    train the same rows in the same order, so step k is the same work on each, but a case whose first steps ran
    under the census or the profiler starts its window 3 steps later (the 1 x 2k cases of the third H200 run:
    steps 9-30 against 6-30). `ratio`: finetune / baseline tokens/s over those steps; `median_step_ratio`: the
    median over those steps of baseline / finetune seconds (a slow step on one side, say a new row length's
    set-up, moves one term); `rows_match`: every step trained as many tokens on each side. None where a side
    has no per-step record (runs before 2026-11-28) or the windows share fewer steps than a steady window needs
    (finetune.speed.MIN_STEADY_STEPS)."""
    from finetune.speed import MIN_STEADY_STEPS

    windows = []
    for record in (mine, theirs):
        steady = record.get("steady") or {}
        per_step = steady.get("per_step") or {}
        if not per_step.get("seconds") or steady.get("warmup_steps") is None:
            return None
        first = steady["warmup_steps"] + 1  # per_step lists steps first, first + 1, ...
        windows.append((first, per_step["seconds"], per_step["tokens"]))
    start = max(w[0] for w in windows)
    end = min(w[0] + len(w[1]) for w in windows)  # exclusive
    if end - start < MIN_STEADY_STEPS:
        return None
    cut = [(seconds[start - first:end - first], tokens[start - first:end - first])
           for first, seconds, tokens in windows]
    (s_mine, t_mine), (s_theirs, t_theirs) = cut
    if not sum(s_mine) or not sum(s_theirs):
        return None
    speed = (sum(t_mine) / sum(s_mine)) / (sum(t_theirs) / sum(s_theirs))
    per = [b / a for a, b in zip(s_mine, s_theirs) if a > 0]
    return {"steps": [start, end - 1], "ratio": speed, "median_step_ratio": statistics.median(per) if per else None,
            "rows_match": t_mine == t_theirs}


def ratios(records: list[dict[str, Any]]) -> dict[str, Any]:
    """finetune / bench_hf steady tokens/s per pair (auto: finetune auto / LLaMA-Factory's defaults), and the same
    for a finetune case compared with another case's baseline (Case.baseline). `p50_ratio` compares the median step
    times (baseline / finetune at the same tokens per step): at a host-bound shape a few slow steps move the mean.
    `same_steps`: both over the steps both windows hold (same_steps above)."""
    out = {}
    ok = [r for r in records if r.get("steady_tokens_per_second")]
    by_name = {r["name"]: r for r in ok}
    compared: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
    for pair in sorted({r["pair"] for r in records if r.get("pair")}):
        mine = [r for r in ok if r["pair"] == pair and r["tool"] == "finetune"]
        theirs = [r for r in ok if r["pair"] == pair and r["tool"] == "bench_hf"]
        if mine and theirs:
            compared.append((pair, mine[0], theirs[0]))
    for r in ok:
        if r["tool"] == "finetune" and r.get("baseline") in by_name:
            compared.append((r["name"], r, by_name[r["baseline"]]))
        elif r["tool"] == "bench_hf" and r.get("baseline") in by_name:  # a baseline variant: that finetune case
            compared.append((r["name"], by_name[r["baseline"]], r))
    for name, mine, theirs in compared:
        p50 = (theirs["step_seconds_p50"] / mine["step_seconds_p50"]
               if mine.get("step_seconds_p50") and theirs.get("step_seconds_p50") and mine.get("pair") != "auto" else None)
        out[name] = {"finetune": mine["steady_tokens_per_second"], "bench_hf": theirs["steady_tokens_per_second"],
                     "ratio": mine["steady_tokens_per_second"] / theirs["steady_tokens_per_second"], "p50_ratio": p50,
                     "same_steps": same_steps(mine, theirs), "target": 1.5 if name == "auto" else 1.0}
    return out


def gib(value) -> str:
    if isinstance(value, list):
        value = max(v for v in value if v is not None) if any(v is not None for v in value) else None
    return "-" if value is None else f"{value / 2**30:.2f}"


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    where = ("CPU (--rehearse: the GPU cases on the tiny model, that they run; no figure here is a GPU's)"
             if results.get("rehearsal") else "CPU (--cpu: the plumbing only)" if m["cpu"] else
             f"{m['gpus']} x {m['gpu_name']}")
    v = m["versions"]
    lines = [f"# GPU speed check: {where}", "",
             f"{results['created']}; commit {results.get('commit')}; torch {v.get('torch')}, transformers "
             f"{v.get('transformers')}, deepspeed {v.get('deepspeed')}, peft {v.get('peft')}, bitsandbytes "
             f"{v.get('bitsandbytes')}; budget {results['budget']:.0f} s, {results['elapsed']:.0f} s used.",
             "Steady: after the first 5 steps (finetune.speed); MFU on the published anchors' basis "
             "(6 x matmul parameters + attention, LoRA counted as full).", "",
             "| case | status | steady tokens/s | step p50 s | MFU | start-up s | peak allocated GiB | plan GiB | s | note |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["runs"]:
        steady = r.get("steady_tokens_per_second")
        startup = sum(v for v in (r.get("startup") or {}).values() if isinstance(v, (int, float)))
        lines.append(f"| {r['name']} | {r['status']} | {f'{steady:,.0f}' if steady else '-'} | "
                     f"{r['step_seconds_p50']:.3f} | " if r.get("step_seconds_p50") else
                     f"| {r['name']} | {r['status']} | {f'{steady:,.0f}' if steady else '-'} | - | ")
        lines[-1] += (f"{100 * r['mfu']:.1f}% | " if r.get("mfu") is not None else "- | ") + \
            (f"{startup:.1f} | " if startup else "- | ") + \
            f"{gib(r.get('peak_memory_bytes'))} | {gib(r.get('predicted_allocated_bytes'))} | {r.get('seconds', '-')} | " + \
            (r.get("reason") or "").replace("|", "/")[:100] + " |"
    lines += ["", "| pair | finetune tokens/s | baseline tokens/s | ratio | step p50 ratio | same steps: ratio | "
                  "same steps: median step ratio | target |",
              "|---|---|---|---|---|---|---|---|"]
    for pair, r in results["ratios"].items():
        p50 = "-" if r.get("p50_ratio") is None else f"{r['p50_ratio']:.3f}"
        same = r.get("same_steps")
        paired = "- | -" if not same else (
            f"{same['ratio']:.3f} (steps {same['steps'][0]}-{same['steps'][1]}"
            f"{'' if same['rows_match'] else ', rows differ'}) | "
            + ("-" if same["median_step_ratio"] is None else f"{same['median_step_ratio']:.3f}"))
        lines.append(f"| {pair} | {r['finetune']:,.0f} | {r['bench_hf']:,.0f} | {r['ratio']:.3f} | {p50} | {paired} | "
                     f">= {r['target']:.2f} |")
    for r in results["runs"]:
        profile = r.get("profile")
        if profile:
            busy = profile.get("gpu_busy_fraction")
            counts = [f"{profile[key]:,.0f} {what}" for key, what in (("operator_calls_per_step", "operator calls"),
                                                                       ("kernels_per_step", "kernels")) if profile.get(key)]
            per_step = f"; {', '.join(counts)} a step" if counts else ""
            lines += ["", f"Profile of {r['name']} ({profile.get('note')}): GPU busy "
                          f"{'-' if busy is None else f'{100 * busy:.0f}%'} of {profile['wall_seconds']:.3f} s wall"
                          f"{per_step}.", "",
                      f"Shares of {profile.get('shares_of', 'the table total (operators and kernels both)')}."]
            for title, rows in (("operator (its own kernels)" if profile.get("kernels") else "operator", "top"),
                                ("kernel", "kernels")):
                if profile.get(rows):
                    lines += ["", f"| {title} | seconds | share | calls |", "|---|---|---|---|"]
                    lines += [f"| {k['name'][:90]} | {k['seconds']:.4f} | {100 * k['share']:.1f}% | {k['calls']} |"
                              for k in profile[rows]]
    split = [r for r in results["runs"] if r.get("startup")]
    if split:  # finetune's runs: where the seconds before the first step went (finetune.train.startup)
        from finetune.train.startup import STAGES

        lines += ["", "Start-up of the finetune runs, seconds (summary.json's `startup`; tokenize: the launcher's, "
                      "before the ranks):", "", "| case | tokenize | " + " | ".join(s.replace("_", " ") for s in STAGES)
                  + " |", "|---|---|" + "---|" * len(STAGES)]
        for r in split:
            stages = r["startup"]
            tokenize = (stages.get("tokenize") or {}).get("seconds")
            cells = [stages.get(stage) for stage in STAGES]
            lines.append(f"| {r['name']} | " + " | ".join("-" if v is None else f"{v:.1f}" for v in [tokenize, *cells])
                         + " |")
    for r in results["runs"]:
        counted = r.get("syncs")
        if counted:
            lines += ["", f"Host syncs and collectives per step of {r['name']} (finetune.train.syncs, "
                          f"{counted['steps']} steps):", "", "| per step | call | site |", "|---|---|---|"]
            for key, label in (("host_syncs", "host syncs"), ("collectives", "collectives"),
                               ("host_side", "host-side, no device wait")):
                part = counted.get(key) or {"per_step": 0, "sites": []}
                lines.append(f"| {part['per_step']:g} | {label}, in all | |")
                lines += [f"| {x['per_step']:g} | {x['call']} | {x['site'][:110].replace('|', '/')} |"
                          for x in part["sites"]]
    for r in results["runs"]:
        peak = r.get("memory_at_peak")
        if peak and peak.get("error"):
            lines += ["", f"Live at the peak of {r['name']}: {peak['error']}"]
        elif peak:
            lines += ["", f"Live at the peak of {r['name']}'s first {peak.get('steps')} steps: "
                          f"{gib(peak['peak_bytes'])} GiB ({gib(peak['baseline_bytes'])} before the first step; "
                          f"max_memory_allocated {gib(peak.get('max_memory_allocated_bytes'))})"
                          + (", history truncated" if peak.get("truncated") else "") + ".", "",
                      "| allocated by | GiB | blocks |", "|---|---|---|"]
            lines += [f"| {g['owner'][:100]} | {gib(g['bytes'])} | {g['blocks']} |" for g in peak["groups"][:15]]
    return "\n".join(lines) + "\n"


def write_results(out: Path, results: dict[str, Any], also: Optional[Path] = None) -> None:
    """results.json and results.md in `out` (and `also`: the GPU machine's $OUT, which comes back even when the
    command is stopped at its time limit)."""
    results["ratios"] = ratios(results["runs"])
    for folder in [out] + ([also] if also else []):
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in (("results.json", json.dumps(results, indent=2, default=str) + "\n"),
                           ("results.md", markdown(results))):
            tmp = folder / f".{name}.tmp"
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, folder / name)


def pack_logs(out: Path, results: Path) -> None:
    """The runs' console logs as one archive beside the results (the GPU machine returns at most 8 files)."""
    import tarfile

    with tarfile.open(results / "logs.tar.gz", "w:gz") as archive:
        for log in sorted((out / "logs").glob("*.log")):
            archive.add(log, arcname=log.name)


# ------------------------------------------------------------------------------------------------


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="models, runs, logs and results (required but with --list)")
    parser.add_argument("--cpu", action="store_true", help="the tiny model on one CPU process (CI)")
    parser.add_argument("--wheels", type=Path, default=None, help="carried wheels to install first (scripts/gpu_wheels.sh)")
    parser.add_argument("--budget", type=float, default=None, help="seconds for everything (default 450; --cpu 600)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per speed case (default 30; --cpu 10)")
    parser.add_argument("--only", default=None, help="run only the cases whose name contains one of these comma-separated "
                        "texts, in their order; -TEXT leaves out the cases whose name contains TEXT")
    parser.add_argument("--results", type=Path, default=None,
                        help="also write results.json, results.md (after each run) and logs.tar.gz (at the end) here")
    parser.add_argument("--list", action="store_true",
                        help="print the cases that would run (after --only), in their order, and exit: builds nothing")
    parser.add_argument("--rehearse", action="store_true",
                        help="the GPU cases (after --only) on this machine's CPU, shrunk onto the tiny model: that a "
                        "prepared command's cases run, before a GPU is rented (no figure of it means anything)")
    args = parser.parse_args(argv)
    if args.rehearse and args.cpu:
        parser.error("--rehearse runs the GPU cases on the CPU; --cpu runs the CI cases: give one")
    if args.rehearse and args.wheels:
        parser.error("--rehearse runs on this machine's own packages: leave out --wheels (the GPU machine's)")
    begun = time.perf_counter()
    budget = args.budget or (1800.0 if args.rehearse else 600.0 if args.cpu else 450.0)
    # 30 on a GPU: at micro batch 1 x 2,048 a step is host-bound (~0.3 s), and the 9 steady steps of 14 let one slow
    # step move the mean by half (2026-11-28: p90 1.47 s against p50 0.34 s)
    steps = args.steps or (10 if args.cpu or args.rehearse else 30)
    every = every_case(args.cpu, steps, args.rehearse)
    chosen = selected(every, args.only) if args.only else every
    if args.list and chosen:
        for case in chosen:
            print(f"{case.name}\t{case.tool}" + (f"\t{' '.join(case.bench_args)}" if case.bench_args else ""))
        return 0
    if not chosen:  # a GPU loan is short: say so before installing, building or timing anything
        kind = "--cpu " if args.cpu else "--rehearse " if args.rehearse else ""
        print(f"gpu_speed: --only {args.only!r} selects none of the {kind}cases: "
              f"{', '.join(c.name for c in every)}", file=sys.stderr)
        return 2
    if args.out is None:
        parser.error("the following arguments are required: --out")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)

    def log(message: str) -> None:
        print(f"gpu_speed: {message}", flush=True)

    build = None
    if args.wheels:
        install_wheels(args.wheels.resolve(), log)
        needed = ops_to_build(chosen)
        if needed:
            build = start_build(needed, log)
        else:
            log("no DeepSpeed op to compile: none of the selected cases builds one (ops_to_build)")
    use_site()
    harness = acceptance()
    machine = harness.detect(args.cpu or args.rehearse)
    log(f"machine: {machine.gpus} x {machine.gpu_name} ({time.perf_counter() - begun:.0f} s from the start)")
    if not args.cpu and not args.rehearse and machine.cpu:
        log("no CUDA GPU visible (--cpu tests the plumbing on CPU, --rehearse the GPU cases)")
        return 2
    if args.rehearse:
        from finetune.builtin import BUILTIN_PREFIX

        length, long_length = REHEARSAL_LENGTHS
        cases = gpu_cases(f"{BUILTIN_PREFIX}tiny-llama", write_full_rows(out, steps * 8 * 2 + 64, length),
                          harness.write_text_data(out, 64, long_length), steps,
                          write_varied_data(out, VARIED_STEPS * 2 + 64, length), REHEARSAL_LENGTHS, cpu=True)
    elif machine.cpu:
        from finetune.builtin import BUILTIN_PREFIX

        model = f"{BUILTIN_PREFIX}tiny-llama"
        cases = cpu_cases(model, REPO / "recipes" / "data" / "demo_instructions.jsonl", steps)
    else:
        model = str(harness.build_model("llama-1b", out))
        data = write_full_rows(out, steps * 8 * 2 + 64, 2048)
        long_data = harness.write_text_data(out, 64, 8192)
        cases = gpu_cases(model, data, long_data, steps, write_varied_data(out, VARIED_STEPS * 2 + 64, 2048))
        log(f"model and data built ({time.perf_counter() - begun:.0f} s from the start)")  # the set-up's parts, timed
    if args.only:
        cases = selected(cases, args.only)
    ops_seconds = None
    if build is not None:  # no timed run shares the CPUs with the compiler (nvcc and ninja take every core)
        waited = time.perf_counter()
        output, _ = build.communicate()  # its pipe read to the end: a full pipe would block the compiler
        ops_seconds = time.perf_counter() - begun
        log(f"DeepSpeed's ops compiled ({ops_seconds:.0f} s from the start; waited {time.perf_counter() - waited:.0f} s)"
            if build.returncode == 0 else f"finetune doctor --build-ops failed (the runs compile what they need): "
            f"{((output or '').strip().splitlines() or [''])[-1]}")
    results: dict[str, Any] = {"created": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                               "commit": harness.git_commit(), "machine": dataclasses.asdict(machine), "steps": steps,
                               "budget": budget, "elapsed": 0.0, "runs": [], "ratios": {}, "rehearsal": args.rehearse,
                               "ops_compiled_before_timing_s": ops_seconds,
                               # the shapes the memory rows trained, for scripts/acceptance_to_corpus.py
                               "models": {} if machine.cpu else {"llama-1b": {"model_type": "llama",
                                                                             **harness.MODELS["llama-1b"]}}}
    seen: dict[str, float] = {}  # the longest run so far of each tool
    for i, case in enumerate(cases, 1):
        left = budget - (time.perf_counter() - begun)
        need = seen.get(case.tool, case.estimate)
        if need > left:
            record = {"name": case.name, "tool": case.tool, "pair": case.pair, "status": "not run",
                      "reason": f"{left:.0f} s left of the {budget:.0f} s budget; a {case.tool} run took {need:.0f} s"}
        else:
            record = run_case(case, machine, harness, out, timeout=max(60.0, left))
            if record.get("seconds"):
                seen[case.tool] = max(seen.get(case.tool, 0.0), record["seconds"])
        results["runs"].append(record)
        results["elapsed"] = time.perf_counter() - begun
        write_results(out, results, args.results)
        steady = record.get("steady_tokens_per_second")
        log(f"[{i}/{len(cases)}] {case.name}: {record['status']}" + (f", steady {steady:,.0f} tokens/s" if steady else "")
            + (f" ({record.get('reason', '')[:200]})" if record["status"] != "ok" else ""))
    for pair, r in results["ratios"].items():
        same = r.get("same_steps")
        log(f"{pair}: finetune {r['finetune']:,.0f} / baseline {r['bench_hf']:,.0f} tokens/s = {r['ratio']:.3f} "
            + (f"(steps {same['steps'][0]}-{same['steps'][1]} on both sides: {same['ratio']:.3f}) " if same else "")
            + f"(target >= {r['target']:.2f})")
    if args.results:
        pack_logs(out, args.results)
    log(f"{out / 'results.md'} ({time.perf_counter() - begun:.0f} s)")
    return 1 if any(r["status"] == "failed" for r in results["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
