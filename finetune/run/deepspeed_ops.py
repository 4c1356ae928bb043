"""DeepSpeed's JIT-built ops in torch's extensions cache: first-run compiles and stale build locks.

DeepSpeed compiles some ops on first use into torch's extensions cache (TORCH_EXTENSIONS_DIR, else
~/.cache/torch_extensions/py<XY>_<cpu|cuNNN>/<op>/): the CPU communication op `deepspeed_shm_comm` on
DeepSpeed's CPU accelerator, `fused_adam` on a GPU where asked for, `cpu_adam` with optimizer offload (ops_needed). That
takes 35-90 s with nothing on screen, so `finetune train` says so before launch and when it is done, and
`finetune doctor --build-ops` compiles them ahead (build_ahead).

torch serialises a build with a FileBaton: a plain file `<op>/lock` created with O_EXCL and removed when
the build ends. Nothing releases it when the builder dies (Ctrl-C during the first compile), and every
later process waits for it forever, silently. Whether a live process still builds can only be judged
from outside: ninja and the compiler run with their working directory in the op's folder, so a lock
with no process working there, older than LOCK_GRACE_S, is stale and is removed (with a note).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    from finetune.recipe import Recipe

CPU_COMM_OP = "deepspeed_shm_comm"  # deepspeed/ops/op_builder/cpu/comm.py ShareMemCommBuilder.NAME
CPU_ADAM_OP = "cpu_adam"  # deepspeed/ops/op_builder/cpu/cpu_adam.py CPUAdamBuilder.NAME
CPU_LION_OP, CPU_ADAGRAD_OP = "cpu_lion", "cpu_adagrad"  # the same folder: CPULionBuilder, CPUAdagradBuilder
FUSED_ADAM_OP, FUSED_LION_OP, FUSED_LAMB_OP = "fused_adam", "fused_lion", "fused_lamb"  # op_builder/fused_*.py
CUDA_OPS = (FUSED_ADAM_OP, FUSED_LION_OP, FUSED_LAMB_OP)  # CUDA kernels: compiled with the CUDA toolkit's nvcc
ASYNC_IO_OP = "async_io"  # deepspeed/ops/op_builder/async_io.py: NVMe offload (needs libaio)
# Between taking the baton and starting ninja torch only writes build.ninja and checks the compiler:
# seconds, even on a loaded box. A lock older than this with nobody compiling is left by a dead build.
LOCK_GRACE_S = 30.0
COMPILE_NOTE = "compiling "  # what a real launch will compile: not said by a dry run or a refused launch


def extensions_root(environ: Optional[dict[str, str]] = None) -> Path:
    """Where torch builds extensions, without creating it (torch.utils.cpp_extension._get_build_directory
    makes the folders as a side effect). TORCH_EXTENSIONS_DIR is used as it is, as torch does."""
    environ = os.environ if environ is None else environ
    if environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(environ["TORCH_EXTENSIONS_DIR"])
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        accelerator = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accelerator = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}"


def per_environment_root(python: str = sys.executable, environ: Optional[dict[str, str]] = None) -> Path:
    """~/.cache/torch_extensions/<python>_<torch>_<environment hash>: one build folder per interpreter and
    torch. torch's default (py311_cpu) is shared by every venv of one Python on the machine, and ninja
    rebuilds an op whose command line names another venv's torch headers, so two venvs took turns
    invalidating each other's build (90-100 s each time, issue 24)."""
    import hashlib
    from importlib.metadata import PackageNotFoundError, version

    environ = os.environ if environ is None else environ
    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "none"
    # the venv, not the interpreter it links to: sys.prefix of `python` is its parent's parent for a venv
    prefix = os.path.abspath(os.path.join(os.path.dirname(python), os.pardir))
    key = hashlib.sha1(f"{prefix}\0{torch_version}".encode()).hexdigest()[:10]
    cache = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch_version.replace('+', '_')}_{key}"
    return Path(cache) / "torch_extensions" / tag


