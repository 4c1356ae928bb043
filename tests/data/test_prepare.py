"""Issue 20: the training set is tokenized before the ranks start, on every core, into a flat Arrow cache.

The equivalence test compares the parallel Arrow path with the fingerprints of the path it replaced
(tests/golden/tokenize_equivalence.json, written by tests/data/prepare_cases.py from the one-process,
Python-list implementation): same input_ids, labels, position_ids, and the same batches from every collator.
"""

from __future__ import annotations

import json

import pytest

from finetune.data import prepare as prep
from tests.data import prepare_cases as cases


@pytest.fixture(scope="module")
def golden():
    return json.loads(cases.GOLDEN.read_text())


@pytest.fixture(scope="module")
def computed(tmp_path_factory, tiny_dir):
    return cases.compute(tmp_path_factory.mktemp("prepare"), tiny_dir, prep.tokenize_for_training)


@pytest.mark.parametrize("name", sorted(json.loads(cases.GOLDEN.read_text())))
def test_the_prepared_rows_are_the_old_rows_token_for_token(name, golden, computed):
    assert computed[name] == golden[name]


@pytest.mark.parametrize("name", ["alpaca_truncated", "messages_generation_think", "text_packed", "mixture_samples_packed"])
def test_several_processes_give_the_same_rows(name, golden, tmp_path, tiny_dir, monkeypatch):
    """Workers split the rows (and the blocks) between them; the result does not depend on how."""
    monkeypatch.setattr(prep, "MIN_ROWS_PER_PROC", 10)
    monkeypatch.setattr(prep, "BATCH", 16)  # several batches per worker
    monkeypatch.setattr(prep, "CHUNK_ROWS", 40)  # several maps per source
    section, variant = cases.cases(tmp_path / "sources")[name]
    tokenizer = cases.tokenizer_for(variant, tiny_dir)
    lines: list[str] = []
    dataset = prep.tokenize_for_training(section, tokenizer, tmp_path / "cache", log=lines.append, num_proc=2)
    assert any("2 processes" in line for line in lines)
    got = cases.fingerprint(dataset, tokenizer.pad_token_id)
    assert got == {k: v for k, v in golden[name].items() if k != "report"}


# ------------------------------------------------------------------------------------------------
# Bad rows, the cache's atomicity, and `finetune prepare`


def _alpaca_rows(path, count, bad_at=None, blank_every=0, bad=7):
    """count alpaca rows as JSON lines; the row at 0-based `bad_at` has `bad` for `output`; a blank
    line after every `blank_every` rows (datasets skips them, so lines and rows differ)."""
    lines = []
    for i in range(count):
        lines.append(json.dumps({"instruction": f"Add {i} and 1.", "output": bad if i == bad_at else f"{i + 1}"}))
        if blank_every and i % blank_every == blank_every - 1:
            lines.append("")
    path.write_text("\n".join(lines) + "\n")
    return lines


def test_a_bad_row_in_a_worker_is_named_by_file_and_line_and_nothing_is_cached(tmp_path, tiny_dir, monkeypatch):
    from transformers import AutoTokenizer

    from finetune.data.tokenize import DataError

    monkeypatch.setattr(prep, "MIN_ROWS_PER_PROC", 10)
    monkeypatch.setattr(prep, "BATCH", 8)
    path = tmp_path / "rows.jsonl"
    lines = _alpaca_rows(path, 120, bad_at=97, blank_every=10, bad="  ")
    line = next(n for n, text in enumerate(lines, 1) if '"output": "  "' in text)
    section = cases._section(path=str(path), max_length=64)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_dir))
    with pytest.raises(DataError) as caught:
        prep.prepare(section, tokenizer, tmp_path / "cache", log=lambda m: None, num_proc=2)
    assert str(caught.value) == f"{path}:{line}: `output` is empty: nothing to train on"
    assert line == 107 and not list((tmp_path / "cache").iterdir())  # no entry, no partial folder


