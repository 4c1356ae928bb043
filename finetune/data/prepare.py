"""The tokenized training set, prepared once before any rank starts: every core, flat memory, atomic cache.

`prepare(spec, tokenizer, cache_dir)` (spec: finetune.data.spec.DataSpec) is what `finetune prepare` and `finetune train` (in the launcher,
before torchrun spawns anything) run; the ranks only `load_prepared` the finished cache, memory-mapped.
No tokenizing happens inside a process group, so no collective timeout can cut it short.

1. Each source is read by datasets (local files become memory-mapped Arrow; finetune.data.tokenize.load_raw)
   and tokenized by a batched `Dataset.map(num_proc=data.num_proc)`: each worker converts its rows with their
   format and calls the fast tokenizer once per batch (finetune.data.tokenize.encode_rows), and the rows go
   to Arrow files a batch at a time. Token ids are stored as int32.
2. Dropped rows (nothing left to train after truncation) are counted from the `row` column each sequence
   carries (the index of the row it came from), not from a list.
3. Mixing (finetune.data.mix) picks (source, example) pairs as numpy arrays and selects them from the
   concatenated sources: an index mapping, not copies.
4. Packing computes the block boundaries from the lengths (numpy), then builds the blocks from Arrow columns
   (finetune.data.packing.pack_table), in parallel batches of blocks.
5. The result is saved into a temporary folder beside the cache entry and renamed into place when complete
   (a killed prepare leaves only `.KEY.*.partial`, which no later run takes for a cache, and which the next
   prepare removes when its owner is gone).

The cache entry is keyed by DataSpec.cache_key: a hash of the data section (not num_proc: same rows on any core
count), the source files' identity and the tokenizer; mix.json beside the rows holds the per-source report.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

from finetune.data import cache_entry
from finetune.data.formats import RowSpec
from finetune.data.mix import MixError, mixture_arrays, targets
from finetune.data.peak import PeakMemory
from finetune.data.sources import Source, data_files, is_local
from finetune.data.spec import DataSpec
from finetune.data.packing import pack_starts, pack_table
from finetune.data.tokenize import DataError, RowError, encode_rows, load_raw
from finetune.data.vision_encode import image_column, undecoded  # registers the rows with images too
from finetune.fsutil import OWNER_FILE, remove_stale_partials

MIX_REPORT = "mix.json"
# The Arrow files of a cache entry, in order, the mixture's order over them (a .npy of row numbers) and the
# columns to drop on loading: the files are those the workers wrote, never copied.
MANIFEST = "manifest.json"
# A worker process costs a fork and a pickled tokenizer: below this many rows per worker, fewer workers.
MIN_ROWS_PER_PROC = 2000
BATCH = 1000  # rows per tokenizer call and per Arrow write: what bounds a worker's memory
CHUNK_ROWS = 100_000  # rows per map over the workers (at least; a source is cut in at most 20): a progress line each


def resolve_num_proc(value: Union[str, int, None]) -> int:
    """data.num_proc: `auto` (or unset) is the cores this process may run on."""
    if value in (None, "auto"):
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except AttributeError:  # not Linux
            return max(1, os.cpu_count() or 1)
    return max(1, int(value))


@dataclass
class SourceReport:
    """One source's line of the mixture report."""
    path: str
    format: str
    rows: int  # read from the source
    dropped: int  # examples truncation left with nothing to train
    examples: int  # tokenized sequences after dropping (a text document may give several)
    mixed: int  # sequences of this source in the training set
    how: str

    def line(self, max_length: int) -> str:
        drop = f", {self.dropped} dropped (nothing left to train within max_length {max_length})" if self.dropped else ""
        return (f"data: {self.path} ({self.format}): {self.rows} rows -> {self.examples} examples{drop}; "
                f"{self.mixed} in the mixture ({self.how})")


@dataclass
class Prepared:
    """Where the tokenized rows are, and what it took (the start-up split in summary.json reads it)."""
    path: Path
    cached: bool  # found, not made
    seconds: float
    rows: int  # rows read from the sources (0 on a cache hit)
    num_proc: int
    peak_rss: Optional[int] = None  # bytes, summed over the process and its workers (finetune.data.peak)

    def as_dict(self) -> dict[str, Any]:
        return {"cache": str(self.path), "cached": self.cached, "seconds": round(self.seconds, 3),
                "rows": self.rows, "num_proc": self.num_proc, "peak_rss": self.peak_rss}

    @classmethod
    def from_dict(cls, item: dict[str, Any]) -> "Prepared":
        return cls(Path(item["cache"]), item["cached"], item["seconds"], item["rows"], item["num_proc"],
                   item.get("peak_rss"))