def jit_arch_list(environ: dict[str, str]) -> Optional[str]:
    """TORCH_CUDA_ARCH_LIST as DeepSpeed's JIT builder can read it, or None when it already can (or is unset).

    torch accepts arch-specific targets such as `9.0a` (Hopper's wgmma) and `10.0f`, and CUDA images for
    Hopper set them. DeepSpeed's JIT builder (0.19.8, op_builder/builder.py compute_capability_args) sorts
    the list by `int()` of each dotted part and fails on the suffix ("invalid literal for int() with base
    10: '0a'") when a rank builds FusedAdam, seen on an H100. Its ops use no arch-specific instruction, so
    the ranks get the plain targets (`9.0a` -> `9.0`); `+PTX` is kept.
    """
    value = environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    targets = [t for t in value.replace(" ", ";").split(";") if t.strip()]

    def readable(target: str) -> bool:
        return all(part.split("+")[0].isdigit() for part in target.split("."))

    if all(readable(t) for t in targets):
        return None
    plain: list[str] = []
    for target in targets:
        ptx = "+PTX" if target.upper().endswith("+PTX") else ""
        base = target[:-len(ptx)] if ptx else target
        base = ".".join(part.rstrip("abcdefghijklmnopqrstuvwxyz") for part in base.split(".")) + ptx
        if base not in plain:
            plain.append(base)
    return ";".join(plain)


def ops_needed(device: str, optimizer: str = "adamw", offload_optimizer: str = "none",
               offload_param: str = "none") -> list[str]:
    """The ops the ranks of a launch on `device` ("cpu" or "cuda") JIT-compile, as DeepSpeed 0.19 picks them
    (runtime/engine.py _configure_basic_optimizer) for the recipe's training.optimizer and offload:
    Adam/AdamW are FusedAdam on a GPU (a block without torch_adam, which finetune renders only when the overrides
    ask: finetune.render.with_torch_adam) and DeepSpeedCPUAdam when offloaded, but on the CPU accelerator the
    runner makes them torch.optim (finetune.train.runner.adapt_deepspeed_config); Lion is FusedLion or
    DeepSpeedCPULion; Lamb is FusedLamb; Adagrad offloaded is DeepSpeedCPUAdagrad (torch's otherwise); the
    Trainer's own optimizers (sgd, adamw_bnb_8bit) and torch's (torch_adam) build nothing: `optimizer` "". NVMe
    offload reads and writes through async_io."""
    ops = [CPU_COMM_OP] if device == "cpu" else []
    offloaded = offload_optimizer in ("cpu", "nvme")
    if optimizer in ("adam", "adamw") and device != "cpu":
        ops.append(CPU_ADAM_OP if offloaded else FUSED_ADAM_OP)
    elif optimizer == "lion":
        ops.append(CPU_LION_OP if offloaded else FUSED_LION_OP)
    elif optimizer == "lamb" and device != "cpu":
        ops.append(FUSED_LAMB_OP)
    elif optimizer == "adagrad" and offloaded:
        ops.append(CPU_ADAGRAD_OP)
    if "nvme" in (offload_optimizer, offload_param):
        ops.append(ASYNC_IO_OP)
    return ops


def recipe_ops(device: str, recipe: Optional["Recipe"], run_dir: Optional[Path] = None) -> list[str]:
    """ops_needed for the DeepSpeed config `recipe` renders (None: the defaults, AdamW without offload: torch's fused
    AdamW), so that deepspeed.overrides count (`torch_adam: false` is DeepSpeed's FusedAdam), less the ops this
    DeepSpeed was installed with (prebuilt_ops): those are loaded, not compiled. `run_dir`: a run directory the
    launch writes into in place (a resume), whose recorded Adam implementation the run keeps
    (finetune.rundir.layout.with_recorded_optimizer). Without DeepSpeed's engine (deepspeed.enabled false, as
    written or decided: `auto` undecided counts as the engine) no optimizer op; the ranks still join through
    deepspeed.init_distributed, whose CPU backend loads the shared-memory op."""
    name, offloads = "", ("none", "none")  # "": the Trainer's or torch's optimizer, nothing to build
    if recipe is not None and recipe.deepspeed.enabled is not False:
        from finetune.render import offload_device, optimizer_class, render_deepspeed
        from finetune.rundir.layout import with_recorded_optimizer

        config = render_deepspeed(recipe)
        config = with_recorded_optimizer(config, run_dir) if run_dir is not None else config
        stepper = optimizer_class(config)
        if stepper is not None and not stepper.startswith("torch.optim."):
            name = str(config["optimizer"]["type"]).lower()
        offloads = tuple(offload_device(config, block) or "none" for block in ("offload_optimizer", "offload_param"))
    ops = ops_needed(device, name, *offloads)
    prebuilt = prebuilt_ops(device)
    return [op for op in ops if op not in prebuilt]


