"""A vectorised pass over a JSON lines source: proves it clean at C++ speed, or says "look closer" where.

`line_ranges(handle)` cuts the file into ranges of whole lines (RANGE bytes and up to the next
newline), each with the number of its first line. `clean_counts(data, spec)` parses one range with
pyarrow's JSON reader and checks every batch with Arrow compute (column present and of type string, no
nulls, nothing-to-train rows, known roles, an assistant turn in every conversation, valid UTF-8). It
returns the per-row character counts when every row passes, and None on anything it cannot prove: a
parse error, a type that changes between rows, a null, a per-message `train`/`weight` key, a format it
does not know. finetune.data.validate then reads that range, and only that range, row by row in Python,
which names each problem by line; so this pass only has to be right when it says "clean", and it is
conservative everywhere else.
"""

from __future__ import annotations

import re
from typing import BinaryIO, Iterator, Optional

from finetune.data.formats import CHAT_FORMATS, RowSpec
from finetune.errors import FinetuneError

BLOCK = 2**20  # bytes per parsed block: measured fastest of 1, 16 and 64 MiB (scripts/bench_validate.py)
# Bytes per range: a bad row costs the row-by-row pass over one range (orjson: ~30 MB/s on a shared
# 2-core box), while each range pays a fixed start-up in pyarrow (scripts/bench_validate.py).
RANGE = 16 * 2**20
# The longest line a JSON lines file may have. A row of a 1M-token conversation is ~4-8 MB of JSON; a
# file without newlines (a JSON array saved as .jsonl, /dev/zero behind a link, a binary file) would
# otherwise be read whole, in memory, before failing (issue 25: 6.5 GB of RAM for a 2 GB line).
MAX_LINE = 64 * 2**20


# The deepest a row may nest. pyarrow's JSON reader recurses once per level, in time growing with the square
# of the depth (one row: 2,000 levels 1.9 s, 5,000 levels 10 s, 10,000 past a minute) and dies with SIGSEGV
# near 20,000 (issue 40); orjson stops at 1,024, the json module at the interpreter's recursion limit. Real
# rows nest a few levels (row > messages > message > tool_calls > arguments); a tree of 64 is far past any.
MAX_NESTING = 64
NESTED_TOO_DEEP = f"nested deeper than {MAX_NESTING} levels"

_DROP_BUT_OPENERS = bytes(b for b in range(256) if b not in b"[{\n")
_HEAVY = re.compile(rb"[^\n]{%d}" % (MAX_NESTING + 1))  # a line with more brackets than MAX_NESTING
# A JSON string (escapes included) or one bracket: what the exact depth count walks, skipping strings' contents.
_TOKENS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')


def deep_lines(data: bytes, first_line: int = 1) -> list[int]:
    """Numbers of the lines of `data` (the first one numbered `first_line`) nested deeper than MAX_NESTING."""
    return _scan(data, first_line)[1]


def _scan(data: bytes, first_line: int) -> tuple[int, list[int]]:
    """(newlines in `data`, numbers of its lines nested deeper than MAX_NESTING), in one pass over the bytes.

    The pass (in C) keeps only the `[`, `{` and newlines: their count is the newline count line_ranges needs
    anyway, and a line with at most MAX_NESTING brackets cannot nest deeper (strings included, so this only
    over-counts); only the others are walked exactly, strings skipped."""
    openers = data.translate(None, _DROP_BUT_OPENERS)
    newlines = openers.count(b"\n")
    if len(openers) - newlines <= MAX_NESTING or not _HEAVY.search(openers):
        return newlines, []
    heavy = [i for i, line in enumerate(openers.split(b"\n")) if len(line) > MAX_NESTING]
    if not heavy:
        return newlines, []
    lines = data.split(b"\n") if len(heavy) > 1 else [_nth_line(data, heavy[0])]
    picked = [lines[i] for i in heavy] if len(heavy) > 1 else lines
    return newlines, [first_line + i for i, line in zip(heavy, picked) if nested_too_deep(line)]


def _nth_line(data: bytes, index: int) -> bytes:
    start = 0
    for _ in range(index):
        start = data.index(b"\n", start) + 1
    end = data.find(b"\n", start)
    return data[start:] if end < 0 else data[start:end]


