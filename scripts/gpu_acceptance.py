"""GPU acceptance: train a matrix of setups through `finetune train` and record speed and memory.

    python scripts/gpu_acceptance.py --out acceptance/                 # a CUDA machine; no network needed
    python scripts/gpu_acceptance.py --out acceptance/ --models llama-1b --methods lora,qlora
    python scripts/gpu_acceptance.py --out /tmp/acc --cpu              # the harness itself on CPU (CI)

On a GPU machine it builds models with random weights from known shapes (a Llama-3.2-1B and a
Llama-3-8B; no download), a tokenizer trained locally, and long synthetic text; then, for every
combination of model x method (lora, qlora, full) x ZeRO stage (0, 2, 3) x optimizer offload x
packing x attention kernel (sdpa, and flash_attention_2 when flash_attn imports) x GPU count (1 and
all visible), it writes a recipe to OUT/recipes/, asks `finetune plan` what it needs, skips it when
the plan says it does not fit, and otherwise trains it for --steps steps with `finetune train`.
Each run records tokens/s, MFU, max_memory_allocated and max_memory_reserved per rank (summary.json),
nvidia-smi's used memory sampled during the run, and the plan's prediction. A separate check collates two
packed rows the way the runner does (finetune.data.packing.make_collator: flattened with flash
boundaries on flash, block-diagonal masks on sdpa) and compares each example's logits there with its
logits alone, for every attention kernel the machine has.

Output: OUT/results.json and OUT/results.md; OUT/logs/ holds each run's console. Run directories
keep summary.json; their weights are deleted after each run (--keep-weights keeps them).

--cpu: the built-in tiny model, 2 CPU processes, one small setup: the same code path, for CI.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from finetune.builtin import BUILTIN_PREFIX, is_builtin  # noqa: E402 (after the path above)
from finetune.run.launch.commands import free_port  # noqa: E402

from finetune.speed import PEAK_BF16_TFLOPS, peak_bf16_flops  # noqa: E402,F401 (the one table of GPU peaks)

# Shapes of public models (their config.json), built here with random weights.
MODELS = {
    "llama-1b": dict(  # meta-llama/Llama-3.2-1B
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128_256, tie_word_embeddings=True, rope_theta=500_000.0,
        max_position_embeddings=8192, rms_norm_eps=1e-5),
    "llama3-8b": dict(  # meta-llama/Meta-Llama-3-8B
        hidden_size=4096, intermediate_size=14_336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128_256, tie_word_embeddings=False, rope_theta=500_000.0,
        max_position_embeddings=8192, rms_norm_eps=1e-5),
}
TINY = f"{BUILTIN_PREFIX}tiny-llama"


@dataclasses.dataclass(frozen=True)
class Case:
    model: str
    method: str
    stage: int
    offload: bool  # deepspeed.offload_optimizer: cpu
    packing: bool
    attn: str
    gpus: int

    @property
    def name(self) -> str:
        attn = {"sdpa": "sdpa", "flash_attention_2": "fa2", "eager": "eager"}.get(self.attn, self.attn)
        model = self.model.removeprefix(BUILTIN_PREFIX)
        return (f"{model}_{self.method}_z{self.stage}{'_off' if self.offload else ''}"
                f"{'_pack' if self.packing else ''}_{attn}_{self.gpus}gpu")


@dataclasses.dataclass
class Machine:
    cpu: bool
    gpus: int
    gpu_name: Optional[str]
    gpu_memory: Optional[int]
    peak_flops: Optional[float]  # per GPU, FLOP/s
    peak_source: Optional[str]
    flash: bool
    bitsandbytes: bool
    versions: dict[str, Optional[str]]


# ------------------------------------------------------------------------------------------------
# What the machine has


def git_commit() -> Optional[str]:
    """The commit of this checkout (what the results measured), None outside a git checkout. The GPU machine's copy
    of .git is the last landed commit's, not the working tree's: scripts/gpu_wheels.sh writes the commit the tree
    was sent from into .whl/COMMIT, which wins where this .git does not know that commit (the GPU machine; here,
    where it does, HEAD is the truth and a COMMIT left from an earlier send is stale)."""
    def git(*args: str) -> Optional[str]:
        try:
            out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=False)
        except OSError:  # no git on the machine
            return None
        return (out.stdout.strip() or "known") if out.returncode == 0 else None

    sent = REPO / ".whl" / "COMMIT"
    recorded = sent.read_text(encoding="utf-8").strip() if sent.is_file() else ""
    if recorded and git("cat-file", "-e", recorded.split("+")[0] + "^{commit}") is None:
        return recorded
    head = git("rev-parse", "HEAD")
    return head if head != "known" else None


def detect(cpu: bool) -> Machine:
    import importlib.metadata as md
    import importlib.util

    versions = {}
    for name in ("torch", "transformers", "deepspeed", "peft", "bitsandbytes", "flash-attn", "liger-kernel"):
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    gpus = None if cpu else gpu_facts()
    if gpus is None:
        return Machine(cpu=True, gpus=0, gpu_name=None, gpu_memory=None, peak_flops=None, peak_source=None,
                       flash=False, bitsandbytes=False, versions=versions)
    count, name, memory = gpus
    peak, source = peak_bf16_flops(name)
    return Machine(cpu=False, gpus=count, gpu_name=name, gpu_memory=memory, peak_flops=peak, peak_source=source,
                   flash=importlib.util.find_spec("flash_attn") is not None,
                   bitsandbytes=importlib.util.find_spec("bitsandbytes") is not None, versions=versions)


def gpu_facts() -> Optional[tuple[int, str, int]]:
    """(GPU count, name, total memory of GPU 0) as torch sees them, asked in a child process: the harness
    itself then holds no CUDA context while the runs it measures with nvidia-smi (every process on a GPU
    counts there) are going. None without a CUDA GPU."""
    code = ("import json, torch\n"
            "if torch.cuda.is_available():\n"
            "    p = torch.cuda.get_device_properties(0)\n"
            "    print(json.dumps([torch.cuda.device_count(), p.name, p.total_memory]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        return None
    count, name, memory = json.loads(lines[-1])
    return int(count), str(name), int(memory)


# ------------------------------------------------------------------------------------------------
# Models and data, built locally


def build_model(name: str, out: Path) -> Path:
    """A random-init Llama of a known shape in bf16 with a locally trained tokenizer (no download)."""
    target = out / "models" / name
    if (target / "config.json").is_file():
        return target
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from finetune.builtin import build_tokenizer

    tmp = target.with_name(f".{name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    build_tokenizer(tmp, vocab_size=4096)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tmp))
    config = LlamaConfig(**MODELS[name], bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 directly: an 8B model in fp32 would need 32 GB
    try:
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(str(tmp))
    del model
    os.replace(tmp, target)
    return target


def write_text_data(out: Path, rows: int, max_length: int) -> Path:
    """Synthetic `text` rows long enough to fill max_length tokens each (packing on or off then trains
    on the same number of tokens per sequence)."""
    return write_words(out / "data" / f"text_{max_length}.jsonl", rows, lambda rng: max_length * 2, seed=0)


def write_words(path: Path, rows: int, words_in_row, seed: int, as_row=lambda text: {"text": text}) -> Path:
    """`rows` rows of the demo's words drawn at random, `words_in_row(rng)` words each, as `as_row(words)` makes a
    row of them (a `text` row unless told; kept if already there)."""
    from finetune.builtin import demo_examples

    if path.is_file():
        return path
    words = " ".join(e["instruction"] + " " + e["output"] for e in demo_examples()).split()
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for _ in range(rows):
            f.write(json.dumps(as_row(" ".join(rng.choice(words) for _ in range(words_in_row(rng))))) + "\n")
    os.replace(tmp, path)
    return path


# ------------------------------------------------------------------------------------------------
# The matrix


def gpu_matrix(machine: Machine, args) -> list[Case]:
    attns = ["sdpa"] + (["flash_attention_2"] if machine.flash else [])
    counts = sorted({1, machine.gpus})
    cases = []
    for model in args.models:
        for method in args.methods:
            for stage in args.stages:
                for offload in (False, True):
                    if offload and stage == 0:
                        continue  # optimizer offload needs ZeRO >= 1
                    for packing in (False, True):
                        for attn in attns:
                            for gpus in counts:
                                cases.append(Case(model, method, stage, offload, packing, attn, gpus))
    return cases


def cpu_matrix() -> list[Case]:
    # One run: it takes the harness through every step a GPU run takes (the method-specific parts, FLOPs and
    # the matrix, have fast tests of their own), and a second 2-process start would double its CI time.
    return [Case(TINY, "lora", 2, False, True, "sdpa", 2)]


def recipe_for(case: Case, machine: Machine, args, out: Path) -> dict[str, Any]:
    if machine.cpu:
        model = {"name_or_path": TINY, "dtype": "float32", "attn_implementation": case.attn}
        data = {"path": str(REPO / "recipes" / "data" / "demo_instructions.jsonl"), "format": "alpaca",
                "max_length": 64, "packing": case.packing}
        micro_batch = 4
    else:
        model = {"name_or_path": str(build_model(case.model, out)), "dtype": "bfloat16",
                 "attn_implementation": case.attn}
        rows = args.steps * args.micro_batch * max(1, machine.gpus) * 2 + 64
        data = {"path": str(write_text_data(out, rows, args.max_length)), "format": "text",
                "max_length": args.max_length, "packing": case.packing, "mask_prompt": False}
        micro_batch = args.micro_batch
    recipe: dict[str, Any] = {
        "name": case.name,
        "model": model,
        "method": case.method,
        "data": data,
        "training": {"max_steps": args.steps, "micro_batch_size": micro_batch, "gradient_accumulation_steps": 1,
                     "learning_rate": 1e-4 if case.method == "full" else 2e-4, "lr_scheduler": "constant",
                     "warmup_steps": 0, "gradient_checkpointing": True, "logging_steps": 1,
                     "report_to": ["none"], "resume": False, "loss_kernel": args.loss_kernel},
        "deepspeed": {"stage": case.stage, "offload_optimizer": "cpu" if case.offload else "none"},
        "launch": {"procs_per_node": case.gpus},
    }
    if case.method == "qlora":
        recipe["quantization"] = {"compute_dtype": model["dtype"], "storage_dtype": model["dtype"]}
    return recipe


# ------------------------------------------------------------------------------------------------
# One run


def finetune_cmd(*argv: str) -> list[str]:
    return [sys.executable, "-m", "finetune.cli", *argv]


def predict(recipe_path: Path, case: Case, machine: Machine) -> dict[str, Any]:
    """`finetune plan --format json` for the recipe, on this machine's GPU memory."""
    cmd = finetune_cmd("plan", str(recipe_path), "--format", "json", "--gpus", str(case.gpus))
    if machine.gpu_memory:
        cmd += ["--gpu-memory", f"{machine.gpu_memory // 2**20}MiB"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=REPO)
    if out.returncode != 0:
        return {"error": (out.stderr or out.stdout).strip()[-500:]}
    plan = json.loads(out.stdout)
    # The planner predicts each counter the run measures (allocated, reserved, nvidia-smi) when it can.
    memory = plan.get("memory") or {}
    return {"predicted_bytes": plan["per_gpu"]["total"], "fits": plan["fits"], "plan_setup": plan.get("setup"),
            "predicted_allocated_bytes": memory.get("allocated_peak"),
            "predicted_reserved_bytes": memory.get("reserved_peak"),
            "predicted_nvidia_smi_bytes": memory.get("nvidia_smi")}


