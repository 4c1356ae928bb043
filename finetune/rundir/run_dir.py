"""`RunDir`: a run directory's folders, its recipe and its adapter, for the commands that read a finished or
running run (chat, eval, convert, merge, export, publish, serve, lint, preflight). The file names live in
finetune.rundir.names; the checkpoints, the lock and the resume key have their own modules beside this one.

    RUN/recipe.yaml          the resolved recipe; the file that makes a folder a run directory
    RUN/deepspeed.json       the exact DeepSpeed config (finetune.rundir.layout writes it)
    RUN/training_args.json   the TrainingArguments kwargs
    RUN/resume_key.json      what a resumed run must share (finetune.rundir.resume_key)
    RUN/format.json          the format version, read with the recipe (finetune.rundir.format)
    RUN/logs/                launcher output, per-rank logs
    RUN/checkpoint-N/        checkpoints (finetune.rundir.checkpoint)
    RUN/adapter/ | model/    the trained weights (the runner, at the end)
    RUN/tokenizer/           the tokenizer the run trained with (its chat template included)
    RUN/env.json, summary.json, report.html, eval.json

The one answer to each question those commands ask of a folder (a model directory's:
finetune.recipe.references.model_dir_problem):
    a run directory?       RunDir.is_run / RunDir.require (NotARunDir)
    a whole adapter?       finetune.rundir.adapter.adapter_weights (NotAnAdapter); where a run's adapter is:
                           finetune.rundir.adapter.find_adapter
    a merged model's run?  merged_recipe
    trained on which base? resolve_base (a recipe, a run directory or an adapter directory)

No torch, no pydantic at import time: lint and `finetune --help` import this.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

if TYPE_CHECKING:
    from finetune.recipe import Recipe

from finetune.recipe.references import is_model_dir
from finetune.rundir.adapter import find_adapter
from finetune.rundir.errors import RunDirError
from finetune.rundir.names import (
    ADAPTER_CONFIG, ADAPTER_DIR, MERGED_RECIPE, MODEL_DIR, RECIPE_FILE, RECIPE_HEADER, RUN_INPUTS,
    TOKENIZER_DIR, ZERO_CHECKPOINT_DIR,
)


class NotARunDir(RunDirError):
    """The folder is not a run directory (no recipe.yaml). One message: `not_a_run_dir_message`."""


def not_a_run_dir_message(path: Path) -> str:
    return f"{path}: not a run directory (no {RECIPE_FILE}; `finetune train RECIPE` writes one)"


class RunDir:
    """A run directory (existing or not yet written): its files by name, its recipe, adapter and checkpoints."""

    def __init__(self, path: Union[str, Path]):
        self.path = Path(path)

    def __fspath__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    # --- files --------------------------------------------------------------------------------
    def file(self, name: str) -> Path:
        return self.path / name

    @property
    def recipe_path(self) -> Path:
        return self.path / RECIPE_FILE

    @property
    def adapter_path(self) -> Path:
        """Where the runner saves the adapter (it may not exist yet)."""
        return self.path / ADAPTER_DIR

    @property
    def model_path(self) -> Path:
        return self.path / MODEL_DIR

    @property
    def tokenizer_path(self) -> Path:
        return self.path / TOKENIZER_DIR

    def tokenizer(self) -> Optional[Path]:
        return self.tokenizer_path if self.tokenizer_path.is_dir() else None

    # --- what it is -----------------------------------------------------------------------------
    def is_run(self) -> bool:
        """A folder holding recipe.yaml (written last, so the other inputs are there too)."""
        try:
            return self.recipe_path.is_file()
        except OSError:
            return False

    def written_by_train(self) -> bool:
        """Whether `finetune train` wrote this folder: every run input there, recipe.yaml with its header. The one
        test before --overwrite deletes a folder: one that merely holds the user's recipe.yaml (their notes,
        their code) is not a run directory (issue 34)."""
        try:
            if not all(self.file(name).is_file() for name in RUN_INPUTS):
                return False
            with open(self.recipe_path, "rb") as handle:
                return handle.read(len(RECIPE_HEADER.encode())) == RECIPE_HEADER.encode()
        except OSError:
            return False

    def require(self) -> "RunDir":
        """self, or NotARunDir with the one message."""
        if not self.path.is_dir() or not self.is_run():
            raise NotARunDir(not_a_run_dir_message(self.path))
        return self

    # --- contents ---------------------------------------------------------------------------------
    def recipe(self) -> "Recipe":
        """The run's resolved recipe, validated; RunDirError naming the file when it cannot be read."""
        if not self.is_run():
            raise NotARunDir(not_a_run_dir_message(self.path))
        return read_recipe(self.recipe_path)

    def adapter(self) -> Optional[Path]:
        """The adapter of this run (RUN/adapter) or this folder itself when it is an adapter directory."""
        return find_adapter(self.path)

    def has_model(self) -> bool:
        return is_model_dir(self.model_path)