def test_a_killed_prepare_leaves_nothing_a_run_takes_for_a_cache(tmp_path, tiny_dir):
    """A partial folder whose writer is gone is not a cache; the next prepare removes it and writes one."""
    import os
    import socket

    from transformers import AutoTokenizer

    from finetune.data.tokenize import DataError
    from finetune.fsutil import OWNER_FILE

    section = cases._section(path=str(cases.SHIPPED / "demo_instructions.jsonl"))
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_dir))
    target = prep.entry(section, tokenizer, tmp_path / "cache")
    partial = target.parent / f".{target.name}.x1y2.partial"  # as a SIGKILLed prepare leaves it
    partial.mkdir(parents=True)
    (partial / "source-0-0.arrow").write_bytes(b"ARROW1")  # half written
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    (partial / OWNER_FILE).write_text(json.dumps({"pid": dead, "host": socket.gethostname()}))
    with pytest.raises(DataError, match="not in the cache"):
        prep.load_prepared(section, tokenizer, tmp_path / "cache")
    lines: list[str] = []
    assert not prep.prepare(section, tokenizer, tmp_path / "cache", log=lines.append).cached
    assert any(line.startswith(f"removed {partial}") for line in lines) and not partial.exists()
    assert len(prep.load_prepared(section, tokenizer, tmp_path / "cache")) == 307
    assert prep.prepare(section, tokenizer, tmp_path / "cache", log=lines.append).cached


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def _garbage(path):
    path.write_bytes(bytes(range(256)) * (path.stat().st_size // 256) + b"\xff" * (path.stat().st_size % 256))


CACHE_DAMAGE = {  # issue 34 item 6, each seen making rank 0 crash (SIGSEGV for garbage) on every rerun
    "truncated-arrow": lambda e, arrow: arrow.write_bytes(arrow.read_bytes()[:1000]),
    "garbage-arrow": lambda e, arrow: _garbage(arrow),
    "flipped-byte": lambda e, arrow: _flip_byte(arrow),
    "missing-arrow": lambda e, arrow: arrow.unlink(),
    "manifest-garbage": lambda e, arrow: (e / prep.MANIFEST).write_text("{"),
    "manifest-names-outside": lambda e, arrow: (e / prep.MANIFEST).write_text(json.dumps(
        {**json.loads((e / prep.MANIFEST).read_text()), "files": ["../x.arrow"]})),
}


def test_a_damaged_cache_entry_is_set_aside_and_made_again(tmp_path, tiny_dir):
    """The launcher and `finetune prepare` (both call prepare) read the entry against its manifest's sizes and
    digests; a rank that finds it changed after that says so instead of crashing."""
    from transformers import AutoTokenizer

    from finetune.data.tokenize import DataError

    section = cases._section(path=str(cases.SHIPPED / "demo_instructions.jsonl"))
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_dir))
    cache = tmp_path / "cache"
    target = prep.prepare(section, tokenizer, cache, log=lambda line: None).path
    for name, damage in CACHE_DAMAGE.items():
        arrow = target / json.loads((target / prep.MANIFEST).read_text())["files"][0]
        damage(target, arrow)
        if name == "truncated-arrow":
            with pytest.raises(DataError, match=f"the tokenized data in the cache {target} is damaged .*has 1000 bytes"):
                prep.load_prepared(section, tokenizer, cache)
        lines: list[str] = []
        again = prep.prepare(section, tokenizer, cache, log=lines.append)
        assert not again.cached, name
        assert lines[0].startswith(f"tokenized data: the cache entry {target} is damaged (") and \
            lines[0].endswith(f"); set aside as .{target.name}.damaged, tokenizing again"), (name, lines[0])
        assert (cache / f".{target.name}.damaged").is_dir() and len(prep.load_prepared(section, tokenizer, cache)) == 307
    assert prep.prepare(section, tokenizer, cache, log=lines.append).cached


def test_a_partial_folder_whose_writer_exited_unreaped_is_removed(tmp_path):
    """A writer that has exited but that its parent has not reaped yet (a zombie) still answers signal 0;
    it writes nothing any more, so what it left is removed like any dead writer's."""
    import os
    import socket
    import time
    from pathlib import Path

    from finetune.fsutil import OWNER_FILE, remove_stale_partials

    target = tmp_path / "entry"
    partial = tmp_path / ".entry.z1.partial"
    partial.mkdir()
    child = os.fork()
    if child == 0:
        os._exit(0)
    try:
        deadline = time.monotonic() + 10
        while not Path(f"/proc/{child}/stat").read_text().split(") ", 1)[1].startswith("Z"):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        (partial / OWNER_FILE).write_text(json.dumps({"pid": child, "host": socket.gethostname()}))
        os.kill(child, 0)  # still there for signal 0
        assert [line.split(" (")[0] for line in remove_stale_partials(target)] == [f"removed {partial}"]
        assert not partial.exists()
    finally:
        os.waitpid(child, 0)


KILLED_PARENT = """
import subprocess, sys, time
import multiprocess
from finetune.data.prepare_fresh import child_argv
from finetune.parentdeath import forks_die_with_parent

forks_die_with_parent()  # what prepare() does before datasets forks its workers
pool = multiprocess.Pool(2)  # datasets' map(num_proc=2) forks its workers with multiprocess
pool.map_async(time.sleep, [60, 60])
child = subprocess.Popen(child_argv(), stdin=subprocess.PIPE, stderr=open(sys.argv[1], "w"))  # the launcher's
print(*[p.pid for p in pool._pool], child.pid, flush=True)
time.sleep(60)
"""


