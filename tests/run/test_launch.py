"""finetune.run.launch: argv for torchrun and deepspeed, and supervision of real launchers with fake runners.

The fake runners are tiny modules written to tmp_path (no torch, start in milliseconds); the
launchers are the real torchrun and DeepSpeed launcher on CPU. The real runner under them:
tests/launches/test_launch.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from finetune.run.launch.commands import HostfileError, free_port, plan_launch, procs_per_node, read_hostfile
from finetune.run.launch.outcome import parse_torchrun_failures
from finetune.run.launch.supervision import supervise
from finetune.recipe import Recipe, load_recipe
from finetune.rundir.layout import write_run_dir
from tests.conftest import hub_recipe

RUN = Path("/runs/demo")


def recipe(**launch) -> Recipe:
    return hub_recipe(launch=launch)


# ----------------------------------------------------------------------------------------------
# argv


def test_torchrun_argv():
    plan = plan_launch(recipe(), RUN, gpu_count=2, python="python", environ={})
    assert plan.argv == [
        "python", "-m", "torch.distributed.run",
        "--nnodes", "1", "--nproc-per-node", "2", "--node-rank", "0",
        "--master-addr", "127.0.0.1", "--master-port", "29500",
        "--log-dir", "/runs/demo/logs/torchrun", "--redirects", "3", "--tee", "0:3",
        "-m", "finetune.train.runner", "--run-dir", "/runs/demo",
    ]
    assert (plan.launcher, plan.world_size, plan.device) == ("torchrun", 2, "cuda")
    assert "DS_ACCELERATOR" not in plan.env


def test_torchrun_argv_multi_node():
    r = recipe(nodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29600, procs_per_node=8)
    plan = plan_launch(r, RUN, gpu_count=8, python="python", environ={})
    assert plan.argv[3:13] == ["--nnodes", "2", "--nproc-per-node", "8", "--node-rank", "1",
                               "--master-addr", "10.0.0.1", "--master-port", "29600"]
    assert plan.world_size == 16


def test_deepspeed_argv_single_node():
    plan = plan_launch(recipe(launcher="deepspeed"), RUN, gpu_count=2, python="python", environ={})
    assert plan.argv == [
        "python", "-m", "deepspeed.launcher.runner",
        "--num_gpus", "2", "--master_addr", "127.0.0.1", "--master_port", "29500",
        "--no_local_rank", "--enable_each_rank_log", "/runs/demo/logs",
        "--module", "finetune.train.runner", "--run-dir", "/runs/demo",
    ]
    assert plan.world_size == 2


def test_deepspeed_keeps_the_gpus_the_user_picked():
    plan = plan_launch(recipe(launcher="deepspeed", procs_per_node=2), RUN, gpu_count=3, python="python",
                       environ={"CUDA_VISIBLE_DEVICES": "1,2,3"})
    assert plan.argv[3:5] == ["--include", "localhost:1,2"]


def test_deepspeed_argv_with_hostfile(tmp_path):
    one = tmp_path / "one"
    one.write_text("localhost slots=4\n")
    plan = plan_launch(recipe(hostfile=str(one)), RUN, gpu_count=4, python="python", environ={})
    assert plan.launcher == "deepspeed"  # auto picks deepspeed for a hostfile
    assert plan.argv[:11] == ["python", "-m", "deepspeed.launcher.runner", "--hostfile", str(one), "--num_nodes", "1",
                              "--no_ssh_check", "--master_addr", "127.0.0.1", "--master_port"]
    assert plan.world_size == 4
    two = tmp_path / "two"
    two.write_text("# two boxes\nworker-0 slots=8\nworker-1 slots=8\n")
    plan = plan_launch(recipe(hostfile=str(two), nodes=2), RUN, gpu_count=8, python="python", environ={})
    # several hosts with the default address: DeepSpeed asks node 0 for its address over ssh
    assert "--master_addr" not in plan.argv and "--no_ssh_check" not in plan.argv
    assert plan.world_size == 16
    plan = plan_launch(recipe(hostfile=str(two), nodes=2, procs_per_node=2), RUN, gpu_count=8, python="python", environ={})
    assert plan.argv[plan.argv.index("--num_gpus") + 1] == "2" and plan.world_size == 4


def test_procs_per_node():
    assert procs_per_node(recipe(), gpu_count=4) == 4
    assert procs_per_node(recipe(), gpu_count=0) == 1  # no GPU: one CPU process
    assert procs_per_node(recipe(procs_per_node=2), gpu_count=0) == 2


def test_cpu_runs_use_deepspeeds_cpu_accelerator():
    plan = plan_launch(recipe(procs_per_node=2), RUN, gpu_count=0, python="python", environ={})
    assert plan.env["DS_ACCELERATOR"] == "cpu" and plan.device == "cpu" and plan.world_size == 2
    assert "DS_ACCELERATOR" not in plan_launch(recipe(), RUN, 0, python="python", environ={"DS_ACCELERATOR": "cpu"}).env


def test_display_is_a_shell_line():
    plan = plan_launch(recipe(), Path("/runs/my run"), gpu_count=1, python="python", environ={})
    assert plan.display().endswith("--run-dir '/runs/my run'")


def test_hostfile_errors(tmp_path):
    bad = tmp_path / "hosts"
    bad.write_text("worker-0 slots=8\nworker-1\n")
    with pytest.raises(HostfileError, match=r"hosts:2: expected `hostname slots=N`"):
        read_hostfile(bad)
    bad.write_text("a slots=1\na slots=2\n")
    with pytest.raises(HostfileError, match="listed twice"):
        read_hostfile(bad)
    with pytest.raises(HostfileError, match="cannot read"):
        read_hostfile(tmp_path / "missing")


def test_free_port_moves_off_a_busy_port(held_port):
    assert free_port(held_port) != held_port
    assert free_port() != held_port > 0  # no port asked for: the OS's pick


REPORT = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
fake FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-01-01_00:00:01
  host      : box
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 11)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 11
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-01-01_00:00:00
  host      : box
  rank      : 3 (local_rank: 1)
  exitcode  : 3 (pid: 12)
  error_file: /runs/x/error.json
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


def test_parse_torchrun_failures_root_cause_first():
    failures = parse_torchrun_failures(REPORT)
    assert [(f.rank, f.local_rank, f.exitcode) for f in failures] == [(3, 1, 3), (0, 0, -15)]
    assert failures[0].error_file == "/runs/x/error.json" and failures[1].error_file is None
    assert failures[1].describe() == "rank 0 (local rank 0) on box was killed by SIGTERM"
    failures[1].message = "SafetensorError: incomplete metadata"  # its error file: it had raised first
    assert failures[1].describe() == "rank 0 (local rank 0) on box raised, then was killed by SIGTERM while exiting"
    assert failures[0].host == "box"
    assert parse_torchrun_failures("all fine\n") == []


# ----------------------------------------------------------------------------------------------
# Supervision with fake runners

FAKE_RUNNER = '''
import os, signal, sys, time
from pathlib import Path
from torch.distributed.elastic.multiprocessing.errors import record

rank = int(os.environ["RANK"])
run_dir = Path(sys.argv[sys.argv.index("--run-dir") + 1])
mode = os.environ["FAKE_MODE"]

def on_signal(signum, frame):
    (run_dir / f"got_{signal.Signals(signum).name}_rank{rank}").write_text("")
    sys.exit(0)

@record
def main():
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"rank {rank} of {os.environ['WORLD_SIZE']} up", flush=True)
    if mode == "exit3" and rank == 1:
        print("rank 1 gives up", file=sys.stderr, flush=True)
        sys.exit(3)
    if mode == "raise" and rank == 1:
        raise RuntimeError("bad batch on rank 1")
    if mode == "hang":
        (run_dir / f"ready{rank}").write_text("")
        time.sleep(30)
    time.sleep(0.5)
    (run_dir / f"done{rank}").write_text("")

main()
'''
# `record` is imported from torch only for the "raise" mode's error file; the import costs ~1 s per rank.
FAKE_RUNNER_NO_TORCH = FAKE_RUNNER.replace("from torch.distributed.elastic.multiprocessing.errors import record\n",
                                           "record = lambda f: f\n")


@pytest.fixture
def fake(tmp_path):
    """fake(mode, launcher) -> (plan, run_dir): a 2-process CPU launch of a fake runner module."""

    def make(mode: str, launcher: str = "torchrun", with_torch: bool = False):
        package = tmp_path / "fakes"
        package.mkdir(exist_ok=True)
        (package / "fake_runner.py").write_text(FAKE_RUNNER if with_torch else FAKE_RUNNER_NO_TORCH)
        r = recipe(procs_per_node=2, launcher=launcher)
        run_dir = tmp_path / "run"
        loaded = _loaded(r, tmp_path)
        write_run_dir(loaded, run_dir, world_size=2)
        plan = plan_launch(r, run_dir, gpu_count=0, module="fake_runner", master_port=free_port())
        plan.env.update({"PYTHONPATH": os.pathsep.join([str(package), os.environ.get("PYTHONPATH", "")]), "FAKE_MODE": mode})
        return plan, run_dir

    return make


def _loaded(r: Recipe, tmp_path: Path):
    path = tmp_path / "r.yaml"
    path.write_text("model: {name_or_path: org/m}\ndata: {path: org/d}\n")
    loaded = load_recipe(path)
    loaded.recipe = r
    return loaded


class Sink:
    """Stands in for the console (bytes)."""

    def __init__(self):
        self.data = b""

    def write(self, data):
        self.data += data

    def flush(self):
        pass


def test_success_runs_every_rank(fake):
    plan, run_dir = fake("ok")
    console = Sink()
    outcome = supervise(plan, console)
    assert outcome.ok and outcome.returncode == 0
    assert (run_dir / "done0").exists() and (run_dir / "done1").exists()
    assert b"[rank0]: rank 0 of 2 up" in console.data
    assert b"rank 1 of 2 up" not in console.data  # other ranks go to their log files only
    assert "rank 1 of 2 up" in (run_dir / "logs" / "rank1" / "stdout.log").read_text()
    # the launcher log has every line; the console all but torchrun's OMP_NUM_THREADS banner (issue 24)
    log = (run_dir / "logs" / "launcher.log").read_bytes()
    assert b"OMP_NUM_THREADS" in log and b"OMP_NUM_THREADS" not in console.data and b"*****" not in console.data
    assert [line for line in log.splitlines(True) if b"OMP_NUM_THREADS" not in line and b"*****" not in line] == \
        console.data.splitlines(True)


def test_a_failing_rank_is_named(fake):
    plan, run_dir = fake("exit3")
    console = Sink()
    outcome = supervise(plan, console)
    assert outcome.returncode == 1
    root = outcome.failures[0]
    assert (root.rank, root.exitcode) == (1, 3)
    assert re.fullmatch(r"rank 1 \(local rank 1\) on \S+ exited with code 3", outcome.message), outcome.message
    assert any("rank 1 gives up" in log.read_text() for log in outcome.logs)
    # torchrun's own traceback is kept out of the console (it reads like a crash of finetune) ...
    assert b'File "' not in console.data and b"Root Cause" in console.data
    # ... but stays in the launcher log
    assert b"Traceback (most recent call last)" in (run_dir / "logs" / "launcher.log").read_bytes()


def test_an_exception_in_a_rank_is_reported_with_its_message(fake):
    plan, _ = fake("raise", with_torch=True)
    outcome = supervise(plan, Sink())
    assert outcome.failures[0].rank == 1
    assert re.fullmatch(r"rank 1 \(local rank 1\) on \S+ exited with code 1: RuntimeError: bad batch on rank 1",
                        outcome.message), outcome.message


def test_deepspeed_launcher_names_the_rank_that_raised(fake):
    plan, run_dir = fake("raise", launcher="deepspeed")
    console = Sink()
    outcome = supervise(plan, console)
    assert outcome.returncode == 1 and [f.rank for f in outcome.failures] == [1]
    assert b"rank 0 of 2 up" in console.data  # rank 0's log file is followed onto the console
    assert "bad batch on rank 1" in outcome.logs[0].read_text()


@pytest.fixture
def held_port():
    """A port something listens on: what a rendezvous port taken between the check and the bind looks like."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_a_port_taken_before_torchrun_binds_it_is_replaced(fake, held_port, monkeypatch):
    import finetune.run.launch.supervision as supervision

    plan, run_dir = fake("ok")
    supervision._set_port(plan, held_port)  # free_port said it was free; someone took it since
    console = Sink()
    outcome = supervise(plan, console)
    assert outcome.ok, (outcome.message, console.data.decode()[-2000:])
    assert plan.master_port != held_port
    assert f"port {held_port} was taken before torchrun could bind it; starting again on port {plan.master_port}".encode() in console.data
    assert b"Traceback" not in console.data  # torchrun's 40-line DistNetworkError stays in launcher.log
    assert (run_dir / "done0").exists() and (run_dir / "done1").exists()


