"""Full-row validation before launch (finetune.data.validate): every row of every local source, each
problem with file and line, all at once up to a cap."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune.data import validate as v
from finetune.data.formats import RowSpec
from finetune.data.sources import Source

ALPACA = [{"instruction": "Add 2 and 3.", "input": "", "output": "5"},
          {"instruction": "Capital of France?", "output": "Paris"}]
MESSAGES = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]
SHAREGPT = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def check(path: Path, fmt: str, **spec) -> v.Validation:
    return v.validate([Source(str(path), "train", RowSpec(fmt, **spec))])


def messages(path: Path, fmt: str, **spec) -> list[str]:
    return check(path, fmt, **spec).messages()


@pytest.mark.parametrize("fmt,rows", [("alpaca", ALPACA), ("messages", MESSAGES), ("sharegpt", SHAREGPT),
                                      ("text", [{"text": "hello"}])])
def test_formats_in_jsonl_json_parquet_and_arrow(tmp_path, fmt, rows):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_jsonl(tmp_path / "d.jsonl", rows)
    (tmp_path / "d.json").write_text(json.dumps(rows, indent=2))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    for name in ("d.jsonl", "d.json", "d.parquet", "saved"):
        result = check(tmp_path / name, fmt)
        assert result.ok, result.messages()
        assert result.checks[0].rows == len(rows)


def test_a_saved_dataset_dict_is_read_by_split(tmp_path):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(ALPACA), "test": datasets.Dataset.from_list([{"x": 1}])}
                         ).save_to_disk(str(tmp_path / "dd"))
    assert check(tmp_path / "dd", "alpaca").checks[0].rows == 2
    result = v.validate([Source(str(tmp_path / "dd"), "test", RowSpec("alpaca"))])
    assert result.messages()[0].startswith(f"{tmp_path / 'dd' / 'test'}") and "no `instruction` column" in result.messages()[0]
    result = v.validate([Source(str(tmp_path / "dd"), "dev", RowSpec("alpaca"))])
    assert result.messages() == [f"{tmp_path / 'dd'}: no split `dev` in this saved dataset (found test, train)"]


def test_csv_lines_are_named(tmp_path):
    (tmp_path / "d.csv").write_text("instruction,input,output\nAdd 1 and 1.,,2\n")
    assert check(tmp_path / "d.csv", "alpaca").ok
    (tmp_path / "q.csv").write_text("question,answer\nwhy,because\n")
    assert messages(tmp_path / "q.csv", "alpaca") == [
        f"{tmp_path / 'q.csv'}:2: no `instruction` column (format alpaca needs it; found `question`, `answer`); "
        "add `columns: {instruction: question}` to the data source"]


def test_json_lines_in_a_json_file_and_an_object_of_columns(tmp_path):
    write_jsonl(tmp_path / "d.json", ALPACA)
    assert check(tmp_path / "d.json", "alpaca").checks[0].rows == 2
    (tmp_path / "cols.json").write_text(json.dumps({"instruction": ["a", "b"], "output": ["1", "2"]}, indent=2))
    assert check(tmp_path / "cols.json", "alpaca").checks[0].rows == 2
    (tmp_path / "one.json").write_text(json.dumps({"instruction": "a", "output": "1"}, indent=2))
    assert "not a table of equal-length columns" in messages(tmp_path / "one.json", "alpaca")[0]


def test_every_row_is_read_and_every_problem_named_by_line(tmp_path):
    rows = [json.dumps({"text": "ok"})] * 50
    rows[3] = '{"text": '                                     # malformed line
    rows[10] = json.dumps({"txt": "typo"})                     # missing column
    rows[20] = json.dumps({"text": 3})                         # wrong type
    rows[30] = json.dumps({"text": "  "})                      # nothing to train on
    rows[49] = json.dumps(["not", "an", "object"])             # far down: the old preflight read 20 rows
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(rows) + "\n")
    out = messages(path, "text")
    assert [m.split(": ", 1)[0] for m in out] == [f"{path}:{n}" for n in (4, 11, 21, 31, 50)]
    assert "not valid JSON" in out[0]
    assert "no `text` column (format text needs it; found `txt`)" in out[1]
    assert "`text` must be text, got int" in out[2]
    assert "`text` is empty: nothing to train on" in out[3]
    assert "expected an object with named columns, got list" in out[4]


def test_non_utf8_bytes_are_named_with_their_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    [message] = messages(path, "text")
    assert message.startswith(f"{path}:2: not UTF-8 text")


def test_unknown_role_and_no_assistant_turn(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "hello"}]},
        {"conversations": [{"from": "human", "value": "hi"}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "x", "train": False}]},
    ])
    out = messages(path, "sharegpt")
    assert out[0].startswith(f"{path}:1: conversations[1]: unknown role `bot`") and "roles: {bot:" in out[0]
    # The same problem on several rows is one line naming them (issue 24).
    assert out[1] == f"{path}: lines 2-3 (2 rows): `conversations` has no assistant turn to train on"
    # The source's role map makes the first row fine.
    assert messages(path, "sharegpt", roles={"bot": "assistant"})[0].startswith(f"{path}: lines 2-3 (2 rows):")


def test_problems_are_capped_with_a_count_of_the_rest(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{f"txt{i}": "x"} for i in range(30)])  # 30 different problems
    out = messages(path, "text")
    assert len(out) == v.MAX_SHOWN + 1
    assert out[-1] == "... and 10 more problem(s) not shown"


def test_a_source_in_the_wrong_format_stops_early(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"txt": "x"}] * (v.MAX_PER_SOURCE + 500))
    result = check(path, "text")
    assert result.checks[0].stopped and result.total == v.MAX_PER_SOURCE + 1
    assert result.messages() == [f"{path}: lines 1-{v.MAX_PER_SOURCE} ({v.MAX_PER_SOURCE} rows): no `text` column (format "
                                 "text needs it; found `txt`); add `columns: {text: txt}` to the data source",
                                 f"{path}: stopped reading after {v.MAX_PER_SOURCE} problems"]


def test_every_source_is_checked_and_hub_ids_skipped(tmp_path):
    good = write_jsonl(tmp_path / "a.jsonl", ALPACA)
    bad = write_jsonl(tmp_path / "b.jsonl", [{"conversations": []}])
    result = v.validate([Source(str(good), "train", RowSpec("alpaca")), Source(str(bad), "train", RowSpec("sharegpt")),
                         Source("org/name", "train", RowSpec("alpaca")), Source(str(tmp_path / "gone.jsonl"), "train", RowSpec("text"))])
    assert result.skipped == ["org/name"]
    assert result.messages() == [f"{bad}:1: `conversations` must be a non-empty list of turns",
                                 f"{tmp_path / 'gone.jsonl'}: file does not exist"]


def test_empty_file_and_broken_json_array(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    assert messages(tmp_path / "empty.jsonl", "text") == [f"{tmp_path / 'empty.jsonl'}: no rows"]
    (tmp_path / "arr.json").write_text('[\n {"text": "a"},\n {"text": \n]\n')
    assert messages(tmp_path / "arr.json", "text") == [f"{tmp_path / 'arr.json'}:4: not valid JSON (Expecting value)"]


def test_a_registered_format_is_checked_on_every_row(tmp_path, monkeypatch):
    from finetune.data import formats

    def pairs(row, spec):
        if not isinstance(row.get("chosen"), str):
            raise formats.RowProblem("`chosen` must be text")
        return formats.Text(row["chosen"])

    monkeypatch.setitem(formats.FORMATS, "pairs", None)
    formats.register_format("pairs", pairs)
    path = write_jsonl(tmp_path / "p.jsonl", [{"chosen": "a"}, {"chosen": 1}])
    assert messages(path, "pairs") == [f"{path}:2: `chosen` must be text"]


def test_length_statistics_for_the_planner(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "x" * n} for n in range(1, 101)])
    stats = check(path, "text").checks[0].length_stats()
    assert stats == {"rows": 100, "p50": 50, "p95": 95, "max": 100}


# ------------------------------------------------------------------------------------------------
# The bulk pass (finetune.data.fastcheck) says "clean" only when the row-by-row pass agrees


BAD_ROWS = {
    "alpaca": [{"instruction": "a"}, {"instruction": "a", "output": 3}, {"instruction": "a", "output": " "},
               {"instruction": None, "output": "b"}, ["a list"]],
    "text": [{"txt": "x"}, {"text": ""}, {"text": None}],
    "sharegpt": [{"conversations": []}, {"conversations": [{"from": "human", "value": "hi"}]},
                 {"conversations": [{"from": "bot", "value": "hi"}]},
                 {"conversations": [{"from": "gpt", "value": "hi", "train": False}]},
                 {"conversations": [{"from": "gpt", "value": None}]}, {"conversations": None}],
    "messages": [{"messages": [{"role": "user", "content": "hi"}]}, {"messages": [{"role": "robot", "content": "x"}]},
                 {"messages": [{"role": "assistant", "content": "x", "weight": 0}]}],
}
GOOD_ROWS = {"alpaca": ALPACA, "text": [{"text": "hello"}], "sharegpt": SHAREGPT + [{"system": "s", **SHAREGPT[0]}],
             "messages": MESSAGES}


@pytest.mark.parametrize("fmt", list(BAD_ROWS))
def test_the_bulk_pass_proves_clean_files_and_defers_every_bad_row(tmp_path, fmt):
    from finetune.data.fastcheck import clean_counts

    clean_rows = lambda path, spec: clean_counts(path.read_bytes(), spec)  # noqa: E731 - the file as one range
    good = write_jsonl(tmp_path / "good.jsonl", GOOD_ROWS[fmt] * 3)
    counts = clean_rows(good, RowSpec(fmt))
    assert counts is not None and sum(len(c) for c in counts) == len(GOOD_ROWS[fmt]) * 3
    for i, bad in enumerate(BAD_ROWS[fmt]):
        path = write_jsonl(tmp_path / f"bad{i}.jsonl", GOOD_ROWS[fmt] * 3 + [bad])
        assert clean_rows(path, RowSpec(fmt)) is None, bad
        assert check(path, fmt).total == 1, bad  # and the row-by-row pass names it
    line = json.dumps(GOOD_ROWS[fmt][0]).encode()
    start = line.rindex(b'"', 0, line.rindex(b'"')) + 1  # inside the last string value
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(good.read_bytes() + line[:start] + b"caf\xe9 " + line[start:] + b"\n")
    assert clean_rows(latin, RowSpec(fmt)) is None
    assert check(latin, fmt).messages()[0].startswith(f"{latin}:{len(GOOD_ROWS[fmt]) * 3 + 1}: not UTF-8 text")


def test_both_passes_give_the_same_length_statistics(tmp_path):
    from finetune.data import fastcheck

    rows = [{"conversations": [{"from": "human", "value": "q" * n}, {"from": "gpt", "value": "a" * (2 * n)}]} for n in range(1, 60)]
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    bulk = check(path, "sharegpt").checks[0].length_stats()
    assert fastcheck.clean_counts(path.read_bytes(), RowSpec("sharegpt")) is not None
    (tmp_path / "c.json").write_text(json.dumps(rows))  # a JSON array: row by row only
    assert check(tmp_path / "c.json", "sharegpt").checks[0].length_stats() == bulk == {"rows": 59, "p50": 90, "p95": 171, "max": 177}


# ------------------------------------------------------------------------------------------------
# Ranges: the bulk pass proves most of a file clean, the row-by-row pass reads only the other ranges


def test_line_ranges_are_whole_lines_numbered_from_one(tmp_path):
    import io

    from finetune.data.fastcheck import line_ranges

    data = b"a\nbb\n\nccccccccccc\nd"
    ranges = list(line_ranges(io.BytesIO(data), size=2))
    assert b"".join(r for _, r, _ in ranges) == data
    assert ranges == [(1, b"a\n", []), (2, b"bb\n", []), (3, b"\nccccccccccc\n", []), (5, b"d", [])]


def test_bad_rows_in_a_file_of_many_ranges_are_named_as_the_row_by_row_pass_names_them(tmp_path, monkeypatch):
    from finetune.data import fastcheck

    good = json.dumps({"text": "fine row"})
    lines = [good] * 100
    # One range is 10 lines of the same width: bad rows at the end of a range (10), at the start of the
    # next (11), in the middle of a later one (55), blank lines, a line longer than a range, the last line.
    lines[9] = json.dumps({"txt": "wrong co"})
    lines[10] = json.dumps({"text": 12345678})
    lines[54] = '{"text": "cut off'
    lines[60] = lines[61] = ""
    lines[70] = json.dumps({"text": "x" * 400, "more": 1})[:-1]
    lines[99] = json.dumps({"text": "   "})
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(line.ljust(len(good)) for line in lines) + "\n")  # JSON allows trailing spaces
    whole = [f"{where}: {problem}" for where, problem in _row_by_row_problems(path, RowSpec("text"))]
    assert [m.split(": ", 1)[0] for m in whole] == [f"{path}:{n}" for n in (10, 11, 55, 71, 100)]

    parsed = []
    loads = v._loads
    monkeypatch.setattr(v, "_loads", lambda line: parsed.append(line) or loads(line))
    monkeypatch.setattr(fastcheck, "RANGE", 10 * (len(good) + 1))
    result = check(path, "text")
    assert result.messages() == whole
    assert result.checks[0].rows == 96  # not the blank lines, nor the two that are not JSON
    # Only the ranges holding a bad row were read row by row: lines 1-20, 51-60, 71 (a range of its
    # own: it is longer than one), 92-100 (the ranges after 71 start one line later).
    assert len(parsed) == 20 + 10 + 1 + 9


def _row_by_row_problems(path: Path, spec: RowSpec):
    from finetune.data.formats import RowProblem, to_example

    for where, row in v.iter_rows(path):
        if isinstance(row, v.BadRow):
            yield where, row.message
            continue
        try:
            to_example(row, spec)
        except RowProblem as exc:
            yield where, str(exc)


# ------------------------------------------------------------------------------------------------
# Issue 25 item 3: paths that are not regular files, lines without an end


@pytest.mark.parametrize("kind", ["fifo", "dev-zero-link"])
def test_a_data_path_that_is_not_a_regular_file_is_refused_without_reading_it(tmp_path, kind):
    import os

    path = tmp_path / "data.jsonl"
    if kind == "fifo":
        os.mkfifo(path)  # opening it would block until a writer comes: never, here
    else:
        path.symlink_to("/dev/zero")  # endless: read whole, it never ends
    import threading

    done: list = []  # a reader that opens the FIFO blocks forever: look from a thread, give up after 20 s
    reader = threading.Thread(target=lambda: done.append(messages(path, "alpaca")), daemon=True)
    reader.start()
    reader.join(20)
    assert done, "validation hung reading the data path"
    found = done[0]
    what = "a named pipe (FIFO)" if kind == "fifo" else "a character device"
    assert found == [f"{path}: {what}, not a regular file: give a data file (or a folder of them)"]


@pytest.mark.parametrize("newline_at", [None, 3000])
def test_a_line_longer_than_the_maximum_is_one_problem_read_in_bounded_memory(tmp_path, monkeypatch, newline_at):
    from finetune.data import fastcheck

    monkeypatch.setattr(fastcheck, "MAX_LINE", 1024)
    monkeypatch.setattr(fastcheck, "RANGE", 256)  # the bulk pass's range ends inside the long line too
    good = json.dumps({"instruction": "a", "output": "b"}).encode() + b"\n"
    body = b'{"instruction": "' + b"x" * 5000 + b'"'
    if newline_at is not None:
        body = body[:newline_at] + b"\n" + body[newline_at:]
    path = tmp_path / "long.jsonl"
    path.write_bytes(good * 2 + body)
    found = messages(path, "alpaca")
    assert len(found) == 1 and found[0].startswith(f"{path}:3: line 3 is longer than") and "\n" not in found[0]
    with pytest.raises(v.Unreadable, match=r"long.jsonl:3: line 3 is longer than"):
        list(v.iter_rows(path))


def test_the_bulk_pass_gives_pyarrow_bytes_it_owns(monkeypatch):
    """Issue 34 item 10: given the Python bytes of a range, the streaming reader's own threads released the last
    slice with the GIL held; when the reader failed on its first block and the process exited at once (1,000
    problems), that thread met interpreter finalization and the process aborted (exit 134, 6 runs in 200:
    scripts/prepare_abort_loop.sh). The reader must read a copy that Arrow allocated."""
    import pyarrow as pa

    from finetune.data.fastcheck import clean_counts

    read: list = []
    real = pa.BufferReader
    monkeypatch.setattr(pa, "BufferReader", lambda source: read.append(source) or real(source))
    data = b"".join(json.dumps({"instruction": "q", "output": 7 if i < 5 else "a"}).encode() + b"\n" for i in range(50))
    assert clean_counts(data, RowSpec("alpaca")) is None  # a bad row: the range goes row by row
    assert len(read) == 1 and isinstance(read[0], pa.Buffer) and read[0].to_pybytes() == data
    assert read[0].address != pa.py_buffer(data).address  # not a view of the bytes object
    clean = data.replace(b'"output": 7', b'"output": "a"')
    assert sum(len(counts) for counts in clean_counts(clean, RowSpec("alpaca"))) == 50  # and the bulk pass works
