"""The launcher's command line for this recipe on this machine: torchrun or DeepSpeed's launcher, hostfile, port.

Two launchers, chosen by `launch.launcher` (auto: deepspeed when a hostfile is set, else torchrun):

    # torchrun: one process per GPU; rank 0 on the console, every rank in RUN/logs/torchrun/...
    python -m torch.distributed.run --nnodes 1 --nproc-per-node 2 --node-rank 0 \\
        --master-addr 127.0.0.1 --master-port 29500 --log-dir RUN/logs/torchrun --redirects 3 --tee 0:3 \\
        -m finetune.train.runner --run-dir RUN

    # deepspeed: hostfiles and pdsh for several machines; each rank to RUN/logs/<time>_rank<K>.log
    python -m deepspeed.launcher.runner --num_gpus 2 --master_addr 127.0.0.1 --master_port 29500 \\
        --no_local_rank --enable_each_rank_log RUN/logs --module finetune.train.runner --run-dir RUN

Several machines: with torchrun, `finetune train` runs on every machine with its --node-rank
(static rendezvous at master_addr:master_port; `finetune slurm` writes that for SLURM); with a
hostfile, DeepSpeed's launcher on node 0 starts the others over pdsh/ssh. --dry-run prints the
command of every node (`commands_per_node`).

With no GPU, `procs_per_node: auto` means `launch.cpu_procs` CPU processes (default 1) and an
explicit number that many, on DeepSpeed's CPU accelerator (gloo), so the whole path runs in CI.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from finetune.errors import FinetuneError
from finetune.plan.allocator import user_alloc_conf
from finetune.plan.constants import ALLOC_CONF_NAMES, TRAINING_ALLOC_CONF
from finetune.recipe import Recipe
from finetune.recipe.schema import LOOPBACK
from finetune.rundir.names import LOGS_DIR

RUNNER_MODULE = "finetune.train.runner"
DEFAULT_MASTER_PORT = 29500  # torchrun's and DeepSpeed's default
# Every rank's console line starts with its global rank (torchrun's default names the role instead).
LOG_LINE_PREFIX = "[rank${rank}]: "
LOCAL_HOSTS = {"localhost", LOOPBACK, "::1"}
DEEPSPEED_ENV_FILE = "deepspeed.env"
HOSTFILE_LIMIT = 2**20  # `host slots=N` lines: a megabyte is ten thousand machines
# Passed to the other nodes of a hostfile launch (DeepSpeed itself exports NCCL*, PYTHON*, UCX*, ...).
# Never tokens: the file sits in the run directory, readable by the team; put HF_TOKEN in ~/.deepspeed_env.
PROPAGATED_ENV = ("TQDM_DISABLE", "DS_ACCELERATOR", "FINETUNE_CACHE", "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE",
                  "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "TOKENIZERS_PARALLELISM", "OMP_NUM_THREADS",
                  "CUDA_DEVICE_ORDER", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", *ALLOC_CONF_NAMES)


class HostfileError(FinetuneError):
    pass



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
    master_addr: str = LOOPBACK
    master_port: int = DEFAULT_MASTER_PORT
    stop_timeout: int = 300  # seconds the ranks get to save a checkpoint after a signal
    hosts: Optional[dict[str, int]] = None  # the hostfile's hosts used (deepspeed launcher)

    def display(self) -> str:
        """The command as a shell line (for --dry-run and the log)."""
        extra = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()) if k not in _QUIET_ENV)
        return (extra + " " if extra else "") + shlex.join(self.argv)


# Set for every run; not worth showing in the printed command.
_QUIET_ENV = {"PYTHONUNBUFFERED", "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "TQDM_DISABLE", "TORCH_EXTENSIONS_DIR", "PATH"}


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
    from finetune.fsutil import read_capped

    try:
        text = read_capped(path, HOSTFILE_LIMIT).decode("utf-8")
    except OSError as exc:
        raise HostfileError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise HostfileError(f"{path}: not UTF-8 text (byte {exc.start})") from None
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
    if not environ.get("TORCH_EXTENSIONS_DIR"):
        from finetune.run.deepspeed_ops import launch_extensions_root

        env["TORCH_EXTENSIONS_DIR"] = str(launch_extensions_root(python, environ))  # DeepSpeed's JIT ops, this venv's
    device = "cuda" if gpu_count > 0 else "cpu"
    if device == "cuda" and user_alloc_conf(environ) is None:
        # Less cache held beyond what is allocated (finetune/plan/allocator.py); a user's setting, under either
        # of torch's names, wins.
        env["PYTORCH_CUDA_ALLOC_CONF"] = TRAINING_ALLOC_CONF
    if device == "cuda":
        from finetune.run.deepspeed_ops import jit_arch_list

        arch_list = jit_arch_list(environ)
        if arch_list is not None:  # shown with the launch command: the ranks build DeepSpeed's ops for these
            env["TORCH_CUDA_ARCH_LIST"] = arch_list
    if device == "cpu" and "DS_ACCELERATOR" not in environ:
        env["DS_ACCELERATOR"] = "cpu"  # skip DeepSpeed's accelerator probing (and its warning)
    from finetune.run.deepspeed_ops import ranks_path

    path = ranks_path(python, environ)
    if path is not None:  # the `ninja` beside the interpreter for DeepSpeed's JIT ops, as `doctor --build-ops` runs it
        env["PATH"] = path
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
        "--log-dir", str(run_dir / LOGS_DIR / "torchrun"),
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
        if not (multi and launch.master_addr == LOOPBACK):
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
    argv += ["--no_local_rank", "--enable_each_rank_log", str(run_dir / LOGS_DIR), "--module", module, "--run-dir", str(run_dir)]
    return argv, world


def free_port(preferred: int = 0, host: str = LOOPBACK) -> int:
    """`preferred` when nothing listens there, else a free port the OS picks (single-node runs only); with no
    `preferred`, the OS's pick (what tests and harnesses use: never a well-known port where a real run may start)."""
    for port in (preferred, 0):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return sock.getsockname()[1]
    return preferred



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