def test_a_busy_port_that_cannot_be_replaced_is_one_line_naming_it(fake, held_port, monkeypatch):
    import finetune.run.launch.supervision as supervision

    monkeypatch.setattr(supervision, "PORT_RETRIES", 0)
    plan, _ = fake("ok")
    supervision._set_port(plan, held_port)
    outcome = supervise(plan, Sink())
    assert outcome.returncode == 1 and outcome.port_in_use == held_port
    assert outcome.message == (f"the rendezvous port {held_port} on 127.0.0.1 is in use (another run?); "
                               f"nothing was started. Pass --master-port with a free port")


def test_failures_are_read_from_torchruns_error_files(fake):
    """The ranks' error.json files name the rank and its exception without torchrun's printed report."""
    from finetune.run.launch.outcome import judge

    plan, run_dir = fake("raise", with_torch=True)
    supervise(plan, Sink())
    outcome = judge(plan, 1, "", None)  # nothing printed (or a format this code does not know)
    assert [f.rank for f in outcome.failures] == [1]
    assert outcome.message.endswith("exited with code 1: RuntimeError: bad batch on rank 1"), outcome.message
    assert outcome.failures[0].error_file.endswith("/1/error.json")


def test_tests_pick_their_ports_from_the_os():
    """A test that asks for a well-known port (free_port(29500)) collides with a real run starting there."""
    here = Path(__file__).parents[1]
    offenders = [f"{path.relative_to(here)}:{number}" for path in sorted(here.rglob("*.py")) if path != Path(__file__)
                 for number, line in enumerate(path.read_text().splitlines(), 1) if re.search(r"free_port\(\s*\d", line)]
    assert not offenders, offenders


