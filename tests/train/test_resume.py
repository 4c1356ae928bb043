"""Preemption and resume without training: the checkpoint rules, the resume key, the decision `finetune train` makes
on a run directory (--dry-run, nothing launched), the lock, exit codes, and signals through fake ranks. The real
interrupted-and-resumed chain is in tests/launches/test_resume.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from finetune.rundir import checkpoint as ckpt
from finetune.rundir import resume_key
from finetune.cli import app
from finetune.recipe import load_recipe
from finetune.rundir.layout import resolved_recipe, write_run_dir
from tests.conftest import SHARED_SFT_RECIPE as RECIPE, write_local_inputs
from finetune.run.launch.commands import free_port
from tests.train_fixtures import REPO


def running(procs, timeout: float) -> list:
    """The processes of `procs` still running after at most `timeout` seconds. A zombie has exited: it only
    waits for a reaper, which in a container whose PID 1 is not an init may never come."""
    import psutil

    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for proc in procs:
            try:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


# ------------------------------------------------------------------------------------------------
# Fast: the checkpoint rules


def fake_checkpoint(run_dir: Path, step: int, complete: bool = True, size: int = 10, shard=None) -> Path:
    """`shard`: an object torch.save writes as the DeepSpeed shard (resuming reads inside it); else `size` bytes."""
    path = run_dir / f"checkpoint-{step}"
    (path / f"global_step{step}").mkdir(parents=True)
    if shard is None:
        (path / f"global_step{step}" / "shard.pt").write_bytes(b"x" * size)
    else:
        import torch

        torch.save(shard, path / f"global_step{step}" / "shard.pt")
    (path / "trainer_state.json").write_text("{}")
    if complete:
        ckpt.publish(path, step)
    return path


def test_only_checkpoints_with_a_valid_marker_count(tmp_path):
    fake_checkpoint(tmp_path, 4)
    fake_checkpoint(tmp_path, 8)
    fake_checkpoint(tmp_path, 12, complete=False)
    cut = fake_checkpoint(tmp_path, 16)
    (cut / "global_step16" / "shard.pt").write_bytes(b"x")  # a shard rewritten after the marker
    wrong = fake_checkpoint(tmp_path, 20)
    (wrong / ckpt.MARKER).write_text(json.dumps({"step": 4, "files": {}}))  # another step's marker
    (tmp_path / "checkpoint-24").write_text("a file, not a folder")
    found = {c.step: c for c in ckpt.list_checkpoints(tmp_path)}
    assert sorted(found) == [4, 8, 12, 16, 20]
    assert [s for s, c in found.items() if c.complete] == [4, 8]
    assert "no COMPLETE marker" in found[12].problem
    assert "shard.pt has 1 bytes, the marker says 10" in found[16].problem
    assert "does not describe step 20" in found[20].problem
    assert ckpt.latest_complete(tmp_path).step == 8
    marker = json.loads((tmp_path / "checkpoint-8" / ckpt.MARKER).read_text())
    assert marker["step"] == 8 and marker["files"] == {"global_step8/shard.pt": 10, "trainer_state.json": 2}


def test_the_ranks_load_nothing_through_a_link_out_of_the_checkpoint(tmp_path):
    """Issue 34 item 1, where DeepSpeed's loader is about to follow the links (preflight refused them already)."""
    from finetune.train.preemption import agreed_checkpoint

    run = tmp_path / "run"
    path = fake_checkpoint(run, 4)
    assert agreed_checkpoint(run, resume=True) == str(path)
    (path / "latest").write_text(str(tmp_path))
    with pytest.raises(ckpt.CheckpointError, match="latest names .* outside"):
        agreed_checkpoint(run, resume=True)


