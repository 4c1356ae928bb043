"""Start the per-rank runner on every GPU of this machine and watch it: argv, spawning, signals, failures.

Two launchers, chosen by `launch.launcher` (auto: deepspeed when a hostfile is set, else torchrun):

    # torchrun: one process per GPU; rank 0 on the console, every rank in RUN/logs/torchrun/...
    python -m torch.distributed.run --nnodes 1 --nproc-per-node 2 --node-rank 0 \\
        --master-addr 127.0.0.1 --master-port 29500 --log-dir RUN/logs/torchrun --redirects 3 --tee 0:3 \\
        -m finetune.train.runner --run-dir RUN

    # deepspeed: hostfiles and pdsh for several machines; each rank to RUN/logs/<time>_rank<K>.log
    python -m deepspeed.launcher.runner --num_gpus 2 --master_addr 127.0.0.1 --master_port 29500 \\
        --no_local_rank --enable_each_rank_log RUN/logs --module finetune.train.runner --run-dir RUN

The launcher runs in its own process group; SIGINT/SIGTERM sent to `finetune train` are forwarded to
it, and it forwards them to the ranks (torchrun waits 30 s, then SIGKILLs). A failing rank is named
from torchrun's failure report (the "Root Cause" block of its ChildFailedError).

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

RUNNER_MODULE = "finetune.train.runner"
DEFAULT_MASTER_PORT = 29500  # torchrun's and DeepSpeed's default
# Every rank's console line starts with its global rank (torchrun's default names the role instead).
LOG_LINE_PREFIX = "[rank${rank}]: "
TAIL_LINES = 400  # launcher output kept in memory to read the failure report from
POLL_SECONDS = 0.2
LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1"}


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
    if choose_launcher(recipe) == "deepspeed":
        argv, world = deepspeed_argv(recipe, run_dir, procs, port, module, python, environ)
        launcher = "deepspeed"
    else:
        env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = LOG_LINE_PREFIX
        argv = torchrun_argv(run_dir, procs, launch.nodes, launch.node_rank, launch.master_addr, port, module, python)
        world = procs * launch.nodes
        launcher = "torchrun"
    return LaunchPlan(argv=argv, env=env, run_dir=run_dir, launcher=launcher, procs_per_node=procs,
                      nodes=launch.nodes, node_rank=launch.node_rank, world_size=world, device=device)


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

    def describe(self) -> str:
        if self.exitcode < 0:
            try:
                how = f"was killed by {signal.Signals(-self.exitcode).name}"
            except ValueError:
                how = f"was killed by signal {-self.exitcode}"
        else:
            how = f"exited with code {self.exitcode}"
        return f"rank {self.rank} (local rank {self.local_rank}) {how}"


@dataclass
class Outcome:
    returncode: int  # what `finetune train` exits with
    failures: list[RankFailure] = field(default_factory=list)  # root cause first
    signal: Optional[int] = None  # a signal we forwarded
    message: str = ""
    logs: list[Path] = field(default_factory=list)  # log files of the failed ranks

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def spawn(plan: LaunchPlan) -> subprocess.Popen:
    """Start the launcher in its own session: terminal signals reach it only through us (forwarded)."""
    env = dict(os.environ)
    env.update(plan.env)
    try:
        return subprocess.Popen(plan.argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
    except OSError as exc:
        raise LaunchError(f"cannot start {plan.argv[0]}: {exc.strerror or exc}") from None


def supervise(plan: LaunchPlan, console: Optional[IO[bytes]] = None) -> Outcome:
    """Run `plan` to the end: relay output, forward SIGINT/SIGTERM, and say which rank failed."""
    console = console or sys.stdout.buffer
    logs = plan.run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    forwarded: list[int] = []
    running: list[subprocess.Popen] = []

    def forward(signum, _frame):
        forwarded.append(signum)
        if running:
            _signal_group(running[0], signum)

    # Handlers go in before the launcher starts: a Ctrl-C in between must not orphan it.
    previous = _install_handlers(forward)
    try:
        proc = spawn(plan)
        running.append(proc)
        if forwarded:
            _signal_group(proc, forwarded[0])
        relay = Relay(proc.stdout, console, logs / "launcher.log")
        relay.start()
        try:
            wait(plan, proc, console)
        except BaseException:
            _signal_group(proc, signal.SIGTERM)  # never leave ranks running behind a crashed supervisor
            raise
        finally:
            relay.join()
    finally:
        _restore_handlers(previous)
    link_rank_logs(plan)
    return judge(plan, proc.returncode, relay.tail(), forwarded[0] if forwarded else None)


def wait(plan: LaunchPlan, proc: subprocess.Popen, console: IO[bytes]) -> None:
    """Until the launcher exits: follow rank 0's log for the deepspeed launcher, link the rank logs."""
    logs = plan.run_dir / "logs"
    rank0 = Follower(logs, "*_rank0.log", console) if plan.launcher == "deepspeed" and plan.node_rank == 0 else None
    linked = False
    while proc.poll() is None:
        time.sleep(POLL_SECONDS)
        if rank0:
            rank0.poll()
        if not linked:
            linked = link_rank_logs(plan)  # as soon as torchrun made the folders: tail -f works during the run
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
    return {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}


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
_LAUNCHER_EXCEPTIONS = (b"torch.distributed.elastic.",)


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
                                        None if error_file in ("", "<N/A>") else error_file))
    return failures