DRIVER = '''
import os, sys, json
from pathlib import Path
from finetune.run.launch.commands import LaunchPlan
from finetune.run.launch.supervision import supervise
plan = LaunchPlan(**{**json.loads(sys.argv[1]), "run_dir": Path(json.loads(sys.argv[1])["run_dir"])})
outcome = supervise(plan)
sys.exit(outcome.returncode)
'''


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signals_are_forwarded_to_every_rank(fake, sig):
    plan, run_dir = fake("hang")
    fields = {k: (str(v) if isinstance(v, Path) else v) for k, v in plan.__dict__.items()}
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, json.dumps(fields)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, cwd=Path(__file__).parents[2])
    try:
        deadline = time.monotonic() + 60
        while not ((run_dir / "ready0").exists() and (run_dir / "ready1").exists()):
            assert time.monotonic() < deadline and proc.poll() is None, "fake ranks did not start"
            time.sleep(0.1)
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 128 + sig
    finally:
        if proc.poll() is None:
            proc.kill()
    name = signal.Signals(sig).name  # each rank gets the signal that was sent (torchrun passes it on)
    assert (run_dir / f"got_{name}_rank0").exists() and (run_dir / f"got_{name}_rank1").exists()
    assert not (run_dir / "done0").exists() and not (run_dir / "done1").exists()