class SmiSampler:
    """Max of nvidia-smi's used memory per GPU while a run lasts (every process on the GPU counts)."""

    def __init__(self, interval: float = 0.5):
        self.interval = interval
        self.peak: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self):
        if shutil.which("nvidia-smi"):
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=10, check=False).stdout
                for line in out.strip().splitlines():
                    index, used = (int(x) for x in line.split(","))
                    self.peak[index] = max(self.peak.get(index, 0), used * 2**20)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                pass
            self._stop.wait(self.interval)

    def values(self) -> Optional[list[int]]:
        return [self.peak[i] for i in sorted(self.peak)] if self.peak else None


def train(recipe_path: Path, run_dir: Path, log: Path, timeout: float,
          extra_env: Optional[dict[str, str]] = None) -> tuple[int, Optional[list[int]], float]:
    cmd = finetune_cmd("train", str(recipe_path), "--output-dir", str(run_dir), "--overwrite",
                       "--master-port", str(free_port()))
    env = {**os.environ, "TQDM_DISABLE": "1", **(extra_env or {})}
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with log.open("w") as f, SmiSampler() as smi:
        # Its own session: on a timeout the whole launch (torchrun and the ranks) is stopped, nothing else.
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = 124
            stop_session(proc)
    return code, smi.values(), time.perf_counter() - start


