"""Checks `finetune train` runs before any process starts: each failed launch costs rented GPU time.

Every check adds to one `Preflight` (all problems are reported at once, torchtune-style):

- lint: the same rules as `finetune lint` (errors stop the run, warnings are shown),
- environment: finetune.run.doctor.checks_for_recipe (versions, bitsandbytes, GPU count, bf16),
- dataset: every row of every local source converts with its format (finetune.data.validate),
- model: a local directory with config.json, a `builtin:` tiny model, or a hub id (a warning:
  it is downloaded at launch),
- output directory: never a non-empty directory unless --overwrite, and --overwrite only replaces
  a previous run directory (one holding recipe.yaml), never an arbitrary folder. A run directory
  with a complete checkpoint is resumed (finetune.rundir.checkpoint.plan_resume decides, or refuses when
  the recipe changed); another node's copy of the same multi-node run is joined.

Nothing here writes into the run directory; launch happens only when `Preflight.ok`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from finetune import objectives
from finetune.recipe import LoadedRecipe, Recipe
from finetune.recipe.references import is_model_path
from finetune.builtin import is_builtin
from finetune.recipe.references import model_dir_problem
from finetune.data.template_budget import RENDER_SECONDS
from finetune.rundir.names import RUN_INPUTS
from finetune.rundir.run_dir import RunDir

# data.chat_template is rendered on every row before launch, for at most TEMPLATE_BUDGET seconds in all (the
# rest render in the ranks), and at most TEMPLATE_ROW_SECONDS for one row: a template that takes longer on one
# conversation (nested loops over the messages) would take days over a dataset.
TEMPLATE_BUDGET = 30.0
TEMPLATE_ROW_SECONDS = RENDER_SECONDS


@dataclass
class Preflight:
    errors: list[str] = field(default_factory=list)
    # The output directory's problems: a dry run shows them as what a real run would do, and goes on.
    run_dir_errors: list[str] = field(default_factory=list)
    lint_errors: list[str] = field(default_factory=list)  # also in lint_report, with file:line:col
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    lint_report: str = ""  # the lint findings, rendered as `finetune lint` does
    resume_from: Optional[Any] = None  # finetune.rundir.checkpoint.Checkpoint to resume from
    join: bool = False  # the run directory was written by another node of this run
    damaged: list = field(default_factory=list)  # checkpoints newer than resume_from that do not load: set aside
    # Problems that errors holds fewer lines for (bad data rows grouped by problem, or not shown).
    grouped_problems: int = 0

    @property
    def ok(self) -> bool:
        return not self.errors and not self.lint_errors and not self.run_dir_errors

    @property
    def problem_count(self) -> int:
        return len(self.errors) + len(self.lint_errors) + len(self.run_dir_errors) + self.grouped_problems


# ----------------------------------------------------------------------------------------------
# Entry point


def run_preflight(loaded: LoadedRecipe, run_dir: Path, overwrite: bool = False, facts=None,
                  world_size: Optional[int] = None, resume: Optional[bool] = None,
                  force_resume: bool = False, in_use: Optional[str] = None) -> Preflight:
    """All checks for training `loaded` into `run_dir`. `facts`: finetune.run.machine.Facts (tests fake them).

    `resume` None follows training.resume. `in_use`: another live run owns `run_dir` (finetune.rundir.lock):
    that is the output directory's only finding, and nothing there is looked at further."""
    from finetune.run.doctor import checks_for_recipe

    result = Preflight()
    recipe = loaded.recipe
    readable = lint_step(loaded, result, world_size)
    # A run directory written in place (a resume; --overwrite replaces it) keeps its recorded optimizer.
    for check in checks_for_recipe(recipe, facts, None if overwrite else run_dir):
        fix = f" (fix: {check.fix})" if check.fix else ""
        if check.status == "fail":
            result.errors.append(f"environment: {check.message}{fix}")
        elif check.status == "warn":
            result.warnings.append(f"environment: {check.message}{fix}")
        elif check.status == "info":
            result.notes.append(check.message)
    if recipe.parallel.model_parallel > 1:  # what a step holds with parallel.sequence / parallel.tensor
        from finetune.render import batch_arithmetic

        result.notes.append("parallel: " + batch_arithmetic(recipe, world_size)["explanation"])
    if readable:  # else lint's R123 named the device, FIFO or socket, and nothing may open it
        dataset_step(recipe, result)
        rewards_step(recipe, result, world_size)
        chat_template_step(recipe, result)
        model_step(recipe, result)
        hostfile_step(recipe, result)
    if resume is None:
        resume = recipe.training.resume
    if in_use:
        result.run_dir_errors.append(in_use)
    else:
        output_dir_step(run_dir, overwrite, result, loaded, world_size, resume, force_resume)
    result.notes.append(f"run directory: {run_dir.absolute()}")
    return result