def read_recipe_data(path: Path) -> dict[str, Any]:
    """A run's recipe file (recipe.yaml, or a merged model's finetune_recipe.yaml) as a mapping, in today's keys
    (an older run directory's recipe migrated: finetune.rundir.format, finetune.recipe.migrations)."""
    from finetune.recipe.migrations import migrate
    from finetune.recipe.yamlio import DocumentError, load_yaml, read_text
    from finetune.rundir.format import FORMAT_VERSION, FormatProblem, recorded_version

    try:
        version = recorded_version(path)
    except FormatProblem as exc:
        raise RunDirError(str(exc)) from None
    try:
        data = load_yaml(read_text(path), str(path)).data
    except (DocumentError, OSError, ValueError) as exc:  # ValueError: UnicodeDecodeError, a NUL byte
        raise RunDirError(f"{path}: cannot read the run's recipe: {_one_line(exc)}") from None
    if not isinstance(data, dict):
        raise RunDirError(f"{path}: cannot read the run's recipe: not a mapping of recipe sections")
    return migrate(data, version, FORMAT_VERSION)


def read_recipe(path: Path) -> "Recipe":
    """A run's recipe file, validated against the schema (the one way a written recipe is read back)."""
    from pydantic import ValidationError

    from finetune.recipe import Recipe

    data = read_recipe_data(path)
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        raise RunDirError(f"{path}: cannot read the run's recipe: {_one_line(exc)}") from None


def merged_recipe(path: Union[str, Path]) -> "Optional[Recipe]":
    """The recipe of the run a merged model directory came from (the finetune_recipe.yaml `finetune merge` copies
    in), or None for a model merged elsewhere; RunDirError naming the file when it cannot be read."""
    file = Path(path) / MERGED_RECIPE
    return read_recipe(file) if file.is_file() else None


class NoBaseModel(RunDirError):
    """An adapter directory whose adapter_config.json names no base model."""


def resolve_base(source: "Union[Recipe, RunDir, str, Path]") -> str:
    """The base model SOURCE was trained on, as from_pretrained takes it (a hub id, or a local directory made
    absolute): a recipe's model.name_or_path, a `builtin:` name built locally on first use
    (finetune.builtin.resolve_model_path); a run directory's recorded recipe's; an adapter directory's
    adapter_config.json base_model_name_or_path (the runner writes this same answer there). RunDirError names
    the file that cannot be read or names no base; BuiltinModelError an unknown built-in name."""
    from finetune.builtin import resolve_model_path

    if not isinstance(source, (str, Path, RunDir)):  # a Recipe
        name = source.model.name_or_path
    elif RunDir(source).is_run():
        name = RunDir(source).recipe().model.name_or_path
    else:
        from finetune.fsutil import read_json

        config_file = Path(source) / ADAPTER_CONFIG
        try:
            config = read_json(config_file)
        except (OSError, ValueError) as exc:
            raise RunDirError(f"{config_file}: cannot read: {exc}") from None
        name = config.get("base_model_name_or_path") if isinstance(config, dict) else None
        if not isinstance(name, str) or not name:
            raise NoBaseModel(f"{config_file} names no base model; pass --base")
    path = resolve_model_path(name)
    local = Path(path).expanduser()
    return str(local.resolve()) if local.exists() else path


def no_model_yet(run_dir: Path) -> str:
    """Why a run directory has nothing to chat with or export, and what would give it something."""
    from finetune.rundir.checkpoint import checkpoint_dirs

    checkpoints = checkpoint_dirs(run_dir)
    if checkpoints:
        step, newest = checkpoints[-1]
        adapter = run_dir / f"adapter-{step}"
        return (f"{run_dir}: no adapter/ or model/ yet (the run has not finished). Its newest checkpoint can be "
                f"converted: `{command_line('finetune', 'convert', newest, '-o', adapter)}`, then "
                f"`{command_line('finetune', 'chat', run_dir, '--adapter', adapter)}`; "
                f"or run `finetune train` again to finish it")
    if (run_dir / ZERO_CHECKPOINT_DIR).is_dir():
        return (f"{run_dir}: the weights are a ZeRO checkpoint ({ZERO_CHECKPOINT_DIR}/); "
                f"`{command_line('finetune', 'convert', run_dir / ZERO_CHECKPOINT_DIR, '-o', 'OUT')}` turns them "
                f"into an adapter or model")
    return f"{run_dir}: no adapter/ or model/ yet and no checkpoint: the run has not trained (see {run_dir}/logs/)"


def command_line(*words: Union[str, Path]) -> str:
    """A command printed for the user to paste (`next:` lines, report.html): every word shell-quoted, so a
    run directory named `$(touch PWNED)` is a name and not a command (issue 25)."""
    import shlex

    return " ".join(shlex.quote(str(word)) for word in words)


def _one_line(exc: BaseException) -> str:
    """An exception's text on one line (pydantic and YAML errors span several)."""
    text = " ".join(part.strip() for part in str(exc).splitlines() if part.strip())
    return text[:500] + ("..." if len(text) > 500 else "")