def nested_too_deep(text: bytes) -> bool:
    """Whether the JSON text `text` nests deeper than MAX_NESTING (arrays and objects; strings skipped)."""
    if text.count(b"[") + text.count(b"{") <= MAX_NESTING:
        return False
    depth = 0
    for token in _TOKENS.finditer(text):
        char = token.group()[0]
        if char in b"[{":  # `[` or `{`
            depth += 1
            if depth > MAX_NESTING:
                return True
        elif char in b"]}":
            depth -= 1
    return False


class LineTooLong(FinetuneError):
    """Line `line` of a JSON lines file runs past MAX_LINE bytes without a newline."""

    def __init__(self, line: int):
        limit = f"{MAX_LINE // 2**20} MiB" if MAX_LINE % 2**20 == 0 else f"{MAX_LINE} bytes"
        super().__init__(f"line {line} is longer than {limit} (no newline in it): JSON lines "
                         "hold one row per line; is this a JSON lines file?")
        self.line = line


def bounded_lines(handle: BinaryIO, first_line: int = 1) -> Iterator[tuple[int, bytes]]:
    """(number, line) of every line, each read with at most MAX_LINE bytes in memory (LineTooLong past that)."""
    number = first_line
    while True:
        line = handle.readline(MAX_LINE + 1)
        if not line:
            return
        if len(line) > MAX_LINE and not line.endswith(b"\n"):
            raise LineTooLong(number)
        yield number, line
        number += 1


def line_ranges(handle: BinaryIO, size: Optional[int] = None) -> Iterator[tuple[int, bytes, list[int]]]:
    """(number of the first line, bytes, numbers of the lines nested deeper than MAX_NESTING) of consecutive
    ranges of whole lines, `size` (RANGE) bytes and up to the next newline: a line longer than that makes its
    range longer rather than being cut (up to MAX_LINE: LineTooLong)."""
    size = size or RANGE
    first = 1
    while True:
        data = handle.read(size)
        if not data:
            return
        if not data.endswith(b"\n"):
            tail = handle.readline(MAX_LINE + 1)
            if len(tail) > MAX_LINE and not tail.endswith(b"\n"):
                raise LineTooLong(first + data.count(b"\n"))
            data += tail
        newlines, deep = _scan(data, first)
        yield first, data, deep
        first += newlines


def clean_counts(data: bytes, spec: RowSpec, deep: Optional[list[int]] = None) -> Optional[list]:
    """Character count of every row of one range (numpy arrays, one per batch) when every row is fine, else None.
    `deep`: the range's lines nested too deeply, when line_ranges found them already."""
    try:
        import pyarrow as pa
        import pyarrow.json as pj
    except ImportError:
        return None
    kind = spec.reader or spec.format
    check = {"alpaca": _alpaca, "text": _text, "pairs": _pairs, "kto": _kto}.get(kind) or \
        (_chat if kind in CHAT_FORMATS else None)
    if check is None:
        return None
    if deep_lines(data) if deep is None else deep:  # read row by row instead, which names each such line
        return None
    lengths = []
    try:
        reader = pj.open_json(pa.BufferReader(_arrow_owned(data)), read_options=pj.ReadOptions(block_size=BLOCK))
        for batch in reader:
            batch.validate(full=True)  # UTF-8 of every string, nested ones included
            if any(_non_finite(column) for column in batch.columns):
                return None  # NaN or Infinity: pyarrow reads them, JSON (and the row-by-row pass) does not
            counts = check(batch, spec)
            if counts is None:
                return None
            lengths.append(counts)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OSError, ValueError):
        return None
    return lengths


def _arrow_owned(data: bytes):
    """`data` copied into memory that Arrow allocated (a memcpy per 16 MiB range, next to parsing it: nothing).

    The streaming reader goes on reading blocks ahead on Arrow's own threads. Given the bytes object itself, each
    block is a slice of a buffer that wraps the Python object, and the last slice to go releases it with the GIL
    held. When the reader failed early (a bad row in its first block) and the process then exited within
    moments (`finetune prepare` stops after 1,000 problems), a thread still holding a slice asked for the GIL
    during interpreter finalization, was made to exit (pthread_exit), and the unwinding through that destructor
    called std::terminate: "terminate called without an active exception", exit 134 (issue 34 item 10; 6 runs
    in 200 on the shared 2-core box, 0 in 400 with this copy: scripts/prepare_abort_loop.sh)."""
    import pyarrow as pa

    buffer = pa.allocate_buffer(len(data))
    with memoryview(buffer) as view, view.cast("B") as octets:  # pyarrow exports format "b"; bytes are "B"
        octets[:] = data
    return buffer


