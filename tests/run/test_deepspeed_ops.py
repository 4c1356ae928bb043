"""finetune.run.deepspeed_ops: torch's extensions cache, in a temporary TORCH_EXTENSIONS_DIR (never the real cache)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from finetune.cli import app
from finetune.run.deepspeed_ops import CPU_COMM_OP, LOCK_GRACE_S, BuildWatch, is_built, lock_note
from tests.conftest import write_local_inputs


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "torch_extensions"
    (root / CPU_COMM_OP).mkdir(parents=True)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
    return root


def stale_lock(build_dir: Path, age: float = 3600) -> Path:
    lock = build_dir / "lock"
    lock.touch()
    os.utime(lock, (time.time() - age, time.time() - age))
    return lock


def test_a_lock_nobody_compiles_behind_is_removed_with_a_note(cache):
    lock = stale_lock(cache / CPU_COMM_OP)
    note = lock_note(cache / CPU_COMM_OP)
    assert note == f"removed a stale build lock {lock} (60 min old, left by an interrupted compile of {CPU_COMM_OP})"
    assert not lock.exists()


def test_a_lock_of_a_live_compile_is_kept(cache):
    build_dir = cache / CPU_COMM_OP
    lock = stale_lock(build_dir)
    compiler = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=build_dir)  # ninja works there
    try:
        note = lock_note(build_dir)
    finally:
        compiler.kill()
        compiler.wait()
    assert note == f"another process (PID {compiler.pid}) is compiling {CPU_COMM_OP} in {build_dir}; this run waits for it"
    assert lock.exists()


def test_a_young_lock_is_kept_with_the_command_to_remove_it(cache):
    lock = stale_lock(cache / CPU_COMM_OP, age=LOCK_GRACE_S / 3)
    note = lock_note(cache / CPU_COMM_OP)
    assert lock.exists() and note.endswith(f"remove it: rm {lock}")


def test_first_run_compile_is_announced_and_its_end_reported(cache):
    import torch

    watch = BuildWatch(cache, [CPU_COMM_OP])
    assert watch.notes() == [f"compiling {CPU_COMM_OP} (first run in this environment; about a minute on a few cores; "
                             "`finetune doctor --build-ops` compiles it ahead) "
                             f"into {cache / CPU_COMM_OP}"]
    (cache / CPU_COMM_OP / "lock").touch()  # a rank builds it
    assert watch.poll() == []
    (cache / CPU_COMM_OP / f"{CPU_COMM_OP}.so").write_bytes(b"")
    (cache / CPU_COMM_OP / "build.ninja").write_text(f"cflags = -isystem {Path(torch.__file__).parent / 'include'}\n")
    (cache / CPU_COMM_OP / "lock").unlink()
    assert is_built(cache / CPU_COMM_OP)
    [done] = watch.poll()
    assert done.startswith(f"compiled {CPU_COMM_OP} (")
    assert BuildWatch(cache, [CPU_COMM_OP]).notes() == []  # the next run: nothing to say


def test_train_says_so_before_launch_and_a_dry_run_removes_nothing(cache, tmp_path, monkeypatch):
    lock = stale_lock(cache / CPU_COMM_OP)
    monkeypatch.chdir(tmp_path)
    write_local_inputs(tmp_path)
    (tmp_path / "r.yaml").write_text("model: {name_or_path: ./model}\ndata: {path: data.jsonl}\n")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the CPU path, where the comm op is compiled
    result = CliRunner().invoke(app, ["train", "r.yaml", "--output-dir", "out", "--dry-run"])
    assert result.exit_code == 0, result.output
    # a dry run compiles nothing, so it does not say it will (issue 24); the stale lock is still named
    assert "note: compiling" not in result.stderr
    assert f"rm {lock}" in result.stderr and lock.exists()


def test_each_environment_builds_in_its_own_folder(tmp_path, monkeypatch):
    """Two venvs of one Python shared ~/.cache/torch_extensions/py311_cpu and rebuilt each other's ops."""
    from finetune.run.deepspeed_ops import per_environment_root
    from finetune.run.launch.commands import plan_launch
    from tests.conftest import hub_recipe

    environ = {"XDG_CACHE_HOME": str(tmp_path)}
    one = per_environment_root("/envs/a/bin/python", environ)
    assert one == per_environment_root("/envs/a/bin/python", environ)
    assert one != per_environment_root("/envs/b/bin/python", environ)
    assert one.parent == tmp_path / "torch_extensions" and "_torch" in one.name
    plan = plan_launch(hub_recipe(), tmp_path / "run", 0, python="/envs/a/bin/python", environ=environ)
    assert plan.env["TORCH_EXTENSIONS_DIR"] == str(one) and "TORCH_EXTENSIONS_DIR" not in plan.display()
    mine = plan_launch(hub_recipe(), tmp_path / "run", 0, environ={**environ, "TORCH_EXTENSIONS_DIR": "/x"})
    assert "TORCH_EXTENSIONS_DIR" not in mine.env  # the user's own choice is inherited as it is