def test_rotation_removes_only_after_a_newer_checkpoint_is_complete(tmp_path):
    for step in (2, 4, 6):
        fake_checkpoint(tmp_path, step)
    fake_checkpoint(tmp_path, 3, complete=False)  # an old half-written one
    fake_checkpoint(tmp_path, 8, complete=False)  # being written right now
    removed = ckpt.rotate(tmp_path, keep=2)
    assert sorted(p.name for p in removed) == ["checkpoint-2", "checkpoint-3"]
    assert [(c.step, c.complete) for c in ckpt.list_checkpoints(tmp_path)] == [(4, True), (6, True), (8, False)]
    assert not list(tmp_path.glob(".checkpoint-*"))
    assert ckpt.rotate(tmp_path, keep=None) == []
    assert [p.name for p in ckpt.discard_incomplete(tmp_path)] == ["checkpoint-8"]


def test_stop_record_round_trip(tmp_path):
    assert ckpt.read_stop_record(tmp_path) is None
    ckpt.write_stop_record(tmp_path, 7, "checkpoint-7", "SIGTERM")
    assert ckpt.read_stop_record(tmp_path)["checkpoint"] == "checkpoint-7"
    ckpt.clear_stop_record(tmp_path)
    assert ckpt.read_stop_record(tmp_path) is None


def test_resume_key_names_what_changed():
    recipe = load_recipe(RECIPE).recipe
    base = resolved_recipe(recipe, Path("/runs/x"))
    old = resume_key.resume_fields(base, world_size=2)
    assert resume_key.changed_fields(old, resume_key.resume_fields(base, world_size=2)) == []
    # Cadence, logging and launch details do not matter for resuming ...
    same = load_recipe(RECIPE, ["training.save_steps=7", "training.logging_steps=3", "launch.nccl_timeout=600",
                                "deepspeed.offload_optimizer=cpu", "training.report_to=[tensorboard]"]).recipe
    assert resume_key.resume_hash(resume_key.resume_fields(resolved_recipe(same, Path("/runs/x")), 2)) == resume_key.resume_hash(old)
    # ... the optimisation, the data, the ZeRO stage and the world size do.
    other = load_recipe(RECIPE, ["training.learning_rate=0.02", "data.max_length=32", "deepspeed.stage=3"]).recipe
    changes = resume_key.changed_fields(old, resume_key.resume_fields(resolved_recipe(other, Path("/runs/x")), world_size=4))
    assert changes == ["data.max_length: 64 -> 32", "deepspeed.stage: 2 -> 3", "training.learning_rate: 0.01 -> 0.02",
                       "world size (processes): 2 -> 4"]


def test_disk_errors_are_one_line():
    import errno

    full = OSError(errno.ENOSPC, "No space left on device", "/runs/x/checkpoint-8/shard.pt")
    assert "output disk is full (writing /runs/x/checkpoint-8/shard.pt)" in ckpt.disk_error_message(full, Path("/runs/x"))
    ro = OSError(errno.EROFS, "Read-only file system", "/runs/x/a")
    assert "read-only" in ckpt.disk_error_message(ro, Path("/runs/x"))
    assert ckpt.disk_error_message(ValueError("nope"), Path("/runs/x")) is None
    torch_save = RuntimeError("[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing file data/3: file write failed")
    assert "writing a checkpoint under /tmp failed" in ckpt.disk_error_message(torch_save, Path("/tmp"))


def test_free_space_check(tmp_path):
    assert ckpt.space_problem(tmp_path, 10 * 2**20, free=2**30) is None
    message = ckpt.space_problem(tmp_path, 10 * 2**30, free=2**30)
    assert "not enough free space for the next checkpoint" in message and "1.00 GiB free" in message
    # A first checkpoint of a full fine-tune of 1B bf16 parameters: weights twice + 12 bytes/param (Adam, fp32).
    assert ckpt.model_checkpoint_bytes(10**9, 10**9, 2) == 16 * 10**9


# ------------------------------------------------------------------------------------------------
# Fast: what `finetune train` decides about a run directory (in-process CLI, nothing launched)


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_local_inputs(tmp_path)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {name_or_path: ./model, dtype: float32}\ndata: {path: data.jsonl}\n"
                      "launch: {procs_per_node: 2}\ntraining: {save_steps: 4}\n")
    return tmp_path


