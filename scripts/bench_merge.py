"""Benchmark `finetune merge` against PEFT's merge_and_unload on a synthetic 1.1B Llama (TinyLlama's shape), or 8B.

    $ .venv/bin/python scripts/bench_merge.py             # ~7 GB of temporary files under /tmp, removed at the end
    $ .venv/bin/python scripts/bench_merge.py --repeat 1  # one run per side (default 3, median reported)
    $ .venv/bin/python scripts/bench_merge.py --size 8b   # Llama-3-8B's shape, finetune only: ~33 GB of disk
    $ .venv/bin/python scripts/bench_merge.py --size tiny --repeat 1   # 2 layers of width 64: the harness end to end (39 s)

What it does, all in one run so both sides see the same machine state:
  1. writes a random bf16 LlamaForCausalLM checkpoint (1b: hidden 2048, intermediate 5632, 22 layers,
     vocab 32000, untied head: 1.1B parameters, 2.2 GB, 5 shards; 8b: hidden 4096, intermediate 14336,
     32 layers, vocab 128256: 8.0B parameters, 16.06 GB, 8 shards), and a rank-16 LoRA adapter on every
     linear layer of the decoder (q/k/v/o/gate/up/down, float32 like PEFT saves it);
  2. times a plain copy of the base shards, fsynced (what any merge that reads and writes them must move);
  3. runs `finetune merge --base ... --adapter ... -o ...` as a subprocess;
  4. runs PEFT as a subprocess: from_pretrained(bf16) -> PeftModel.from_pretrained -> merge_and_unload ->
     save_pretrained (3 and 4 alternate, --repeat times each; both read the base from the page cache).
     At 8b only with --peft: it holds the whole model, ~17 GB, in RAM;
  5. checks the two outputs are bit-identical, tensor by tensor, and prints wall and CPU times (user + sys
     of the process, which another job on the machine slows less than the wall time) and memory peaks.

Memory is anonymous memory: RssAnon from /proc/PID/status, sampled every 20 ms (finetune.data.peak; each side
is one process). Pages of memory-mapped files (safetensors maps the shards it reads) count in RSS too, but they
are clean page cache that the kernel drops under pressure, so they do not decide whether a merge fits in RAM;
what the process allocates (tensors, Python, libraries) does. ru_maxrss (peak RSS, file pages included) is printed too.

Measured on the 2-core, 24 GiB development box while other jobs kept its load average at 10-13 (so
wall times swing from run to run; medians of 3):
  1b: finetune merge 6.8 s wall (runs 6.5, 6.8, 8.4), 3.8 s CPU (3.3 user, 0.4 sys); PEFT 58.6 s
      (51.1, 58.6, 64.1), 22.7 s CPU (11.9 user, 10.8 sys): 0.12x the time, 0.17x the CPU time; peak
      RssAnon 0.24 GiB vs 2.34 GiB: 0.10x the memory; outputs bit-identical (201 tensors).
  8b: finetune merge 37.5 s wall (runs 36.7, 37.5, 41.0), 18.3 s CPU (16.1 user, 2.8 sys); peak RssAnon
      0.59 GiB (0.64 GB: under the 1 GB target); a plain copy of the shards, fsynced, 35.3 s (load 10-11).
Before issue 20 the merge wrote its shards through the page cache, and on this VM that cost 1.8-4.1 s
of system time per 1.1B merge, as much as all its arithmetic (5 runs each against the same data, load
average ~16: 7.8 s CPU, 4.0 of it sys, median wall 24.7 s, then 4.1 s CPU, 0.5 sys, 12.1 s wall; the
code of 5c82595 and of the commit before the fix measured the same); it now writes with direct I/O.
The tests build the tiny size and run `run_measured` and `compare` (tests/test_entry_points.py), not the two
merges: each side's process imports torch (`--size tiny --repeat 1` runs everything, 39 s).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The shapes of real models: TinyLlama-1.1B (config.json of TinyLlama/TinyLlama-1.1B-Chat-v1.0) and
# Llama-3-8B (meta-llama/Meta-Llama-3-8B). The 8B base is cut into 8 shards (Meta ships 4) so that building
# it holds at most ~2 GB of tensors at a time.
SIZES = {
    "1b": dict(shape=dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                          num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048,
                          tie_word_embeddings=False),
               shards=5, needed=10 * 10**9),  # base 2.2 GB + two merged copies + a plain copy, with room to spare
    "8b": dict(shape=dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                          tie_word_embeddings=False),
               shards=8, needed=36 * 10**9),  # base 16 GB + one merged copy (or the plain copy) + room
    # The harness itself (tests/test_entry_points.py builds it; `--size tiny --repeat 1` runs both sides in 39 s).
    "tiny": dict(shape=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
                            tie_word_embeddings=False),
                 shards=2, needed=10**8),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ANON_LIMIT = 10**9  # issue 20: finetune's merge of the 8B model stays under 1 GB of anonymous memory

PEFT_SCRIPT = """
import sys, torch
from transformers import AutoModelForCausalLM
from peft import PeftModel
base, adapter, out = sys.argv[1:4]
model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
model.save_pretrained(out)
"""


def build_base(path: Path, size: str = "1b") -> int:
    """Random bf16 weights with LlamaForCausalLM's names and shapes, in SIZES[size]["shards"] safetensors files."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SIZES[size]["shape"])
    shards = SIZES[size]["shards"]
    with torch.device("meta"):
        names = {k: tuple(v.shape) for k, v in LlamaForCausalLM(config).state_dict().items()}
    config.dtype = torch.bfloat16
    path.mkdir(parents=True)
    config.save_pretrained(str(path))
    total = sum(_numel(s) * 2 for s in names.values())
    per_shard = total / shards
    generator = torch.Generator().manual_seed(0)
    shard: dict = {}
    shard_bytes, files, weight_map = 0, [], {}

    def flush() -> None:
        nonlocal shard, shard_bytes
        name = f"model-{len(files) + 1:05d}-of-{shards:05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        files.append(name)
        shard, shard_bytes = {}, 0

    for name, shape in names.items():
        if "norm" in name:
            tensor = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensor = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        shard[name] = tensor
        shard_bytes += tensor.numel() * 2
        if shard_bytes >= per_shard and len(files) < shards - 1:
            flush()
    flush()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total


