"""Checks `finetune train` runs before any process starts: each failed launch costs rented GPU time.

Every check adds to one `Preflight` (all problems are reported at once, torchtune-style):

- lint: the same rules as `finetune lint` (errors stop the run, warnings are shown),
- environment: finetune.doctor.checks_for_recipe (versions, bitsandbytes, GPU count, bf16),
- dataset: the file exists and its first rows have the columns `data.format` needs,
- model: a local directory with config.json, a `builtin:` tiny model, or a hub id (a warning:
  it is downloaded at launch),
- output directory: never a non-empty directory unless --overwrite, and --overwrite only replaces
  a previous run directory (one holding recipe.yaml), never an arbitrary folder. A run directory
  with a complete checkpoint is resumed (finetune.checkpoint.plan_resume decides, or refuses when
  the recipe changed); another node's copy of the same multi-node run is joined.

Nothing here writes into the run directory; launch happens only when `Preflight.ok`.
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

from finetune.recipe import LoadedRecipe, Recipe
from finetune.references import DATA_SUFFIXES, is_local, is_model_path

SAMPLE_ROWS = 20  # enough to catch a wrong format, cheap on a 100 GB file
# A .json array is read only up to here to find its first rows (raw_decode needs whole objects).
JSON_PREFIX_BYTES = 4 * 2**20
BUILTIN_PREFIX = "builtin:"
RUN_MARKER = "recipe.yaml"  # a directory holding this is a finetune run directory


@dataclass
class Preflight:
    errors: list[str] = field(default_factory=list)
    # The output directory's problems: a dry run shows them as what a real run would do, and goes on.
    run_dir_errors: list[str] = field(default_factory=list)
    lint_errors: list[str] = field(default_factory=list)  # also in lint_report, with file:line:col
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    lint_report: str = ""  # the lint findings, rendered as `finetune lint` does
    resume_from: Optional[Any] = None  # finetune.checkpoint.Checkpoint to resume from
    join: bool = False  # the run directory was written by another node of this run

    @property
    def ok(self) -> bool:
        return not self.errors and not self.lint_errors and not self.run_dir_errors


class DataProblem(Exception):
    """The dataset cannot be used as configured (message names the file and row)."""


# ----------------------------------------------------------------------------------------------
# Entry point


def run_preflight(loaded: LoadedRecipe, run_dir: Path, overwrite: bool = False, facts=None,
                  world_size: Optional[int] = None, resume: Optional[bool] = None,
                  force_resume: bool = False, in_use: Optional[str] = None) -> Preflight:
    """All checks for training `loaded` into `run_dir`. `facts`: finetune.doctor.Facts (tests fake them).

    `resume` None follows training.resume. `in_use`: another live run owns `run_dir` (finetune.runlock):
    that is the output directory's only finding, and nothing there is looked at further."""
    from finetune.doctor import checks_for_recipe

    result = Preflight()
    recipe = loaded.recipe
    lint_step(loaded, result, world_size)
    for check in checks_for_recipe(recipe, facts):
        fix = f" (fix: {check.fix})" if check.fix else ""
        if check.status == "fail":
            result.errors.append(f"environment: {check.message}{fix}")
        elif check.status == "warn":
            result.warnings.append(f"environment: {check.message}{fix}")
        elif check.status == "info":
            result.notes.append(check.message)
    dataset_step(recipe, result)
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


def lint_step(loaded: LoadedRecipe, result: Preflight, world_size: Optional[int]) -> None:
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


# ----------------------------------------------------------------------------------------------
# Dataset


def dataset_step(recipe: Recipe, result: Preflight) -> None:
    path = recipe.data.path
    if not is_local(path):
        result.notes.append(f"dataset {path}: a hub id, not checked here (read at launch; needs network)")
        return
    try:
        files = data_files(Path(path).expanduser())
        if recipe.objective != "sft":  # every row of every file (finetune/preference_rows.py)
            from finetune.preference_rows import check_files

            count, problems = check_files(files, recipe.objective)
            result.errors += [f"dataset {problem}" for problem in problems]
            if not problems:
                result.notes.append(f"dataset {path}: {count} {recipe.objective} row(s), all look right")
            return
        rows = 0
        for file in files[:1]:  # the first file speaks for a directory of shards
            rows = check_rows(file, recipe.data.format)
        result.notes.append(f"dataset {path}: {recipe.data.format} format, first {rows} row(s) look right")
    except DataProblem as exc:
        result.errors.append(f"dataset {exc}")


# A conversation to render the template on when the dataset's rows cannot be read here (a hub id).
_SAMPLE_CONVERSATION = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Hello!"}]


# apply_chat_template passes the tokenizer's special tokens to the template (`bos_token + ...` is
# common); their values do not matter for whether the template renders, only that they are strings.
_SPECIAL_TOKENS = {name: f"<{name}>" for name in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                                                   "cls_token", "mask_token")}