def judge(plan: LaunchPlan, returncode: int, output: str, forwarded: Optional[int]) -> Outcome:
    if returncode == 0:
        return Outcome(0, message="all ranks finished")
    if forwarded is not None:
        name = signal.Signals(forwarded).name
        return Outcome(128 + forwarded, signal=forwarded, message=f"stopped by {name} (forwarded to all ranks)")
    failures = parse_torchrun_failures(output) if plan.launcher == "torchrun" else []
    if failures:
        root = failures[0]
        _read_error_file(root)
        logs = rank_log_files(plan, root.local_rank)
        message = f"{root.describe()}"
        if root.message:
            message += f": {root.message}"
        return Outcome(1, failures=failures, message=message, logs=logs)
    if plan.launcher == "deepspeed":
        return _judge_deepspeed(plan, returncode, output)
    return Outcome(returncode if returncode > 0 else 1,
                   message=f"{plan.launcher} exited with code {returncode} (see {plan.run_dir / 'logs' / 'launcher.log'})")


def _read_error_file(failure: RankFailure) -> None:
    """A rank whose main is wrapped in torch's @record leaves its exception in error.json."""
    import json

    if not failure.error_file:
        return
    try:
        data = json.loads(Path(failure.error_file).read_text(encoding="utf-8"))
        message = data.get("message", {})
        text = message.get("message") if isinstance(message, dict) else str(message)
        failure.message = (text or "").strip().splitlines()[-1] if text else None
    except (OSError, ValueError, AttributeError):
        pass


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
            failures.append(RankFailure(rank, rank % max(plan.procs_per_node, 1), exitcode))
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


def run_dir_for(recipe: Recipe, output_dir: Optional[Path]) -> Path:
    from finetune.dsconfig import resolved_output_dir

    return (Path(output_dir) if output_dir is not None else Path(resolved_output_dir(recipe))).expanduser().absolute()


def prepare(loaded: "LoadedRecipe", output_dir: Optional[Path] = None, overwrite: bool = False,
            module: str = RUNNER_MODULE, facts=None) -> Prepared:
    """Preflight and launch plan for `loaded` on this machine (facts: finetune.doctor.Facts, faked in tests)."""
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
    preflight = run_preflight(loaded, run_dir, overwrite=overwrite, facts=facts,
                              world_size=plan.world_size if plan else None)
    return Prepared(loaded, run_dir, preflight, plan, overwrite)


def start_run(prepared: Prepared, console: Optional[IO[bytes]] = None) -> Outcome:
    """Write the run directory, then launch and supervise. Call only when prepared.preflight.ok."""
    from finetune.rundir import write_run_dir

    if not prepared.preflight.ok or prepared.plan is None:
        raise LaunchError("preflight failed; nothing was launched")
    write_run_dir(prepared.loaded, prepared.run_dir, prepared.plan.world_size, overwrite=prepared.overwrite)
    return supervise(prepared.plan, console)