def stop_session(proc: subprocess.Popen) -> None:
    """SIGTERM to `finetune train` (it stops its ranks), then SIGKILL to its session if it lingers."""
    import signal

    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def flops_per_token(model_dir: Path, seq_len: int) -> tuple[float, str]:
    """Model FLOPs per trained token of `seq_len`-token sequences, on the published anchors' basis
    (finetune.speed: 6 x matmul parameters + attention, every method; no recomputation)."""
    from finetune.plan.archs import load_config_json
    from finetune.speed import FLOPS_BASIS
    from finetune.speed import flops_per_token as per_token

    return per_token(load_config_json(model_dir), seq_len), FLOPS_BASIS


def model_dir_of(case: Case, out: Path) -> Path:
    if is_builtin(case.model):
        from finetune.builtin import ensure_builtin_model

        return ensure_builtin_model(case.model)  # built on first use (preflight does the same)
    return out / "models" / case.model


def run_case(case: Case, machine: Machine, args, out: Path) -> dict[str, Any]:
    record: dict[str, Any] = {"name": case.name, **dataclasses.asdict(case), "status": None}
    recipe = recipe_for(case, machine, args, out)
    record.update(dtype=recipe["model"]["dtype"], max_length=recipe["data"]["max_length"],
                  micro_batch=recipe["training"]["micro_batch_size"])
    recipe_path = out / "recipes" / f"{case.name}.yaml"
    recipe_path.parent.mkdir(parents=True, exist_ok=True)
    recipe_path.write_text(json.dumps(recipe, indent=2) + "\n", encoding="utf-8")  # JSON is YAML
    prediction = predict(recipe_path, case, machine)
    record["predicted_bytes"] = prediction.get("predicted_bytes")
    record["predicted_fits"] = prediction.get("fits")
    for key in ("predicted_allocated_bytes", "predicted_reserved_bytes", "predicted_nvidia_smi_bytes"):
        record[key] = prediction.get(key)
    if "error" in prediction:
        record["plan_error"] = prediction["error"]
    if case.method == "qlora" and not machine.bitsandbytes:
        return {**record, "status": "skipped", "reason": "bitsandbytes is not installed"}
    if prediction.get("fits") is False:
        return {**record, "status": "skipped",
                "reason": f"finetune plan predicts {prediction['predicted_bytes'] / 2**30:.1f} GiB per GPU "
                          f"of {machine.gpu_memory / 2**30:.1f} GiB"}
    run_dir = out / "runs" / case.name
    code, smi, seconds = train(recipe_path, run_dir, out / "logs" / f"{case.name}.log", args.timeout)
    record["exit_code"] = code
    record["seconds"] = round(seconds, 1)
    record["nvidia_smi_used_bytes"] = smi
    summary_path = run_dir / "summary.json"
    if code != 0 or not summary_path.is_file():
        tail = (out / "logs" / f"{case.name}.log").read_text(errors="replace").strip().splitlines()[-5:]
        return {**record, "status": "failed", "reason": " | ".join(tail)[-800:]}
    summary = json.loads(summary_path.read_text())
    tps = summary.get("tokens_per_second")
    steady = summary.get("steady") or {}
    peaks = summary.get("peak_memory_bytes") or []
    record.update({
        "status": "ok",
        "steps": summary.get("steps"),
        "loss_first": summary.get("train_loss_first"),
        "loss_last": summary.get("train_loss_last"),
        "tokens_per_second": tps,
        "peak_memory_bytes": max(peaks) if peaks else None,
        "peak_memory_bytes_per_rank": peaks,
        "peak_memory_kind": summary.get("peak_memory_kind"),
        "peak_memory_scope": summary.get("peak_memory_scope"),  # "training": over the steps alone
        "max_memory_reserved_bytes": summary.get("peak_memory_reserved_bytes"),
        "trainable_parameters": summary.get("trainable_parameters"),
        # issue 35: the steady state (after the warm-up steps) and the start-up split, as the run measured them
        "steady": steady or None,
        "steady_tokens_per_second": steady.get("tokens_per_second"),
        "startup": summary.get("startup"),
        "auto": summary.get("auto"),
    })
    seq = recipe["data"]["max_length"]
    flops, formula = flops_per_token(model_dir_of(case, out), seq)
    record["flops_per_token"] = steady.get("flops_per_token") or flops
    record["flops_formula"] = steady.get("flops_basis") or formula
    steady_tps = steady.get("tokens_per_second")
    # MFU on the steady figure: the runner's own where it knew the GPU, else from the steady tokens/s here
    record["mfu"] = steady.get("mfu") if steady.get("mfu") is not None else \
        ((steady_tps * record["flops_per_token"] / (case.gpus * machine.peak_flops)) if steady_tps and machine.peak_flops else None)
    if not args.keep_weights:
        for name in ("model", "adapter", "zero_checkpoint"):
            shutil.rmtree(run_dir / name, ignore_errors=True)
        for checkpoint in run_dir.glob("checkpoint-*"):
            shutil.rmtree(checkpoint, ignore_errors=True)
    return record