def _error_file(path: Path, message: str, timestamp: int) -> None:
    """An error.json as torch's @record writes it (torch/distributed/elastic/multiprocessing/errors)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"message": {"message": message, "extraInfo": {"py_callstack": "...",
                                                                              "timestamp": str(timestamp)}}}))


def _report(*failures: tuple[int, int, str]) -> str:
    """torchrun's ChildFailedError report: (local rank, exit code, error file) per failure, root cause first."""
    block = lambda i, r, c, f: (f"[{i}]:\n  time      : 2026-01-01_00:00:0{i}\n  host      : box\n"  # noqa: E731
                                f"  rank      : {r} (local_rank: {r})\n  exitcode  : {c} (pid: 1{r})\n"
                                f"  error_file: {f}\n  traceback : ...\n")
    root, *others = failures
    return ("Failures:\n" + "".join(block(i + 1, *f) for i, f in enumerate(others)) +
            "Root Cause (first observed failure):\n" + block(0, *root) + "=" * 20 + "\n")


@pytest.mark.parametrize("case", ["sigkill-rank1", "rank1-raises-later-than-rank0-notices"])
def test_the_rank_that_failed_first_is_named_not_its_peer(tmp_path, case):
    """Issue 25 item 7: rank 1 killed (or failing on a corrupt shard); rank 0 then fails in gloo."""
    import types

    from finetune.run.launch.outcome import torchrun_failures

    attempt = tmp_path / "logs" / "torchrun" / "id_x" / "attempt_0"
    gloo = "RuntimeError: [pair.cc:534] Connection closed by peer [127.0.0.1]:41772"
    _error_file(attempt / "0" / "error.json", gloo, 100)
    if case == "sigkill-rank1":
        output = _report((0, 1, attempt / "0" / "error.json"), (1, -9, "<N/A>"))
        expected = ("rank 1 (local rank 1) on box was killed by SIGKILL", None)
    else:
        shard = "RuntimeError: PytorchStreamReader failed reading zip archive: failed finding central directory"
        _error_file(attempt / "1" / "error.json", shard, 101)
        output = _report((0, 1, attempt / "0" / "error.json"), (1, 1, attempt / "1" / "error.json"))
        expected = (None, shard)
    plan = types.SimpleNamespace(run_dir=tmp_path, node_rank=0, procs_per_node=2)
    failures = torchrun_failures(plan, output)
    assert [f.rank for f in failures] == [1, 0]
    describe, message = expected
    assert failures[0].describe() == describe if describe else failures[0].message == message