def build_adapter(path: Path, base: Path, r: int = 16, size: str = "1b") -> None:
    """A rank-r LoRA on every decoder linear layer, saved in PEFT's format with non-zero B."""
    import torch
    from peft import LoraConfig
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**SIZES[size]["shape"]))
    generator = torch.Generator().manual_seed(1)
    tensors = {}
    for name, module in model.named_modules():
        if name.split(".")[-1] in TARGETS:
            out_features, in_features = module.weight.shape
            key = f"base_model.model.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, in_features, generator=generator) / in_features ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, r, generator=generator) * 0.01
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    LoraConfig(r=r, lora_alpha=2 * r, target_modules=TARGETS, base_model_name_or_path=str(base)).save_pretrained(str(path))


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def run_measured(argv: list[str], label: str) -> dict:
    """Run a command; sample its RssAnon every 20 ms (finetune.data.peak); return wall time and peaks (bytes)."""
    from finetune.data.peak import PeakMemory

    log = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a chatty child cannot fill it and stall
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True)
    with PeakMemory(proc.pid, ("rss_anon",), interval=0.02) as peak:
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    log.seek(0)
    output = log.read()
    log.close()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        print(output[-3000:])
        raise SystemExit(f"{label} failed with exit code {proc.returncode}")
    return {"wall": wall, "cpu": usage.ru_utime + usage.ru_stime, "user": usage.ru_utime, "sys": usage.ru_stime,
            "anon": peak.bytes or 0, "maxrss": usage.ru_maxrss * 1024, "output": output}


def _median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2]


def _summary(runs: list[dict]) -> dict:
    """Median wall and CPU times (the machine may be shared), highest memory peaks."""
    return {"wall": _median([r["wall"] for r in runs]), "walls": sorted(r["wall"] for r in runs),
            "cpu": _median([r["cpu"] for r in runs]), "user": _median([r["user"] for r in runs]),
            "sys": _median([r["sys"] for r in runs]),
            "anon": max(r["anon"] for r in runs), "maxrss": max(r["maxrss"] for r in runs)}


