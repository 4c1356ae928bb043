"""Shared test fixtures. Keep this small; module-specific helpers live beside their tests."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.train_fixtures import cache_dir, runner_env

REPO = Path(__file__).resolve().parent.parent
FINETUNE = [sys.executable, "-m", "finetune.cli"]


def _one_extensions_build() -> None:
    """Every DeepSpeed process of the session builds its JIT ops in one folder with one ninja: the folder and
    PATH `finetune train` gives its ranks (finetune.run.deepspeed_ops.launch_extensions_root, ranks_path).
    The tests that start torchrun or a probe themselves would otherwise use torch's default folder, and a
    fresh CI machine compiled the CPU communication op twice (about 37 CPU seconds each); a system ninja
    first on PATH would compile it again after each launch's ninja did. A TORCH_EXTENSIONS_DIR already set
    is kept."""
    import os

    from finetune.run.deepspeed_ops import launch_extensions_root, ranks_path

    os.environ["TORCH_EXTENSIONS_DIR"] = str(launch_extensions_root())
    path = ranks_path()
    if path is not None:
        os.environ["PATH"] = path


_one_extensions_build()


def _no_hub_requests() -> None:
    """The tests never touch the network: preflight's look-up of a hub model id (finetune.run.hub) is off for the
    session and its subprocesses; tests/run/test_preflight.py turns it on with huggingface_hub mocked."""
    import os

    from finetune.run.hub import CHECK_ENV

    os.environ[CHECK_ENV] = "0"


_no_hub_requests()

MINIMAL = """\
model:
  name_or_path: org/some-model
data:
  path: org/some-dataset