def test_a_rank_that_exits_with_its_own_one_line_error_is_named_with_it(tmp_path):
    """Issue 25 item 8: a full disk is one line naming the device and the file, also in `finetune train`'s verdict."""
    import errno
    import types

    from finetune.rundir.checkpoint import disk_error_message, mount_point
    from finetune.run.launch.outcome import torchrun_failures

    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "run" / "checkpoint-4" / "shard.pt"))
    message = disk_error_message(full, tmp_path / "run")
    assert message.startswith(f"no space left on {mount_point(tmp_path)}: the output disk is full (writing {full.filename})")
    attempt = tmp_path / "logs" / "torchrun" / "id_x" / "attempt_0"
    (attempt / "0").mkdir(parents=True)
    (attempt / "0" / "stderr.log").write_text(f"[rank0]: step 4\n[rank0]: error: rank 0 on box: {message}\n")
    plan = types.SimpleNamespace(run_dir=tmp_path, node_rank=0, procs_per_node=2)
    failures = torchrun_failures(plan, _report((0, 1, "<N/A>"), (1, -15, "<N/A>")))
    assert [f.rank for f in failures] == [0, 1] and failures[0].message == message


# What torchrun printed when the run directory's disk filled during a checkpoint (issue 34 item 9, abridged from a
# run on a 1.5 MB tmpfs): its parse of the rank's empty error file, then its own error file unwritable.
FULL_DISK_OUTPUT = b"""\
[rank0]: {'loss': '5.035', 'grad_norm': '1.219'}
E1127 15:08:10.867000 6342 .venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/errors/__init__.py:132] Failed to parse reply file: /x/run/logs/torchrun/none_oi1rdop2/attempt_0/0/error.json
E1127 15:08:10.867000 6342 .venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/errors/__init__.py:132] Traceback (most recent call last):
E1127 15:08:10.867000 6342 .venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/errors/__init__.py:132] json.decoder.JSONDecodeError: Expecting value: line 1 column 1 (char 0)
Traceback (most recent call last):
  File "/v/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/errors/__init__.py", line 123, in __post_init__
    self.error_file_data = json.load(fp)
json.decoder.JSONDecodeError: Expecting value: line 1 column 1 (char 0)

During handling of the above exception, another exception occurred:

OSError: [Errno 28] No space left on device

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/v/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/errors/error_handler.py", line 87, in record_exception
    with open(file, "w") as fp:
OSError: [Errno 28] No space left on device
"""


