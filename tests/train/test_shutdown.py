"""finetune.train.shutdown: a rank ends with its own exit code, after the shutdown work Python would do."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


def run_rank(body: str, tmp_path: Path) -> subprocess.CompletedProcess:
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent("""
        import atexit, sys, threading, time
        from pathlib import Path
        from finetune.train.shutdown import run_as_rank
        OUT = Path(sys.argv[1])
    """) + textwrap.dedent(body))
    return subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=120)


def test_exit_code_is_kept_and_shutdown_work_done(tmp_path):
    proc = run_rank("""
        def late_writer():
            time.sleep(0.3)
            (OUT / "thread").write_text("joined")

        def main():
            atexit.register(lambda: (OUT / "atexit").write_text("ran"))
            threading.Thread(target=late_writer).start()
            print("buffered line", end="")
            return 75
        run_as_rank(main)
    """, tmp_path)
    assert proc.returncode == 75, proc.stderr
    assert proc.stdout == "buffered line"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "thread").read_text() == "joined"


def test_uncaught_exception_prints_traceback_and_exits_1(tmp_path):
    proc = run_rank("""
        def main():
            raise RuntimeError("rank failed here")
        run_as_rank(main)
    """, tmp_path)
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "RuntimeError: rank failed here" in proc.stderr


def test_system_exit_codes(tmp_path):
    for body, code in [("sys.exit(3)", 3), ("sys.exit()", 0), ("sys.exit('bad input')", 1), ("return None", 0)]:
        proc = run_rank(f"""
            def main():
                {body}
            run_as_rank(main)
        """, tmp_path)
        assert proc.returncode == code, (body, proc.stderr)
        assert ("bad input" in proc.stderr) == ("bad input" in body)


def test_process_group_is_closed_without_abort(tmp_path):
    """A one-process gloo group, a collective, then the rank's end: exit 0, group destroyed first."""
    pytest.importorskip("torch")
    proc = run_rank("""
        import os
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0", RANK="0", WORLD_SIZE="1")
        import torch, torch.distributed as dist
        from finetune.train.shutdown import close_process_group

        def main():
            dist.init_process_group("gloo")
            dist.all_reduce(torch.ones(4))
            dist.barrier()
            close_process_group()
            print("initialized:", dist.is_initialized())
            return 0
        run_as_rank(main)
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "initialized: False" in proc.stdout