@pytest.mark.parametrize("value, expected", [
    ("9.0a", "9.0"),
    ("8.0;9.0a 10.0f+PTX", "8.0;9.0;10.0+PTX"),
    ("9.0 9.0a", "9.0"),
    ("8.0;9.0+PTX", None),  # already readable: left as it is
    ("", None),
])
def test_arch_specific_targets_are_made_plain_for_deepspeeds_jit_builder(value, expected, monkeypatch):
    """CUDA images for Hopper set TORCH_CUDA_ARCH_LIST=9.0a; DeepSpeed's JIT builder then failed to build
    FusedAdam on an H100 ("invalid literal for int() with base 10: '0a'"). DeepSpeed's own builder is the judge."""
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    from finetune.run.deepspeed_ops import jit_arch_list
    from finetune.run.launch.commands import plan_launch
    from tests.conftest import hub_recipe

    assert jit_arch_list({"TORCH_CUDA_ARCH_LIST": value}) == expected
    builder = FusedAdamBuilder()
    builder.jit_mode = True
    if expected is not None:
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", value)
        with pytest.raises(ValueError, match="invalid literal"):
            builder.compute_capability_args()
    if value:
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", expected or value)
        builder.compute_capability_args()  # what the ranks get: DeepSpeed reads it

    on_gpus = plan_launch(hub_recipe(), Path("/tmp/run"), 2, environ={"TORCH_CUDA_ARCH_LIST": value})
    assert on_gpus.env.get("TORCH_CUDA_ARCH_LIST") == expected
    if expected:
        assert f"TORCH_CUDA_ARCH_LIST={shlex.quote(expected)}" in on_gpus.display()  # said in the run log
    on_cpu = plan_launch(hub_recipe(), Path("/tmp/run"), 0, environ={"TORCH_CUDA_ARCH_LIST": value})
    assert "TORCH_CUDA_ARCH_LIST" not in on_cpu.env


class _Builder:
    """DeepSpeed's op builder as torch's JIT leaves its folder: the library, and build.ninja naming this torch."""

    def __init__(self, op: str, fails: bool = False):
        self.op, self.fails, self.loads = op, fails, 0

    def load(self, verbose=True):
        import torch

        self.loads += 1
        if self.fails:
            raise RuntimeError("Error building extension 'deepspeed_shm_comm'\nninja: build stopped: subcommand failed.")
        build_dir = Path(os.environ["TORCH_EXTENSIONS_DIR"]) / self.op  # where torch builds: read at load time
        build_dir.mkdir(parents=True, exist_ok=True)
        (build_dir / f"{self.op}.so").write_bytes(b"")
        (build_dir / "build.ninja").write_text(f"cflags = -isystem {Path(torch.__file__).parent / 'include'}\n")