def launch_extensions_root(python: str = sys.executable, environ: Optional[dict[str, str]] = None) -> Path:
    """The folder `finetune train` gives its ranks (run with `python`) for DeepSpeed's JIT ops: the user's
    TORCH_EXTENSIONS_DIR as it is, else this environment's own (per_environment_root)."""
    environ = os.environ if environ is None else environ
    if environ.get("TORCH_EXTENSIONS_DIR"):  # empty is unset, for torch too
        return Path(environ["TORCH_EXTENSIONS_DIR"])
    return per_environment_root(python, environ)


def ranks_path(python: str = sys.executable, environ: Optional[dict[str, str]] = None) -> Optional[str]:
    """PATH for the ranks and for `finetune doctor --build-ops`: the interpreter's folder first where it holds a
    `ninja` and is not on PATH (a venv used without activation). torch's extension builder runs `ninja` from
    PATH (torch.utils.cpp_extension.is_ninja_available), and pip installs it beside a venv's interpreter
    (DeepSpeed requires the `ninja` package). Where PATH found another ninja instead, the op built by one was
    compiled again by the other, since ninjas of other versions do not read each other's build logs (1.11 and
    1.13 log other hashes for the same command): DeepSpeed's CPU communication op took 20 s here each time a
    run from the activated venv (its ninja 1.13) and one without (the system's 1.11) took turns; FusedAdam
    takes minutes. None where the folder is on PATH already (its order is the user's) or holds no ninja."""
    import shutil

    environ = os.environ if environ is None else environ
    path = environ.get("PATH", os.defpath)
    here = os.path.dirname(python)
    listed = {os.path.realpath(entry) for entry in path.split(os.pathsep) if entry}
    if os.path.realpath(here) in listed or shutil.which("ninja", path=here) is None:
        return None
    return here + os.pathsep + path


def missing_build_tools(python: str = sys.executable, environ: Optional[dict[str, str]] = None) -> list[tuple[str, str]]:
    """(what is missing, the command that installs it) for each tool torch's extension builder needs to compile
    DeepSpeed's ops (torch.utils.cpp_extension: the C++ compiler CXX, else `c++`; `ninja` on the ranks' PATH;
    Python's headers, Python.h), on this machine (issue 34: the demo died after a 190-line traceback ending
    "ninja: build stopped" and `finetune doctor` said "all checks passed")."""
    import shutil
    import sysconfig

    environ = os.environ if environ is None else environ
    path = ranks_path(python, environ) or environ.get("PATH", os.defpath)
    install = system_packages()
    missing = []
    compiler = environ.get("CXX", "c++")
    if not shutil.which(compiler, path=path):
        missing.append((f"the C++ compiler `{compiler}` (CXX, else c++)", install["c++"]))
    if not shutil.which("ninja", path=path):
        missing.append(("ninja", f"{python} -m pip install ninja"))
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not headers.is_file():
        missing.append((f"Python's headers ({headers})", install["python-dev"]))
    return missing