def entry(spec: DataSpec, tokenizer, cache_dir: Path) -> Path:
    return Path(cache_dir) / spec.cache_key(tokenizer)


def is_prepared(target: Path) -> bool:
    return (target / MANIFEST).is_file() and (target / MIX_REPORT).is_file()


def prepare(spec: DataSpec, tokenizer, cache_dir: Path, log: Callable[[str], None] = print,
            num_proc: Union[str, int, None] = None) -> Prepared:
    """Tokenize the rows `spec` names into the cache, or find them there."""
    started = time.perf_counter()
    target = entry(spec, tokenizer, cache_dir)
    max_length = spec.max_length
    procs = resolve_num_proc(num_proc if num_proc is not None else spec.num_proc)
    if is_prepared(target):
        damaged = cache_entry.problem(target, MANIFEST)
        if damaged is None:
            log(f"tokenized data: found in the cache {target} (made earlier, or by another node on a shared file system)")
            for report in read_reports(target):
                log(report.line(max_length))
            return Prepared(target, True, time.perf_counter() - started, 0, procs)
        aside = cache_entry.set_aside(target, MANIFEST, cache_entry.identity(target, MANIFEST))
        log(f"tokenized data: the cache entry {target} is damaged ({damaged}); set aside as {aside.name}, tokenizing again")
    for line in remove_stale_partials(target):
        log(line)
    from finetune.parentdeath import forks_die_with_parent

    forks_die_with_parent()  # the tokenizing workers go when this process does (kill -9)
    import datasets

    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # per-chunk bars; our own progress lines say how far it is (_Progress)
    try:
        with PeakMemory() as peak, _partial_dir(target) as tmp:
            dataset, reports, rows_read, order = _build(spec, tokenizer, tmp, procs, log)
            files = [Path(f["filename"]) for f in dataset.cache_files]
            if order is not None:
                import numpy as np

                np.save(tmp / "order.npy", order)
            lengths = _lengths(dataset)
            sequences, tokens = (len(order), int(lengths[order].sum())) if order is not None else \
                (len(dataset), int(lengths.sum()))
            del dataset
            for stale in set(tmp.glob("*.arrow")) - set(files):  # the sources' rows, once packed
                stale.unlink()
            (tmp / MIX_REPORT).write_text(json.dumps([asdict(r) for r in reports], indent=2), encoding="utf-8")
            names = [f.name for f in files] + (["order.npy"] if order is not None else []) + [MIX_REPORT]
            manifest = {"files": [f.name for f in files], "order": "order.npy" if order is not None else None,
                        "drop": ["row"], **cache_entry.seal(tmp, names)}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")  # last: complete
    finally:
        if bars:
            datasets.enable_progress_bars()
    seconds = time.perf_counter() - started
    for report in reports:
        log(report.line(max_length))
    memory = f", peak RSS {peak.bytes / 2**30:.2f} GB summed over the processes" if peak.bytes else ""
    log(f"tokenized data: {rows_read} rows -> {sequences} {'packed ' if spec.packing else ''}"
        f"sequences, {tokens} tokens in {seconds:.1f} s ({rows_read / max(seconds, 1e-9):.0f} rows/s, up to {procs} "
        f"process{'es' if procs != 1 else ''}{memory}) -> {target}")
    return Prepared(target, False, seconds, rows_read, procs, peak.bytes)


