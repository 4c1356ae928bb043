"""Time the full-row validation `finetune train` runs before launch on a ~1 GB JSON lines file.

    python scripts/bench_validate.py                    # 1 GiB of alpaca rows in /tmp, then removed
    python scripts/bench_validate.py --size 256MiB --format sharegpt --no-datasets

Writes a generated file (alpaca or ShareGPT rows of a few hundred bytes), then times:
- finetune.data.validate.validate on the clean file (the bulk pyarrow pass proves it clean), and the part of
  it that finds rows nested too deep for pyarrow, against the newline count it replaced,
- the same after one bad row is appended at the end: the bulk pass proves every range of lines clean
  but the last, and the row-by-row pass (orjson, as shipped; then the json module, the fallback) reads
  that range to name the line (--range sets the range size, finetune.data.fastcheck.RANGE),
- a copy with one bad row in the middle instead: the row-by-row pass reads one whole range there,
- datasets.load_dataset("json", ...) into a fresh cache: what a user would otherwise run to find out
  whether the file loads (it stops at the first bad row, with no line number).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

from finetune.recipe import parse_size

WORDS = ("the cat sat on a mat while rain fell over river stone bread milk book door cloud snow "
         "green blue red tree apple moon star sun bird dog").split()


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


def row(rng: random.Random, fmt: str) -> dict:
    if fmt == "alpaca":
        return {"instruction": sentence(rng, rng.randint(5, 30)), "input": "", "output": sentence(rng, rng.randint(10, 60))}
    turns = []
    for _ in range(rng.randint(1, 3)):
        turns += [{"from": "human", "value": sentence(rng, rng.randint(5, 30))},
                  {"from": "gpt", "value": sentence(rng, rng.randint(10, 60))}]
    return {"conversations": turns}


BAD_ROW = {"alpaca": '{"instruction": "a bad row near the end", "input": ""}\n',
           "sharegpt": '{"conversations": [{"from": "human", "value": "no answer"}]}\n'}


def write(path: Path, size: int, fmt: str) -> int:
    rng = random.Random(0)
    block = [json.dumps(row(rng, fmt)) + "\n" for _ in range(5000)]  # repeated: writing stays fast
    lines = written = 0
    with path.open("w", encoding="utf-8") as handle:
        while written < size:
            for line in block:
                handle.write(line)
                written += len(line)
                lines += 1
    return lines


def with_bad_row_in_the_middle(path: Path, bad: str) -> Path:
    """A copy of `path` with `bad` after the line that holds its middle byte."""
    copy = path.with_name("middle.jsonl")
    with path.open("rb") as source, copy.open("wb") as target:
        target.write(source.read(path.stat().st_size // 2) + source.readline() + bad.encode())
        shutil.copyfileobj(source, target, 2**24)
    return copy


def time_validate(path: Path, fmt: str, use_orjson: bool) -> tuple[str, list[str], int]:
    """(wall and CPU seconds, the problems found, rows read): CPU seconds vary less on a shared box."""
    import finetune.data.validate as v
    from finetune.data.formats import RowSpec
    from finetune.data.sources import Source

    saved = v._loads, v._JSONError
    if not use_orjson:
        v._loads, v._JSONError = json.loads, (json.JSONDecodeError, UnicodeDecodeError)
    try:
        start, cpu = time.perf_counter(), time.process_time()
        result = v.validate([Source(str(path), "train", RowSpec(fmt))])
        wall = time.perf_counter() - start
        mb = path.stat().st_size / 1e6
        timing = f"{wall:.1f} s, {time.process_time() - cpu:.1f} s CPU ({mb / wall:,.0f} MB/s"
        return timing, result.messages(), result.checks[0].rows
    finally:
        v._loads, v._JSONError = saved


def time_depth_scan(path: Path) -> str:
    """CPU seconds of fastcheck's pass over every range (newlines and brackets: rows nested too deep never reach
    pyarrow) against the newline count it replaced, same ranges, alternating (CPU time: a shared box's load)."""
    from finetune.data.fastcheck import RANGE, _scan

    scan = count = 0.0
    with path.open("rb") as handle:
        while data := handle.read(RANGE):
            start = time.process_time()
            data.count(b"\n")
            count += time.process_time() - start
            start = time.process_time()
            _scan(data, 1)
            scan += time.process_time() - start
    return f"{scan:.2f} s CPU, where counting the newlines alone took {count:.2f} s"


def time_datasets(path: Path) -> tuple[float, str]:
    import datasets

    datasets.disable_progress_bars()
    cache = tempfile.mkdtemp(prefix="bench-validate-cache-")
    start = time.perf_counter()
    try:
        loaded = datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=cache)
        outcome = f"loaded {len(loaded)} rows"
    except Exception as exc:  # noqa: BLE001 - what it says is the point of the comparison
        outcome = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:150]}"
    finally:
        elapsed = time.perf_counter() - start
        shutil.rmtree(cache, ignore_errors=True)
    return elapsed, outcome


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GiB", help="file size, e.g. 1GiB or 256MiB")
    parser.add_argument("--format", choices=["alpaca", "sharegpt"], default="alpaca")
    parser.add_argument("--no-datasets", action="store_true", help="skip the datasets.load_dataset comparison")
    parser.add_argument("--no-json", action="store_true", help="skip the json-module fallback")
    parser.add_argument("--range", default=None, help="bytes per range of the bulk pass, e.g. 4MiB (default: as shipped)")
    args = parser.parse_args()
    if args.range:
        from finetune.data import fastcheck

        fastcheck.RANGE = parse_size(args.range)
    folder = Path(tempfile.mkdtemp(prefix="bench-validate-"))
    try:
        path = folder / "data.jsonl"
        start = time.perf_counter()
        lines = write(path, parse_size(args.size), args.format)
        mb = path.stat().st_size / 1e6
        print(f"wrote {path}: {mb:,.0f} MB, {lines:,} rows ({args.format}) in {time.perf_counter() - start:.1f} s")
        seconds, problems, rows = time_validate(path, args.format, True)
        print(f"finetune validate, clean file (bulk pass): {seconds}, {rows:,} rows); found: {problems}")
        print(f"the depth scan (rows nested deeper than 64 levels never reach pyarrow): {time_depth_scan(path)}")
        if not args.no_datasets:
            seconds, outcome = time_datasets(path)
            print(f"datasets.load_dataset('json'), clean file: {seconds:.1f} s ({mb / seconds:,.0f} MB/s); {outcome}")
        middle = with_bad_row_in_the_middle(path, BAD_ROW[args.format])
        seconds, problems, rows = time_validate(middle, args.format, True)
        print(f"bad row in the middle (bulk pass, then row by row with orjson): {seconds}, {rows:,} rows); found: {problems}")
        middle.unlink()
        with path.open("a", encoding="utf-8") as handle:
            handle.write(BAD_ROW[args.format])
        runs = [("bad last row (bulk pass, then row by row with orjson)", True)]
        runs += [] if args.no_json else [("bad last row (bulk pass, then row by row with the json module)", False)]
        for label, use_orjson in runs:
            seconds, problems, rows = time_validate(path, args.format, use_orjson)
            print(f"{label}: {seconds}, {rows:,} rows); found: {problems}")
        if not args.no_datasets:
            seconds, outcome = time_datasets(path)
            print(f"datasets.load_dataset('json'), bad last row: {seconds:.1f} s ({mb / seconds:,.0f} MB/s); {outcome}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