def system_packages(os_release: str = "/etc/os-release") -> dict[str, str]:
    """The commands that install a C++ compiler and Python's headers on this system (by /etc/os-release)."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    if sys.platform == "darwin":
        return {"c++": "xcode-select --install", "python-dev": "reinstall Python (python.org or Homebrew)"}
    try:
        fields = dict(line.split("=", 1) for line in Path(os_release).read_text().splitlines() if "=" in line)
    except OSError:
        fields = {}
    family = " ".join(fields.get(k, "").strip('"').lower() for k in ("ID", "ID_LIKE")).split()
    if {"debian", "ubuntu"} & set(family):
        return {"c++": "sudo apt install g++", "python-dev": f"sudo apt install python{version}-dev"}
    if {"fedora", "rhel", "centos"} & set(family):
        return {"c++": "sudo dnf install gcc-c++", "python-dev": "sudo dnf install python3-devel"}
    if "alpine" in family:
        return {"c++": "apk add g++", "python-dev": "apk add python3-dev"}
    if "arch" in family:
        return {"c++": "sudo pacman -S gcc", "python-dev": "sudo pacman -S python"}
    return {"c++": "install g++ (or clang++) with the system's package manager",
            "python-dev": f"install the Python {version} development headers (python3-dev / python3-devel)"}


def prebuilt_ops(device: str) -> set[str]:
    """The ops DeepSpeed's install compiled ahead for `device` (DS_BUILD_OPS=1 / DS_BUILD_<OP>=1 pip install):
    its setup.py writes them to deepspeed/git_version_info_installed.py, read here as text (importing
    DeepSpeed takes seconds). OpBuilder.load uses them only when built for the accelerator in use."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        return set()
    path = Path(list(spec.submodule_search_locations)[0]) / "git_version_info_installed.py"
    values = {}
    try:
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                try:
                    values[node.targets[0].id] = ast.literal_eval(node.value)
                except ValueError:
                    continue
    except (OSError, SyntaxError, ValueError):
        return set()  # a source checkout never installed: every op is compiled on first use
    installed = values.get("installed_ops")
    if values.get("accelerator_name") != device or not isinstance(installed, dict):
        return set()
    return {op for op, built in installed.items() if built}


def is_built(build_dir: Path) -> bool:
    """Built for this torch and these sources: the library is there, its build file names this torch's headers
    (a build from another environment's torch is rebuilt by ninja, since its command lines differ), and no
    source file it compiles is newer than the library (ninja compiles those again: a DeepSpeed installed anew,
    even the same version, since pip writes every file with the time of the install)."""
    import torch

    library = build_dir / f"{build_dir.name}.so"
    try:
        ninja = (build_dir / "build.ninja").read_text(encoding="utf-8", errors="replace")
        built = library.stat().st_mtime_ns
    except OSError:
        return False
    if str(Path(torch.__file__).parent / "include") not in ninja:
        return False
    for source in build_sources(ninja):
        try:
            if source.stat().st_mtime_ns > built:
                return False
        except OSError:
            return False  # gone: ninja cannot build the op as it was
    return True


def build_sources(ninja: str) -> list[Path]:
    """The source files a build.ninja compiles: the absolute inputs of its `build OUT: RULE IN...` lines
    (torch.utils.cpp_extension writes one such line per source file, then one that links the objects)."""
    import re

    sources = []
    for line in ninja.splitlines():
        if not line.startswith("build "):
            continue
        parts = re.split(r"(?<!\$):", line, maxsplit=1)  # ninja escapes a path's own colons and spaces with $
        words = re.split(r"(?<!\$) +", parts[-1].strip())[1:] if len(parts) == 2 else []
        sources += [Path(re.sub(r"\$(.)", r"\1", word)) for word in words if word.startswith("/")]
    return sources


def compiling_pids(build_dir: Path) -> list[int]:
    """Processes working in `build_dir` (ninja and the compiler it runs): a build in progress."""
    target = os.path.realpath(build_dir)
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue
        if cwd == target or cwd.startswith(target + os.sep):
            pids.append(int(entry.name))
    return sorted(pids)


# What ninja runs to build an op (a no-op ninja run, every load, compiles nothing and runs none of these).
COMPILERS = {"cc1plus", "c++", "g++", "gcc", "cc", "clang", "clang++", "nvcc", "cicc", "ptxas", "ld", "collect2"}