def previous_run(workspace: Path, *steps: int, finished: bool = False) -> Path:
    """A run directory as `finetune train` leaves it, with complete checkpoints at `steps`."""
    out = workspace / "out"
    write_run_dir(load_recipe(workspace / "r.yaml"), out, world_size=2)
    for step in steps:
        fake_checkpoint(out, step, shard={"step": step})
    if finished:
        (out / "summary.json").write_text("{}")
    return out


def dry_run(*args):
    result = CliRunner().invoke(app, ["train", "r.yaml", "--output-dir", "out", "--dry-run", *map(str, args)])
    assert "Traceback" not in result.output
    return result


def test_a_run_directory_with_a_checkpoint_is_resumed(workspace, no_launch):
    previous_run(workspace, 4, 8)
    fake_checkpoint(workspace / "out", 12, complete=False)
    result = dry_run()
    assert result.exit_code == 0, result.output
    assert "note: resuming from checkpoint-8 (step 8)" in result.stderr
    assert "checkpoint-12 is incomplete" in result.stderr
    assert result.stdout.splitlines()[1].endswith("--run-dir " + str(workspace / "out") + " --resume")


class _RunsAShellCommand:
    """Unpickling this runs `touch MARKER` (what DeepSpeed's weights_only=False load of a shard would do)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_resume_refuses_a_checkpoint_that_pickles_code(workspace, no_launch):
    """Issue 25 item 2: the same allow-list as `finetune convert`, before anything is launched."""
    out = previous_run(workspace, 4, 8)
    marker = workspace / "PWNED"
    shard = out / "checkpoint-8" / "global_step8" / "shard.pt"
    import torch

    torch.save({"state": _RunsAShellCommand(marker)}, shard)
    ckpt.publish(out / "checkpoint-8", 8)  # the marker's sizes agree: only a look inside finds it
    for result in (dry_run(), CliRunner().invoke(app, ["train", "r.yaml", "--output-dir", "out"])):
        assert result.exit_code == 1, result.output
        assert f"{shard}: refused to load: it pickles posix.system" in result.stderr
        assert "Traceback" not in result.output
    assert not marker.exists() and not no_launch


def test_a_damaged_newest_checkpoint_is_passed_over_for_the_previous_one(workspace, no_launch):
    """Issue 25 item 6: same-size garbage in trainer_state.json, which the marker's sizes cannot see."""
    out = previous_run(workspace, 4, 8)
    state = out / "checkpoint-8" / "trainer_state.json"
    state.write_bytes(b"\x00" * state.stat().st_size)
    result = dry_run()
    assert result.exit_code == 0, result.output
    assert "warning: checkpoint-8 is damaged (trainer_state.json: not valid JSON" in result.stderr
    assert "set aside as .checkpoint-8.damaged and the run resumes from checkpoint-4" in result.stderr
    assert "note: resuming from checkpoint-4 (step 4)" in result.stderr
    assert (out / "checkpoint-8").is_dir()  # a dry run moves nothing
    # A real run sets it aside (kept for a look) before launch; the runner then resumes from checkpoint-4.
    (out / "checkpoint-4" / "trainer_state.json").write_text("[")
    ckpt.publish(out / "checkpoint-4", 4)
    both = dry_run()
    assert both.exit_code == 1 and "every complete checkpoint is damaged (checkpoint-8: trainer_state.json" in both.stderr
    found = ckpt.Checkpoint(8, out / "checkpoint-8", True)
    # Issue 34: a link in the way (to a folder of the user's) made every rerun fail with "Not a directory"; the
    # link is removed, never what it points at, and so are links left where a removal renamed a checkpoint.
    keep = workspace / "theirs"
    (keep / "global_step1").mkdir(parents=True)
    (out / ".checkpoint-8.damaged").symlink_to(keep, target_is_directory=True)
    (out / ".checkpoint-3.deleting-1").symlink_to(keep, target_is_directory=True)
    assert ckpt.set_aside(found) == out / ".checkpoint-8.damaged" and ckpt.latest_complete(out).step == 4
    ckpt.discard_incomplete(out)
    assert (out / ".checkpoint-8.damaged" / "COMPLETE").is_file() and not (out / ".checkpoint-3.deleting-1").is_symlink()
    assert (keep / "global_step1").is_dir()