def compare(ours: Path, theirs: Path) -> int:
    """Tensor-by-tensor torch.equal of two sharded safetensors directories; returns the tensor count."""
    import torch
    from safetensors import safe_open

    def where(path: Path) -> dict:
        index = path / "model.safetensors.index.json"
        if index.exists():
            return {k: path / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            return {k: path / "model.safetensors" for k in f.keys()}

    a, b = where(ours), where(theirs)
    if set(a) != set(b):
        raise SystemExit(f"different tensor names: {sorted(set(a) ^ set(b))[:5]}")
    for name in a:
        with safe_open(str(a[name]), "pt") as fa, safe_open(str(b[name]), "pt") as fb:
            x, y = fa.get_tensor(name), fb.get_tensor(name)
            if x.dtype != y.dtype or not torch.equal(x, y):
                raise SystemExit(f"{name} differs between finetune and PEFT")
    return len(a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="1b",
                        help="1b: TinyLlama's shape, both sides; 8b: Llama-3-8B's shape, finetune only (unless --peft); "
                             "tiny: the harness itself.")
    parser.add_argument("--peft", action=argparse.BooleanOptionalAction, default=None,
                        help="Run PEFT's merge too (default: for 1b; at 8b it needs ~17 GB of RAM).")
    parser.add_argument("--tmp", type=Path, default=Path("/tmp"), help="Where the temporary files go.")
    parser.add_argument("--keep", action="store_true", help="Keep the temporary directory (prints its path).")
    parser.add_argument("--repeat", type=int, default=3, help="Runs per side; the median wall time is reported.")
    args = parser.parse_args()
    with_peft = args.size != "8b" if args.peft is None else args.peft
    shards = SIZES[args.size]["shards"]

    # Ctrl-C and SIGTERM both unwind through the `finally` below, which removes the gigabytes written.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
    free = shutil.disk_usage(args.tmp).free
    needed = SIZES[args.size]["needed"]
    if free < needed:
        raise SystemExit(f"need {needed / 1e9:.0f} GB free in {args.tmp}, have {free / 1e9:.1f} GB")
    work = Path(tempfile.mkdtemp(prefix="bench_merge.", dir=args.tmp))
    try:
        t0 = time.perf_counter()
        size = build_base(work / "base", args.size)
        build_adapter(work / "adapter", work / "base", size=args.size)
        print(f"built base ({size / 1e9:.2f} GB, {shards} shards) and rank-16 adapter in {time.perf_counter() - t0:.0f} s",
              flush=True)

        t0 = time.perf_counter()
        (work / "copy").mkdir()
        for shard in sorted((work / "base").glob("*.safetensors")):
            shutil.copyfile(shard, work / "copy" / shard.name)
            with open(work / "copy" / shard.name, "rb+") as handle:
                os.fsync(handle.fileno())  # what reaches the disk, like the merge's direct writes
        copy_time = time.perf_counter() - t0
        shutil.rmtree(work / "copy")

        finetune_bin = Path(sys.executable).with_name("finetune")
        finetune_cmd = [str(finetune_bin)] if finetune_bin.exists() else [sys.executable, "-m", "finetune.cli"]
        ours_runs, theirs_runs = [], []
        load_before = os.getloadavg()
        sides = ("finetune", "peft") if with_peft else ("finetune",)
        for i in range(args.repeat):
            # Alternate which side goes first, and start each from the same state (no output yet).
            for side in (sides if i % 2 == 0 else sides[::-1]):
                # At 8b the disk holds one merged copy at a time.
                for old in (("finetune", "peft") if args.size == "8b" else (side,)):
                    shutil.rmtree(work / f"merged-{old}", ignore_errors=True)
                if side == "finetune":
                    ours_runs.append(run_measured(finetune_cmd + [
                        "merge", "--base", str(work / "base"), "--adapter", str(work / "adapter"),
                        "-o", str(work / "merged-finetune")], "finetune merge"))
                else:
                    theirs_runs.append(run_measured([sys.executable, "-c", PEFT_SCRIPT, str(work / "base"),
                                                     str(work / "adapter"), str(work / "merged-peft")], "PEFT"))
                print(f"  {side} run {i + 1}: {(ours_runs if side == 'finetune' else theirs_runs)[-1]['wall']:.1f} s",
                      flush=True)
        load_after = os.getloadavg()
        ours = _summary(ours_runs)
        if with_peft:
            theirs = _summary(theirs_runs)
            if (work / "merged-finetune").is_dir() and (work / "merged-peft").is_dir():
                count = compare(work / "merged-finetune", work / "merged-peft")
                print(f"outputs bit-identical: {count} tensors (torch.equal)")
            else:
                print("outputs not compared (at 8b one merged copy is kept at a time)")

        gib = 2**30
        print(f"{args.size}: {size / 1e9:.2f} GB base in {shards} shards; load average (1, 5, 15 min) before the "
              f"runs {' '.join(f'{x:.1f}' for x in load_before)}, after {' '.join(f'{x:.1f}' for x in load_after)}, "
              f"on {os.cpu_count()} cores")
        print(f"{'':24}{'wall s':>8}{'CPU s':>7}{'user':>6}{'sys':>6}{'RssAnon GiB':>13}{'ru_maxrss GiB':>15}")
        print(f"{'plain copy + fsync':24}{copy_time:8.1f}")
        rows = [("finetune merge", ours)] + ([("PEFT merge_and_unload", theirs)] if with_peft else [])
        for label, r in rows:
            runs = ", ".join(f"{w:.1f}" for w in r["walls"])
            print(f"{label:24}{r['wall']:8.1f}{r['cpu']:7.1f}{r['user']:6.1f}{r['sys']:6.1f}{r['anon'] / gib:13.2f}"
                  f"{r['maxrss'] / gib:15.2f}   runs: {runs}")
        if with_peft:
            print(f"ratios finetune / PEFT: time {ours['wall'] / theirs['wall']:.2f}x (target <= 0.2), "
                  f"CPU time {ours['cpu'] / theirs['cpu']:.2f}x, "
                  f"peak anonymous memory {ours['anon'] / theirs['anon']:.2f}x (target <= 0.2), "
                  f"plain copy {copy_time / theirs['wall']:.2f}x")
        verdict = "under" if ours["anon"] < ANON_LIMIT else "OVER"
        print(f"finetune merge peak anonymous memory: {ours['anon'] / 1e9:.2f} GB ({verdict} the 1 GB target)")
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
