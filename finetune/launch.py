"""Start the per-rank runner on every GPU of this machine and watch it: argv, spawning, signals, failures.

Two launchers, chosen by `launch.launcher` (auto: deepspeed when a hostfile is set, else torchrun):

    # torchrun: one process per GPU; rank 0 on the console, every rank in RUN/logs/torchrun/...
    python -m torch.distributed.run --nnodes 1 --nproc-per-node 2 --node-rank 0 \\
        --master-addr 127.0.0.1 --master-port 29500 --log-dir RUN/logs/torchrun --redirects 3 --tee 0:3 \\
        -m finetune.train.runner --run-dir RUN

    # deepspeed: hostfiles and pdsh for several machines; each rank to RUN/logs/<time>_rank<K>.log
    python -m deepspeed.launcher.runner --num_gpus 2 --master_addr 127.0.0.1 --master_port 29500 \\
        --no_local_rank --enable_each_rank_log RUN/logs --module finetune.train.runner --run-dir RUN

The launcher runs in its own process group; SIGINT/SIGTERM/SIGHUP sent to `finetune train` are
forwarded to it (SIGHUP as SIGTERM), and it forwards them to the ranks, which save a checkpoint at
the next step end and exit (finetune.train.preemption); torchrun waits `launch.stop_timeout` seconds
for them (its TORCH_ELASTIC_SHUTDOWN_TIMEOUT), DeepSpeed's launcher 30 s, then they are killed.
`finetune train` then exits 75 (finetune.checkpoint.EXIT_PREEMPTED) when the checkpoint was saved.
A repeat within finetune.checkpoint.SECOND_SIGNAL_WINDOW is the same request; a later signal kills
every process of the run at once. `finetune train` never returns while a rank it started is still
alive, and the launcher dies with it (finetune.lifeline). A failing rank is named from the error
files torchrun gives every rank (error.json, written by the runner's @record), with exit codes and
hosts from torchrun's printed failure report, which alone serves when there are no error files.

Several machines: with torchrun, `finetune train` runs on every machine with its --node-rank
(static rendezvous at master_addr:master_port; `finetune slurm` writes that for SLURM); with a
hostfile, DeepSpeed's launcher on node 0 starts the others over pdsh/ssh. --dry-run prints the
command of every node (`commands_per_node`).

With no GPU, `procs_per_node: auto` means `launch.cpu_procs` CPU processes (default 1) and an
explicit number that many, on DeepSpeed's CPU accelerator (gloo), so the whole path runs in CI.

The supervision is split in two places on purpose: `spawn()` starts the launcher, `supervise()`
waits, relays output, forwards signals and reports. Resume/preemption builds on these.
"""

from __future__ import annotations

import collections
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Optional

from finetune.recipe import Recipe

if TYPE_CHECKING:
    from finetune.preflight import Preflight
    from finetune.recipe import LoadedRecipe
    from finetune.extensions import BuildWatch
    from finetune.runlock import RunLock

RUNNER_MODULE = "finetune.train.runner"
DEFAULT_MASTER_PORT = 29500  # torchrun's and DeepSpeed's default
# Every rank's console line starts with its global rank (torchrun's default names the role instead).
LOG_LINE_PREFIX = "[rank${rank}]: "
TAIL_LINES = 400  # launcher output kept in memory to read the failure report from
POLL_SECONDS = 0.2
LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1"}
DEEPSPEED_ENV_FILE = "deepspeed.env"
# Passed to the other nodes of a hostfile launch (DeepSpeed itself exports NCCL*, PYTHON*, UCX*, ...).
# Never tokens: the file sits in the run directory, readable by the team; put HF_TOKEN in ~/.deepspeed_env.
PROPAGATED_ENV = ("TQDM_DISABLE", "DS_ACCELERATOR", "FINETUNE_CACHE", "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE",
                  "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "TOKENIZERS_PARALLELISM", "OMP_NUM_THREADS",
                  "CUDA_DEVICE_ORDER", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")


class HostfileError(Exception):
    pass


class LaunchError(Exception):
    """The launcher could not be started at all."""


@dataclass
class LaunchPlan:
    argv: list[str]
    env: dict[str, str]  # added to os.environ for the launcher and the ranks
    run_dir: Path
    launcher: str  # torchrun or deepspeed
    procs_per_node: int
    nodes: int
    node_rank: int
    world_size: int
    device: str  # cuda or cpu
    notes: list[str] = field(default_factory=list)
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_MASTER_PORT
    stop_timeout: int = 300  # seconds the ranks get to save a checkpoint after a signal
    hosts: Optional[dict[str, int]] = None  # the hostfile's hosts used (deepspeed launcher)

    def display(self) -> str:
        """The command as a shell line (for --dry-run and the log)."""
        extra = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()) if k not in _QUIET_ENV)
        return (extra + " " if extra else "") + shlex.join(self.argv)