def test_no_resume_and_overwrite(workspace, no_launch):
    previous_run(workspace, 4)
    refused = dry_run("--no-resume")
    assert refused.exit_code == 1 and "holds checkpoints (newest: checkpoint-4)" in refused.stderr
    fresh = dry_run("--overwrite")
    assert fresh.exit_code == 0 and "--resume" not in fresh.stdout
    assert "the previous run there will be replaced" in fresh.stderr


def test_a_changed_recipe_is_refused_unless_forced(workspace, no_launch):
    previous_run(workspace, 4)
    refused = dry_run("--set", "training.learning_rate=0.001", "--set", "launch.procs_per_node=4")
    assert refused.exit_code == 1
    assert "the recipe changed since checkpoint-4" in refused.stderr
    assert "training.learning_rate: 0.0002 -> 0.001" in refused.stderr
    assert "world size (processes): 2 -> 4" in refused.stderr and "--force-resume" in refused.stderr
    forced = dry_run("--set", "training.learning_rate=0.001", "--force-resume")
    assert forced.exit_code == 0 and "warning: resuming from checkpoint-4 although the recipe changed" in forced.stderr
    # A change that does not matter for resuming is fine
    assert dry_run("--set", "training.logging_steps=1").exit_code == 0


def test_a_finished_run_and_a_run_without_checkpoints(workspace, no_launch):
    previous_run(workspace, 4, finished=True)
    finished = dry_run()
    assert finished.exit_code == 1 and "holds a finished run" in finished.stderr
    assert dry_run("--force-resume").exit_code == 0
    empty = workspace / "empty"
    write_run_dir(load_recipe(workspace / "r.yaml"), empty, world_size=2)
    fake_checkpoint(empty, 4, complete=False)
    result = CliRunner().invoke(app, ["train", "r.yaml", "--output-dir", "empty", "--dry-run"])
    assert result.exit_code == 1 and "holds only incomplete checkpoints (checkpoint-4: no COMPLETE marker" in result.stderr


def test_another_node_of_the_same_run_may_have_written_the_directory(workspace, no_launch):
    out = workspace / "out"
    flags = ("--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1")
    loaded = load_recipe(workspace / "r.yaml", ["launch.nodes=2", "launch.node_rank=0", "launch.master_addr=10.0.0.1"])
    write_run_dir(loaded, out, world_size=4)  # node 0 was first
    from finetune.rundir.lock import acquire, lock_name

    node0 = acquire(out, lock_name(2, 0))  # node 0's `finetune train` is running there
    try:
        joined = dry_run(*flags)
    finally:
        node0.release()
    assert joined.exit_code == 0, joined.output
    assert "written by another node of this run" in joined.stderr
    # a single-node run never writes into someone else's directory
    assert dry_run().exit_code == 1


HOLDER = """
import sys, time
from pathlib import Path
from finetune.rundir.lock import acquire
lock = acquire(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(120)
"""


@pytest.fixture
def live_run(workspace):
    """A run directory with a half-written checkpoint, owned by another live process (a run in progress)."""
    out = previous_run(workspace, 4)
    fake_checkpoint(out, 8, complete=False)  # the live run is writing it
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    yield out, holder.pid
    holder.kill()
    holder.wait()


def test_a_second_run_into_a_live_run_directory_fails_fast_and_deletes_nothing(live_run, no_launch):
    import platform

    out, pid = live_run
    before = sorted(p.name for p in out.iterdir())
    started = time.monotonic()
    result = CliRunner().invoke(app, ["train", "r.yaml", "--output-dir", "out"])
    took = time.monotonic() - started
    assert result.exit_code == 1, result.output
    assert f"is in use by a live run (PID {pid} on {platform.node()}" in result.stderr
    assert f"kill -TERM {pid}" in result.stderr
    assert "resuming from" not in result.stderr  # no resume step announced for a directory it does not own
    assert sorted(p.name for p in out.iterdir()) == before and (out / "checkpoint-8").is_dir()
    assert took < 10, took
    dry = dry_run()
    assert dry.exit_code == 1 and "# a real run would refuse: output directory" in dry.stdout and f"PID {pid}" in dry.stdout