def compiler_running(build_dir: Path) -> bool:
    """A compiler or linker at work in `build_dir`: an op being (re)built now."""
    for pid in compiling_pids(build_dir):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if name in COMPILERS:
            return True
    return False


def last_build_seconds(build_dir: Path) -> Optional[float]:
    """How long the op's last build took, from ninja's own log (`.ninja_log`: start and end in ms of each
    output, from the start of its run; a later line for an output replaces an earlier one), or None."""
    try:
        lines = (build_dir / ".ninja_log").read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    ends = {}
    for line in lines:
        parts = line.split("\t")
        if len(parts) >= 4 and parts[1].isdigit():
            ends[parts[3]] = int(parts[1])
    return max(ends.values()) / 1000 if ends else None


def compile_estimate(build_dir: Path) -> str:
    seconds = last_build_seconds(build_dir)
    return f"about {seconds:.0f} s, as its last build here" if seconds else "about a minute on a few cores"


def lock_note(build_dir: Path, now: Optional[float] = None, remove: bool = True) -> Optional[str]:
    """What to say about `build_dir`'s build lock (None: there is none); removes a stale one when `remove`."""
    lock = build_dir / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except OSError:
        return None
    op = build_dir.name
    pids = compiling_pids(build_dir)
    if pids:
        return f"another process (PID {pids[0]}) is compiling {op} in {build_dir}; this run waits for it"
    if age < LOCK_GRACE_S:
        return (f"{lock} is {age:.0f} s old and nobody compiles there yet; if the run waits on it, "
                f"remove it: rm {lock}")
    if not remove or not Path("/proc").is_dir():  # without /proc nobody can be seen compiling: only say how
        return f"{lock} looks stale (nobody compiles there; an interrupted build left it): rm {lock}"
    try:
        lock.unlink()
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{lock} is stale (an interrupted build left it) and cannot be removed ({exc.strerror}): rm {lock}"
    return f"removed a stale build lock {lock} ({age / 60:.0f} min old, left by an interrupted compile of {op})"


@dataclass
class BuildWatch:
    """Before launch: which ops will compile, and stale locks (notes). During the run (poll): stale
    locks left by a rank killed while compiling, and a line when a compile is done."""

    root: Path
    ops: list[str]
    remove_stale: bool = True  # False for a dry run: it writes nothing, it says what to remove
    started: float = field(default_factory=time.monotonic)
    pending: set[str] = field(default_factory=set)
    rebuilding: dict[str, float] = field(default_factory=dict)  # op -> when a rebuild was seen starting
    every: float = 2.0  # seconds between polls: /proc is scanned when a lock is there
    _last: float = 0.0

    def due(self) -> bool:
        now = time.monotonic()
        if now - self._last < self.every:
            return False
        self._last = now
        return True

    def notes(self) -> list[str]:
        out = []
        for op in self.ops:
            build_dir = self.root / op
            note = lock_note(build_dir, remove=self.remove_stale)
            if note:
                out.append(note)
            if not is_built(build_dir):
                self.pending.add(op)
                why = ("its build is older than DeepSpeed's sources or from another torch"
                       if (build_dir / f"{op}.so").is_file() else "first run in this environment")
                out.append(f"{COMPILE_NOTE}{op} ({why}; {compile_estimate(build_dir)}; "
                           f"`finetune doctor --build-ops` compiles it ahead) into {build_dir}")
        return out

    def poll(self) -> list[str]:
        out = []
        for op in sorted(self.pending):
            build_dir = self.root / op
            if (build_dir / "lock").exists():
                note = lock_note(build_dir)
                if note and note.startswith("removed"):
                    out.append(note)
            elif is_built(build_dir):
                self.pending.discard(op)
                out.append(f"compiled {op} ({time.monotonic() - self.started:.0f} s after launch)")
        out += self._rebuilds()
        return out

    def _rebuilds(self) -> list[str]:
        """An op that was built at launch and that ninja compiles again (its sources, flags or torch changed):
        a line when it starts and when it ends, not a minute of silence under "loading model" (issue 34)."""
        out = []
        for op in self.ops:
            build_dir = self.root / op
            if op in self.pending:
                continue
            if op not in self.rebuilding and compiler_running(build_dir):
                self.rebuilding[op] = time.monotonic()
                out.append(f"{COMPILE_NOTE}DeepSpeed op {op} again ({compile_estimate(build_dir)}): ninja "
                           f"rebuilds it in {build_dir}")
            elif op in self.rebuilding and not compiler_running(build_dir) and not (build_dir / "lock").exists():
                out.append(f"compiled {op} ({time.monotonic() - self.rebuilding.pop(op):.0f} s)")
        return out