# Set for every run; not worth showing in the printed command.
_QUIET_ENV = {"PYTHONUNBUFFERED", "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "TQDM_DISABLE"}


# ----------------------------------------------------------------------------------------------
# Planning: recipe + machine -> argv


def choose_launcher(recipe: Recipe) -> str:
    launcher = recipe.launch.launcher
    if launcher == "auto":
        return "deepspeed" if recipe.launch.hostfile else "torchrun"
    return launcher


def procs_per_node(recipe: Recipe, gpu_count: int) -> int:
    """auto: one process per visible GPU; with no GPU, `launch.cpu_procs` CPU processes."""
    procs = recipe.launch.procs_per_node
    if isinstance(procs, int):
        return procs
    return gpu_count if gpu_count > 0 else recipe.launch.cpu_procs


def read_hostfile(path: Path) -> dict[str, int]:
    """DeepSpeed's format: `host slots=N` per line, `#` comments. Returns host -> slots, in order."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise HostfileError(f"{path}: cannot read: {exc.strerror or exc}") from None
    hosts: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.match(r"^(\S+)\s+slots=(\d+)", line)
        if not match:
            raise HostfileError(f"{path}:{number}: expected `hostname slots=N`, got {line!r}")
        host, slots = match.group(1), int(match.group(2))
        if host in hosts:
            raise HostfileError(f"{path}:{number}: host {host} is listed twice")
        hosts[host] = slots
    if not hosts:
        raise HostfileError(f"{path}: no hosts")
    return hosts


def plan_launch(recipe: Recipe, run_dir: Path, gpu_count: int, module: str = RUNNER_MODULE,
                python: str = sys.executable, environ: Optional[dict[str, str]] = None,
                master_port: Optional[int] = None) -> LaunchPlan:
    """The launch for `recipe` on this machine. `module` is replaced by tests with a fake runner."""
    environ = dict(os.environ if environ is None else environ)
    run_dir = Path(run_dir).absolute()
    launch = recipe.launch
    procs = procs_per_node(recipe, gpu_count)
    port = master_port if master_port is not None else launch.master_port
    env = {"PYTHONUNBUFFERED": "1"}  # rank output reaches the log files (and the console) as it is printed
    if "TQDM_DISABLE" not in environ:
        # Rank output reaches the console through log files read line by line (torchrun's tee), where a
        # redrawn progress bar turns into a new line per redraw; the loss lines are printed anyway.
        env["TQDM_DISABLE"] = "1"
    device = "cuda" if gpu_count > 0 else "cpu"
    if device == "cpu" and "DS_ACCELERATOR" not in environ:
        env["DS_ACCELERATOR"] = "cpu"  # skip DeepSpeed's accelerator probing (and its warning)
    hosts = None
    if choose_launcher(recipe) == "deepspeed":
        argv, world = deepspeed_argv(recipe, run_dir, procs, port, module, python, environ)
        launcher = "deepspeed"
        if launch.hostfile:
            hosts = dict(list(read_hostfile(Path(launch.hostfile).expanduser()).items())[:launch.nodes])
            if len(hosts) > 1:
                # pdsh starts the other nodes with DeepSpeed's list of exports (NCCL*, PYTHON*, ...) plus
                # the lines of this file (DS_ENV_FILE; an absolute name wins over DeepSpeed's folders).
                env["DS_ENV_FILE"] = str(run_dir / DEEPSPEED_ENV_FILE)
    else:
        env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = LOG_LINE_PREFIX
        # torchrun's grace period between forwarding a signal to the ranks and SIGKILL (default 30 s).
        env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(launch.stop_timeout)
        argv = torchrun_argv(run_dir, procs, launch.nodes, launch.node_rank, launch.master_addr, port, module, python)
        world = procs * launch.nodes
        launcher = "torchrun"
    return LaunchPlan(argv=argv, env=env, run_dir=run_dir, launcher=launcher, procs_per_node=procs,
                      nodes=launch.nodes, node_rank=launch.node_rank, world_size=world, device=device,
                      master_addr=launch.master_addr, master_port=port, stop_timeout=launch.stop_timeout, hosts=hosts)


def torchrun_argv(run_dir: Path, procs: int, nodes: int, node_rank: int, master_addr: str, master_port: int,
                  module: str = RUNNER_MODULE, python: str = sys.executable) -> list[str]:
    # --redirects 3: every rank's stdout+stderr go to files under --log-dir; --tee 0:3: local rank 0
    # also to the console. Static rendezvous: node 0 hosts the store at master_addr:master_port.
    return [
        python, "-m", "torch.distributed.run",
        "--nnodes", str(nodes),
        "--nproc-per-node", str(procs),
        "--node-rank", str(node_rank),
        "--master-addr", master_addr,
        "--master-port", str(master_port),
        "--log-dir", str(run_dir / "logs" / "torchrun"),
        "--redirects", "3",
        "--tee", "0:3",
        "-m", module, "--run-dir", str(run_dir),
    ]


def deepspeed_argv(recipe: Recipe, run_dir: Path, procs: int, master_port: int, module: str = RUNNER_MODULE,
                   python: str = sys.executable, environ: Optional[dict[str, str]] = None) -> tuple[list[str], int]:
    """argv for deepspeed.launcher.runner and the world size it implies."""
    environ = environ if environ is not None else dict(os.environ)
    launch = recipe.launch
    argv = [python, "-m", "deepspeed.launcher.runner"]
    if launch.hostfile:
        hosts = list(read_hostfile(Path(launch.hostfile).expanduser()).items())[:launch.nodes]
        argv += ["--hostfile", str(Path(launch.hostfile).expanduser().absolute()), "--num_nodes", str(len(hosts))]
        if isinstance(launch.procs_per_node, int):
            argv += ["--num_gpus", str(procs)]
            world = procs * len(hosts)
        else:
            world = sum(slots for _, slots in hosts)
        multi = len(hosts) > 1
        if not multi and hosts[0][0] in LOCAL_HOSTS:
            argv.append("--no_ssh_check")  # one local host: DeepSpeed would still ssh to it first
        # With several hosts and the default address, let DeepSpeed ask node 0 (`hostname -I` over ssh).
        if not (multi and launch.master_addr == "127.0.0.1"):
            argv += ["--master_addr", launch.master_addr]
    else:
        visible = [d for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        if visible:
            # DeepSpeed drops CUDA_VISIBLE_DEVICES once any of --num_gpus/--include is given; --include
            # keeps the GPUs the user picked.
            argv += ["--include", f"localhost:{','.join(visible[:procs])}"]
        else:
            argv += ["--num_gpus", str(procs)]
        argv += ["--master_addr", launch.master_addr]
        world = procs
    argv += ["--master_port", str(master_port)]
    # The runner reads LOCAL_RANK from the environment, as under torchrun.
    argv += ["--no_local_rank", "--enable_each_rank_log", str(run_dir / "logs"), "--module", module, "--run-dir", str(run_dir)]
    return argv, world


def free_port(preferred: int, host: str = "127.0.0.1") -> int:
    """`preferred` when nothing listens there, else a free port the OS picks (single-node runs only)."""
    for port in (preferred, 0):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return sock.getsockname()[1]
    return preferred


# ----------------------------------------------------------------------------------------------
# Supervision


@dataclass
class RankFailure:
    rank: int
    local_rank: int
    exitcode: int
    error_file: Optional[str] = None
    message: Optional[str] = None
    host: Optional[str] = None

    def describe(self) -> str:
        if self.exitcode < 0:
            try:
                how = f"was killed by {signal.Signals(-self.exitcode).name}"
            except ValueError:
                how = f"was killed by signal {-self.exitcode}"
        else:
            how = f"exited with code {self.exitcode}"
        where = f" on {self.host}" if self.host else ""
        return f"rank {self.rank} (local rank {self.local_rank}){where} {how}"


@dataclass
class Outcome:
    returncode: int  # what `finetune train` exits with
    failures: list[RankFailure] = field(default_factory=list)  # root cause first
    signal: Optional[int] = None  # a signal we forwarded
    message: str = ""
    logs: list[Path] = field(default_factory=list)  # log files of the failed ranks
    port_in_use: Optional[int] = None  # the launcher could not bind the rendezvous port; nothing started

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def spawn(plan: LaunchPlan, keep_fds: tuple[int, ...] = ()) -> subprocess.Popen:
    """Start the launcher in its own session: terminal signals reach it only through us (forwarded).

    It dies with us (finetune.lifeline: SIGTERM when this process dies, so torchrun stops its ranks),
    and inherits `keep_fds` (the run directory's lock: the directory stays owned while it lives)."""
    from finetune.lifeline import wrap

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
LAUNCHER_ERROR_FILE = "launcher_error.json"  # torchrun's own exception (its main is wrapped in @record)


def supervise(plan: LaunchPlan, console: Optional[IO[bytes]] = None, keep_fds: tuple[int, ...] = (),
              builds: Optional["BuildWatch"] = None) -> Outcome:
    """Run `plan` to the end: relay output, forward stop signals, say which rank failed.

    A single-node torchrun whose rendezvous port was taken between the check and its bind is started
    again on another port (PORT_RETRIES times); nothing had started then."""
    from finetune.checkpoint import clear_stop_record

    console = console or sys.stdout.buffer
    (plan.run_dir / "logs").mkdir(parents=True, exist_ok=True)
    clear_stop_record(plan.run_dir)
    for attempt in range(PORT_RETRIES + 1):
        outcome = _supervise_once(plan, console, keep_fds, builds)
        busy = outcome.port_in_use
        if busy is None or outcome.signal is not None or plan.nodes > 1 or attempt == PORT_RETRIES:
            return outcome
        port = free_port(0, plan.master_addr if plan.master_addr in LOCAL_HOSTS else "127.0.0.1")
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
    from finetune.checkpoint import SECOND_SIGNAL_WINDOW

    logs = plan.run_dir / "logs"
    error_file = logs / LAUNCHER_ERROR_FILE
    error_file.unlink(missing_ok=True)
    if plan.launcher == "torchrun":
        # torchrun's @record main writes its own exception here; it gives each rank a file of its own.
        plan = LaunchPlan(**{**plan.__dict__, "env": {**plan.env, "TORCHELASTIC_ERROR_FILE": str(error_file)}})
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
    return judge(plan, proc.returncode, relay.tail(), forwarded[0] if forwarded else None)


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
    when a first-run compile is done (or a stale build lock was cleared)."""
    logs = plan.run_dir / "logs"
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
        if builds is not None and builds.pending and builds.due():
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
        self._held: list[bytes] = []  # a launcher traceback being read, not shown yet

    def run(self) -> None:
        with open(self.log_path, "ab") as log:
            for line in iter(self.source.readline, b""):
                self._tail.append(line.rstrip(b"\n"))
                self._write(log, line)
                for shown in self._filter(line):
                    self._write(self.console, shown)
            for shown in self._held:
                self._write(self.console, shown)

    def _filter(self, line: bytes) -> list[bytes]:
        if line.startswith(b"Traceback (most recent call last):"):
            held, self._held = self._held, [line]
            return held
        if not self._held:
            return [line]
        if line[:1] in (b" ", b"\t"):
            self._held.append(line)
            return []
        held, self._held = self._held, []
        if line.startswith(_LAUNCHER_EXCEPTIONS):
            return [line]  # the frames are the launcher's, not the user's: keep only the exception
        return held + [line]

    @staticmethod
    def _write(sink: IO[bytes], data: bytes) -> None:
        try:
            sink.write(data)
            sink.flush()
        except (OSError, ValueError):  # a closed terminal must not stop the training
            pass

    def tail(self) -> str:
        return b"\n".join(self._tail).decode("utf-8", "replace")


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


# ----------------------------------------------------------------------------------------------
# Reports


_ROOT_CAUSE = "Root Cause (first observed failure):"
_FAILURE_RE = re.compile(
    r"(?:host\s*:\s*(?P<host>\S+)[^\n]*\n\s*)?"
    r"rank\s*:\s*(?P<rank>-?\d+)\s*\(local_rank:\s*(?P<local>\d+)\)\s*\n"
    r"\s*exitcode\s*:\s*(?P<code>-?\d+)[^\n]*\n"
    r"\s*error_file\s*:\s*(?P<file>[^\n]*)")


def parse_torchrun_failures(text: str) -> list[RankFailure]:
    """Failed ranks from torchrun's ChildFailedError report, root cause first.

    The report (torch/distributed/elastic/multiprocessing/errors) lists `rank : 1 (local_rank: 1)`,
    `exitcode : 3 (pid: ...)` and `error_file` for each failure under "Failures:", and the first
    observed one under "Root Cause". Ranks SIGTERMed by torchrun after the root cause are listed too.
    """
    if _ROOT_CAUSE not in text:
        return []
    before, _, root = text.rpartition(_ROOT_CAUSE)
    others = before[before.rfind("Failures:"):] if "Failures:" in before else ""
    failures = []
    for block in (root, others):
        for match in _FAILURE_RE.finditer(block):
            error_file = match.group("file").strip()
            failures.append(RankFailure(int(match.group("rank")), int(match.group("local")), int(match.group("code")),
                                        None if error_file in ("", "<N/A>") else error_file, host=match.group("host")))
    return failures


def judge(plan: LaunchPlan, returncode: int, output: str, forwarded: Optional[int]) -> Outcome:
    from finetune.checkpoint import EXIT_PREEMPTED, latest_complete, read_stop_record

    if returncode == 0:
        return Outcome(0, message="all ranks finished")
    stopped = read_stop_record(plan.run_dir)  # written by the ranks once the checkpoint is complete
    if stopped is not None:
        # The ranks saw SIGTERM when we were sent SIGHUP (_as_stop): name what the user's side sent.
        name = "SIGHUP" if forwarded == signal.SIGHUP else stopped.get("signal")
        return Outcome(EXIT_PREEMPTED, signal=forwarded,
                       message=f"{name} at step {stopped.get('step')}: "
                               f"{stopped.get('checkpoint')} is complete; run the same command again to resume")
    if forwarded is not None:
        name = signal.Signals(forwarded).name
        latest = latest_complete(plan.run_dir)
        saved = f"the newest complete checkpoint is {latest.name}" if latest else "no checkpoint was saved"
        return Outcome(128 + forwarded, signal=forwarded, message=f"stopped by {name} (forwarded to all ranks); {saved}")
    launcher_error = read_error_file(plan.run_dir / "logs" / LAUNCHER_ERROR_FILE) if plan.launcher == "torchrun" else None
    busy = port_in_use(launcher_error or "", plan.master_port) or port_in_use(output, plan.master_port)
    if busy is not None:
        return Outcome(1, port_in_use=busy,
                       message=f"the rendezvous port {busy} on {plan.master_addr} is in use (another run?); "
                               f"nothing was started. Pass --master-port with a free port")
    failures = torchrun_failures(plan, output) if plan.launcher == "torchrun" else []
    if failures:
        root = failures[0]
        logs = rank_log_files(plan, root.local_rank)
        message = f"{root.describe()}"
        if root.message:
            message += f": {root.message}"
        return Outcome(1, failures=failures, message=message, logs=logs)
    if plan.launcher == "deepspeed":
        return _judge_deepspeed(plan, returncode, output)
    if launcher_error:
        return Outcome(returncode if returncode > 0 else 1, message=f"{plan.launcher} failed: {launcher_error}")
    return Outcome(returncode if returncode > 0 else 1,
                   message=f"{plan.launcher} exited with code {returncode} (see {plan.run_dir / 'logs' / 'launcher.log'})")


_PORT_IN_USE_RE = re.compile(r"EADDRINUSE|[Aa]ddress already in use")
_PORT_RE = re.compile(r"port:?\s*(\d+)")


def port_in_use(text: str, default: int) -> Optional[int]:
    """The port named in a bind failure (torch's DistNetworkError: "port: 29500, ... EADDRINUSE"), or None."""
    for line in text.splitlines():
        if _PORT_IN_USE_RE.search(line):
            match = _PORT_RE.search(line)
            return int(match.group(1)) if match else default
    return None


def read_error_file(path: Path) -> Optional[str]:
    """The last line of the exception in a torchrun error file (written by torch's @record), or None."""
    import json

    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    message = data.get("message", {}) if isinstance(data, dict) else None
    text = message.get("message") if isinstance(message, dict) else message
    if not isinstance(text, str) or not text.strip():
        return None
    return text.strip().splitlines()[-1]


def _error_file_time(path: Path) -> float:
    """When the rank raised (error.json's timestamp, else the file's mtime): the first one is the root cause."""
    import json

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return float(data["message"]["extraInfo"]["timestamp"])
    except (OSError, ValueError, KeyError, TypeError):
        try:
            return path.stat().st_mtime
        except OSError:
            return float("inf")


def torchrun_failures(plan: LaunchPlan, output: str) -> list[RankFailure]:
    """Failed ranks, root cause first: from the error files torchrun gives every rank
    (attempt_N/<local rank>/error.json, written by the runner's @record), exit codes and hosts from
    torchrun's printed report. Ranks that died without an error file (a signal, os._exit) come only
    from the printed report."""
    printed = {f.local_rank: f for f in parse_torchrun_failures(output)}
    attempt = torchrun_attempt_dir(plan.run_dir)
    files = sorted(attempt.glob("*/error.json"), key=_error_file_time) if attempt else []
    failures = []
    for path in files:
        local = int(path.parent.name) if path.parent.name.isdigit() else None
        message = read_error_file(path)
        if local is None or message is None:
            continue
        seen = printed.pop(local, None)
        failures.append(RankFailure(plan.node_rank * plan.procs_per_node + local, local,
                                    seen.exitcode if seen else 1, str(path), message,
                                    host=seen.host if seen else socket.gethostname()))
    rest = parse_torchrun_failures(output)  # in the report's order: root cause first
    failures += [f for f in rest if f.local_rank in printed]
    for failure in failures:
        if failure.message is None and failure.error_file:
            failure.message = read_error_file(Path(failure.error_file))
    return failures


def _judge_deepspeed(plan: LaunchPlan, returncode: int, output: str) -> Outcome:
    # DeepSpeed's launcher reports only "exits with return code = N", not which rank. A Python
    # failure leaves a traceback in that rank's log; the ranks it then kills end without one.
    code = re.findall(r"exits with return code = (-?\d+)", output)
    exitcode = int(code[-1]) if code else returncode
    failures, logs = [], []
    for path in sorted((plan.run_dir / "logs").glob("*_rank*.log")):
        match = re.search(r"_rank(\d+)\.log$", path.name)
        if match and "Traceback (most recent call last)" in _read_tail(path, 200):
            rank = int(match.group(1))
            # Rank logs under this run directory come from this machine's launch (other nodes write theirs).
            host = socket.gethostname() if not plan.hosts or len(plan.hosts) == 1 else None
            failures.append(RankFailure(rank, rank % max(plan.procs_per_node, 1), exitcode, host=host))
            logs.append(path)
    if failures:
        return Outcome(1, failures=failures, message=failures[0].describe(), logs=logs)
    return Outcome(1, message=f"a rank exited with code {exitcode}; DeepSpeed's launcher does not say which "
                              f"(per-rank logs: {plan.run_dir / 'logs'})")


def _read_tail(path: Path, lines: int) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 256 * lines))
            return b"\n".join(handle.read().splitlines()[-lines:]).decode("utf-8", "replace")
    except OSError:
        return ""


def tail_of(path: Path, lines: int = 20) -> str:
    return _read_tail(path, lines)


# ----------------------------------------------------------------------------------------------
# Per-rank logs


def torchrun_attempt_dir(run_dir: Path) -> Optional[Path]:
    """torchrun writes RUN/logs/torchrun/<run id>_<random>/attempt_<n>/<local rank>/; the newest attempt."""
    attempts = sorted((run_dir / "logs" / "torchrun").glob("*/attempt_*"), key=lambda p: p.stat().st_mtime)
    return attempts[-1] if attempts else None


def rank_log_files(plan: LaunchPlan, local_rank: int) -> list[Path]:
    if plan.launcher == "torchrun":
        attempt = torchrun_attempt_dir(plan.run_dir)
        if attempt is None:
            return []
        return [p for p in (attempt / str(local_rank) / "stderr.log", attempt / str(local_rank) / "stdout.log") if p.exists()]
    rank = plan.node_rank * plan.procs_per_node + local_rank
    return sorted((plan.run_dir / "logs").glob(f"*_rank{rank}.log"))[-1:]


def link_rank_logs(plan: LaunchPlan) -> bool:
    """RUN/logs/rank<K> -> torchrun's folder for global rank K, so `tail logs/rank1/stderr.log` works.

    Returns whether every local rank's folder was there to link."""
    if plan.launcher != "torchrun":
        return True
    attempt = torchrun_attempt_dir(plan.run_dir)
    if attempt is None:
        return False
    logs = plan.run_dir / "logs"
    local_dirs = [d for d in attempt.iterdir() if d.name.isdigit()]
    for local_dir in local_dirs:
        if not local_dir.name.isdigit():
            continue
        rank = plan.node_rank * plan.procs_per_node + int(local_dir.name)
        link = logs / f"rank{rank}"
        try:
            if link.is_symlink() and link.resolve() != local_dir.resolve():
                link.unlink()  # a restarted attempt: point at the new folder
            if not link.exists():
                link.symlink_to(local_dir.relative_to(logs), target_is_directory=True)
        except OSError:
            pass  # filesystems without symlinks: the logs are still under logs/torchrun
    return len(local_dirs) >= plan.procs_per_node


# ----------------------------------------------------------------------------------------------
# `finetune train`: preflight, plan, run directory, launch


@dataclass
class Prepared:
    """Everything decided before launch. Nothing has been written yet."""

    loaded: "LoadedRecipe"
    run_dir: Path
    preflight: "Preflight"
    plan: Optional[LaunchPlan]
    overwrite: bool = False
    lock: Optional["RunLock"] = None  # the existing run directory, owned from preflight to the end of the run
    builds: Optional["BuildWatch"] = None  # DeepSpeed ops compiled on first use (finetune.extensions)

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    @property
    def resume_from(self):
        """The finetune.checkpoint.Checkpoint the run continues from, or None."""
        return self.preflight.resume_from


def run_dir_for(recipe: Recipe, output_dir: Optional[Path]) -> Path:
    from finetune.dsconfig import resolved_output_dir

    return (Path(output_dir) if output_dir is not None else Path(resolved_output_dir(recipe))).expanduser().absolute()


def prepare(loaded: "LoadedRecipe", output_dir: Optional[Path] = None, overwrite: bool = False,
            module: str = RUNNER_MODULE, facts=None, resume: Optional[bool] = None,
            force_resume: bool = False, dry_run: bool = False) -> Prepared:
    """Preflight and launch plan for `loaded` on this machine (facts: finetune.doctor.Facts, faked in tests).

    `resume`: continue from the newest complete checkpoint in the run directory (None: training.resume).
    An existing run directory is locked first (finetune.runlock; a dry run only looks), so no other live
    run changes it between what preflight decides and the launch: release() the result when not
    launching."""
    from finetune.doctor import collect_facts, recipe_imports
    from finetune.preflight import run_preflight

    recipe = loaded.recipe
    run_dir = run_dir_for(recipe, output_dir)
    if facts is None:
        facts = collect_facts(recipe_imports(recipe))
    gpu_count = len(facts.gpus) if facts.cuda_available else 0
    plan: Optional[LaunchPlan] = None
    try:
        port = recipe.launch.master_port
        if recipe.launch.nodes == 1:
            port = free_port(port)  # a second run on the same box must not collide with the first
        plan = plan_launch(recipe, run_dir, gpu_count, module=module, master_port=port)
        if port != recipe.launch.master_port:
            plan.notes.append(f"port {recipe.launch.master_port} is busy; using {port}")
    except HostfileError:
        pass  # preflight reports it
    builds = watch_builds(plan, recipe, dry_run) if plan is not None else None
    lock, in_use = lock_existing(run_dir, dry_run, recipe)
    preflight = run_preflight(loaded, run_dir, overwrite=overwrite, facts=facts,
                              world_size=plan.world_size if plan else None, resume=resume, force_resume=force_resume,
                              in_use=in_use)
    if plan is not None and preflight.resume_from is not None:
        plan.argv.append("--resume")  # the runner's argument, last on both launchers' command lines
    return Prepared(loaded, run_dir, preflight, plan, overwrite, lock, builds)


def watch_builds(plan: LaunchPlan, recipe: Recipe, dry_run: bool) -> Optional["BuildWatch"]:
    """Say which DeepSpeed ops the ranks will compile first, and clear a stale build lock that would make
    them wait forever (a dry run only says how). Single-node runs: other nodes have their own caches."""
    from finetune.extensions import BuildWatch, extensions_root, ops_needed

    ops = ops_needed(plan.device, recipe.deepspeed.offload_optimizer)
    if not ops or plan.nodes > 1:
        return None
    try:
        watch = BuildWatch(extensions_root({**os.environ, **plan.env}), ops, remove_stale=not dry_run)
        plan.notes.extend(watch.notes())
    except ImportError:
        return None  # no torch: the preflight's environment checks say so
    return watch


def lock_existing(run_dir: Path, dry_run: bool, recipe: Recipe) -> tuple[Optional["RunLock"], Optional[str]]:
    """(our lock on an existing run directory, or None; the live holder's description, or None)."""
    from finetune.preflight import RUN_MARKER
    from finetune.runlock import RunDirLocked, acquire, holder, lock_name

    name = lock_name(recipe.launch.nodes, recipe.launch.node_rank)
    if not (run_dir / RUN_MARKER).is_file():
        return None, None  # nothing there for another run to own; locked once written (start_run)
    if dry_run:
        return None, holder(run_dir, name)
    try:
        return acquire(run_dir, name), None
    except RunDirLocked as exc:
        return None, str(exc)
    except OSError:
        return None, None  # not writable: preflight says so


def start_run(prepared: Prepared, console: Optional[IO[bytes]] = None) -> Outcome:
    """Write the run directory, then launch and supervise. Call only when prepared.preflight.ok."""
    from finetune.rundir import write_run_dir

    from finetune.runlock import LOCK_ENV, OWNER_ENV, RunDirLocked, acquire, lock_name

    if not prepared.preflight.ok or prepared.plan is None:
        raise LaunchError("preflight failed; nothing was launched")
    plan = prepared.plan
    try:
        # Resuming keeps the checkpoints; the nodes of one run may share (and all write) one directory.
        in_place = prepared.resume_from is not None or prepared.preflight.join or plan.nodes > 1
        write_run_dir(prepared.loaded, prepared.run_dir, plan.world_size, overwrite=prepared.overwrite, in_place=in_place)
        if prepared.lock is None or not in_place:
            # A new directory, or --overwrite replaced the one we had locked: own the one now in place.
            try:
                lock = acquire(prepared.run_dir, lock_name(plan.nodes, plan.node_rank))
            except RunDirLocked as exc:
                raise LaunchError(str(exc)) from None
            prepared.release()
            prepared.lock = lock
        if "DS_ENV_FILE" in plan.env:
            from finetune.fsutil import write_atomic

            write_atomic(Path(plan.env["DS_ENV_FILE"]), deepspeed_env_text({**os.environ, **plan.env}))
        # The ranks clean up checkpoints only under this lock.
        plan.env.update({OWNER_ENV: str(os.getpid()), LOCK_ENV: prepared.lock.path.name})
        return supervise(plan, console, keep_fds=(prepared.lock.fd,), builds=prepared.builds)
    finally:
        prepared.release()


def deepspeed_env_text(environ: dict[str, str]) -> str:
    """`.deepspeed_env` lines (KEY=value) for the other nodes of a hostfile launch."""
    return "".join(f"{key}={environ[key]}\n" for key in PROPAGATED_ENV if environ.get(key))


# ----------------------------------------------------------------------------------------------
# The command of every node (--dry-run)


def commands_per_node(plan: LaunchPlan) -> list[tuple[str, str]]:
    """(label, shell line) for every machine of the run, this one first.

    torchrun: the same command on each machine, with its --node-rank. DeepSpeed with a hostfile: the
    launcher runs on node 0 only; what it starts on each host over pdsh is computed by DeepSpeed's
    own functions (the --world_info it passes)."""
    if plan.launcher == "torchrun":
        out = []
        for rank in range(plan.nodes):
            argv = list(plan.argv)
            argv[argv.index("--node-rank") + 1] = str(rank)
            line = LaunchPlan(**{**plan.__dict__, "argv": argv}).display()
            label = f"node {rank}" + (" (this machine)" if rank == plan.node_rank else "")
            out.append((label, line))
        return out
    if not plan.hosts or len(plan.hosts) < 2:
        return [("this machine", plan.display())]
    out = [("this machine: DeepSpeed's launcher, which starts every host below over pdsh/ssh", plan.display())]
    from deepspeed.launcher.runner import apply_num_nodes_and_gpus, encode_world_info

    argv = plan.argv
    gpus = int(argv[argv.index("--num_gpus") + 1]) if "--num_gpus" in argv else -1
    resources = {host: list(range(slots)) for host, slots in plan.hosts.items()}
    world_info = encode_world_info(apply_num_nodes_and_gpus(resources, len(plan.hosts), gpus))
    # Without --master_addr DeepSpeed asks node 0 over ssh (`hostname -I`, first address).
    master = plan.master_addr if "--master_addr" in argv else f"<first address of `hostname -I` on {next(iter(plan.hosts))}>"
    runner_args = argv[argv.index("--module") + 1:]
    python = argv[0]
    for index, host in enumerate(plan.hosts):
        remote = [python, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world_info}",
                  f"--node_rank={index}", f"--master_addr={master}", f"--master_port={plan.master_port}",
                  "--module", "--no_local_rank", f"--enable_each_rank_log={plan.run_dir / 'logs'}", *runner_args]
        out.append((f"{host} (started by DeepSpeed over pdsh, in the same directory)", shlex.join(remote)))
    return out