def _fake_accelerator(monkeypatch, builders: dict):
    import deepspeed.accelerator
    from types import SimpleNamespace

    accelerator = SimpleNamespace(create_op_builder=builders.get, device_name=lambda: "cpu")
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: accelerator)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # build_ahead sets it: restored after the test
    monkeypatch.setenv("PATH", os.environ.get("PATH", os.defpath))  # build_ahead may put ninja's folder first


def test_build_ahead_compiles_what_a_launch_would_and_only_once(cache, monkeypatch):
    from finetune.run.deepspeed_ops import CPU_LION_OP, build_ahead
    from tests.conftest import hub_recipe

    builders = {"ShareMemCommBuilder": _Builder(CPU_COMM_OP), "CPULionBuilder": _Builder(CPU_LION_OP)}
    _fake_accelerator(monkeypatch, builders)
    lines = []
    assert build_ahead("cpu", None, lines.append) == [CPU_COMM_OP]  # AdamW: torch's on the CPU accelerator
    assert lines[0] == f"compiling {CPU_COMM_OP} into {cache / CPU_COMM_OP} (about a minute on a few cores) ..."
    assert lines[1].startswith(f"compiled {CPU_COMM_OP} in ") and is_built(cache / CPU_COMM_OP)
    assert BuildWatch(cache, [CPU_COMM_OP]).notes() == []  # the launch then has nothing to compile
    lines.clear()
    lion = hub_recipe(training={"optimizer": "lion"}, deepspeed={"stage": 2, "offload_optimizer": "cpu"})
    assert build_ahead("cpu", lion, lines.append) == [CPU_LION_OP]  # offloaded Lion: DeepSpeedCPULion's op
    assert lines[0] == f"{CPU_COMM_OP}: already built in {cache / CPU_COMM_OP}"
    assert [b.loads for b in builders.values()] == [1, 1]


def test_build_ahead_on_a_gpu_gives_the_builder_the_arch_list_and_path_the_ranks_get(cache, monkeypatch, tmp_path):
    from finetune.run.deepspeed_ops import FUSED_ADAM_OP, build_ahead
    from finetune.run.launch.commands import plan_launch
    from tests.conftest import hub_recipe

    seen = []

    class Fused(_Builder):
        def load(self, verbose=True):
            seen.append((os.environ["TORCH_CUDA_ARCH_LIST"], os.environ["PATH"]))
            super().load(verbose)

    _fake_accelerator(monkeypatch, {"FusedAdamBuilder": Fused(FUSED_ADAM_OP)})
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a")  # a Hopper image's; DeepSpeed's JIT cannot read 9.0a
    _ninja(tmp_path / "usr-bin")  # another ninja first on PATH: both must run the same one (ranks_path)
    monkeypatch.setenv("PATH", f"{tmp_path / 'usr-bin'}{os.pathsep}{os.environ['PATH']}")
    ranks = plan_launch(hub_recipe(), tmp_path / "run", 1, python=sys.executable, environ=dict(os.environ)).env
    fused_adam = hub_recipe(deepspeed={"overrides": {"optimizer": {"params": {"torch_adam": False}}}})
    assert build_ahead("cuda", fused_adam, lambda line: None) == [FUSED_ADAM_OP]
    assert seen == [("8.0;9.0", ranks.get("PATH", os.environ["PATH"]))]


@pytest.mark.parametrize("device, optimizer, offload, nvme_params, expected", [
    ("cpu", "adamw", "none", False, ["deepspeed_shm_comm"]),
    ("cpu", "adamw", "cpu", False, ["deepspeed_shm_comm"]),  # the runner sets torch_adam on the CPU accelerator
    ("cuda", "adamw", "none", False, ["fused_adam"]),
    ("cuda", "adam", "cpu", False, ["cpu_adam"]),
    ("cuda", "adamw", "nvme", False, ["cpu_adam", "async_io"]),
    ("cuda", "adamw", "none", True, ["fused_adam", "async_io"]),
    ("cuda", "lion", "none", False, ["fused_lion"]),
    ("cuda", "adagrad", "none", False, []),  # torch.optim.Adagrad
    ("cuda", "adagrad", "cpu", False, ["cpu_adagrad"]),
    ("cuda", "sgd", "none", False, []),  # the Trainer's optimizer: DeepSpeed wraps it
])
def test_the_ops_are_the_ones_deepspeeds_engine_builds(device, optimizer, offload, nvme_params, expected):
    """DeepSpeed 0.19.8 runtime/engine.py _configure_basic_optimizer and get_optimizer_configuration."""
    from finetune.run.deepspeed_ops import BUILDERS, ops_needed

    ops = ops_needed(device, optimizer, offload, "nvme" if nvme_params else "none")
    assert ops == expected and set(ops) <= set(BUILDERS)


