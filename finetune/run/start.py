"""`finetune train` from a loaded recipe to an outcome: preflight, launch plan, tokenized data, run directory,
lock, launch.

The one module that brings the parts together: finetune.run.preflight checks, finetune.rundir.layout writes the
run directory, finetune.rundir.lock owns it, finetune.run.launch starts and watches the processes. The SFT
training set is tokenized in the launcher, before torchrun starts anything (finetune.data.prepare_recipe): the
ranks only memory-map it, so no process-group timeout can hit a long tokenization. The CLI
(finetune.cli) prints what `prepare` decided and what `start_run` returned.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Optional

from finetune import objectives
from finetune.run.doctor import recipe_imports
from finetune.run.machine import collect_facts
from finetune.render import resolved_output_dir
from finetune.run.deepspeed_ops import BuildWatch, extensions_root, recipe_ops
from finetune.fsutil import write_atomic
from finetune.run.launch.commands import (
    RUNNER_MODULE, HostfileError, LaunchPlan, deepspeed_env_text, free_port, plan_launch,
)
from finetune.run.launch.outcome import Outcome
from finetune.run.launch.supervision import LaunchError, supervise
from finetune.plan.auto import Resolution
from finetune.run.decide import resolve_on
from finetune.run.preflight import Preflight, run_preflight
from finetune.recipe import LoadedRecipe, Recipe
from finetune.rundir.layout import write_run_dir
from finetune.rundir.names import PREPARE_FILE
from finetune.rundir.lock import LOCK_ENV, OWNER_ENV, RunDirLocked, RunLock, acquire, holder, lock_name


@dataclass
class Prepared:
    """Everything decided before launch. Nothing has been written yet."""

    loaded: LoadedRecipe
    run_dir: Path
    preflight: Preflight
    plan: Optional[LaunchPlan]
    overwrite: bool = False
    lock: Optional[RunLock] = None  # the run directory, owned from before preflight to the end of the run
    builds: Optional[BuildWatch] = None  # DeepSpeed ops compiled on first use (finetune.run.deepspeed_ops)
    # What prepare() created to hold the lock ("dir": the run directory, "file": the lock file in a folder
    # that existed): removed again when nothing is launched, so a refused run leaves no trace.
    created: Optional[str] = None
    auto: Optional[Resolution] = None  # the recipe's auto keys decided for this machine (finetune.plan.auto)

    def release(self) -> None:
        if self.lock is not None:
            if self.created:
                _undo_claim(self.run_dir, self.lock, self.created)
            self.lock.release()
            self.lock = None

    @property
    def resume_from(self):
        """The finetune.rundir.checkpoint.Checkpoint the run continues from, or None."""
        return self.preflight.resume_from


def run_dir_for(recipe: Recipe, output_dir: Optional[Path]) -> Path:
    return (Path(output_dir) if output_dir is not None else Path(resolved_output_dir(recipe))).expanduser().absolute()


def prepare(loaded: LoadedRecipe, output_dir: Optional[Path] = None, overwrite: bool = False,
            module: str = RUNNER_MODULE, facts=None, resume: Optional[bool] = None,
            force_resume: bool = False, dry_run: bool = False) -> Prepared:
    """Preflight and launch plan for `loaded` on this machine (facts: finetune.run.machine.Facts, faked in tests).

    `resume`: continue from the newest complete checkpoint in the run directory (None: training.resume).
    The run directory is locked before anything looks at it (finetune.rundir.lock; created empty when missing,
    a dry run only looks), so no other live run creates, changes or replaces it between what preflight
    decides and the end of the run: release() the result when not launching."""
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
    # The auto keys, decided for these GPUs and processes; everything after reads the decided recipe (the run
    # directory keeps the recipe as written, with auto.json beside it).
    auto = resolve_on(recipe, facts, plan.procs_per_node if plan else 1)
    loaded.recipe = recipe = auto.recipe
    builds = watch_builds(plan, recipe, dry_run, None if overwrite else run_dir) if plan is not None else None
    lock, in_use, created = claim(run_dir, dry_run, recipe)
    prepared = Prepared(loaded, run_dir, None, plan, overwrite, lock, builds, created, auto)  # type: ignore[arg-type]
    try:
        prepared.preflight = run_preflight(loaded, run_dir, overwrite=overwrite, facts=facts,
                                           world_size=plan.world_size if plan else None, resume=resume,
                                           force_resume=force_resume, in_use=in_use)
    except BaseException:
        prepared.release()
        raise
    if plan is not None and prepared.preflight.resume_from is not None:
        plan.argv.append("--resume")  # the runner's argument, last on both launchers' command lines
    return prepared


def resolve_auto(recipe: Recipe, procs_per_node: Optional[int] = None) -> Resolution:
    """The recipe's auto keys decided on the GPUs this process sees, as `finetune train` decides them
    (scripts/bench_hf.py trains a recipe this way). Imports torch (finetune.run.machine)."""
    return resolve_on(recipe, collect_facts(()), procs_per_node)


def watch_builds(plan: LaunchPlan, recipe: Recipe, dry_run: bool, run_dir: Optional[Path] = None) -> Optional[BuildWatch]:
    """Say which DeepSpeed ops the ranks will compile first, and clear a stale build lock that would make
    them wait forever (a dry run only says how). Single-node runs: other nodes have their own caches. `run_dir`:
    written in place, its recorded optimizer counts (deepspeed_ops.recipe_ops)."""
    ops = recipe_ops(plan.device, recipe, run_dir)
    if not ops or plan.nodes > 1:
        return None
    try:
        watch = BuildWatch(extensions_root({**os.environ, **plan.env}), ops, remove_stale=not dry_run)
        plan.notes.extend(watch.notes())
    except ImportError:
        return None  # no torch: the preflight's environment checks say so
    return watch


def claim(run_dir: Path, dry_run: bool, recipe: Recipe) -> tuple[Optional[RunLock], Optional[str], Optional[str]]:
    """(our lock on the run directory, or None; the live holder's description, or None; what we created:
    "dir", "file" (the lock file) or None).

    Taken before preflight reads the directory, and kept through --overwrite's swap (start_run): two
    `finetune train` into one directory, in either order, at any gap, end with one refused naming the other.
    A missing directory is created empty to hold the lock (removed again when nothing is launched)."""
    name = lock_name(recipe.launch.nodes, recipe.launch.node_rank)
    if dry_run:
        return None, (holder(run_dir, name) if run_dir.is_dir() else None), None
    for _ in range(3):  # the directory may vanish under us (another run removing the empty one it created)
        created = None
        try:
            if not run_dir.exists() and not run_dir.is_symlink():
                run_dir.mkdir(parents=True)
                created = "dir"
            if not run_dir.is_dir():
                return None, None, None  # a file, a dangling link: preflight says so
            if created is None and not (run_dir / name).exists():
                created = "file"
            return acquire(run_dir, name), None, created
        except RunDirLocked as exc:
            return None, str(exc), None
        except (FileExistsError, FileNotFoundError):
            continue  # created or removed by another process between our look and our step: look again
        except OSError:
            return None, None, None  # not writable, name too long, a loop: preflight says so
    return None, None, None


def _undo_claim(run_dir: Path, lock: RunLock, created: str) -> None:
    """Remove what claim() created when nothing was launched (a process that opened the lock file before
    this sees it gone: finetune.rundir.lock.acquire looks again)."""
    try:
        lock.path.unlink()
        if created == "dir":
            run_dir.rmdir()  # fails, and leaves it, when anything else appeared in it
    except OSError:
        pass


def start_run(prepared: Prepared, console: Optional[IO[bytes]] = None) -> Outcome:
    """Tokenize (or find the cache), write the run directory, then launch and supervise. Call only when
    prepared.preflight.ok. Bad rows raise LaunchError before anything is written or started."""
    if not prepared.preflight.ok or prepared.plan is None:
        raise LaunchError("preflight failed; nothing was launched")
    plan = prepared.plan
    out = console or sys.stdout.buffer

    def log(line: str) -> None:
        out.write(f"[finetune] {line}\n".encode())
        out.flush()

    from finetune.data.prepare_recipe import prepare_recipe
    from finetune.data.tokenize import DataError
    from finetune.tokenizer import load_for_launch

    recipe = prepared.loaded.recipe
    try:  # TRL's objectives tokenize their rows in the trainer
        data = prepare_recipe(recipe, load_for_launch(recipe), log) \
            if objectives.get(recipe.objective).pretokenized else None
    except DataError as exc:
        prepared.release()
        raise LaunchError(f"{exc}; nothing was launched") from None
    name = lock_name(plan.nodes, plan.node_rank)
    try:
        if prepared.lock is None:  # the directory could not be created or locked at prepare(): try once more
            lock, in_use, _ = claim(prepared.run_dir, False, prepared.loaded.recipe)
            if lock is None:
                raise LaunchError(in_use or f"cannot lock the run directory {prepared.run_dir}")
            prepared.lock = lock
        from finetune.rundir.checkpoint import set_aside

        for damaged in prepared.preflight.damaged:  # newer than the one resumed from (preflight said which)
            set_aside(damaged)
        # Resuming keeps the checkpoints; the nodes of one run may share (and all write) one directory.
        in_place = prepared.resume_from is not None or prepared.preflight.join or plan.nodes > 1
        replaced: list[RunLock] = []

        def own_new_dir(new_dir: Path) -> None:
            # --overwrite: the new directory is locked before it takes the old one's place, and the old one
            # stays locked until then: at no moment is the run directory without its owner.
            replaced.append(acquire(new_dir, name))

        write_run_dir(prepared.loaded, prepared.run_dir, plan.world_size, overwrite=prepared.overwrite,
                      in_place=in_place, before_swap=own_new_dir, auto=prepared.auto)
        prepared.created = None  # from here on the directory is the run's, whatever happens
        if replaced:
            prepared.release()
            replaced[0].path = prepared.run_dir / name
            prepared.lock = replaced[0]
        # The start-up split in summary.json begins here: tokenizing before, the ranks' start after.
        write_atomic(prepared.run_dir / PREPARE_FILE, json.dumps(
            {"tokenize": data.as_dict() if data is not None else None, "launched_at": time.time()}, indent=2) + "\n")
        if "DS_ENV_FILE" in plan.env:
            write_atomic(Path(plan.env["DS_ENV_FILE"]), deepspeed_env_text({**os.environ, **plan.env}))
        # The ranks clean up checkpoints only under this lock.
        plan.env.update({OWNER_ENV: str(os.getpid()), LOCK_ENV: prepared.lock.path.name})
        return supervise(plan, console, keep_fds=(prepared.lock.fd,), builds=prepared.builds)
    finally:
        prepared.release()
