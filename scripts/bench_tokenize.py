"""Tokenizing a training set: finetune's step (finetune.data.prepare) against a batched `datasets.map` reference.

    python scripts/bench_tokenize.py --rows 100000             # alpaca and ShareGPT, num_proc = cores
    python scripts/bench_tokenize.py --rows 1000000 --format alpaca --num-proc 2
    python scripts/bench_tokenize.py --measure -- finetune prepare RECIPE   # the same numbers for any command

Generates N alpaca rows and N ShareGPT rows (JSON lines, a few hundred tokens each with the built-in
tokenizer), then runs, each in a fresh process with an empty Hugging Face datasets cache (so both pay
the JSON -> Arrow conversion):
- finetune: `finetune.data.prepare.prepare`, what `finetune prepare` and `finetune train` run before launch
  (rows tokenized on every core, mixed, written as a memory-mapped cache entry), with the tokenizer loaded
  as they load it (finetune.tokenizer.load_without_torch: AutoTokenizer in a short child process, so torch is
  never imported where the tokenizing happens);
- reference: `datasets.load_dataset("json")` + `Dataset.map(batched=True, num_proc=cores)` with the same
  tokenizer loaded by AutoTokenizer (which imports torch) and the same masking (prompt masked, EOS trained,
  truncation, rows with nothing left dropped; for ShareGPT the assistant turns located by rendering prefixes
  of the conversation with apply_chat_template), the way LLaMA-Factory and axolotl tokenize; its output stays
  in datasets' cache, as theirs does.

What it prints, the same for both sides, from the start of the side's process to the end of its tokenizing
(imports, tokenizer loading and the JSON -> Arrow conversion included; the check that follows, which reads
every token of the result, is not: `_tokenized`):
- seconds: wall time;
- CPU s: user + system time of the process and every descendant it waited for (steadier than wall time on a
  shared machine);
- peak RSS: the peak over time of the SUM of the resident set sizes of the process tree (the process, its
  workers and any helper child), sampled every 50 ms. A page shared after fork counts once per process that
  has it resident, so this is an upper bound of the physical memory, and the number the targets use;
- peak PSS: the same sum with each shared page split between the processes sharing it (closer to physical);
- anon PSS: PSS without memory-mapped files (Arrow data, libraries: page cache the kernel can drop), i.e.
  what the processes allocated;
side by side with the ratios (finetune / reference) and the load average at the end of each side, and checks
that both sides give the same number of sequences, tokens and trained tokens.
The tests run both sides on 24 rows in their own process and `watch` on a small process tree
(tests/test_entry_points.py): the workers' fresh processes would cost seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
WORDS = ("the cat sat on a mat while rain fell over river stone bread milk book door cloud snow green blue red "
         "tree apple moon star sun bird dog engineers wrote careful notes about tokens packing and memory").split()


# ------------------------------------------------------------------------------------------------
# Data


def _paragraphs(rng: random.Random, count: int, low: int, high: int) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high))).capitalize() + "." for _ in range(count)]


def write_rows(path: Path, fmt: str, rows: int, seed: int = 0) -> None:
    """`rows` rows of `fmt`, drawn from a pool of paragraphs (writing a million rows takes seconds)."""
    rng = random.Random(seed)
    short, long = _paragraphs(rng, 512, 8, 40), _paragraphs(rng, 512, 60, 160)
    with path.open("w", encoding="utf-8") as handle:
        for i in range(rows):
            if fmt == "alpaca":
                row = {"instruction": f"Task {i}: {rng.choice(short)}", "input": rng.choice(short) if i % 3 == 0 else "",
                       "output": rng.choice(long)}
            else:
                turns = []
                for _ in range(rng.randint(1, 3)):
                    turns += [{"from": "human", "value": f"Question {i}: {rng.choice(short)}"},
                              {"from": "gpt", "value": rng.choice(long)}]
                row = {"conversations": turns}
            handle.write(json.dumps(row) + "\n")


# ------------------------------------------------------------------------------------------------
# The two sides (each runs in its own process: `--worker`)


def run_finetune(data: Path, fmt: str, tokenizer, max_length: int, num_proc: int, work: Path) -> dict:
    from finetune.data.prepare import load_prepared, prepare
    from finetune.data.spec import DataSpec

    section = DataSpec.from_section({"path": str(data), "format": fmt, "seed": 0, "max_length": max_length,
                                     "packing": False, "mask_prompt": True})
    prepare(section, tokenizer, work / "finetune-cache", log=lambda line: None, num_proc=num_proc)
    _tokenized(work)
    return _counts(load_prepared(section, tokenizer, work / "finetune-cache"))


def run_reference(data: Path, fmt: str, tokenizer, max_length: int, num_proc: int, work: Path) -> dict:
    import datasets

    raw = datasets.load_dataset("json", data_files=str(data), split="train")
    function = _reference_alpaca if fmt == "alpaca" else _reference_sharegpt
    tokenized = raw.map(function, batched=True, num_proc=num_proc, remove_columns=raw.column_names,
                        fn_kwargs={"tokenizer": tokenizer, "max_length": max_length})
    _tokenized(work)
    return _counts(tokenized)


def _tokenized(work: Path) -> None:
    """Tell the parent the tokenizing is done (the counting that follows reads every token of the result through
    memory maps, which would add the whole output to RSS; it is the benchmark's check, not the tokenize step):
    the parent stops its clock and its memory peaks here, and takes the CPU time written here (this process
    and the children it has waited for: datasets' workers, the tokenizer's child)."""
    import resource

    cpu = sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                resource.getrusage(resource.RUSAGE_CHILDREN)))
    (work / "tokenized.tmp").write_text(json.dumps({"cpu_seconds": cpu}))
    (work / "tokenized.tmp").rename(work / "tokenized.json")


def _truncated(ids: list[int], labels: list[int], max_length: int, out: dict) -> None:
    ids, labels = ids[:max_length], labels[:max_length]
    if any(label != -100 for label in labels[1:]):
        out["input_ids"].append(ids)
        out["labels"].append(labels)


def _reference_alpaca(batch: dict, tokenizer, max_length: int) -> dict:
    from finetune.data.formats import ALPACA_PROMPT, ALPACA_PROMPT_WITH_INPUT

    prompts = [ALPACA_PROMPT_WITH_INPUT.format(instruction=i, input=x) if x else ALPACA_PROMPT.format(instruction=i)
               for i, x in zip(batch["instruction"], batch["input"])]
    prompt_ids = tokenizer(prompts)["input_ids"]
    response_ids = tokenizer(batch["output"], add_special_tokens=False)["input_ids"]
    out: dict = {"input_ids": [], "labels": []}
    for p, r in zip(prompt_ids, response_ids):
        r = r + [tokenizer.eos_token_id]
        _truncated(p + r, [-100] * len(p) + r, max_length, out)
    return out


def _reference_sharegpt(batch: dict, tokenizer, max_length: int) -> dict:
    roles = {"human": "user", "gpt": "assistant"}
    texts, spans = [], []
    for conversation in batch["conversations"]:
        messages = [{"role": roles[t["from"]], "content": t["value"]} for t in conversation]
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        turns = []
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
                turns.append((len(before), len(tokenizer.apply_chat_template(messages[:i + 1], tokenize=False))))
        texts.append(text)
        spans.append(turns)
    encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    out: dict = {"input_ids": [], "labels": []}
    for ids, offsets, turns in zip(encoded["input_ids"], encoded["offset_mapping"], spans):
        labels = [t if any(s < e_ and e > s_ for s_, e_ in turns) else -100 for t, (s, e) in zip(ids, offsets)]
        _truncated(ids, labels, max_length, out)
    return out


def _counts(dataset) -> dict:
    import pyarrow.compute as pc

    table = dataset.with_format("arrow")
    tokens = trained = 0
    for start in range(0, len(dataset), 65536):
        part = table[start:start + 65536]
        tokens += int(pc.sum(pc.list_value_length(part["input_ids"])).as_py() or 0)
        trained += int(pc.sum(pc.not_equal(pc.list_flatten(part["labels"]), -100)).as_py() or 0)
    return {"sequences": len(dataset), "tokens": tokens, "trained_tokens": trained}


def worker(args: argparse.Namespace) -> None:
    if args.worker == "finetune":
        # As `finetune prepare` loads it: AutoTokenizer in a short child process, so no torch here (nor in the
        # workers forked from here). The reference loads it the usual way, which imports torch.
        from finetune.tokenizer import load_without_torch

        tokenizer = load_without_torch({"source": args.tokenizer})
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    run = run_finetune if args.worker == "finetune" else run_reference
    started = time.perf_counter()
    counts = run(Path(args.data), args.format, tokenizer, args.max_length, args.num_proc, Path(args.work))
    print(json.dumps({**counts, "inner_seconds": time.perf_counter() - started, "torch": "torch" in sys.modules}))


# ------------------------------------------------------------------------------------------------
# The parent: one fresh process per side, its tree's RSS sampled


def measure(side: str, data: Path, fmt: str, tokenizer: Path, max_length: int, num_proc: int, work: Path) -> dict:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = {**os.environ, "HF_DATASETS_CACHE": str(work / "hf-datasets"), "PYTHONPATH": str(REPO),
           "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false"}
    argv = [sys.executable, __file__, "--worker", side, "--data", str(data), "--format", fmt, "--tokenizer",
            str(tokenizer), "--max-length", str(max_length), "--num-proc", str(num_proc), "--work", str(work)]
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO)
    watched = watch(child, work / "tokenized.json")
    out, err = child.communicate()
    if child.returncode != 0:
        raise SystemExit(f"{side} failed:\n{err.decode()[-3000:]}")
    shutil.rmtree(work, ignore_errors=True)
    return {**json.loads(out.decode().strip().splitlines()[-1]), **watched, "load": os.getloadavg()[0]}


def watch(child, marker: Optional[Path] = None) -> dict:
    """Wall and CPU seconds of a started process and its descendants, and the peaks of their summed RSS, PSS
    and anonymous PSS, sampled every 50 ms (finetune.data.peak) until it ends or writes `marker` (the metric of
    the module docstring; the marker holds the CPU seconds at that point)."""
    import resource

    from finetune.data.peak import PeakMemory

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    marked = None
    with PeakMemory(child.pid, ("rss", "pss", "pss_anon"), interval=0.05) as peak:
        while child.poll() is None and marked is None:
            if marker is not None and marker.exists():
                marked = time.perf_counter() - started
            else:
                time.sleep(0.05)
    child.wait()
    seconds = time.perf_counter() - started
    # The child and the descendants it waited for (each process's CPU time reaches its parent's RUSAGE_CHILDREN
    # when it is waited for; datasets' pool workers and our tokenizer child are).
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if marked is not None:
        seconds, cpu = marked, json.loads(marker.read_text())["cpu_seconds"]
    return {"seconds": seconds, "cpu_seconds": cpu, "peak_rss": peak.peaks["rss"] or 0,
            "peak_pss": peak.peaks["pss"] or 0, "peak_anon": peak.peaks["pss_anon"] or 0}


def measure_command(command: list[str]) -> None:
    """`--measure -- CMD...`: run CMD and print the same numbers for it (e.g. `finetune prepare RECIPE`)."""
    child = subprocess.Popen(command)
    watched = watch(child)
    print(f"exit {child.returncode}: {watched['seconds']:.1f} s, CPU {watched['cpu_seconds']:.1f} s, peak RSS "
          f"{watched['peak_rss'] / 2**30:.2f} GB, peak PSS {watched['peak_pss'] / 2**30:.2f} GB, anon PSS "
          f"{watched['peak_anon'] / 2**30:.2f} GB (load average {' '.join(f'{x:.1f}' for x in os.getloadavg())})")
    raise SystemExit(child.returncode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--format", choices=["alpaca", "sharegpt", "both"], default="both")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--num-proc", type=int, default=None, help="default: the cores this process may use")
    parser.add_argument("--sides", default="reference,finetune", help="which to run (finetune alone: the memory at 1M rows)")
    parser.add_argument("--keep", type=Path, default=None, help="write the generated data here and keep it")
    parser.add_argument("--measure", nargs=argparse.REMAINDER, help="measure this command instead (after --)")
    parser.add_argument("--worker", choices=["finetune", "reference"], help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.measure:
        measure_command(args.measure[1:] if args.measure[0] == "--" else args.measure)
    from finetune.builtin import ensure_builtin_model
    from finetune.data.prepare import resolve_num_proc

    num_proc = args.num_proc or resolve_num_proc("auto")
    folder = args.keep or Path(tempfile.mkdtemp(prefix="bench-tokenize-"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        tokenizer = ensure_builtin_model("builtin:tiny-llama", folder / "models")
        formats = ["alpaca", "sharegpt"] if args.format == "both" else [args.format]
        print(f"{args.rows} rows per format, max_length {args.max_length}, num_proc {num_proc}, built-in tokenizer")
        print(f"{'format':9} {'side':10} {'seconds':>8} {'CPU s':>8} {'peak RSS':>10} {'peak PSS':>10} {'anon PSS':>10} "
              f"{'sequences':>10} {'tokens':>12} {'trained':>12}")
        for fmt in formats:
            data = folder / f"{fmt}.jsonl"
            if not data.exists():
                write_rows(data, fmt, args.rows)
            results = {side: measure(side, data, fmt, tokenizer, args.max_length, num_proc, folder / f"work-{side}")
                       for side in args.sides.split(",")}
            for side, r in results.items():
                print(f"{fmt:9} {side:10} {r['seconds']:8.1f} {r['cpu_seconds']:8.1f} {r['peak_rss'] / 2**30:7.2f} GB "
                      f"{r['peak_pss'] / 2**30:7.2f} GB {r['peak_anon'] / 2**30:7.2f} GB {r['sequences']:10} {r['tokens']:12} "
                      f"{r['trained_tokens']:12}  load {r['load']:.1f}{'' if side == 'reference' or not r.get('torch') else '  TORCH IMPORTED'}",
                      flush=True)
            if len(results) < 2:
                continue
            ours, ref = results["finetune"], results["reference"]
            same = all(ours[k] == ref[k] for k in ("sequences", "tokens", "trained_tokens"))
            print(f"{fmt:9} {'ratio':10} {ours['seconds'] / ref['seconds']:8.2f} {ours['cpu_seconds'] / ref['cpu_seconds']:8.2f} "
                  f"{ours['peak_rss'] / ref['peak_rss']:9.2f}x {ours['peak_pss'] / ref['peak_pss']:9.2f}x "
                  f"{ours['peak_anon'] / ref['peak_anon']:9.2f}x "
                  f"{'same sequences, tokens and trained tokens' if same else 'COUNTS DIFFER'}", flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