# ------------------------------------------------------------------------------------------------
# Packed batches: each example's logits inside a flattened batch equal its logits alone


def packing_checks(machine: Machine, out: Path) -> list[dict[str, Any]]:
    attns = ["sdpa"] + (["flash_attention_2"] if machine.flash else [])
    model_dir = model_dir_of(Case(TINY if machine.cpu else "llama-1b", "lora", 0, False, True, "sdpa", 1), out)
    if not machine.cpu:
        build_model("llama-1b", out)
    return [packing_check(model_dir, attn, machine) for attn in attns]


def packing_check(model_dir: Path, attn: str, machine: Machine) -> dict[str, Any]:
    """Two packed rows in one micro batch, collated exactly as the runner collates them for `attn`.

    Two rows is the case that mixed examples under flash attention before the collator flattened
    packed micro batches (transformers sees packing from position_ids only in a single row).
    """
    import torch
    from transformers import AutoModelForCausalLM

    from finetune.data.packing import make_collator, pack

    device = "cpu" if machine.cpu else "cuda"
    # float32 wherever the kernel allows it: bf16 rounding alone moved logits by 2% of their scale between
    # the packed and the lone shapes on an H100 (sdpa), while mixing examples moves them by over 100%; fp32
    # keeps the two far apart. flash_attention_2 runs in half precision only.
    dtype = torch.bfloat16 if attn == "flash_attention_2" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation=attn).to(device).eval()
    gen = torch.Generator().manual_seed(0)
    examples = [torch.randint(3, 700, (n,), generator=gen) for n in (37, 64, 23)]
    rows = pack([{"input_ids": e.tolist(), "labels": e.tolist()} for e in examples], max_length=100)  # [37], [64, 23]
    batch = make_collator(0, attn, packing=True, padding_free=False)(rows)
    inputs = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in batch.items() if k != "labels"}
    # use_cache=False as in training: with a KV cache transformers does not look for packed sequences
    # in position_ids (masking_utils), so sdpa/eager would attend across examples.
    with torch.no_grad():
        packed = model(**inputs, use_cache=False).logits.float()
        # The same rows with no boundaries: what a packed batch looks like without isolation.
        mixed = model(input_ids=inputs["input_ids"], use_cache=False).logits.float()
        worst, worst_mixed, scale = 0.0, 0.0, 0.0
        for e, (row, part) in zip(examples, example_slices(batch["position_ids"], [len(e) for e in examples])):
            alone = model(input_ids=e[None].to(device), use_cache=False).logits[0].float()
            worst = max(worst, (packed[row, part] - alone).abs().max().item())
            worst_mixed = max(worst_mixed, (mixed[row, part] - alone).abs().max().item())
            scale = max(scale, alone.abs().max().item())
    tolerance = (1e-4 if dtype == torch.float32 else 2e-2) * max(1.0, scale)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"attn": attn, "dtype": str(dtype).replace("torch.", ""), "examples": [len(e) for e in examples],
            "rows": [len(r["input_ids"]) for r in rows], "batch_shape": list(batch["input_ids"].shape),
            "max_abs_diff": worst, "max_abs_diff_without_boundaries": worst_mixed, "tolerance": tolerance,
            "equal": worst <= tolerance}