def lint_step(loaded: LoadedRecipe, result: Preflight, world_size: Optional[int]) -> bool:
    """Lint's findings into `result`; False when a path the recipe names must not be read (R123)."""
    from finetune.lint import LintOptions, LintResult, lint_loaded
    from finetune.lint.report import render

    lint = lint_loaded(loaded, LintOptions(world_size=world_size))
    shown = [f for f in lint.findings if f.severity in ("error", "warning")]
    if shown:
        result.lint_report = render(LintResult(findings=shown, files=lint.files), "text")
    for finding in lint.errors:
        result.lint_errors.append(f"lint {finding.rule} `{finding.key}`: {finding.message}" if finding.key
                             else f"lint {finding.rule}: {finding.message}")
    if lint.warnings:
        result.notes.append(f"lint: {len(lint.warnings)} warning(s), shown above")
    return not any(finding.rule == "R123" for finding in lint.errors)


# ----------------------------------------------------------------------------------------------
# Dataset


def dataset_step(recipe: Recipe, result: Preflight) -> None:
    """Every row of every local source (finetune.data.validate), read the way the objective reads it (SFT
    formats, preference rows, GRPO prompts); hub ids are read at launch."""
    from finetune.data.images import image_note, vision_data
    from finetune.data.sources import sources_of
    from finetune.data.validate import validate
    from finetune.vision_models import VisionModelError

    try:  # a VLM's rows are read with their images: placeholders, files, sizes (finetune.data.images). A hub model
        # not on this machine is not fetched here: the launcher's tokenizing reads its rows with their images.
        vision = vision_data(recipe, download=False)
    except VisionModelError:
        vision = None  # an unsupported family: lint says so
    checked = validate(sources_of(recipe.data, recipe.objective, vision=vision))
    for path in checked.skipped:
        result.notes.append(f"dataset {path}: a hub id, not checked here (read at launch; needs network)")
    shown = checked.messages()
    # A missing file is lint's R109 error too: said once, with lint's file:line.
    result.errors.extend(f"dataset {message}" for message in shown
                         if not any(error.endswith(f": {message}") for error in result.lint_errors))
    result.grouped_problems += checked.total - len(shown)
    if checked.ok:
        for check in checked.checks:
            result.notes.append(f"dataset {check.source.path}: {check.rows} {check.source.format} row(s), all look right"
                                + image_note(check, recipe.data.max_length))


def rewards_step(recipe: Recipe, result: Preflight, world_size: Optional[int] = None) -> None:
    """GRPO: every reward function imported and called on the data's first row (finetune.rewards.preflight):
    a bad one is one line naming it here, not a traceback in every rank after the model loaded. With the
    process count known only now (procs_per_node: auto), the groups are checked again (lint R121)."""
    if not objectives.get(recipe.objective).generates:
        return
    from finetune.lint.objective_rules import group_problems
    from finetune.rewards import preflight

    if world_size and recipe.world_size is None:
        result.errors += [f"{'.'.join(key)}: {message} (fix: {fix})" for key, message, fix in group_problems(recipe, world_size)]

    notes, errors = preflight(recipe)
    result.notes += notes
    result.errors += errors


