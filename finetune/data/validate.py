"""Every row of every local source, checked before launch: file and line of each problem, all at once.

`validate(sources)` reads each local source to its end, streaming (one line, CSV record or Arrow batch
at a time, so a file larger than RAM is fine), and converts every row with its format
(finetune.data.formats.to_example: the same function tokenization uses, so what passes here does not
fail in the ranks). It reports a malformed line, bytes that are not UTF-8, a missing or wrongly-typed
column, an unknown role and a row with nothing to train on, as `file:line: problem` (1-based lines for
JSON lines and CSV, `file: row N` for JSON arrays, parquet and Arrow). The first MAX_SHOWN problems
are shown, the rest counted. A format registered with finetune.data.formats.register_format is
checked here too: its converter is the row check.

A JSON lines file is checked in bulk, in ranges of whole lines (finetune.data.fastcheck: pyarrow's JSON
reader and Arrow compute); only a range that pass cannot prove fine is read row by row, parsed with
orjson when installed (the json module otherwise), to name each problem by line (the lines of the
ranges before it counted, not parsed).
scripts/bench_validate.py measures all three.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Optional

from finetune.data.fastcheck import (
    MAX_LINE, MAX_NESTING, NESTED_TOO_DEEP, LineTooLong, bounded_lines, clean_counts, line_ranges, nested_too_deep,
)
from finetune.data import grpo as _grpo_rows  # noqa: F401 - registers GRPO's prompts
from finetune.data import preference as _trl_rows  # noqa: F401 - registers the preference objectives' rows
from finetune.data.formats import Chat, Columns, Prompted, RowProblem, Text, to_example
from finetune.data.sources import Source, SourceProblem, data_files
from finetune.recipe.references import is_local
from finetune.errors import FinetuneError

try:
    import orjson

    _loads = orjson.loads
    _JSONError: tuple[type[Exception], ...] = (orjson.JSONDecodeError,)
except ImportError:  # pragma: no cover - orjson is a dependency; the json module is the fallback
    orjson = None
    _loads = json.loads
    _JSONError = (json.JSONDecodeError, UnicodeDecodeError)

MAX_SHOWN = 20
# A source whose every row is wrong (the wrong format) is not read to its end: its first problems say why.
MAX_PER_SOURCE = 1000
ARROW_BATCH = 4096


class Unreadable(FinetuneError):
    """A problem that ends the reading of one file (bad JSON array, damaged parquet): file and position."""


@dataclass
class SourceCheck:
    source: Source
    rows: int = 0
    problems: int = 0
    stopped: bool = False  # gave up after MAX_PER_SOURCE problems
    lengths: array = field(default_factory=lambda: array("I"))  # characters per good row, for the planner
    # a VLM's rows (finetune.data.images): image tokens per good row, beside `lengths`
    image_tokens: array = field(default_factory=lambda: array("I"))

    def length_stats(self) -> Optional[dict[str, int]]:
        return length_stats(self.lengths)


# "file:12: problem" (JSON lines, CSV) or "file: row 12: problem" (arrays, parquet, Arrow).
_WHERE = re.compile(r"^(?P<file>.+?)(?P<sep>:| row )(?P<n>\d+): (?P<problem>.+)$", re.S)


@dataclass
class Validation:
    """Problems grouped by (file, text): 50 rows without a `messages` column are one line naming the rows
    (issue 24: the same message 20 times, then "21 problems" for 50 bad rows, hid the fix)."""
    checks: list[SourceCheck] = field(default_factory=list)
    groups: dict[tuple[str, str, str], list[int]] = field(default_factory=dict)  # (file, sep, problem) -> rows
    total: int = 0
    skipped: list[str] = field(default_factory=list)  # hub sources: read at launch

    @property
    def ok(self) -> bool:
        return self.total == 0

    def messages(self) -> list[str]:
        shown = list(self.groups.items())[:MAX_SHOWN]
        lines = [_grouped(file, sep, problem, rows) for (file, sep, problem), rows in shown]
        hidden = self.total - sum(max(1, len(rows)) for _, rows in shown)
        return lines + ([f"... and {hidden} more problem(s) not shown"] if hidden > 0 else [])

    def add(self, check: SourceCheck, message: str) -> None:
        check.problems += 1
        self.total += 1
        match = _WHERE.match(message)
        if match is None:
            self.groups.setdefault((message, "", ""), [])
            return
        key = (match["file"], match["sep"], match["problem"])
        if key in self.groups or len(self.groups) < MAX_SHOWN:
            self.groups.setdefault(key, []).append(int(match["n"]))


def _grouped(file: str, sep: str, problem: str, rows: list[int]) -> str:
    """One line per distinct problem of a file: `file:12: p`, or `file: lines 1-20, 31-50 (40 rows): p`."""
    if not sep:
        return file
    if len(rows) == 1:
        return f"{file}{sep}{rows[0]}: {problem}"
    spans, start = [], rows[0]
    for previous, row in zip(rows, rows[1:] + [None]):
        if row != previous + 1:
            spans.append(f"{start}-{previous}" if previous != start else str(start))
            start = row
    listed = ", ".join(spans[:5]) + (", ..." if len(spans) > 5 else "")
    return f"{file}: {'lines' if sep == ':' else 'rows'} {listed} ({len(rows)} rows): {problem}"


def validate(sources: list[Source]) -> Validation:
    result = Validation()
    for source in sources:
        if not is_local(source.path):
            result.skipped.append(source.path)
            continue
        check = SourceCheck(source)
        result.checks.append(check)
        try:
            files = data_files(Path(source.path).expanduser(), source.split)
        except SourceProblem as exc:
            result.add(check, str(exc))
            continue
        for file in files:
            if not check.stopped:
                _check_file(file, check, result)
        if check.rows == 0 and check.problems == 0:
            result.add(check, f"{source.path}: no rows")
    return result


def _check_file(path: Path, check: SourceCheck, result: Validation) -> None:
    if path.suffix == ".jsonl":
        _check_jsonl(path, check, result)
        return
    try:
        _check_rows(path, iter_rows(path), check, result)
    except Unreadable as exc:
        result.add(check, str(exc))


def _check_jsonl(path: Path, check: SourceCheck, result: Validation) -> None:
    """Range by range: the bulk pass proves most ranges clean; the others are read row by row."""
    try:
        with path.open("rb") as handle:
            for first_line, data, deep in line_ranges(handle):
                clean = clean_counts(data, check.source.spec, deep)
                if clean is None:
                    rows = _guarded(path, _jsonl_lines(path, io.BytesIO(data), first_line))
                    if not _check_rows(path, rows, check, result):
                        return
                    continue
                for counts in clean:
                    check.rows += len(counts)
                    check.lengths.frombytes(counts.clip(0, 2**32 - 1).astype("uint32").tobytes())
    except OSError as exc:
        result.add(check, f"{path}: cannot read: {exc.strerror or exc}")
    except LineTooLong as exc:
        result.add(check, f"{path}:{exc.line}: {exc}")
    except Unreadable as exc:
        result.add(check, str(exc))


def _check_rows(path: Path, rows: Iterator[tuple[str, Any]], check: SourceCheck, result: Validation) -> bool:
    """Converts every row with its format; False once the source has too many problems to go on."""
    spec = check.source.spec
    for where, row in rows:
        if isinstance(row, BadRow):
            result.add(check, f"{where}: {row.message}")
        else:
            check.rows += 1
            try:
                example = to_example(row, spec)
                check.lengths.append(min(_characters(example), 2**32 - 1))
                if spec.images is not None:
                    check.image_tokens.append(min(sum(ref.tokens for ref in example.images), 2**32 - 1))
                continue
            except RowProblem as exc:
                result.add(check, f"{where}: {exc}")
        if check.problems >= MAX_PER_SOURCE:
            check.stopped = True
            result.add(check, f"{path}: stopped reading after {MAX_PER_SOURCE} problems")
            return False
    return True


def _characters(example: Any) -> int:
    if isinstance(example, Prompted):
        return len(example.prompt) + len(example.response)
    if isinstance(example, Text):
        return len(example.text)
    if isinstance(example, Chat):
        return _message_characters(example.messages)
    if isinstance(example, Columns):  # a TRL row: its texts (the prompt once, each answer)
        return sum(len(v) if isinstance(v, str) else _message_characters(v) if isinstance(v, list) else 0
                   for v in example.values.values())
    return 0


def _message_characters(messages: list) -> int:
    return sum(len(m["content"]) if isinstance(m, dict) and isinstance(m.get("content"), str) else 0 for m in messages)


def length_stats(lengths: array) -> Optional[dict[str, int]]:
    """p50 / p95 / max characters per example (None without rows)."""
    if not lengths:
        return None
    ordered = sorted(lengths)
    pick = lambda q: ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]  # noqa: E731
    return {"rows": len(ordered), "p50": pick(0.5), "p95": pick(0.95), "max": ordered[-1]}


# ------------------------------------------------------------------------------------------------
# Readers: (where, row) for every row, or (where, BadRow) for a row that cannot be parsed


@dataclass
class BadRow:
    message: str


def iter_rows(path: Path) -> Iterator[tuple[str, Any]]:
    if path.suffix == ".arrow":
        return _arrow_rows(path)
    readers = {".jsonl": _jsonl_rows, ".json": _json_rows, ".csv": _csv_rows, ".parquet": _parquet_rows}
    return _guarded(path, readers[path.suffix](path))


def chat_rows(source: Source) -> Iterator[tuple[str, Chat]]:
    """(where, conversation) of every row of a local chat source (its first file) as its format
    makes them, role names mapped; rows that do not convert, and a source that cannot be read, are left out
    (`validate` reports them). A hub source: finetune.data.chat_template.SAMPLE_CONVERSATION."""
    from finetune.data.chat_template import SAMPLE_CONVERSATION

    if not is_local(source.path):
        yield "a sample conversation", Chat(SAMPLE_CONVERSATION, [m["role"] == "assistant" for m in SAMPLE_CONVERSATION])
        return
    try:
        for where, row in iter_rows(data_files(Path(source.path).expanduser(), source.split)[0]):
            try:
                example = to_example(row, source.spec)
            except RowProblem:
                continue
            if isinstance(example, Chat):
                yield where, example
    except (SourceProblem, Unreadable):
        return


def _guarded(path: Path, rows: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    try:
        yield from rows
    except UnicodeDecodeError as exc:
        raise Unreadable(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise Unreadable(f"{path}: cannot read: {exc.strerror or exc}") from None
    except LineTooLong as exc:
        raise Unreadable(f"{path}:{exc.line}: {exc}") from None
    except csv.Error as exc:  # a field past csv.field_size_limit(), a NUL byte
        raise Unreadable(f"{path}: not a readable CSV file ({exc})") from None


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open("rb") as handle:
        yield from _jsonl_lines(path, handle, 1)


def _jsonl_lines(path: Path, lines: BinaryIO, first_line: int) -> Iterator[tuple[str, Any]]:
    for line_no, line in bounded_lines(lines, first_line):
        if nested_too_deep(line):  # orjson would refuse it past 1,024 levels, json recurse to its limit
            yield f"{path}:{line_no}", BadRow(NESTED_TOO_DEEP)
            continue
        try:
            yield f"{path}:{line_no}", _loads(line)
        except _JSONError as exc:
            if not line.strip():
                continue  # blank lines: datasets skips them too
            yield f"{path}:{line_no}", BadRow(_json_message(line, exc))


def _json_message(line: bytes, exc: Exception) -> str:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as bad:
        return f"not UTF-8 text (byte {bad.start} of the line)"
    try:
        json.loads(text)
    except json.JSONDecodeError as std:  # the json module's wording names what is wrong and where
        return f"not valid JSON ({std.msg}, column {std.colno})"
    except RecursionError:
        return NESTED_TOO_DEEP
    return _only_python_reads(line, exc)


# What Python's json module (and pyarrow) read but JSON and orjson do not: NaN, Infinity, -Infinity.
_NON_FINITE = re.compile(rb"(?<![\w\"])-?(?:NaN|Infinity)(?![\w\"])")


def _only_python_reads(text: bytes, exc: Exception) -> str:
    """Why orjson refused `text` that the json module reads (issue 40: `NaN` in a .json file was a traceback)."""
    where = f"line {exc.lineno}, column {exc.colno}" if getattr(exc, "lineno", 1) > 1 else f"column {getattr(exc, 'colno', '?')}"
    found = _NON_FINITE.search(text)
    if found:
        return f"not valid JSON: `{found.group().decode()}` ({where}) is not a JSON number; write null or a number"
    return f"not valid JSON ({exc})"


def _json_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """A JSON array of rows, an object of columns, or JSON lines in a .json file (what `datasets` reads)."""
    with path.open("rb") as handle:
        head = handle.read(64).lstrip()
    if not head.startswith((b"[", b"{")) or (head.startswith(b"{") and _is_jsonl(path)):
        yield from _jsonl_rows(path)
        return
    raw = path.read_bytes()
    try:
        data = _loads(raw)
    except _JSONError as first:
        try:
            json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as bad:
            raise Unreadable(f"{path}: not UTF-8 text (byte {bad.start})") from None
        except json.JSONDecodeError as exc:
            raise Unreadable(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
        except RecursionError:
            raise Unreadable(f"{path}: {NESTED_TOO_DEEP}") from None
        if nested_too_deep(raw):  # orjson's own limit, 1,024 levels: no row can be named
            raise Unreadable(f"{path}: {NESTED_TOO_DEEP}") from None
        raise Unreadable(f"{path}:{getattr(first, 'lineno', 1)}: {_only_python_reads(raw, first)}") from None
    if isinstance(data, dict):
        columns = list(data.values())
        if not columns or not all(isinstance(c, list) for c in columns) or len({len(c) for c in columns}) != 1:
            raise Unreadable(f"{path}: one JSON object that is not a table of equal-length columns "
                             f"(expected JSON lines, an array of rows, or {{column: [values]}})")
        data = [{key: values[i] for key, values in data.items()} for i in range(len(columns[0]))]
    deep = nested_too_deep(raw)  # the whole file: when it is not, no row is
    for number, row in enumerate(data, 1):
        yield f"{path}: row {number}", BadRow(NESTED_TOO_DEEP) if deep and _depth(row) > MAX_NESTING else row


def _depth(value: Any) -> int:
    """Levels of arrays and objects in `value` (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def _is_jsonl(path: Path) -> bool:
    """A .json file starting with `{`: JSON lines when its first line is a whole object."""
    with path.open("rb") as handle:
        first = handle.readline(MAX_LINE + 1)
    try:
        return isinstance(_loads(first), dict)
    except _JSONError:
        return False


def _csv_rows(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open(encoding="utf-8", newline="") as handle:
        reader = csv.DictReader(handle)
        if not reader.fieldnames:
            return
        for row in reader:
            yield f"{path}:{reader.line_num}", row


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=ARROW_BATCH)
        yield from _numbered(path, batches)
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise Unreadable(f"{path}: not a readable parquet file ({exc})") from None


def _arrow_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """The .arrow files of a save_to_disk folder: Arrow IPC streams, memory-mapped as datasets does."""
    import pyarrow as pa

    try:
        with pa.memory_map(str(path)) as source:
            yield from _numbered(path, pa.ipc.open_stream(source))
    except (OSError, ValueError) as exc:
        raise Unreadable(f"{path}: not a readable Arrow file ({exc})") from None


def _numbered(path: Path, batches) -> Iterator[tuple[str, Any]]:
    number = 0
    for batch in batches:
        for row in batch.to_pylist():
            number += 1
            yield f"{path}: row {number}", row