# DeepSpeed's builder class of each op, as its accelerators name them (create_op_builder).
BUILDERS = {CPU_COMM_OP: "ShareMemCommBuilder", CPU_ADAM_OP: "CPUAdamBuilder", CPU_LION_OP: "CPULionBuilder",
            CPU_ADAGRAD_OP: "CPUAdagradBuilder", FUSED_ADAM_OP: "FusedAdamBuilder", FUSED_LION_OP: "FusedLionBuilder",
            FUSED_LAMB_OP: "FusedLambBuilder", ASYNC_IO_OP: "AsyncIOBuilder"}


def build_ahead(device: str, recipe: Optional["Recipe"], log: Callable[[str], None]) -> list[str]:
    """Compile now, with DeepSpeed's own builders, the ops a launch of `recipe` (None: the defaults) on
    `device` would compile in its ranks on first use, into the folder `finetune train` gives them: for a
    machine image, or before the paid hours start. Ops already built are left as they are. Returns the ops
    compiled; a failed compile raises FinetuneError. Sets DS_ACCELERATOR (cpu), TORCH_EXTENSIONS_DIR, PATH
    (ranks_path) and TORCH_CUDA_ARCH_LIST (jit_arch_list) in this process as the launch sets them for its ranks
    (finetune.run.launch.commands.plan_launch)."""
    environ = os.environ
    root = launch_extensions_root()
    environ["TORCH_EXTENSIONS_DIR"] = str(root)  # torch's builder reads it when it loads
    path = ranks_path(sys.executable, environ)
    if path is not None:  # the ninja the ranks will run: another one would build the op again
        environ["PATH"] = path
    if device == "cpu":
        environ.setdefault("DS_ACCELERATOR", "cpu")
    else:
        arch_list = jit_arch_list(environ)
        if arch_list is not None:
            environ["TORCH_CUDA_ARCH_LIST"] = arch_list
    compiled = []
    ops = recipe_ops(device, recipe)
    if not ops:
        log("no DeepSpeed op to compile: " + ("the recipe trains without DeepSpeed's engine here (deepspeed.enabled)"
            if recipe is not None and recipe.deepspeed.enabled is False else "torch's optimizer, or prebuilt ops"))
    for op in ops:
        build_dir = root / op
        note = lock_note(build_dir)
        if note:
            log(note)
        if is_built(build_dir):
            log(f"{op}: already built in {build_dir}")
            continue
        from deepspeed.accelerator import get_accelerator

        builder = get_accelerator().create_op_builder(BUILDERS[op])
        if builder is None:
            log(f"{op}: DeepSpeed's {get_accelerator().device_name()} accelerator has no such op; nothing to build")
            continue
        started = time.monotonic()
        log(f"{COMPILE_NOTE}{op} into {build_dir} (about a minute on a few cores) ...")
        try:
            builder.load(verbose=False)
        except Exception as exc:  # no compiler, a broken DeepSpeed: what the compiler said last, on one line
            from finetune.errors import FinetuneError

            said = str(exc).strip().splitlines()
            raise FinetuneError(f"compiling {op} failed: {type(exc).__name__}: {said[-1] if said else ''}") from exc
        log(f"compiled {op} in {time.monotonic() - started:.0f} s")
        compiled.append(op)
    return compiled