def chat_template_step(recipe: Recipe, result: Preflight, budget: float = TEMPLATE_BUDGET) -> None:
    """Render the chat template on every chat row the way tokenizing will (finetune.data.chat_template, within
    finetune.data.template_budget), for at most `budget` seconds: data.chat_template, else the tokenizer's own
    when it can be loaded here (a local or built-in model; a hub model's is read at launch).

    A template the sandbox refuses (`__class__`, mutating a list), that raises on one row (row 51 as well as
    row 1), that leaves out the assistant's reply, or that takes seconds per row otherwise fails (or trains
    on nothing, or hangs) in every rank's data loading after launch (issue 34: a tokenizer's own hostile
    template passed --dry-run).
    """
    import time

    from finetune.data.chat_template import PLACEHOLDER_TOKENS, ChatRenderer
    from finetune.data.formats import CHAT_FORMATS
    from finetune.data.sources import sources_of
    from finetune.data.validate import chat_rows

    chats = [source for source in sources_of(recipe.data) if source.format in CHAT_FORMATS]
    if not chats:
        return
    name, template, tokens = "data.chat_template", recipe.data.chat_template, PLACEHOLDER_TOKENS
    if not template:
        name = "the tokenizer's chat template"
        template, tokens = _tokenizer_template(recipe, result)
        if not template:
            return
    render = ChatRenderer.for_template(template, tokens)
    deadline = time.monotonic() + budget
    rendered = 0
    for source in chats:
        for where, example in chat_rows(source):
            left = deadline - time.monotonic()
            if left <= 0:
                result.notes.append(f"{name}: rendered on the first {rendered} row(s) in {budget:.0f} s; "
                                    f"the rest are rendered by the ranks")
                return
            problem = render_problem(render, example, recipe.data.mask_prompt, recipe.data.think,
                                     min(left, TEMPLATE_ROW_SECONDS))
            if problem:
                result.errors.append(f"{name}: {where}: {problem}")
                return
            rendered += 1


def _tokenizer_template(recipe: Recipe, result: Preflight) -> tuple[Optional[str], dict]:
    """(chat template, special tokens) of the recipe's tokenizer, loaded as the launcher loads it, when it is
    local or built in; (None, {}) otherwise (a hub tokenizer is downloaded at launch; a tokenizer that does not
    load is model_step's to report). No template for chat data is an error here, as it is at launch."""
    from finetune.builtin import resolve_model_path
    from finetune.data.template_budget import template_of, tokenizer_kwargs
    from finetune.data.tokenize import DataError
    from finetune.tokenizer import load_without_torch, tokenizer_args

    reference = recipe.model.tokenizer or recipe.model.name_or_path
    if not (is_builtin(reference) or is_model_path(reference)):
        return None, {}
    try:
        tokenizer = load_without_torch(tokenizer_args(recipe, resolve_model_path(recipe.model.name_or_path)))
    except DataError as exc:
        result.errors.append(str(exc))
        return None, {}
    except (OSError, ValueError):
        return None, {}
    return template_of(tokenizer), tokenizer_kwargs(tokenizer)


def render_problem(render, example, mask_prompt: bool, think: str, seconds: float = TEMPLATE_ROW_SECONDS) -> Optional[str]:
    """Why the template cannot render `example` (a finetune.data.formats.Chat) as tokenizing renders it
    (finetune.data.chat_template.chat_text, through `render`), or None; all of the row's renders within `seconds`."""
    from jinja2 import TemplateSyntaxError

    from finetune.data.chat_template import TemplateFailed, chat_text
    from finetune.data.formats import RowProblem
    from finetune.data.template_budget import time_budget

    try:
        with time_budget(seconds):
            text, _ = chat_text(example, render, mask_prompt, think)
    except TemplateFailed as exc:
        cause = exc.cause
        if isinstance(cause, TemplateSyntaxError):
            return f"template line {cause.lineno}: {cause.message}"
        # The template is user code; anything it raises stops the ranks.
        return f"the template cannot render this conversation: {type(cause).__name__}: {' '.join(str(cause).split())[:300]}"
    except RowProblem as exc:  # past the budget, or turns that cannot be located
        return str(exc)
    replies = [m["content"].strip() for m in example.messages
               if isinstance(m, dict) and m.get("role") == "assistant" and isinstance(m.get("content"), str)
               and m["content"].strip()]
    if replies and not any(reply in text for reply in replies):
        return ("the rendered conversation holds none of the assistant's replies (does the template skip "
                "`assistant` messages?): the model would train on no reply")
    return None