def test_ops_deepspeed_was_installed_with_are_not_compiled(tmp_path, monkeypatch):
    """DS_BUILD_FUSED_ADAM=1 pip install deepspeed: setup.py records the op as installed for its accelerator."""
    import importlib.util
    from types import SimpleNamespace

    from finetune.run import deepspeed_ops

    (tmp_path / "git_version_info_installed.py").write_text(
        "version='0.19.8'\ninstalled_ops={'fused_adam': True, 'cpu_adam': False}\naccelerator_name='cuda'\n")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: SimpleNamespace(
        submodule_search_locations=[str(tmp_path)]) if name == "deepspeed" else real(name, *a))
    assert deepspeed_ops.prebuilt_ops("cuda") == {"fused_adam"} and deepspeed_ops.prebuilt_ops("cpu") == set()
    from tests.conftest import hub_recipe

    fused_adam = hub_recipe(deepspeed={"overrides": {"optimizer": {"params": {"torch_adam": False}}}})
    assert deepspeed_ops.recipe_ops("cuda", fused_adam) == []
    assert deepspeed_ops.recipe_ops("cuda", hub_recipe(deepspeed={"stage": 2, "offload_optimizer": "cpu"})) == ["cpu_adam"]


def test_doctor_build_ops_failure_is_one_line(cache, monkeypatch):
    _fake_accelerator(monkeypatch, {"ShareMemCommBuilder": _Builder(CPU_COMM_OP, fails=True)})
    result = CliRunner().invoke(app, ["doctor", "--build-ops"])
    assert result.exit_code == 1, result.output
    assert result.output.splitlines()[-1] == (f"error: compiling {CPU_COMM_OP} failed: RuntimeError: ninja: build "
                                              "stopped: subcommand failed.")


def _built(build_dir: Path, seconds_log: int | None = None) -> None:
    import torch

    (build_dir / f"{build_dir.name}.so").write_bytes(b"")
    (build_dir / "build.ninja").write_text(f"cflags = -isystem {Path(torch.__file__).parent / 'include'}\n")
    if seconds_log is not None:  # ninja's own log: start, end (ms), mtime, output, hash
        (build_dir / ".ninja_log").write_text(f"# ninja log v5\n5\t{seconds_log * 1000 - 900}\t1\tshm.o\tab\n"
                                              f"{seconds_log * 1000 - 900}\t{seconds_log * 1000}\t1\t{build_dir.name}.so\tcd\n")


def test_a_rebuild_of_a_built_op_is_announced_with_its_last_build_time(cache, tmp_path):
    """Issue 34: a recompile of an op that was built ran 58 s in silence under "loading model"."""
    import shutil

    _built(cache / CPU_COMM_OP, seconds_log=58)
    watch = BuildWatch(cache, [CPU_COMM_OP])
    assert watch.notes() == [] and watch.poll() == []
    compiler = tmp_path / "cc1plus"  # what g++ runs; a no-op ninja run at every load starts none
    shutil.copy(shutil.which("sleep"), compiler)
    running = subprocess.Popen([str(compiler), "60"], cwd=cache / CPU_COMM_OP)
    try:
        for _ in range(50):  # /proc shows the new process's name once it has exec'd
            if Path(f"/proc/{running.pid}/comm").read_text().strip() == "cc1plus":
                break
            time.sleep(0.05)
        assert watch.poll() == [f"compiling DeepSpeed op {CPU_COMM_OP} again (about 58 s, as its last build here): "
                                f"ninja rebuilds it in {cache / CPU_COMM_OP}"]
        assert watch.poll() == []  # said once
    finally:
        running.kill()
        running.wait()
    [done] = watch.poll()
    assert done.startswith(f"compiled {CPU_COMM_OP} (")