def load_prepared(spec: DataSpec, tokenizer, cache_dir: Path):
    """The prepared rows, memory-mapped (what each rank does: it never tokenizes)."""
    import datasets

    target = entry(spec, tokenizer, cache_dir)
    if not is_prepared(target):
        raise DataError(f"the tokenized data is not in the cache {target}: `finetune train` prepares it before "
                        f"launching (or run `finetune prepare RECIPE`) with the same FINETUNE_CACHE")
    damaged = cache_entry.problem(target, MANIFEST, digests=False)  # the launcher has just read the bytes
    if damaged:
        raise DataError(f"the tokenized data in the cache {target} is damaged ({damaged}): run the same command "
                        "again (the launcher checks the entry, sets it aside and tokenizes again)")
    manifest = json.loads((target / MANIFEST).read_text(encoding="utf-8"))
    parts = [datasets.Dataset.from_file(str(target / name)) for name in manifest["files"]]
    dataset = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    if manifest.get("order"):
        import numpy as np

        # In memory (8 bytes a row): no indices file written into the cache by every rank.
        dataset = dataset.select(np.load(target / manifest["order"]), keep_in_memory=True)
    return dataset.remove_columns([c for c in manifest.get("drop", []) if c in dataset.column_names])


def tokenize_for_training(spec: DataSpec, tokenizer, cache_dir: Path, log: Callable[[str], None] = print,
                          num_proc: Union[str, int, None] = None):
    """prepare + load_prepared in one process (finetune eval, tests)."""
    prepare(spec, tokenizer, cache_dir, log, num_proc)
    return load_prepared(spec, tokenizer, cache_dir)


def mix_report(spec: DataSpec, tokenizer, cache_dir: Path) -> list[dict[str, Any]]:
    """The per-source report of the cached tokenization of `spec`."""
    return [asdict(r) for r in read_reports(entry(spec, tokenizer, cache_dir))]


def read_reports(target: Path) -> list[SourceReport]:
    try:
        return [SourceReport(**item) for item in json.loads((target / MIX_REPORT).read_text(encoding="utf-8"))]
    except (OSError, ValueError, TypeError):
        return []


@contextmanager
def _partial_dir(target: Path) -> Iterator[Path]:
    """A `.KEY.*.partial` folder beside `target`, renamed to `target` when the block ends without error and
    removed otherwise. An entry already complete (another node on a shared file system was faster, with
    the same rows) is kept as it is: ranks may be reading it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.{os.getpid()}.", suffix=".partial", dir=target.parent))
    try:
        (tmp / OWNER_FILE).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
        yield tmp
        (tmp / OWNER_FILE).unlink()
        if target.exists() and not is_prepared(target):
            shutil.rmtree(target)  # an entry from before mix.json was written last: incomplete
        try:
            os.rename(tmp, target)
        except OSError:
            if not is_prepared(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------------------------------
# Building


def _features(images: bool = False):
    import datasets

    ids = datasets.Sequence(datasets.Value("int32"))
    columns = {"input_ids": ids, "labels": ids, "row": datasets.Value("int64")}
    if images:  # a VLM's rows: each sequence's images as datasets' Image storage (finetune.data.images)
        columns["images"] = datasets.List({"bytes": datasets.Value("binary"), "path": datasets.Value("string")})
    return datasets.Features(columns)


def _build(spec: DataSpec, tokenizer, folder: Path, procs: int, log: Callable[[str], None]):
    """(dataset, reports, rows read, order or None): the sequences, written as Arrow files into `folder`; a
    mixture's order (rows of the concatenated sources, numpy) is applied on loading, packing applies it here."""
    sources = spec.read_sources()
    max_length = spec.max_length
    per_source, reports, rows_read = [], [], 0
    for number, source in enumerate(sources):
        raw = undecoded(load_raw(source.path, source.split), source.spec)  # a VLM's images: bytes, not PIL images
        rows_read += len(raw)
        tokenized = _tokenize_source(raw, source, spec, tokenizer, folder / f"source-{number}", procs, log)
        report = SourceReport(source.path, source.format, len(raw), len(raw) - _rows_kept(tokenized),
                              len(tokenized), len(tokenized), "all")
        per_source.append(tokenized)
        reports.append(report)
    combined, order = _mix(sources, per_source, reports, spec.seed)
    if (len(order) if order is not None else len(combined)) == 0:
        raise DataError(f"{', '.join(s.path for s in sources)}: no example has a trainable token after truncation "
                        f"to max_length {max_length}")
    if spec.packing and spec.vision:
        raise DataError("data.packing: a vision-language model's rows carry images, which packing would separate "
                        "from their tokens; set data.packing: false (lint R170)")
    if spec.packing:
        mixed = combined.select(order, keep_in_memory=True) if order is not None else combined
        return _pack(mixed.remove_columns("row"), max_length, folder / "packed.arrow", procs), reports, rows_read, None
    return combined, reports, rows_read, order


