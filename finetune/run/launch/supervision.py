"""Running the launcher to its end: spawn it, relay its output, forward signals, wait for every rank.

The launcher runs in its own process group; SIGINT/SIGTERM/SIGHUP sent to `finetune train` are
forwarded to it (SIGHUP as SIGTERM), and it forwards them to the ranks, which save a checkpoint at
the next step end and exit (finetune.train.preemption); torchrun waits `launch.stop_timeout` seconds
for them (its TORCH_ELASTIC_SHUTDOWN_TIMEOUT), DeepSpeed's launcher 30 s, then they are killed.
`finetune train` then exits 75 (finetune.rundir.checkpoint.EXIT_PREEMPTED) when the checkpoint was saved.
A repeat within finetune.rundir.checkpoint.SECOND_SIGNAL_WINDOW is the same request; a later signal kills
every process of the run at once. `finetune train` never returns while a rank it started is still
alive, and the launcher dies with it (finetune.run.lifeline). What the run came to is judged in
finetune.run.launch.outcome.

The supervision is split in two places on purpose: `spawn()` starts the launcher, `supervise()`
waits, relays output, forwards signals and reports. Resume/preemption builds on these.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Optional

from finetune.errors import FinetuneError
from finetune.run.launch.commands import LOCAL_HOSTS, LOOPBACK, LaunchPlan, free_port
from finetune.run.launch.outcome import Outcome, judge, link_rank_logs
from finetune.rundir.names import LAUNCHER_ERROR_FILE, LOGS_DIR

if TYPE_CHECKING:
    from finetune.run.deepspeed_ops import BuildWatch

TAIL_LINES = 400  # launcher output kept in memory to read the failure report from
POLL_SECONDS = 0.2


class LaunchError(FinetuneError):
    """The launcher could not be started at all."""



def spawn(plan: LaunchPlan, keep_fds: tuple[int, ...] = ()) -> subprocess.Popen:
    """Start the launcher in its own session: terminal signals reach it only through us (forwarded).

    It dies with us (finetune.run.lifeline: SIGTERM when this process dies, so torchrun stops its ranks),
    and inherits `keep_fds` (the run directory's lock: the directory stays owned while it lives)."""
    from finetune.run.lifeline import wrap

    env = dict(os.environ)
    env.update(plan.env)
    try:
        return subprocess.Popen(wrap(plan.argv, signal.SIGTERM, plan.argv[0]), env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                                pass_fds=keep_fds)
    except OSError as exc:
        raise LaunchError(f"cannot start {plan.argv[0]}: {exc.strerror or exc}") from None


# Signals `finetune train` turns into a checkpoint-and-stop; SIGHUP is a dropped terminal or SSH session.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
PORT_RETRIES = 3  # new rendezvous ports tried when the one checked free was taken before torchrun bound it


def supervise(plan: LaunchPlan, console: Optional[IO[bytes]] = None, keep_fds: tuple[int, ...] = (),
              builds: Optional["BuildWatch"] = None) -> Outcome:
    """Run `plan` to the end: relay output, forward stop signals, say which rank failed.

    A single-node torchrun whose rendezvous port was taken between the check and its bind is started
    again on another port (PORT_RETRIES times); nothing had started then."""
    from finetune.rundir.checkpoint import clear_stop_record

    console = console or sys.stdout.buffer
    (plan.run_dir / LOGS_DIR).mkdir(parents=True, exist_ok=True)
    clear_stop_record(plan.run_dir)
    for attempt in range(PORT_RETRIES + 1):
        outcome = _supervise_once(plan, console, keep_fds, builds)
        busy = outcome.port_in_use
        if busy is None or outcome.signal is not None or plan.nodes > 1 or attempt == PORT_RETRIES:
            return outcome
        port = free_port(0, plan.master_addr if plan.master_addr in LOCAL_HOSTS else LOOPBACK)
        Relay._write(console, f"[finetune] port {busy} was taken before torchrun could bind it; "
                              f"starting again on port {port}\n".encode())
        _set_port(plan, port)
    return outcome


def _set_port(plan: LaunchPlan, port: int) -> None:
    flag = "--master-port" if plan.launcher == "torchrun" else "--master_port"
    plan.argv[plan.argv.index(flag) + 1] = str(port)
    plan.master_port = port


def _supervise_once(plan: LaunchPlan, console: IO[bytes], keep_fds: tuple[int, ...],
                    builds: Optional["BuildWatch"]) -> Outcome:
    from finetune.rundir.checkpoint import SECOND_SIGNAL_WINDOW

    logs = plan.run_dir / LOGS_DIR
    error_file = logs / LAUNCHER_ERROR_FILE
    error_file.unlink(missing_ok=True)
    if plan.launcher == "torchrun":
        # torchrun's @record main writes its own exception here; it gives each rank a file of its own.
        plan = LaunchPlan(**{**plan.__dict__, "env": {**plan.env, "TORCHELASTIC_ERROR_FILE": str(error_file)}})
    started_at = time.time()
    forwarded: list[int] = []
    first_at: list[float] = []
    running: list[subprocess.Popen] = []
    tracker = ProcessTree()

    def forward(signum, _frame):
        now = time.monotonic()
        if first_at and now - first_at[0] <= SECOND_SIGNAL_WINDOW:
            return  # the same request, sent twice (the ranks apply the same rule)
        forwarded.append(signum)
        first_at.append(now)
        if not running:
            return
        if len(forwarded) == 1:
            _signal_group(running[0], _as_stop(signum))  # the ranks save a checkpoint and stop
        else:
            tracker.kill(running[0])  # a later second signal: abort at once

    # Handlers go in before the launcher starts: a Ctrl-C in between must not orphan it.
    previous = _install_handlers(forward)
    if builds is not None:
        builds.started = time.monotonic()
    try:
        proc = spawn(plan, keep_fds)
        running.append(proc)
        if forwarded:
            _signal_group(proc, _as_stop(forwarded[0]))
        relay = Relay(proc.stdout, console, logs / "launcher.log")
        relay.start()
        try:
            wait(plan, proc, console, tracker, builds)
            # torchrun starts each rank in a session of its own, and a launcher that was signalled can
            # exit before its ranks: wait for them (they may be writing a checkpoint), then kill.
            tracker.wait_gone(plan.stop_timeout + 30 if forwarded else 30)
        except BaseException:
            _signal_group(proc, signal.SIGTERM)  # never leave ranks running behind a crashed supervisor
            raise
        finally:
            tracker.kill(proc)
            relay.join()
    finally:
        _restore_handlers(previous)
    link_rank_logs(plan)
    return judge(plan, proc.returncode, relay.tail(), forwarded[0] if forwarded else None, started_at)


def _as_stop(signum: int) -> int:
    """SIGHUP asks for what SIGTERM does; the ranks (and torchrun's report) know SIGTERM and SIGINT."""
    return signal.SIGTERM if signum == signal.SIGHUP else signum


class ProcessTree:
    """The launcher's descendants (the ranks), remembered while they run.

    torchrun puts every rank in a new session, out of reach of a signal to the launcher's group.
    psutil (a DeepSpeed dependency) lists them; without it only the group is reached."""

    def __init__(self) -> None:
        self.known: dict[int, object] = {}
        try:
            import psutil
        except ImportError:
            psutil = None
        self._psutil = psutil

    def poll(self, proc: subprocess.Popen) -> None:
        if self._psutil is None or proc.poll() is not None:
            return
        try:
            for child in self._psutil.Process(proc.pid).children(recursive=True):
                self.known.setdefault(child.pid, child)
        except self._psutil.Error:
            pass

    def alive(self) -> list:
        if self._psutil is None:
            return []
        return [p for p in self.known.values() if self._is_running(p)]

    def _is_running(self, process) -> bool:
        try:
            return process.is_running() and process.status() != self._psutil.STATUS_ZOMBIE
        except self._psutil.Error:
            return False

    def wait_gone(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.alive() and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)

    def kill(self, proc: subprocess.Popen) -> None:
        """SIGKILL the launcher's group and every descendant seen (no-op once all are gone)."""
        self.poll(proc)
        _signal_group(proc, signal.SIGKILL)
        for process in self.alive():
            try:
                process.kill()
            except self._psutil.Error:
                pass


def wait(plan: LaunchPlan, proc: subprocess.Popen, console: IO[bytes], tracker: Optional[ProcessTree] = None,
         builds: Optional["BuildWatch"] = None) -> None:
    """Until the launcher exits: follow rank 0's log for the deepspeed launcher, link the rank logs, say
    when a first-run compile is done, when ninja compiles a built op again (or a stale build lock was cleared)."""
    logs = plan.run_dir / LOGS_DIR
    rank0 = Follower(logs, "*_rank0.log", console) if plan.launcher == "deepspeed" and plan.node_rank == 0 else None
    linked = False
    while proc.poll() is None:
        time.sleep(POLL_SECONDS)
        if tracker is not None:
            tracker.poll(proc)
        if rank0:
            rank0.poll()
        if not linked:
            linked = link_rank_logs(plan)  # as soon as torchrun made the folders: tail -f works during the run
        if builds is not None and builds.due():  # built ops too: ninja may compile one again (BuildWatch._rebuilds)
            for note in builds.poll():
                Relay._write(console, f"[finetune] {note}\n".encode())
    if rank0:
        rank0.poll()


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)  # the launcher leads its own process group (start_new_session)
    except ProcessLookupError:
        pass