def test_an_op_older_than_deepspeeds_sources_is_not_built(cache, tmp_path):
    """pip writes every file of a package it installs with the time of the install, the same version too: the
    GPU check installs its wheels again on a warm machine, `doctor --build-ops` found FusedAdam built, and ninja
    compiled it again inside the run's DeepSpeed start-up (35.6 s against 0.8-1.1 s, 2026-11-28)."""
    import torch

    build_dir = cache / CPU_COMM_OP
    sources = tmp_path / "deep speed" / "csrc"  # a path with a space: ninja writes it as `deep$ speed`
    sources.mkdir(parents=True)
    for name in ("shm.cpp", "shm_interface.cpp"):
        (sources / name).write_text("// source\n")
    escaped = str(sources).replace(" ", "$ ")
    (build_dir / "build.ninja").write_text(
        f"cflags = -isystem {Path(torch.__file__).parent / 'include'}\n"
        f"build shm.o: compile {escaped}/shm.cpp\nbuild shm_interface.o: compile {escaped}/shm_interface.cpp\n"
        f"build {CPU_COMM_OP}.so: link shm.o shm_interface.o\n")
    library = build_dir / f"{CPU_COMM_OP}.so"
    library.write_bytes(b"")
    os.utime(library, ns=(time.time_ns() + 10**9,) * 2)  # built after its sources were written
    assert is_built(build_dir) and BuildWatch(cache, [CPU_COMM_OP]).notes() == []
    os.utime(sources / "shm.cpp", ns=(time.time_ns() + 2 * 10**9,) * 2)  # DeepSpeed installed again
    assert not is_built(build_dir)
    [note] = BuildWatch(cache, [CPU_COMM_OP]).notes()
    assert note.startswith(f"compiling {CPU_COMM_OP} (its build is older than DeepSpeed's sources or from another "
                           "torch; ")
    (sources / "shm.cpp").unlink()  # DeepSpeed gone: nothing ninja can rebuild the op from
    assert not is_built(build_dir)


def test_the_launcher_watches_built_ops_for_a_rebuild(cache, tmp_path):
    """The launcher's wait loop polled its BuildWatch only while an op was missing at launch, so the rebuild of a
    built op (ninja's command changed: another ninja, torch or flags) went unsaid: 20 s of the CPU op in the
    process group stage here, when the venv's ninja and the system's took turns."""
    import io
    import shutil
    from types import SimpleNamespace

    from finetune.run.launch.supervision import wait

    _built(cache / CPU_COMM_OP, seconds_log=20)
    watch = BuildWatch(cache, [CPU_COMM_OP], every=0.0)
    assert watch.notes() == [] and not watch.pending
    compiler = tmp_path / "cc1plus"
    shutil.copy(shutil.which("sleep"), compiler)
    rebuild = subprocess.Popen([str(compiler), "1"], cwd=cache / CPU_COMM_OP)
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(2)"])  # the ranks' launcher
    console = io.BytesIO()
    plan = SimpleNamespace(run_dir=tmp_path, launcher="deepspeed", node_rank=1)  # no rank-0 log to follow
    try:
        wait(plan, launcher, console, builds=watch)
    finally:
        rebuild.kill()
        rebuild.wait()
    lines = console.getvalue().decode().splitlines()
    assert lines[0] == (f"[finetune] compiling DeepSpeed op {CPU_COMM_OP} again (about 20 s, as its last build "
                        f"here): ninja rebuilds it in {cache / CPU_COMM_OP}")
    assert lines[1].startswith(f"[finetune] compiled {CPU_COMM_OP} (") and len(lines) == 2