def test_ranks_clean_up_incomplete_checkpoints_only_under_their_own_runs_lock(live_run, monkeypatch):
    pytest.importorskip("transformers")
    from finetune.rundir.lock import OWNER_ENV
    from finetune.train.preemption import discard_incomplete_if_owned

    out, pid = live_run
    monkeypatch.setenv(OWNER_ENV, str(os.getpid()))  # ranks of another `finetune train` than the holder
    discard_incomplete_if_owned(out)
    monkeypatch.delenv(OWNER_ENV)  # ranks started by hand
    discard_incomplete_if_owned(out)
    assert (out / "checkpoint-8").is_dir()
    monkeypatch.setenv(OWNER_ENV, str(pid))  # the holder's own ranks
    discard_incomplete_if_owned(out)
    assert not (out / "checkpoint-8").exists() and (out / "checkpoint-4").is_dir()


def test_the_lock_goes_with_its_holder(live_run):
    from finetune.rundir.lock import acquire, holder

    out, pid = live_run
    assert holder(out) is not None
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while holder(out) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    acquire(out).release()  # the kernel dropped it: no stale lock


def test_dry_run_says_what_a_real_run_would_do_and_still_shows_the_launch(workspace, no_launch):
    out = previous_run(workspace, 4, 8)
    resumed = dry_run()
    assert "# a real run would resume from checkpoint-8 (step 8) in " in resumed.stdout
    # The demo's case: a finished run that kept no checkpoint
    for entry in out.glob("checkpoint-*"):
        ckpt.remove_checkpoint(entry)
    (out / "summary.json").write_text("{}")
    finished = dry_run()
    assert finished.exit_code == 1
    assert "holds a finished run (summary.json) and no checkpoint to continue from" in finished.stdout
    assert "previous run with no checkpoint" not in finished.output
    assert "-m finetune.train.runner --run-dir" in finished.stdout and "# deepspeed.json" in finished.stdout
    assert "a real run would stop here" in finished.stderr
    fresh = CliRunner().invoke(app, ["train", "r.yaml", "--output-dir", "new", "--dry-run"])
    assert fresh.exit_code == 0 and f"# a real run would start fresh in {workspace / 'new'}" in fresh.stdout
    assert not (workspace / "new").exists()


def test_runner_exit_codes(tmp_path):
    pytest.importorskip("transformers")
    from finetune.train.preemption import Preempted, exit_code_for

    assert exit_code_for(Preempted(7, "checkpoint-7", "SIGTERM"), tmp_path) == 75
    assert exit_code_for(ckpt.CheckpointError("no space"), tmp_path) == 1
    assert exit_code_for(KeyError("x"), tmp_path) is None
    assert ckpt.EXIT_PREEMPTED == getattr(os, "EX_TEMPFAIL", 75)  # sysexits.h


def _trained(nan_in: str = ""):
    """(model, optimizer as the Trainer holds it under DeepSpeed: accelerate's wrapper around DeepSpeed's
    optimizer around torch's) after one step; `nan_in`: "state" or "weights" turns NaN."""
    from types import SimpleNamespace

    import torch

    model = torch.nn.Linear(4, 2)
    torch_adam = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    torch_adam.step()
    if nan_in == "state":
        next(iter(torch_adam.state.values()))["exp_avg_sq"][0] = float("nan")
    elif nan_in == "weights":
        model.weight.data[0, 0] = float("inf")
    return model, SimpleNamespace(optimizer=SimpleNamespace(optimizer=torch_adam), step_was_skipped=False)