def test_a_disk_that_fills_during_a_checkpoint_is_one_line_naming_the_mount(tmp_path):
    """Issue 34 item 9: 4 tracebacks and "torchrun exited with code 1"; now the console keeps the ranks' lines, the
    log that cannot be written is given up, and the verdict names the mount."""
    import io
    import types

    from finetune.rundir.checkpoint import mount_point
    from finetune.run.launch.outcome import judge
    from finetune.run.launch.supervision import Relay

    console = io.BytesIO()
    relay = Relay(io.BytesIO(FULL_DISK_OUTPUT), console, Path("/dev/full"))  # every write: ENOSPC
    relay.run()  # raised ENOSPC out of the thread when it closed the log
    assert console.getvalue() == FULL_DISK_OUTPUT.splitlines(True)[0]
    plan = types.SimpleNamespace(run_dir=tmp_path, launcher="torchrun", master_port=29500, master_addr="127.0.0.1",
                                 node_rank=0, procs_per_node=2)
    outcome = judge(plan, 1, relay.tail(), None)
    assert outcome.returncode == 1 and outcome.message == (
        f"no space left on {mount_point(tmp_path)}: the output disk is full (writing {tmp_path}); free some space, "
        "then run the same command again to resume")


# ------------------------------------------------------------------------------------------------
# The lifeline between `finetune train` and the launcher

LIFELINE_PARENT = r"""
import signal, subprocess, sys, threading, time
from finetune.run.lifeline import wrap
for _ in range(4):  # threads that outlive the main one when the process is SIGKILLed, as finetune train's do
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
proc = subprocess.Popen(wrap([sys.executable, "-c", sys.argv[1], sys.argv[2]], signal.SIGTERM), start_new_session=True)
print(proc.pid, flush=True)
time.sleep(60)
"""
LIFELINE_CHILD = r"""
import os, signal, sys, time
seen = []
signal.signal(signal.SIGTERM, lambda *_: seen.append(1))
open(sys.argv[1] + ".started", "w").close()
deadline = time.monotonic() + 2
while time.monotonic() < deadline:  # a launcher's shutdown, during which a second signal would hurt
    time.sleep(0.05)
with open(sys.argv[1], "w") as f:
    f.write(str(len(seen)))
"""


def test_a_killed_parent_gives_the_launcher_one_stop_signal_however_many_threads_it_had(tmp_path):
    """Linux fires the parent-death signal again each time the orphan is handed to another thread of the
    dying process: exec'd straight from `finetune train`, torchrun got two or three SIGTERMs and hung."""
    from tests.conftest import REPO

    count = tmp_path / "count"
    parent = subprocess.Popen([sys.executable, "-c", LIFELINE_PARENT, LIFELINE_CHILD, str(count)], cwd=REPO,
                              stdout=subprocess.PIPE, text=True)
    parent.stdout.readline()
    deadline = time.monotonic() + 60
    while not count.with_suffix(".started").exists():
        assert time.monotonic() < deadline and parent.poll() is None
        time.sleep(0.05)
    parent.kill()
    parent.wait()
    while not count.exists():
        assert time.monotonic() < deadline, "the launcher stand-in never finished"
        time.sleep(0.05)
    time.sleep(0.1)  # the file is written whole before the process ends
    assert count.read_text() == "1"


@pytest.mark.parametrize("code,expected", [("raise SystemExit(3)", 3),
                                           ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", -15)])
def test_the_lifeline_leaves_with_the_launchers_exit_status(code, expected):
    from finetune.run.lifeline import wrap
    from tests.conftest import REPO

    done = subprocess.run(wrap([sys.executable, "-c", code], signal.SIGTERM), cwd=REPO, timeout=60)
    assert done.returncode == expected