def test_missing_build_tools_fail_doctor_and_preflight_with_what_to_install(cache, tmp_path, monkeypatch):
    """Issue 34: without a compiler the demo died after a 190-line traceback ending "ninja: build stopped", and
    `finetune doctor` said "all checks passed". Checked only while an op still has to be compiled."""
    import sysconfig

    from finetune.run import deepspeed_ops
    from finetune.run.doctor import build_tool_checks, checks_for_recipe, run_doctor
    from finetune.run.machine import collect_facts
    from tests.conftest import hub_recipe

    os_release = tmp_path / "os-release"
    os_release.write_text('ID=ubuntu\nID_LIKE=debian\n')
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert deepspeed_ops.system_packages(str(os_release)) == {"c++": "sudo apt install g++",
                                                             "python-dev": f"sudo apt install python{version}-dev"}
    os_release.write_text('ID="rocky"\nID_LIKE="rhel centos fedora"\n')
    assert deepspeed_ops.system_packages(str(os_release))["c++"] == "sudo dnf install gcc-c++"

    bare = tmp_path / "bin"
    bare.mkdir()
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"include": str(tmp_path / "no-headers")})
    missing = deepspeed_ops.missing_build_tools(str(bare / "python"), {"PATH": str(bare), "CXX": "c++"})
    assert [what.split()[0] for what, _ in missing] == ["the", "ninja", "Python's"]
    assert missing[1][1] == f"{bare / 'python'} -m pip install ninja"

    monkeypatch.setenv("CXX", "no-such-compiler-here")
    facts = collect_facts()
    device = "cuda" if facts.cuda_available and facts.gpus else "cpu"
    [check] = build_tool_checks(facts)
    assert check.status == "fail" and "`no-such-compiler-here`" in check.message and "Python's headers" in check.message
    assert check.name in {c.name for c in run_doctor(facts)[1]}
    assert "deepspeed.build-tools" in {c.name for c in checks_for_recipe(hub_recipe(), facts)}  # preflight's checks
    for op in deepspeed_ops.recipe_ops(device, None):  # built: nothing to compile, nothing to check
        (cache / op).mkdir(exist_ok=True)
        _built(cache / op)
    assert build_tool_checks(facts) == []


def _ninja(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ninja").write_text("#!/bin/sh\n")
    (folder / "ninja").chmod(0o755)


def test_the_ranks_run_the_ninja_beside_the_interpreter(tmp_path):
    """A venv used without activation leaves its ninja off PATH; where PATH finds another first (the system's
    1.11 beside the venv's 1.13), each took turns rebuilding the op the other had built (20 s each time here)."""
    from finetune.run.deepspeed_ops import ranks_path

    venv_bin, elsewhere = tmp_path / "venv" / "bin", tmp_path / "usr-bin"
    _ninja(venv_bin)
    elsewhere.mkdir()
    python = str(venv_bin / "python")
    assert ranks_path(python, {"PATH": str(elsewhere)}) == f"{venv_bin}{os.pathsep}{elsewhere}"
    assert ranks_path(python, {"PATH": f"{venv_bin}"}) is None  # on PATH already
    _ninja(elsewhere)  # another ninja found first: the interpreter's goes ahead of it, as activating the venv does
    assert ranks_path(python, {"PATH": str(elsewhere)}) == f"{venv_bin}{os.pathsep}{elsewhere}"
    assert ranks_path(python, {"PATH": f"{venv_bin}{os.pathsep}{elsewhere}"}) is None  # activated
    assert ranks_path(python, {"PATH": f"{elsewhere}{os.pathsep}{venv_bin}"}) is None  # on PATH: the user's order
    link = tmp_path / "link-bin"  # the same folder under another name
    link.symlink_to(venv_bin, target_is_directory=True)
    assert ranks_path(python, {"PATH": f"{link}{os.pathsep}{elsewhere}"}) is None
    assert ranks_path(str(tmp_path / "bare" / "python"), {"PATH": str(elsewhere)}) is None  # none beside it