# ----------------------------------------------------------------------------------------------
# Model


def model_step(recipe: Recipe, result: Preflight) -> None:
    reference = recipe.model.name_or_path
    if is_builtin(reference):
        _builtin_model(reference, result)
    elif is_model_path(reference):
        _local_model(reference, "model.name_or_path", result)
    else:
        _hub_model("model", reference, recipe.model.revision, result)
    tokenizer = recipe.model.tokenizer
    if tokenizer and is_model_path(tokenizer) and not Path(tokenizer).expanduser().is_dir():
        result.errors.append(f"model.tokenizer {tokenizer}: directory does not exist")
    elif tokenizer and not is_model_path(tokenizer) and tokenizer != reference:
        _hub_model("model.tokenizer", tokenizer, None, result)
    if recipe.model.adapter:
        from finetune.rundir.adapter import adapter_problem

        problem = adapter_problem(recipe.model.adapter)
        if problem:
            result.errors.append(f"model.adapter {recipe.model.adapter}: {problem}")


def _builtin_model(reference: str, result: Preflight) -> None:
    from finetune.builtin import BuiltinModelError, builtin_name, ensure_builtin_model

    try:
        builtin_name(reference)
    except BuiltinModelError as exc:
        result.errors.append(f"model.name_or_path: {exc}")
        return
    # Built once into a cache outside the run directory (seconds, CPU), so the ranks do not race to build it.
    path = ensure_builtin_model(reference)
    result.notes.append(f"model {reference}: built-in tiny model at {path}")


def _local_model(reference: str, key: str, result: Preflight) -> None:
    problem = model_dir_problem(reference)
    if problem is not None:
        result.errors.append(f"{key} {reference}: {problem}")
    else:
        result.notes.append(f"model {reference}: local directory")


def _hub_model(key: str, repo_id: str, revision: Optional[str], result: Preflight) -> None:
    """A hub id: in the local cache, or on the Hub (finetune.run.hub); else one line that stops the launch."""
    from finetune.run.hub import hub_model_problem

    problem, note = hub_model_problem(repo_id, revision)
    (result.errors if problem else result.warnings).append(f"{key} {repo_id}: {problem or note}")


# ----------------------------------------------------------------------------------------------
# Hostfile and output directory


def hostfile_step(recipe: Recipe, result: Preflight) -> None:
    from finetune.run.launch.commands import HostfileError, read_hostfile

    if not recipe.launch.hostfile:
        return
    try:
        hosts = read_hostfile(Path(recipe.launch.hostfile).expanduser())
    except HostfileError as exc:
        result.errors.append(f"launch.hostfile {exc}")
        return
    nodes = recipe.launch.nodes
    if len(hosts) < nodes:
        result.errors.append(f"launch.hostfile {recipe.launch.hostfile}: {len(hosts)} host(s) but launch.nodes is {nodes}")
    elif len(hosts) > nodes:
        result.warnings.append(f"launch.hostfile lists {len(hosts)} hosts; only the first {nodes} are used (launch.nodes: {nodes})")


# Another node of a multi-node run may be writing the shared run directory at this moment: its files
# appear one by one and recipe.yaml, written last (finetune.rundir.layout.run_files), makes it a run directory.
OTHER_NODE_WRITE_S = 30.0


def output_dir_step(run_dir: Path, overwrite: bool, result: Preflight, loaded: Optional[LoadedRecipe] = None,
                    world_size: Optional[int] = None, resume: bool = False, force_resume: bool = False) -> None:
    if loaded is not None and loaded.recipe.launch.nodes > 1 and not overwrite:
        _wait_for_another_node(run_dir)
    if loaded is not None and not overwrite and RunDir(run_dir).written_by_train():
        resume_step(run_dir, loaded.recipe, world_size, resume, force_resume, result)
        return
    problem = output_dir_problem(run_dir, overwrite)
    if problem:
        result.run_dir_errors.append(problem)
    elif overwrite and run_dir_entries(run_dir):
        result.warnings.append(f"output directory {run_dir}: the previous run there will be replaced (--overwrite)")