def _install_handlers(handler) -> dict[int, object]:
    if threading.current_thread() is not threading.main_thread():
        return {}  # signals can only be caught in the main thread; a caller there forwards them
    return {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}


def _restore_handlers(previous: dict[int, object]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


class Relay(threading.Thread):
    """Copies the launcher's output to the console and RUN/logs/launcher.log; keeps the last lines.

    Line by line: ranks' lines arrive whole anyway (torchrun tails their log files). The launcher's
    own Python traceback when a rank fails (frames of torch/distributed/run.py, which read like a
    crash of finetune) goes only to launcher.log; its exception line and failure report still show.
    """

    def __init__(self, source: IO[bytes], console: IO[bytes], log_path: Path):
        super().__init__(daemon=True)
        self.source, self.console, self.log_path = source, console, log_path
        self._tail: collections.deque[bytes] = collections.deque(maxlen=TAIL_LINES)
        self._held: list[bytes] = []  # a launcher traceback being read (with its chained ones), not shown yet
        self._raised = False  # the held traceback's exception line has come: a line that continues nothing ends it

    def run(self) -> None:
        # Unbuffered, and a log that cannot be written is given up: on a full disk the relay goes on (a close that
        # flushed a buffer raised ENOSPC out of this thread, issue 34); the console and the tail still get every line.
        try:
            log: Optional[IO[bytes]] = open(self.log_path, "ab", buffering=0)
        except OSError:
            log = None
        try:
            for line in iter(self.source.readline, b""):
                self._tail.append(line.rstrip(b"\n"))
                if log is not None and not self._write(log, line):
                    log.close()
                    log = None
                for shown in self._filter(line):
                    self._write(self.console, shown)
            for shown in self._end_traceback():
                self._write(self.console, shown)
        finally:
            if log is not None:
                log.close()

    def _filter(self, line: bytes) -> list[bytes]:
        stripped = line.rstrip(b"\r\n")
        if _SIGNALLED.search(stripped):
            self._held, self._raised = [], False  # its traceback too: `finetune train` reports the stop (issue 34)
            return []
        if _NOISE.search(stripped):
            return []  # in launcher.log only (issue 24: every line on screen worth reading)
        if not self._held:
            if line.startswith(b"Traceback (most recent call last):"):
                self._held = [line]
                return []
            return [line]
        if line[:1] in (b" ", b"\t") or not stripped or line.startswith(b"Traceback (most recent call last):") \
                or stripped in _CHAINED:
            self._held.append(line)  # a frame, or the next exception of a chain
            if stripped in _CHAINED:
                self._raised = False  # its exception line (with or without frames) comes next
            return []
        if not self._raised:
            self._held.append(line)  # the exception line; a chained traceback may follow
            self._raised = True
            return []
        return self._end_traceback() + self._filter(line)

    def _end_traceback(self) -> list[bytes]:
        """What the console shows of the launcher traceback just read: torchrun's own (its frames in
        torch/distributed) only as its last exception line when that is torchrun's report of failed ranks
        (ChildFailedError, whose report follows), else nothing: launcher.log keeps it, and `finetune train`'s
        verdict says what failed (a full disk, a port in use)."""
        held, self._held, self._raised = self._held, [], False
        raised = [line for line in held if line[:1] not in (b" ", b"\t") and line.strip()
                  and not line.startswith(b"Traceback (most recent call last):") and line.rstrip(b"\r\n") not in _CHAINED]
        if raised and raised[-1].startswith(_LAUNCHER_EXCEPTIONS):
            return [raised[-1]]
        if any(b"torch/distributed/" in line for line in held if line.lstrip().startswith(b'File "')):
            return []
        return held

    @staticmethod
    def _write(sink: IO[bytes], data: bytes) -> bool:
        try:
            sink.write(data)
            sink.flush()
            return True
        except (OSError, ValueError):  # a closed terminal, a full disk: must not stop the training
            return False

    def tail(self) -> str:
        return b"\n".join(self._tail).decode("utf-8", "replace")


# Lines that tell the user nothing to act on: torchrun's OMP_NUM_THREADS banner (it sets 1 per rank, as it
# says, whenever several ranks share a machine), and DeepSpeed's "built successfully" for an op that
# finetune.run.deepspeed_ops already announced (and that a cache hit merely loads).
# Also torchrun's "Failed to parse reply file" with its traceback (a rank's error file that a full disk left
# empty, or a rank killed while writing it): the verdict names the rank and the cause.
_NOISE = re.compile(rb"^\*{20,}$|^Setting OMP_NUM_THREADS environment variable for each process"
                    rb"|^(\[(rank|default)\d+\]:\s?)?DeepSpeed \S+ built successfully$"
                    rb"|^E\d{4} [\d:.]+ +\d+ \S*torch/distributed/elastic/multiprocessing/errors/__init__\.py:\d+\] ")
_CHAINED = (b"During handling of the above exception, another exception occurred:",
            b"The above exception was the direct cause of the following exception:")

# torchrun's own account of being signalled (its agent's warning, and the SignalException its handler raises
# through main, with the traceback): on every Ctrl-C, while `finetune train` reports the stop and the checkpoint.
_SIGNALLED = re.compile(rb"torch/distributed/elastic/agent/server/api\.py:\d+\] Received \S+ death signal"
                        rb"|^torch\.distributed\.elastic\.multiprocessing\.api\.SignalException: Process \d+ got signal")

# Exceptions torchrun raises itself when ranks fail or it is signalled (torch.distributed.elastic).
_LAUNCHER_EXCEPTIONS = (b"torch.distributed.elastic.", b"torch.distributed.DistNetworkError")


class Follower:
    """Prints what a rank appends to its log file (deepspeed's launcher sends rank 0 only there)."""

    def __init__(self, directory: Path, pattern: str, console: IO[bytes]):
        self.directory, self.pattern, self.console = directory, pattern, console
        self.path: Optional[Path] = None
        self.offset = 0

    def poll(self) -> None:
        if self.path is None:
            found = sorted(self.directory.glob(self.pattern))
            if not found:
                return
            self.path = found[-1]
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except OSError:
            return
        if data:
            self.offset += len(data)
            self.console.write(data)
            self.console.flush()