def _tokenize_source(raw, source: Source, spec: DataSpec, tokenizer, stem: Path, procs: int,
                     log: Callable[[str], None]):
    """The sequences of one source, tokenized in chunks of rows (a progress line after each), each chunk
    by a batched map over `procs` processes."""
    import datasets

    requested, procs = procs, max(1, min(procs, len(raw) // MIN_ROWS_PER_PROC))
    if procs > 1:
        # Each worker runs the Rust tokenizer single-threaded: the cores are already the workers.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    log(f"tokenizing {source.path}: {len(raw)} rows, {procs} process{'es' if procs != 1 else ''}"
        + (f" (at least {MIN_ROWS_PER_PROC} rows each)" if procs < requested else ""))
    kwargs = {"spec": source.spec, "tokenizer": tokenizer, "max_length": spec.max_length,
              "mask_prompt": spec.mask_prompt, "think": spec.think}
    chunk = max(CHUNK_ROWS, -(-len(raw) // 20))
    progress = _Progress(len(raw), log)
    parts = []
    for first in range(0, max(len(raw), 1), chunk):
        rows = raw.select(range(first, min(first + chunk, len(raw))))  # a contiguous range: a slice, no copy
        name = stem.parent / f"{stem.name}-{first}.arrow"  # map's workers add _0000k_of_0000n
        try:
            parts.append(rows.map(_encode_batch, batched=True, batch_size=BATCH, with_indices=True,
                                  fn_kwargs={**kwargs, "offset": first}, remove_columns=raw.column_names,
                                  features=_features(source.spec.images is not None), num_proc=procs if procs > 1 and len(rows) >= 2 * BATCH else None,
                                  cache_file_name=str(name), writer_batch_size=BATCH, load_from_cache_file=False,
                                  new_fingerprint=f"finetune-tokenize-{name.stem}"))
        except RowError as exc:
            raise DataError(f"{where(source, exc.index)}: {_problem(exc)}") from None
        progress.done(first + len(rows))
    return datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]


class _Progress:
    """`tokenizing: done/total rows` lines at the progress interval (the live display asks for 1 s, logs get
    15 s), with the rate and the time left; finetune.run.progress shows them as the status text."""

    def __init__(self, total: int, log: Callable[[str], None]):
        from finetune.progress_env import progress_interval

        self.total, self.log = total, log
        self.interval = progress_interval()
        self.started = self.last = time.monotonic()

    def done(self, rows: int) -> None:
        now = time.monotonic()
        if rows >= self.total or now - self.last < self.interval:
            return
        self.last = now
        rate = rows / max(now - self.started, 1e-9)
        self.log(f"tokenizing: {rows}/{self.total} rows ({rate:.0f} rows/s, about {(self.total - rows) / rate:.0f} s left)")


def _encode_batch(batch: dict[str, list], indices: list[int], spec: RowSpec, tokenizer, max_length: int,
                  mask_prompt: bool, think: str, offset: int):
    indices = [offset + i for i in indices]
    names = list(batch)
    rows = [dict(zip(names, values)) for values in zip(*batch.values())]
    try:
        encoded = encode_rows(rows, spec, tokenizer, max_length, mask_prompt, think)
    except RowError as exc:
        raise RowError(indices[exc.index], str(exc)) from None
    return _table(encoded, indices, images=spec.images is not None)


def _table(encoded: list[list[dict[str, list[int]]]], indices: list[int], images: bool = False):
    """The sequences of a batch as an Arrow table (input_ids, labels: list<int32>; row: int64), the token lists
    flattened by numpy (fromiter, or concatenate for numpy rows): a half to a third of the time datasets' writer
    takes to convert the lists."""
    from itertools import chain

    import numpy as np
    import pyarrow as pa

    sequences = [sequence for sequences in encoded for sequence in sequences]
    rows = [index for index, sequences in zip(indices, encoded) for _ in sequences]
    lengths = np.fromiter((len(s["input_ids"]) for s in sequences), dtype=np.int64, count=len(sequences))
    offsets = np.zeros(len(sequences) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    total, offsets = int(offsets[-1]), pa.array(offsets)

    def column(name: str):
        values = [s[name] for s in sequences]
        if values and all(isinstance(v, np.ndarray) for v in values):  # chat rows: numpy already
            flat = np.concatenate(values).astype(np.int32)
        else:
            flat = np.fromiter(chain.from_iterable(values), dtype=np.int32, count=total)
        return pa.ListArray.from_arrays(offsets, pa.array(flat))

    table = {"input_ids": column("input_ids"), "labels": column("labels"), "row": pa.array(rows, type=pa.int64())}
    if images:
        table["images"] = image_column(sequences)
    return pa.table(table)


def _problem(exc: RowError) -> str:
    """The message of a RowError without encode_rows' `example N: ` (the caller names file and line)."""
    text = str(exc)
    return text.split(": ", 1)[1] if text.startswith("example ") and ": " in text else text


def where(source: Source, index: int) -> str:
    """`file:line` (JSON lines, CSV) or `file: row N` of the row at 0-based `index` of a local source, as
    finetune.data.validate names it; `source: row N` for a hub dataset."""
    from finetune.data.validate import iter_rows

    local = Path(source.path).expanduser()
    if is_local(source.path) and local.exists():
        try:
            seen = 0
            for path in data_files(local, source.split) if local.is_dir() else [local]:
                for place, _row in iter_rows(path):
                    if seen == index:
                        return place
                    seen += 1
        except Exception:  # noqa: BLE001 - the position is a courtesy; the problem is the message
            pass
    return f"{source.path}: row {index + 1}"


def _rows_kept(tokenized) -> int:
    """How many source rows gave at least one sequence (`row` is non-decreasing: map keeps the order)."""
    import numpy as np

    if len(tokenized) == 0:
        return 0
    rows = tokenized.data.column("row").to_numpy()
    return int(np.count_nonzero(np.diff(rows)) + 1)


def _mix(sources: list[Source], per_source: list, reports: list[SourceReport], seed: int):
    """(the sources' rows end to end, the training order over them or None). One source without weight or
    samples keeps its order (the Trainer shuffles)."""
    import datasets
    import numpy as np

    combined = datasets.concatenate_datasets(per_source) if len(per_source) > 1 else per_source[0]
    if len(sources) == 1 and sources[0].weight is None and sources[0].samples is None:
        return combined, None
    try:
        shares = targets([len(rows) for rows in per_source], [s.weight for s in sources],
                         [s.samples for s in sources], [s.path for s in sources])
    except MixError as exc:
        raise DataError(str(exc)) from None
    for report, share in zip(reports, shares):
        report.mixed, report.how = share.target, share.describe()
    source_of, index_of = mixture_arrays(shares, seed)
    offsets = np.concatenate([[0], np.cumsum([len(rows) for rows in per_source])]).astype(np.int64)
    return combined, offsets[source_of] + index_of


def _pack(mixed, max_length: int, cache_file: Path, procs: int):
    """Blocks of the mixed rows, made in parallel batches of blocks from Arrow columns."""
    import datasets

    starts = pack_starts(_lengths(mixed), max_length)
    blocks = datasets.Dataset.from_dict({"start": starts[:-1], "end": starts[1:]})
    procs = max(1, min(procs, len(blocks) // MIN_ROWS_PER_PROC))
    ids = datasets.Sequence(datasets.Value("int32"))
    return blocks.map(_pack_batch, batched=True, batch_size=BATCH, fn_kwargs={"mixed": mixed},
                      remove_columns=["start", "end"], num_proc=procs if procs > 1 else None,
                      features=datasets.Features({"input_ids": ids, "labels": ids, "position_ids": ids}),
                      cache_file_name=str(cache_file), writer_batch_size=BATCH, load_from_cache_file=False,
                      new_fingerprint=f"finetune-pack-{cache_file.stem}", desc="packing")


def _lengths(mixed):
    """Sequence lengths of `mixed` in its (selected) order, read a batch at a time."""
    import numpy as np
    import pyarrow.compute as pc

    arrow = mixed.with_format("arrow")
    parts = [pc.list_value_length(arrow[i:i + 65536]["input_ids"]).to_numpy()
             for i in range(0, len(mixed), 65536)]
    return np.concatenate(parts).astype(np.int64)


def _pack_batch(batch: dict[str, list], mixed) -> Any:
    import numpy as np

    first, last = batch["start"][0], batch["end"][-1]
    rows = mixed.with_format("arrow")[first:last]
    table = pack_table(rows, np.append(np.asarray(batch["start"]) - first, last - first))
    return table
