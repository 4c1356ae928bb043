"""What checking a tokenized cache entry costs (finetune.data.cache_entry), against tokenizing it.

    python scripts/bench_cache_check.py                      # 1,000,000 alpaca rows, max_length 512
    python scripts/bench_cache_check.py --rows 200000 --num-proc 2

Generates the rows (scripts/bench_tokenize.py's generator), runs finetune.data.prepare.prepare once (which
tokenizes and writes the entry, its digests included), then times, in this process:
- seal: the digests of every file, as prepare computes them before the manifest is written;
- check (page cache warm): what the launcher and `finetune prepare` do on a cache hit;
- check (page cache dropped for the entry's files, posix_fadvise DONTNEED): a hit on a cold cache;
- sizes: what each rank does before it maps the files.
Prints the entry's size, each time, and the check as a fraction of the tokenizing time.

Not run by the tests: it only times finetune.data.cache_entry on a large entry (minutes of tokenizing); what
the check does is tested on the demo's entry by tests/data/test_prepare.py::test_a_damaged_cache_entry_is_set_aside_and_made_again.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))


def drop_page_cache(folder: Path) -> None:
    for path in folder.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--num-proc", type=int, default=None)
    parser.add_argument("--work", type=Path, default=None, help="Folder for the rows and the cache (default: a temporary one).")
    args = parser.parse_args()

    from bench_tokenize import write_rows

    from finetune.builtin import ensure_builtin_model
    from finetune.data import cache_entry
    from finetune.data.prepare import MANIFEST, prepare
    from finetune.data.spec import DataSpec
    from finetune.tokenizer import load_without_torch

    work = args.work or Path(tempfile.mkdtemp(prefix="bench-cache-check-"))
    rows = work / "rows.jsonl"
    if not rows.exists():
        write_rows(rows, "alpaca", args.rows)
    tokenizer = load_without_torch({"source": str(ensure_builtin_model("builtin:tiny-llama"))})
    section = DataSpec.from_section({"path": str(rows), "format": "alpaca", "max_length": args.max_length,
                                     "mask_prompt": True})
    started = time.perf_counter()
    done = prepare(section, tokenizer, work / "cache", log=lambda line: None, num_proc=args.num_proc)
    tokenize_s = time.perf_counter() - started if not done.cached else float("nan")
    target = done.path
    manifest = json.loads((target / MANIFEST).read_text())
    names = list(manifest["sizes"])
    size = sum(manifest["sizes"].values())
    seal_s = timed(lambda: cache_entry.seal(target, names))
    warm_s = timed(lambda: cache_entry._problem(target, MANIFEST, digests=True))
    drop_page_cache(target)
    cold_s = timed(lambda: cache_entry._problem(target, MANIFEST, digests=True))
    sizes_s = timed(lambda: cache_entry._problem(target, MANIFEST, digests=False))
    print(json.dumps({"rows": args.rows, "entry_bytes": size, "files": len(names), "tokenize_s": round(tokenize_s, 2),
                      "seal_s": round(seal_s, 3), "check_warm_s": round(warm_s, 3), "check_cold_s": round(cold_s, 3),
                      "sizes_only_s": round(sizes_s, 5),
                      "check_warm_over_tokenize": round(warm_s / tokenize_s, 4) if tokenize_s == tokenize_s else None,
                      "GiB_per_s_warm": round(size / 2**30 / warm_s, 2)}, indent=1))


if __name__ == "__main__":
    main()