def _wait_for_another_node(run_dir: Path, timeout: float = OTHER_NODE_WRITE_S) -> None:
    """While the directory holds only some of a run directory's files (not yet recipe.yaml), for at most
    `timeout`: another node of this run is writing it. A folder with anything else in it is not waited for."""
    import time

    from finetune.rundir.names import FORMAT_FILE, LOGS_DIR
    from finetune.rundir.resume_key import RESUME_KEY_FILE

    written_first = {FORMAT_FILE, RESUME_KEY_FILE, *RUN_INPUTS, LOGS_DIR}

    def being_written() -> bool:  # only run-directory files and their temporary files (fsutil.write_atomic)
        entries = run_dir_entries(run_dir)
        return bool(entries) and not RunDir(run_dir).is_run() and all(
            name in written_first or any(name.startswith(f".{known}.") for known in written_first) for name in entries)

    deadline = time.monotonic() + timeout
    while being_written() and time.monotonic() < deadline:
        time.sleep(0.2)


def resume_step(run_dir: Path, recipe: Recipe, world_size: Optional[int], resume: bool, force: bool,
                result: Preflight) -> None:
    """A previous run directory: resume from its newest complete checkpoint, join it, or refuse."""
    from finetune.rundir.checkpoint import plan_resume
    from finetune.rundir.layout import resolved_recipe

    from finetune.rundir.verify import inspect

    plan = plan_resume(run_dir, resolved_recipe(recipe, run_dir), world_size, recipe.launch.nodes, resume, force,
                       inspect=inspect)
    if plan.error:
        result.run_dir_errors.append(plan.error)
    result.notes.extend(plan.notes)
    result.warnings.extend(plan.warnings)
    result.resume_from, result.join, result.damaged = plan.checkpoint, plan.join, plan.damaged
    if not plan.error and not os.access(run_dir, os.W_OK | os.X_OK):
        result.run_dir_errors.append(f"output directory {run_dir}: not writable")


def output_dir_problem(run_dir: Path, overwrite: bool) -> Optional[str]:
    problem = impossible_run_dir(run_dir)
    if problem:
        return problem
    if run_dir.exists() and not run_dir.is_dir():
        return f"output directory {run_dir}: exists and is not a directory"
    if run_dir.is_dir():
        entries = run_dir_entries(run_dir)
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        if entries and not RunDir(run_dir).written_by_train():
            # --overwrite deletes the directory: only ever a previous run's, never a user's folder.
            return (f"output directory {run_dir} is not empty ({shown}) and is not a run directory `finetune train` "
                    f"wrote (its {', '.join(RUN_INPUTS)}); nothing there is replaced, even with --overwrite: "
                    "choose another --output-dir")
        if entries and not overwrite:
            return (f"output directory {run_dir} is not empty ({shown}); "
                    f"pass --overwrite to replace it, or choose another --output-dir")
    parent = _existing_ancestor(run_dir)
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"output directory {run_dir}: cannot create it ({parent} is not writable)"
    return None


def run_dir_entries(run_dir: Path) -> list[str]:
    """What a directory holds, sorted, leaving out lock files (`finetune train` creates the directory to lock it)."""
    from finetune.rundir.lock import is_lock_file

    try:
        return sorted(p.name for p in run_dir.iterdir() if not is_lock_file(p.name))
    except OSError:
        return []


def impossible_run_dir(run_dir: Path) -> Optional[str]:
    """Why no directory can ever be created at `run_dir` (a dry run must not show a launch a real run refuses)."""
    import errno

    for part in run_dir.absolute().parts:
        if len(os.fsencode(part)) > 255:  # NAME_MAX on Linux and macOS file systems
            return f"output directory {run_dir}: the name {part[:40]}... is {len(os.fsencode(part))} bytes, longer than 255"
    if run_dir.is_symlink() and not run_dir.exists():
        try:
            run_dir.stat()
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return f"output directory {run_dir}: a symbolic link loop"
        return f"output directory {run_dir}: a symbolic link to {os.readlink(run_dir)}, which does not exist"
    try:
        run_dir.stat()
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"output directory {run_dir}: {exc.strerror or exc}"
    return None


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