def chat_template_step(recipe: Recipe, result: Preflight) -> None:
    """Render data.chat_template on the first rows, the way the ranks will (transformers' sandboxed Jinja).

    A template the sandbox refuses (`__class__`, mutating a list) or that raises on this data otherwise
    fails in every rank's data loading after launch, as one traceback per process.
    """
    template = recipe.data.chat_template
    if recipe.data.format != "messages" or not template:
        return
    problem = None
    try:
        for where, messages in _sample_conversations(recipe.data.path):
            problem = render_problem(template, messages, recipe.data.mask_prompt)
            if problem:
                problem = f"{where}: {problem}"
                break
    except DataProblem:
        return  # dataset_step reported it
    if problem:
        result.errors.append(f"data.chat_template: {problem}")


def _sample_conversations(path: str) -> Iterator[tuple[str, list]]:
    if not is_local(path):
        yield "a sample conversation", _SAMPLE_CONVERSATION
        return
    file = data_files(Path(path).expanduser())[0]
    for number, row in first_rows(file):
        messages = row.get("messages") if isinstance(row, dict) else None
        if isinstance(messages, str):
            messages = json.loads(messages)  # CSV cells; check_row has already parsed it once
        if isinstance(messages, list):
            yield f"{file}: row {number}", messages


def render_problem(template: str, messages: list, mask_prompt: bool) -> Optional[str]:
    """Why `template` cannot render `messages` (as finetune.train.data does), or None."""
    from jinja2 import TemplateSyntaxError
    from transformers.utils.chat_template_utils import render_jinja_template

    # The calls finetune.train.data makes: the whole conversation, and with mask_prompt every prefix
    # up to an assistant turn with the generation prompt.
    calls = [(messages, False)]
    if mask_prompt:
        calls += [(messages[:i], True) for i, m in enumerate(messages) if i and isinstance(m, dict) and m.get("role") == "assistant"]
    for conversation, generation_prompt in calls:
        try:
            render_jinja_template([conversation], chat_template=template, add_generation_prompt=generation_prompt,
                                  **_SPECIAL_TOKENS)
        except TemplateSyntaxError as exc:
            return f"template line {exc.lineno}: {exc.message}"
        except Exception as exc:  # noqa: BLE001 - the template is user code; anything it raises stops the ranks
            return f"the template cannot render this conversation: {type(exc).__name__}: {exc}"
    return None


def data_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in DATA_SUFFIXES and not p.name.startswith("."))
        if not files:
            raise DataProblem(f"{path}: directory holds no {'/'.join(DATA_SUFFIXES)} files")
        return files
    if not path.exists():
        raise DataProblem(f"{path}: file does not exist")
    if path.suffix not in DATA_SUFFIXES:
        raise DataProblem(f"{path}: unsupported file type `{path.suffix}` (use {', '.join(DATA_SUFFIXES)})")
    return [path]


def check_rows(path: Path, fmt: str) -> int:
    """Read the first rows of `path` and check them against `fmt`. Returns how many were checked."""
    count = 0
    for number, row in first_rows(path):
        check_row(row, fmt, f"{path}: row {number}")
        count += 1
    if count == 0:
        raise DataProblem(f"{path}: no rows")
    return count