def _non_finite(array) -> bool:
    """Whether a float anywhere in `array` (nested in lists and structs too) is NaN or infinite."""
    import pyarrow as pa
    import pyarrow.compute as pc

    kind = array.type
    if pa.types.is_floating(kind):
        return len(array) > 0 and not pc.all(pc.fill_null(pc.is_finite(array), True)).as_py()
    if pa.types.is_struct(kind):
        return any(_non_finite(array.field(i)) for i in range(kind.num_fields))
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return _non_finite(pc.list_flatten(array))
    return False


def _strings(batch, name: str, required: bool = True, nonblank: bool = False):
    """The column as a string array when it passes, False when it fails, None when absent and optional."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if name not in batch.schema.names:
        return False if required else None
    column = batch.column(name)
    if not pa.types.is_string(column.type) and not pa.types.is_large_string(column.type):
        return False if required or not pa.types.is_null(column.type) else None
    if required and column.null_count:
        return False
    if nonblank and len(column) and pc.min(pc.utf8_length(pc.utf8_trim_whitespace(column))).as_py() == 0:
        return False
    return column


def _length(column):
    import pyarrow.compute as pc

    return pc.fill_null(pc.utf8_length(column), 0).to_numpy(zero_copy_only=False)


def _alpaca(batch, spec: RowSpec):
    instruction = _strings(batch, spec.column("instruction"))
    output = _strings(batch, spec.column("output"), nonblank=True)
    extra = _strings(batch, spec.column("input"), required=False)
    if instruction is False or output is False or extra is False:
        return None
    total = _length(instruction) + _length(output)
    return total + _length(extra) if extra is not None else total


def _text(batch, spec: RowSpec):
    text = _strings(batch, spec.column("text"), nonblank=True)
    return None if text is False else _length(text)


def _pairs(batch, spec: RowSpec, answers: tuple[str, ...] = ("chosen", "rejected")):
    """Text rows only (message lists go row by row): prompt a string (may be blank), answers non-blank."""
    prompt = _strings(batch, spec.column("prompt"))
    columns = [_strings(batch, spec.column(name), nonblank=True) for name in answers]
    if prompt is False or any(c is False for c in columns):
        return None
    total = _length(prompt)
    for column in columns:
        total = total + _length(column)
    return total


def _kto(batch, spec: RowSpec):
    import pyarrow as pa

    name = spec.column("label")
    if name not in batch.schema.names:
        return None
    label = batch.column(name)
    if not pa.types.is_boolean(label.type) or label.null_count:
        return None
    return _pairs(batch, spec, ("completion",))


def _chat(batch, spec: RowSpec):
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    name = spec.column("messages")
    if name not in batch.schema.names:
        return None
    turns = batch.column(name)
    if not pa.types.is_list(turns.type) or turns.null_count or not pa.types.is_struct(turns.type.value_type):
        return None
    fields = {f.name for f in turns.type.value_type}
    role_key, content_key = spec.column("role"), spec.column("content")
    # Per-message switches, tool calls and function_call JSON are left to the row-by-row pass.
    if fields - {role_key, content_key} or len(turns) == 0 or pc.min(pc.list_value_length(turns)).as_py() == 0:
        return None
    flat = pc.list_flatten(turns)
    roles, contents = flat.field(role_key), flat.field(content_key)
    for column in (roles, contents):
        if not pa.types.is_string(column.type) or column.null_count:
            return None
    roles_map = spec.role_map()
    if "function_call" in roles_map and pc.any(pc.equal(roles, "function_call")).as_py():
        return None
    known = pa.array(sorted(roles_map))
    if not pc.all(pc.is_in(roles, value_set=known)).as_py():
        return None
    assistant = pa.array(sorted(k for k, v in roles_map.items() if v == "assistant"))
    is_assistant = pc.is_in(roles, value_set=assistant).to_numpy(zero_copy_only=False)
    parents = pc.list_parent_indices(turns).to_numpy()
    if np.bincount(parents[is_assistant], minlength=len(turns)).min() == 0:
        return None
    system = _strings(batch, spec.column("system"), required=False)
    if system is False:
        return None
    total = np.bincount(parents, weights=_length(contents), minlength=len(turns)).astype(np.int64)
    return total + _length(system) if system is not None else total