def test_a_resumed_state_that_is_not_finite_is_set_aside_for_the_previous_checkpoint(tmp_path):
    """Issue 34 item 8: a damaged optimizer state (bytes overwritten, archive intact) trained 29 steps of loss 0 and
    grad norm inf and ended "done"; it is refused where the Trainer has loaded it, and the rerun resumes earlier."""
    from transformers import TrainerControl, TrainerState

    from finetune.train.finite import FiniteGuard, NonFiniteState

    run = tmp_path / "run"
    for step in (4, 8):
        fake_checkpoint(run, step)
    state, control = TrainerState(global_step=8, max_steps=12), TrainerControl()
    FiniteGuard(run, str(run / "checkpoint-8")).on_train_begin(None, state, control, *_trained())
    with pytest.raises(NonFiniteState, match=r"^checkpoint-8 holds values that are not finite \(rank 0: optimizer "
                       r"state exp_avg_sq of master weights 0 holds NaN\): .* set aside as \.checkpoint-8\.damaged; "
                       r"run the same command again to resume from checkpoint-4$"):
        FiniteGuard(run, str(run / "checkpoint-8")).on_train_begin(None, state, control, *_trained("state"))
    assert ckpt.latest_complete(run).step == 4 and (run / ".checkpoint-8.damaged" / ckpt.MARKER).is_file()
    # weights that turned inf are never published, nor reported as trained
    guard = FiniteGuard(run, None)
    with pytest.raises(NonFiniteState, match="by step 8 .*weight weight holds inf.*checkpoint-8 is not published; "
                                             "the newest complete checkpoint is checkpoint-4"):
        guard.on_save(None, state, control, *_trained("weights"))
    guard.on_save(None, state, control, *_trained())
    with pytest.raises(NonFiniteState, match="no adapter or model was written"):
        guard.on_train_end(None, TrainerState(global_step=12, max_steps=12), control, *_trained("weights"))


def test_a_run_whose_every_step_was_skipped_is_not_done(tmp_path):
    from transformers import TrainerControl, TrainerState

    from finetune.train.finite import FiniteGuard, NonFiniteState

    model, optimizer = _trained()
    optimizer.step_was_skipped = True  # DeepSpeed's overflow, as accelerate reports it
    guard = FiniteGuard(tmp_path, str(tmp_path / "checkpoint-8"))
    for step in (9, 10, 11, 12):
        guard.on_step_end(None, TrainerState(global_step=step), TrainerControl(), optimizer=optimizer)
    guard.on_train_end(None, TrainerState(global_step=10, max_steps=12), TrainerControl(), model, optimizer)  # a signal
    with pytest.raises(NonFiniteState, match="after resuming from checkpoint-8, which may be damaged .*skipped every one "
                                             "of the 4 optimizer steps"):
        guard.on_train_end(None, TrainerState(global_step=12, max_steps=12), TrainerControl(), model, optimizer)
    optimizer.step_was_skipped = False
    guard.on_step_end(None, TrainerState(global_step=13), TrainerControl(), optimizer=optimizer)
    guard.on_train_end(None, TrainerState(global_step=13, max_steps=13), TrainerControl(), model, optimizer)


# ------------------------------------------------------------------------------------------------
# Fast: the supervisor's signals, with fake ranks under the real torchrun

STUBBORN_RANK = '''
import os, signal, sys, time
from pathlib import Path

run_dir = Path(sys.argv[sys.argv.index("--run-dir") + 1])
rank = os.environ["RANK"]
signal.signal(signal.SIGTERM, lambda *_: (run_dir / f"asked{rank}").write_text(""))  # "saving a checkpoint"
(run_dir / f"pid{rank}").write_text(str(os.getpid()))
time.sleep(120)
'''

DRIVER = '''
import json, sys
from pathlib import Path
from finetune.run.launch.commands import LaunchPlan
from finetune.run.launch.supervision import supervise
fields = json.loads(sys.argv[1])
sys.exit(supervise(LaunchPlan(**{**fields, "run_dir": Path(fields["run_dir"])})).returncode)
'''