def example_slices(position_ids, lengths: list[int]) -> list[tuple[int, slice]]:
    """Where each example (in order) sits in a collated batch: (row, columns), found by its position ids."""
    found, row, col = [], 0, 0
    for n in lengths:
        while position_ids[row, col:col + n].tolist() != list(range(n)):
            row, col = row + 1, 0
        found.append((row, slice(col, col + n)))
        col += n
    return found


# ------------------------------------------------------------------------------------------------
# Report


def gib(value: Optional[float]) -> str:
    return "-" if value is None else f"{value / 2**30:.2f}"


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    where = "CPU (--cpu: the harness itself; memory is peak RSS)" if m["cpu"] else f"{m['gpus']} x {m['gpu_name']}"
    lines = [f"# GPU acceptance: {where}", "",
             f"{results['created']}; torch {m['versions'].get('torch')}, transformers {m['versions'].get('transformers')}, "
             f"deepspeed {m['versions'].get('deepspeed')}; {results['steps']} steps per run; loss_kernel {results['loss_kernel']}.",
             "Memory in GiB per GPU (the largest rank), measured / `finetune plan`'s prediction: allocated = "
             "max_memory_allocated, reserved = max_memory_reserved, smi = nvidia-smi used (on CPU: peak RSS "
             "in allocated).", "",
             "tokens/s: the whole training loop (warm-up included) and steady (after the first 5 steps; MFU from it).", "",
             "| run | status | tokens/s | steady tokens/s | MFU (steady) | allocated / plan | reserved / plan | smi / plan | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results["runs"]:
        reserved = max(r["max_memory_reserved_bytes"]) if r.get("max_memory_reserved_bytes") else None
        smi = max(r["nvidia_smi_used_bytes"]) if r.get("nvidia_smi_used_bytes") else None
        tps = f"{r['tokens_per_second']:.0f}" if r.get("tokens_per_second") else "-"
        steady = f"{r['steady_tokens_per_second']:.0f}" if r.get("steady_tokens_per_second") else "-"
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
        note = (r.get("reason") or "").replace("|", "/")[:120]
        lines.append(f"| {r['name']} | {r['status']} | {tps} | {steady} | {mfu} | "
                     f"{gib(r.get('peak_memory_bytes'))} / {gib(r.get('predicted_allocated_bytes'))} | "
                     f"{gib(reserved)} / {gib(r.get('predicted_reserved_bytes'))} | "
                     f"{gib(smi)} / {gib(r.get('predicted_nvidia_smi_bytes') or r.get('predicted_bytes'))} | {note} |")
    lines += ["", "Packed (flattened) batch against each example alone:", "",
              "| attention | dtype | max abs diff | without boundaries | tolerance | equal |", "|---|---|---|---|---|---|"]
    for c in results["packing_checks"]:
        lines.append(f"| {c['attn']} | {c['dtype']} | {c['max_abs_diff']:.2e} | {c['max_abs_diff_without_boundaries']:.2e} "
                     f"| {c['tolerance']:.1e} | {'yes' if c['equal'] else '**no**'} |")
    return "\n".join(lines) + "\n"


def write_results(out: Path, results: dict[str, Any]) -> None:
    for name, text in (("results.json", json.dumps(results, indent=2) + "\n"), ("results.md", markdown(results))):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, out / name)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for models, recipes, runs and results")
    parser.add_argument("--cpu", action="store_true", help="the built-in tiny model on 2 CPU processes (CI)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 30; --cpu 3)")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)}")
    parser.add_argument("--methods", default="lora,qlora,full", help="comma list of lora, qlora, full")
    parser.add_argument("--stages", default="0,2,3", help="comma list of ZeRO stages")
    parser.add_argument("--max-length", type=int, default=2048, help="tokens per sequence (default 2048)")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU per step (default 1)")
    parser.add_argument("--loss-kernel", default="default", choices=["default", "chunked", "liger"])
    parser.add_argument("--timeout", type=float, default=None, help="seconds per run (default 1800; --cpu 300)")
    parser.add_argument("--only", default=None, help="run only the cases whose name contains this text")
    parser.add_argument("--keep-weights", action="store_true", help="keep each run's saved weights")
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model {unknown[0]!r}; known: {', '.join(MODELS)}")
    args.methods = [m for m in args.methods.split(",") if m]
    args.stages = [int(s) for s in args.stages.split(",") if s]
    args.steps = args.steps or (3 if args.cpu else 30)
    args.timeout = args.timeout or (300 if args.cpu else 1800)

    machine = detect(args.cpu)
    if not args.cpu and machine.cpu:
        print("gpu_acceptance: no CUDA GPU visible (use --cpu to test the harness on CPU)", file=sys.stderr)
        return 2
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    cases = cpu_matrix() if machine.cpu else gpu_matrix(machine, args)
    if args.only:
        cases = [c for c in cases if args.only in c.name]
    results: dict[str, Any] = {"created": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                               "commit": git_commit(), "machine": dataclasses.asdict(machine), "steps": args.steps,
                               "loss_kernel": args.loss_kernel, "runs": [], "packing_checks": [],
                               # the shapes the runs trained, for scripts/acceptance_to_corpus.py
                               "models": {} if machine.cpu else {m: {"model_type": "llama", **MODELS[m]}
                                                                 for m in {c.model for c in cases}}}
    print(f"gpu_acceptance: {len(cases)} runs on {'CPU' if machine.cpu else f'{machine.gpus} x {machine.gpu_name}'}",
          flush=True)
    for i, case in enumerate(cases, 1):
        record = run_case(case, machine, args, out)
        results["runs"].append(record)
        write_results(out, results)  # after every run: a long matrix that stops keeps what it measured
        tps = f"{record['tokens_per_second']:.0f} tokens/s" if record.get("tokens_per_second") else ""
        print(f"  [{i}/{len(cases)}] {case.name}: {record['status']} {tps} {record.get('reason', '')}"[:300], flush=True)
    # After the runs: the check loads a model on GPU 0 in this process, whose CUDA context would
    # otherwise be in every run's nvidia-smi reading.
    results["packing_checks"] = packing_checks(machine, out)
    for check in results["packing_checks"]:
        print(f"  packed vs alone, {check['attn']}: max abs diff {check['max_abs_diff']:.2e} "
              f"({'equal' if check['equal'] else 'DIFFERENT'})", flush=True)
    write_results(out, results)
    failed = [r for r in results["runs"] if r["status"] == "failed"]
    unequal = [c for c in results["packing_checks"] if not c["equal"]]
    print(f"gpu_acceptance: {out / 'results.md'}; {len(failed)} failed run(s), "
          f"{len(unequal)} packing check(s) unequal", flush=True)
    return 1 if failed or unequal else 0


if __name__ == "__main__":
    sys.exit(main())