def test_a_killed_tokenizer_takes_its_workers_and_its_child_along(tmp_path):
    """Issue 34 item 7: kill -9 of `finetune prepare` (or of `finetune train` while it tokenizes) left the
    tokenizing child and the workers running at full CPU, which then printed BrokenPipeError tracebacks."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import REPO
    from tests.train.test_resume import running

    psutil = pytest.importorskip("psutil")
    parent = subprocess.Popen([sys.executable, "-c", KILLED_PARENT, str(tmp_path / "child.err")], cwd=REPO,
                              stdout=subprocess.PIPE, text=True)
    pids = [int(pid) for pid in parent.stdout.readline().split()]
    assert len(pids) == 3
    time.sleep(0.5)  # the child has started to read its arguments
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    alive = running([psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)], timeout=10)
    assert not alive, [p.cmdline() for p in alive]
    assert (tmp_path / "child.err").read_text() == ""  # no EOFError / BrokenPipeError traceback


def test_a_tokenizing_child_without_its_arguments_says_so_without_a_traceback():
    """The pipe closes a moment before the parent-death signal arrives (CI caught the EOFError traceback once);
    with the parent alive, the child reports the broken-off input as its error line."""
    import json
    import subprocess

    from finetune.data.prepare_fresh import child_argv
    from tests.conftest import REPO

    done = subprocess.run(child_argv(), input=b"\x80\x04trunc", capture_output=True, cwd=REPO, timeout=120)
    assert done.returncode == 1 and b"Traceback" not in done.stderr, done.stderr
    assert "received no arguments" in json.loads(done.stdout.splitlines()[-1])["error"]


# three CLI processes (~25 s on 2 cores), no training: it stays beside the rest of prepare's tests
def test_prepare_then_train_finds_the_cache(tmp_path, tiny_cache):
    """`finetune prepare` writes the cache, a second one finds it; bad rows stop prepare with file:line,
    before anything is tokenized."""
    import os
    import subprocess

    from tests.conftest import FINETUNE, REPO

    env = {**os.environ, "FINETUNE_CACHE": str(tiny_cache), "PYTHONPATH": str(REPO)}
    recipe = REPO / "recipes" / "demo.yaml"
    done = subprocess.run([*FINETUNE, "prepare", str(recipe), "--num-proc", "2"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "[finetune] data: " in done.stderr and "prepared: " in done.stderr and "Traceback" not in done.stderr
    again = subprocess.run([*FINETUNE, "prepare", str(recipe)], capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0 and "found in the cache" in again.stderr and "already there" in again.stderr

    bad = tmp_path / "bad.jsonl"
    _alpaca_rows(bad, 30, bad_at=4)
    broken = tmp_path / "r.yaml"
    broken.write_text(recipe.read_text().replace("path: data/demo_instructions.jsonl", f"path: {bad}"))
    failed = subprocess.run([*FINETUNE, "prepare", str(broken)], capture_output=True, text=True, env=env, timeout=300)
    assert failed.returncode == 1 and f"{bad}:5: `output` must be text, got int" in failed.stderr, failed.stderr
    assert "nothing was tokenized" in failed.stderr and "Traceback" not in failed.stderr


def test_the_launchers_relative_path_and_the_run_directorys_absolute_one_share_a_cache(tmp_path, tiny_dir, monkeypatch):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_dir))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "d.jsonl").write_text('{"instruction": "a", "output": "b"}\n')
    monkeypatch.chdir(tmp_path)
    relative = cases._section(path="data/d.jsonl")
    absolute = cases._section(path=str(tmp_path / "data" / "d.jsonl"))
    assert relative.cache_key(tokenizer) == absolute.cache_key(tokenizer)
    mixed = cases._section(sources=[{"path": "./data/d.jsonl", "format": "alpaca", "weight": 1}])
    assert mixed.cache_key(tokenizer) == cases._section(
        sources=[{"path": str(tmp_path / "data" / "d.jsonl"), "format": "alpaca", "weight": 1}]).cache_key(tokenizer)


def test_the_live_display_shows_the_tokenizing_rate_and_time_left():
    import io

    from rich.console import Console

    from finetune.run.progress import TrainingDisplay

    with TrainingDisplay(Console(file=io.StringIO(), force_terminal=True, width=160)) as display:
        display.write(b"[finetune] tokenizing: 200000/1000000 rows (1500 rows/s, about 533 s left)\n")
        assert display.progress.tasks[0].description == "tokenizing 200000/1000000 rows (1500 rows/s, about 533 s left)"


# ------------------------------------------------------------------------------------------------
# Memory: no torch where the tokenizing happens


def test_the_tokenizer_arrives_without_torch_and_gives_the_ranks_cache_key(tmp_path, tiny_dir):
    """`finetune prepare` loads the tokenizer in a child process (AutoTokenizer imports torch) and tokenizes
    with it: after prepare, no torch in the process; the cache entry is the one the ranks' AutoTokenizer names."""
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from tests.conftest import REPO

    written = cases.section_dict(path=str(cases.SHIPPED / "demo_chats_sharegpt.jsonl"), format="sharegpt")
    section = cases._section(**written)
    script = (f"import json, sys\nfrom pathlib import Path\nfrom finetune.tokenizer import load_without_torch\n"
              f"from finetune.data.prepare import prepare\nfrom finetune.data.spec import DataSpec\n"
              f"t = load_without_torch({{'source': {str(tiny_dir)!r}, 'chat_formats': ['sharegpt']}})\n"
              f"done = prepare(DataSpec.from_section({written!r}), t, Path({str(tmp_path / 'cache')!r}), "
              f"log=lambda line: None, num_proc=2)\n"
              f"print(json.dumps({{'torch': 'torch' in sys.modules, 'key': done.path.name}}))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"torch": False, "key": prep.entry(section, AutoTokenizer.from_pretrained(str(tiny_dir)), tmp_path).name}

    missing = subprocess.run([sys.executable, "-c", "from finetune.tokenizer import load_without_torch\n"
                              f"load_without_torch({{'source': {str(tmp_path / 'nope')!r}}})"],
                             capture_output=True, text=True, cwd=REPO, timeout=300)
    assert missing.returncode == 1 and f"OSError: {tmp_path / 'nope'}: cannot load the tokenizer" in missing.stderr


def test_a_launcher_with_torch_tokenizes_in_a_fresh_process(tmp_path, tiny_dir, golden):
    """finetune.data.prepare_fresh: the same rows as in-process, its log lines relayed; a bad row is named by
    file and line, and nothing is cached."""
    from transformers import AutoTokenizer

    from finetune.data.prepare_fresh import prepare_in_fresh_process
    from finetune.data.tokenize import DataError

    section, variant = cases.cases(tmp_path / "sources")["shipped_sharegpt"]
    tokenizer = cases.tokenizer_for(variant, tiny_dir)
    lines: list[str] = []
    done = prepare_in_fresh_process(section, tokenizer, tmp_path / "cache", log=lines.append, num_proc=2)
    assert not done.cached and done.path == prep.entry(section, tokenizer, tmp_path / "cache")
    assert done.peak_rss > 50 * 2**20  # the child and its workers, sampled (finetune.data.peak)
    assert any(line.startswith("tokenized data: ") for line in lines)
    got = cases.fingerprint(prep.load_prepared(section, tokenizer, tmp_path / "cache"), tokenizer.pad_token_id)
    assert got == {k: v for k, v in golden["shipped_sharegpt"].items() if k != "report"}

    path = tmp_path / "rows.jsonl"
    _alpaca_rows(path, 30, bad_at=4, bad="  ")
    bad = cases._section(path=str(path), max_length=64)
    with pytest.raises(DataError, match=f"^{path}:5: `output` is empty"):
        prepare_in_fresh_process(bad, AutoTokenizer.from_pretrained(str(tiny_dir)), tmp_path / "bad", log=lambda m: None)
    assert not list((tmp_path / "bad").iterdir())


def test_the_chat_renderer_is_apply_chat_template(tiny_dir, monkeypatch):
    """Prefixes of one converted conversation render as apply_chat_template renders each prefix; a renderer
    whose check on the batch's first conversation fails is apply_chat_template."""
    from transformers import AutoTokenizer

    from finetune.data.chat_template import ChatRenderer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_dir))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi", "name": None},
                {"role": "assistant", "content": "Hello.", "reasoning_content": "greet"},
                {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    render = ChatRenderer(tokenizer, messages)
    assert render.fast
    chat = render.conversation(messages)
    for i in range(1, len(messages) + 1):
        for prompt in (False, True):
            assert render(chat[:i], prompt) == tokenizer.apply_chat_template(messages[:i], tokenize=False,
                                                                             add_generation_prompt=prompt)
    monkeypatch.setattr(tokenizer, "apply_chat_template", lambda messages, tokenize, add_generation_prompt=False: "x")
    slow = ChatRenderer(tokenizer, messages)
    assert not slow.fast and slow(slow.conversation(messages)) == "x"