def test_a_second_signal_kills_every_rank_at_once(tmp_path):
    """The rule of finetune.rundir.checkpoint.SECOND_SIGNAL_WINDOW: a repeat within it is the same request;
    a later one SIGKILLs every process of the run."""
    from finetune.rundir.checkpoint import SECOND_SIGNAL_WINDOW
    from finetune.run.launch.commands import plan_launch
    from finetune.recipe import Recipe

    (tmp_path / "fakes").mkdir()
    (tmp_path / "fakes" / "stubborn_rank.py").write_text(STUBBORN_RANK)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    recipe = Recipe.model_validate({"model": {"name_or_path": "org/m"}, "data": {"path": "org/d"},
                                    "launch": {"procs_per_node": 2}})
    plan = plan_launch(recipe, run_dir, gpu_count=0, module="stubborn_rank", master_port=free_port())
    plan.env["PYTHONPATH"] = str(tmp_path / "fakes")
    fields = {k: (str(v) if isinstance(v, Path) else v) for k, v in plan.__dict__.items()}
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, json.dumps(fields)], cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        # Not just there: written (write_text creates the file before it writes the PID).
        while not all((run_dir / f"pid{r}").exists() and (run_dir / f"pid{r}").read_text() for r in (0, 1)):
            assert time.monotonic() < deadline and driver.poll() is None, "fake ranks did not start"
            time.sleep(0.05)
        pids = [int((run_dir / f"pid{r}").read_text()) for r in (0, 1)]
        driver.send_signal(signal.SIGTERM)
        while not ((run_dir / "asked0").exists() and (run_dir / "asked1").exists()):
            assert time.monotonic() < deadline, "the first signal did not reach every rank"
            time.sleep(0.05)
        first = time.monotonic()
        # Within the window: the same request (as the ranks see it), nothing is killed.
        driver.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert driver.poll() is None and all(_alive(pid) for pid in pids)  # still "saving"
        time.sleep(max(0.0, SECOND_SIGNAL_WINDOW + 0.5 - (time.monotonic() - first)))
        started = time.monotonic()
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(timeout=30) == 128 + signal.SIGTERM
        assert time.monotonic() - started < 10  # not torchrun's grace period of launch.stop_timeout
        time.sleep(0.2)
        assert not any(_alive(pid) for pid in pids)
    finally:
        if driver.poll() is None:
            driver.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


# ------------------------------------------------------------------------------------------------
# Fast: the rank's callback on its own (no process group: every decision is this rank's)


def test_a_signal_turns_the_next_step_end_into_save_and_stop(tmp_path):
    from transformers import TrainerControl, TrainerState

    from finetune.train.preemption import PreemptionCallback, Preempted, Resilience

    callback = PreemptionCallback(tmp_path, keep=2, dtype_bytes=4, full=False)
    callback.first_estimate = 1024
    state, control = TrainerState(), TrainerControl()
    state.global_step = 3
    callback.install()
    try:
        callback.on_step_end(None, state, control)
        assert not control.should_save and not control.should_training_stop
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # the same request relayed twice (launcher + system): not an abort
        callback.on_step_end(None, state, control)
    finally:
        callback.uninstall()
    assert control.should_save and control.should_training_stop and callback.stopped_at == 3
    resilience = Resilience({}, {}, None, callback)
    with pytest.raises(Preempted, match="stopped by SIGTERM at step 3"):
        resilience.raise_if_stopped()


def test_no_checkpoint_is_started_without_room_for_it(tmp_path, monkeypatch):
    from transformers import TrainerControl, TrainerState

    from finetune.train.preemption import PreemptionCallback

    callback = PreemptionCallback(tmp_path, keep=2, dtype_bytes=2, full=False)
    callback.first_estimate = 10 * 2**30  # no checkpoint yet: the model's estimate
    monkeypatch.setattr(ckpt, "free_bytes", lambda path: 2**30)
    state, control = TrainerState(), TrainerControl()
    state.global_step = 4
    callback.on_step_end(None, state, control)  # no save due at this step: nothing to check
    control.should_save = True
    with pytest.raises(ckpt.CheckpointError, match=r"not enough free space .* 1.00 GiB free;.*step 4\)"):
        callback.on_step_end(None, state, control)
    fake_checkpoint(tmp_path, 2, size=1000)  # later checkpoints: the previous one's size
    callback.on_step_end(None, state, control)