"""


def hub_recipe(**sections):
    """A valid Recipe naming a hub model and data set (nothing is read), `sections` replacing its own."""
    from finetune.recipe import Recipe

    return Recipe.model_validate({"model": {"name_or_path": "org/m"}, "data": {"path": "org/d"}, **sections})


def write_local_inputs(folder: Path) -> None:
    """A local model directory (a config.json only: preflight reads no weights) and a one-row alpaca
    data.jsonl in `folder`, for recipes that say `name_or_path: ./model` and `path: data.jsonl`."""
    (folder / "model").mkdir()
    (folder / "model" / "config.json").write_text('{"model_type": "llama"}')
    (folder / "data.jsonl").write_text('{"instruction": "Add 2 and 3.", "output": "5"}\n')


@pytest.fixture
def write_recipe(tmp_path):
    """write_recipe(text, name="r.yaml") -> Path of a recipe file in tmp_path (text is dedented)."""

    def write(text: str = MINIMAL, name: str = "r.yaml") -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
        return path

    return write


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> Path:
    """The session's FINETUNE_CACHE with the built-in tiny model built in it, before any run starts
    (as `finetune train`'s preflight does, so that the ranks never race to build it)."""
    from finetune.builtin import ensure_builtin_model

    root = cache_dir(tmp_path_factory)
    ensure_builtin_model("builtin:tiny-llama", root)
    return root


@pytest.fixture(scope="session")
def tiny_dir(tiny_cache) -> Path:
    """The built-in tiny model's directory (config, weights, tokenizer)."""
    from finetune.builtin import ensure_builtin_model

    return ensure_builtin_model("builtin:tiny-llama", tiny_cache)


# The one SFT run several slow tests read (report and next steps, chat, merge, eval, the runner's lora_zero2
# case, resume's uninterrupted reference): a 2-process start costs ~90% of a tiny run, so it is trained once.
SHARED_SFT_RECIPE = REPO / "recipes" / "tiny" / "lora_zero2.yaml"
SHARED_SFT_SETS = ("--set", "training.save_steps=4")  # checkpoints 4, 8, 12 (save_total_limit 2 keeps 8 and 12)


@pytest.fixture(scope="session")
def shared_sft_run(tmp_path_factory, tiny_cache):
    """(run directory, CompletedProcess) of `finetune train recipes/tiny/lora_zero2.yaml` with SHARED_SFT_SETS,
    trained once per session by the real CLI. Readers must not change what is in it (eval.json aside)."""
    from finetune.run.launch.commands import free_port

    out = tmp_path_factory.mktemp("shared-sft") / "run"
    argv = [*FINETUNE, "train", str(SHARED_SFT_RECIPE), "--output-dir", str(out), *SHARED_SFT_SETS,
            "--master-port", str(free_port())]
    result = subprocess.run(argv, cwd=REPO, env=runner_env(tiny_cache), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, result


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, tiny_cache, request):
    """tiny_run(name) -> (run directory, CompletedProcess, Recipe) of recipes/tiny/NAME.yaml run by the real
    per-rank runner under torchrun (2 processes), once per session, saving a checkpoint of its last step: the
    runner's tests check what it saved, convert's tests convert that checkpoint. The shared SFT recipe is the shared_sft_run (the real CLI)."""
    from finetune.recipe import load_recipe
    from tests.train_fixtures import TINY_RECIPES, launch_runner, write_run_dir

    runs = {}

    def get(name: str):
        if name not in runs:
            path = TINY_RECIPES / f"{name}.yaml"
            if path == SHARED_SFT_RECIPE:
                run_dir, result = request.getfixturevalue("shared_sft_run")
                recipe = load_recipe(path, list(SHARED_SFT_SETS[1::2])).recipe
            else:
                run_dir = tmp_path_factory.mktemp(name) / "run"
                steps = load_recipe(path).recipe.training.max_steps
                # a checkpoint of the last step (none is saved without save_steps), for convert's tests
                recipe = write_run_dir(path, run_dir, world_size=2, overrides=(f"training.save_steps={steps}",))
                result = launch_runner(run_dir, tiny_cache)
            runs[name] = (run_dir, result, recipe)
        return runs[name]

    return get


@pytest.fixture
def cli(tiny_cache, monkeypatch):
    """cli(*args) -> (returncode, stdout, stderr) of the real `finetune` app, run in this process (typer's
    CliRunner): a process each would import torch and transformers again (~3 s of CPU per call)."""
    from types import SimpleNamespace

    from typer.testing import CliRunner

    from finetune.cli import app

    for name, value in runner_env(tiny_cache).items():
        if name in ("FINETUNE_CACHE", "TOKENIZERS_PARALLELISM"):
            monkeypatch.setenv(name, value)

    def invoke(*args):
        result = CliRunner().invoke(app, [str(a) for a in args])
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise result.exception
        return SimpleNamespace(returncode=result.exit_code, stdout=result.stdout, stderr=result.stderr)

    return invoke


@pytest.fixture
def no_network(monkeypatch):
    """Every connection attempt is recorded and refused: offline means not one (lm-eval's runs, tests/use and
    tests/launches)."""
    tried = []

    def refuse(self, address, *args, **kwargs):
        tried.append(address)
        raise OSError("the test forbids the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    return tried


@pytest.fixture
def one_thread():
    """torch on one thread: the tiny model's matmuls gain nothing from two, and on a busy 2-core box (or beside the
    other xdist worker) two threads waiting for each other made an lm-eval run 4x slower (32 s vs 7 s)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def no_launch(monkeypatch):
    """Fails the test if anything tries to start the launcher; the list of plans it was handed stays empty."""
    import finetune.run.launch.supervision

    started = []

    def spawn(plan):
        started.append(plan)
        raise AssertionError("nothing should have been launched")

    monkeypatch.setattr(finetune.run.launch.supervision, "spawn", spawn)
    return started


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the real `finetune` entry point in a subprocess."""
    return subprocess.run([*FINETUNE, *map(str, args)], capture_output=True, text=True, cwd=cwd or REPO, timeout=timeout)


# ------------------------------------------------------------------------------------------------
# Order. In one process (plain `pytest`): every fast test runs before the first slow (multi-process) one, and a
# fast failure skips the slow tier, so a broken build fails in about a minute instead of after ten.
# Under pytest-xdist (`-n auto`, what CI runs): the tests are split into groups that each go whole to one worker,
# so that no training run a fixture shares is trained twice: the tests reading the shared SFT run, those reading
# the tiny_run runs, one group per module for the tests of a module-scoped fixture, and otherwise one test each.
# The slow groups are sent first (the two shared-run groups, then by number of slow tests), and the fast tests
# fill the gaps: a 2-process run leaves a core idle while it waits for a launch, a barrier or a checkpoint.


def _xdist_group(item) -> str:
    if "shared_sft_run" in item.fixturenames or _tiny_run_name(item) == SHARED_SFT_RECIPE.stem:
        return "shared-sft"
    if "tiny_run" in item.fixturenames:
        return "tiny-runs"
    shared = any(d.scope in ("module", "package", "class")
                 for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs)
    # a test that shares no fixture with its module goes alone: small units keep both workers busy to the end
    return item.nodeid.split("::")[0] if shared else item.nodeid


def _tiny_run_name(item) -> str | None:
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("name") if callspec is not None and "tiny_run" in item.fixturenames else None


LAUNCHES = Path(__file__).resolve().parent / "launches"


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the folder gives the marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.is_relative_to(LAUNCHES):
            item.add_marker(pytest.mark.slow)
    if not hasattr(config, "workerinput"):
        items.sort(key=lambda item: item.get_closest_marker("slow") is not None)  # stable: file order kept
        return
    groups = {item.nodeid: _xdist_group(item) for item in items}
    slow_groups = {}
    for item in items:
        if item.get_closest_marker("slow") is not None:
            slow_groups[groups[item.nodeid]] = slow_groups.get(groups[item.nodeid], 0) + 1
    # The scheduler (below) sends the groups in this order: the groups of the shared runs first (each of their
    # tests reads a training run), then the other slow groups by their number of slow tests, then the fast modules.
    first = {"shared-sft": -2, "tiny-runs": -1}
    order = {group: (first.get(group, 0), -count) for group, count in slow_groups.items()}
    items.sort(key=lambda item: order.get(groups[item.nodeid], (1, 0)))
    # xdist's own `xdist_group` mark reaches the scheduler by renaming node ids, which pytest 9.2 no longer
    # allows; the groups go to the scheduler in a file instead (every worker writes the same one).
    path = Path(config.workerinput["finetune_groups"])
    partial = path.with_name(f"{path.name}.{config.workerinput['workerid']}")
    partial.write_text(json.dumps(groups))
    partial.replace(path)


try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # pytest-xdist is in the dev extra; without it the tests run in one process
    pass
else:
    class _GroupScheduling(LoadScopeScheduling):
        """One work unit per group (above), sent in the order of the collection."""

        def __init__(self, config, log=None):
            super().__init__(config, log)
            self._groups = None

        def _split_scope(self, nodeid: str) -> str:
            if self._groups is None:
                self._groups = json.loads(Path(self.config.finetune_groups).read_text())
            return self._groups.get(nodeid, nodeid)

    @pytest.hookimpl(optionalhook=True)  # xdist's hooks: unknown under `-p no:xdist`
    def pytest_xdist_make_scheduler(config, log):
        config.option.loadscopereorder = False
        return _GroupScheduling(config, log)

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(node):
        node.workerinput["finetune_groups"] = node.config.finetune_groups

    @pytest.hookimpl(tryfirst=True)
    def pytest_configure(config):
        if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
            import tempfile

            config.finetune_groups = str(Path(tempfile.mkdtemp(prefix="finetune-xdist-")) / "groups.json")


FAST_FAILURES = pytest.StashKey[int]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.failed and item.get_closest_marker("slow") is None:  # a slow failure does not stop the slow tier
        item.config.stash[FAST_FAILURES] = item.config.stash.get(FAST_FAILURES, 0) + 1


def pytest_runtest_setup(item):
    if hasattr(item.config, "workerinput"):
        return  # under xdist the slow groups are sent first, before any fast test could fail
    failed = item.config.stash.get(FAST_FAILURES, 0)
    if item.get_closest_marker("slow") is not None and failed and not item.config.getoption("--keep-going"):
        pytest.skip(f"{failed} fast test(s) failed: the slow tier is skipped (--keep-going runs it anyway)")


def pytest_addoption(parser):
    parser.addoption("--keep-going", action="store_true", help="Run the slow tier even after a fast test failed.")


# A readable progress line (issue 34: `pytest -q -n auto` printed only dots for 10 minutes): each test or fixture
# set-up that took at least PROGRESS_SECONDS, and each failure, as it finishes, with the time since the start.
PROGRESS_SECONDS = 10.0
_progress: list = []  # [(config, start)] in the process that prints: the controller, or the only process


def pytest_sessionstart(session):
    import time

    if not hasattr(session.config, "workerinput"):
        _progress.append((session.config, time.monotonic()))


def pytest_runtest_logreport(report):
    import time

    if not _progress or (report.duration < PROGRESS_SECONDS and not report.failed):
        return
    if report.when == "teardown" and not report.failed:
        return
    config, started = _progress[0]
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    elapsed = int(time.monotonic() - started)
    what = {"setup": "set-up", "call": report.outcome}.get(report.when, report.when)
    if reporter._tw.width_of_current_line:  # after the dots of -q
        reporter.write("\n")
    reporter.write_line(f"  {elapsed // 60}:{elapsed % 60:02d}  {what:<7} {report.duration:5.0f} s  {report.nodeid}")