def first_rows(path: Path, limit: int = SAMPLE_ROWS) -> Iterator[tuple[int, Any]]:
    readers = {".jsonl": _jsonl_rows, ".json": _json_rows, ".csv": _csv_rows, ".parquet": _parquet_rows}
    try:
        yield from readers[path.suffix](path, limit)
    except UnicodeDecodeError as exc:
        raise DataProblem(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise DataProblem(f"{path}: cannot read: {exc.strerror or exc}") from None


def _jsonl_rows(path: Path, limit: int) -> Iterator[tuple[int, Any]]:
    with path.open(encoding="utf-8") as handle:
        seen = 0
        for line_no, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataProblem(f"{path}:{line_no}: not valid JSON ({exc.msg})") from None
            seen += 1
            if seen >= limit:
                return


def _json_rows(path: Path, limit: int) -> Iterator[tuple[int, Any]]:
    """A JSON array of rows, or JSON lines in a .json file (both are what `datasets` reads)."""
    with path.open(encoding="utf-8") as handle:
        text = handle.read(JSON_PREFIX_BYTES)
    start = len(text) - len(text.lstrip())
    if text[start:start + 1] != "[":
        if len(text) < JSON_PREFIX_BYTES and "\n" in text.strip() and _is_one_object(text):
            yield from _column_rows(path, json.loads(text), limit)  # one pretty-printed object
        else:
            yield from _jsonl_rows(path, limit)
        return
    decoder, pos, seen = json.JSONDecoder(), start + 1, 0
    while seen < limit:
        pos = _skip(text, pos, ",")
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            row, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            if len(text) == JSON_PREFIX_BYTES and exc.pos >= len(text) - 1:
                return  # the row runs past the prefix we read: the rows before it were fine
            line = text.count("\n", 0, exc.pos) + 1
            raise DataProblem(f"{path}:{line}: not valid JSON ({exc.msg})") from None
        seen += 1
        yield seen, row


def _column_rows(path: Path, data: dict, limit: int) -> Iterator[tuple[int, Any]]:
    """`{"instruction": [...], "output": [...]}`: columns, which `datasets` reads as rows."""
    columns = list(data.values())
    if not columns or not all(isinstance(c, list) for c in columns) or len({len(c) for c in columns}) != 1:
        raise DataProblem(f"{path}: one JSON object that is not a table of equal-length columns "
                          f"(expected JSON lines, an array of rows, or {{column: [values]}})")
    for number in range(min(len(columns[0]), limit)):
        yield number + 1, {key: values[number] for key, values in data.items()}


def _is_one_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def _skip(text: str, pos: int, separators: str) -> int:
    while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
        pos += 1
    return pos


def _csv_rows(path: Path, limit: int) -> Iterator[tuple[int, Any]]:
    with path.open(encoding="utf-8", newline="") as handle:
        reader = csv.DictReader(handle)
        if not reader.fieldnames:
            return
        for number, row in enumerate(reader, 1):
            yield number, row
            if number >= limit:
                return


def _parquet_rows(path: Path, limit: int) -> Iterator[tuple[int, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataProblem(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
    try:
        parquet = pq.ParquetFile(path)
        batch = next(parquet.iter_batches(batch_size=limit), None)
    except Exception as exc:  # pyarrow raises ArrowInvalid and friends for a damaged file
        raise DataProblem(f"{path}: not a readable parquet file ({exc})") from None
    for number, row in enumerate(batch.to_pylist() if batch is not None else [], 1):
        yield number, row


def check_row(row: Any, fmt: str, where: str) -> None:
    if not isinstance(row, dict):
        raise DataProblem(f"{where}: expected an object with named columns, got {type(row).__name__}")
    if fmt == "alpaca":
        _need_text(row, ("instruction", "output"), where, fmt)
        if row.get("input") is not None and not isinstance(row["input"], str):
            raise DataProblem(f"{where}: `input` must be text, got {type(row['input']).__name__}")
    elif fmt == "text":
        _need_text(row, ("text",), where, fmt)
    elif fmt == "messages":
        _check_messages(row, where)


_FORMAT_COLUMNS = {"alpaca": {"instruction", "output"}, "text": {"text"}, "messages": {"messages"}}


def _need_text(row: dict, columns: tuple[str, ...], where: str, fmt: str) -> None:
    missing = [c for c in columns if c not in row or row[c] is None]
    if missing:
        found = ", ".join(f"`{k}`" for k in row) or "none"
        raise DataProblem(f"{where}: no {' or '.join(f'`{c}`' for c in missing)} column "
                          f"(data.format: {fmt} needs {', '.join(f'`{c}`' for c in columns)}; found {found})"
                          f"{_format_hint(row, fmt)}")
    for column in columns:
        if not isinstance(row[column], str):
            raise DataProblem(f"{where}: `{column}` must be text, got {type(row[column]).__name__}")


def _format_hint(row: dict, fmt: str) -> str:
    for other, columns in _FORMAT_COLUMNS.items():
        if other != fmt and columns <= set(row):
            return f"; did you mean data.format: {other}?"
    return ""


def _check_messages(row: dict, where: str) -> None:
    messages = row.get("messages")
    if messages is None:
        found = ", ".join(f"`{k}`" for k in row) or "none"
        raise DataProblem(f"{where}: no `messages` column (data.format: messages needs a list of "
                          f"{{role, content}}; found {found}){_format_hint(row, 'messages')}")
    if isinstance(messages, str):
        # CSV cells are text; a JSON-encoded list in a cell is what people put there.
        try:
            messages = json.loads(messages)
        except json.JSONDecodeError:
            raise DataProblem(f"{where}: `messages` must be a list of {{role, content}}, got text") from None
    if not isinstance(messages, list) or not messages:
        raise DataProblem(f"{where}: `messages` must be a non-empty list of {{role, content}}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
            raise DataProblem(f"{where}: messages[{i}] must be an object with `role` and `content`")


# ----------------------------------------------------------------------------------------------
# Model


def model_step(recipe: Recipe, result: Preflight) -> None:
    reference = recipe.model.name_or_path
    if reference.startswith(BUILTIN_PREFIX):
        _builtin_model(reference[len(BUILTIN_PREFIX):], result)
    elif is_model_path(reference):
        _local_model(reference, "model.name_or_path", result)
    else:
        result.warnings.append(f"model {reference}: {_hub_note(reference, recipe.model.revision)}")
    tokenizer = recipe.model.tokenizer
    if tokenizer and is_model_path(tokenizer) and not Path(tokenizer).expanduser().is_dir():
        result.errors.append(f"model.tokenizer {tokenizer}: directory does not exist")
    if recipe.model.adapter:
        from finetune.preference_rows import adapter_problem

        problem = adapter_problem(recipe.model.adapter)
        if problem:
            result.errors.append(f"model.adapter {recipe.model.adapter}: {problem}")


def _builtin_model(name: str, result: Preflight) -> None:
    from finetune.tiny import BuiltinModelError, builtin_name, ensure_builtin_model

    try:
        builtin_name(BUILTIN_PREFIX + name)
    except BuiltinModelError as exc:
        result.errors.append(f"model.name_or_path: {exc}")
        return
    # Built once into a cache outside the run directory (seconds, CPU), so the ranks do not race to build it.
    path = ensure_builtin_model(BUILTIN_PREFIX + name)
    result.notes.append(f"model {BUILTIN_PREFIX}{name}: built-in tiny model at {path}")


def _local_model(reference: str, key: str, result: Preflight) -> None:
    path = Path(reference).expanduser()
    if not path.exists():
        result.errors.append(f"{key} {reference}: directory does not exist")
    elif not path.is_dir():
        result.errors.append(f"{key} {reference}: expected a model directory (with config.json), got a file")
    elif not (path / "config.json").is_file():
        result.errors.append(f"{key} {reference}: no config.json in this directory (is it a Hugging Face model folder?)")
    else:
        result.notes.append(f"model {reference}: local directory")


def _hub_note(repo_id: str, revision: Optional[str]) -> str:
    """Hub ids are downloaded at launch; say whether the local HF cache already has the config."""
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    except Exception:  # not a valid repo id, or huggingface_hub missing: the download will tell
        cached = None
    if isinstance(cached, str):
        return "a hub id, found in the local Hugging Face cache"
    return "a hub id, not in the local cache: it will be downloaded at launch (needs network, and HF_TOKEN for gated models)"


# ----------------------------------------------------------------------------------------------
# Hostfile and output directory


def hostfile_step(recipe: Recipe, result: Preflight) -> None:
    from finetune.launch import HostfileError, read_hostfile

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


def output_dir_step(run_dir: Path, overwrite: bool, result: Preflight, loaded: Optional[LoadedRecipe] = None,
                    world_size: Optional[int] = None, resume: bool = False, force_resume: bool = False) -> None:
    if loaded is not None and not overwrite and (run_dir / RUN_MARKER).is_file():
        resume_step(run_dir, loaded.recipe, world_size, resume, force_resume, result)
        return
    problem = output_dir_problem(run_dir, overwrite)
    if problem:
        result.run_dir_errors.append(problem)
    elif overwrite and run_dir.exists() and any(run_dir.iterdir()):
        result.warnings.append(f"output directory {run_dir}: the previous run there will be replaced (--overwrite)")


def resume_step(run_dir: Path, recipe: Recipe, world_size: Optional[int], resume: bool, force: bool,
                result: Preflight) -> None:
    """A previous run directory: resume from its newest complete checkpoint, join it, or refuse."""
    from finetune.checkpoint import plan_resume
    from finetune.rundir import resolved_recipe

    plan = plan_resume(run_dir, resolved_recipe(recipe, run_dir), world_size, recipe.launch.nodes, resume, force)
    if plan.error:
        result.run_dir_errors.append(plan.error)
    result.notes.extend(plan.notes)
    result.warnings.extend(plan.warnings)
    result.resume_from, result.join = plan.checkpoint, plan.join
    if not plan.error and not os.access(run_dir, os.W_OK | os.X_OK):
        result.run_dir_errors.append(f"output directory {run_dir}: not writable")


def output_dir_problem(run_dir: Path, overwrite: bool) -> Optional[str]:
    if run_dir.exists() and not run_dir.is_dir():
        return f"output directory {run_dir}: exists and is not a directory"
    if run_dir.is_dir():
        entries = sorted(p.name for p in run_dir.iterdir())
        if entries and not overwrite:
            shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
            return (f"output directory {run_dir} is not empty ({shown}); "
                    f"pass --overwrite to replace it, or choose another --output-dir")
        if entries and not (run_dir / RUN_MARKER).is_file():
            # --overwrite deletes the directory: only ever a previous run's, never a user's folder.
            return (f"output directory {run_dir} is not empty and is not a finetune run directory "
                    f"(no {RUN_MARKER}); --overwrite only replaces run directories: choose another --output-dir")
    parent = _existing_ancestor(run_dir)
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"output directory {run_dir}: cannot create it ({parent} is not writable)"
    return None


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
