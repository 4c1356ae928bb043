"""What `finetune merge` reads: the base model and adapter directories, found from a run directory or given."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from finetune.errors import FinetuneError
from finetune.weights.errors import MergeError
from finetune.recipe.references import require_model_dir
from finetune.rundir.names import ADAPTER_CONFIG, CHECKPOINT_PREFIX, RECIPE_FILE
from finetune.rundir.adapter import no_adapter_message
from finetune.rundir.run_dir import NoBaseModel, RunDir, resolve_base
from finetune.rundir.adapter import adapter_weights as whole_adapter


@dataclass
class Inputs:
    base: Path
    adapter: Path
    tokenizer_dirs: tuple = ()  # searched for tokenizer files after the adapter, before the base


def resolve_inputs(run_dir: Optional[Path], base: Optional[Path], adapter: Optional[Path]) -> Inputs:
    """Base and adapter from a run directory, or from --base/--adapter (which override the run's)."""
    tokenizer_dirs: tuple = ()
    _regular(("RUN_DIR", run_dir), ("--base", base), ("--adapter", adapter))
    if run_dir is not None:
        if not run_dir.is_dir():
            raise MergeError(f"{run_dir}: no such run directory")
        adapter = adapter or _run_adapter(run_dir)
        base = base or _run_base(run_dir, adapter)
        # `finetune train` saves the tokenizer it trained with (chat template included) in tokenizer/.
        tokenizer_dirs = (RunDir(run_dir).tokenizer_path, run_dir)
    if base is None or adapter is None:
        raise MergeError("give a run directory, or both --base and --adapter")
    # What the run directory named: the adapter and base folders, the tokenizer files merge copies.
    _regular(("the adapter", adapter), ("the base model", base), *(("the tokenizer", d) for d in tokenizer_dirs))
    adapter_weights(adapter)  # fails early and clearly when the adapter is incomplete
    base_local_dir(base)
    return Inputs(base, adapter, tokenizer_dirs)


def _regular(*named: tuple[str, Optional[Path]]) -> None:
    """MergeError for a device, FIFO or socket given (or found in a folder given) as an input: merge would wait
    on it or read it forever (finetune.fsutil.refuse_special)."""
    from finetune.fsutil import SpecialFile, refuse_special

    for what, path in named:
        if path is not None:
            try:
                refuse_special(path, what)
            except SpecialFile as exc:
                raise MergeError(str(exc)) from None


def _run_adapter(run_dir: Path) -> Path:
    run = RunDir(run_dir)
    found = run.adapter()
    if found is not None:
        return found
    hint = ""
    if any(run_dir.glob(f"{CHECKPOINT_PREFIX}*/global_step*")):
        hint = " (it has DeepSpeed checkpoints: `finetune convert RUN_DIR/checkpoint-N -o ADAPTER` makes one)"
    elif run.model_path.is_dir() or (run_dir / "model.safetensors").is_file():
        hint = " (it holds full weights: a full fine-tune needs no merge)"
    elif not run.is_run():
        runs = sorted(str(p.parent) for p in run_dir.glob(f"*/{RECIPE_FILE}"))
        if runs:  # `finetune merge runs -o x`: the folder that holds the run directories
            hint = f" (it holds run directories: {', '.join(runs)}; give one of them)"
    raise MergeError(f"{run_dir}: {no_adapter_message(run_dir)}{hint}")


def _run_base(run_dir: Path, adapter: Path) -> Path:
    """The local base model the run's recipe names (finetune.rundir.run_dir.resolve_base), else the adapter's."""
    tried = []
    run = RunDir(run_dir)
    named = [(adapter, f"{adapter / ADAPTER_CONFIG} base_model_name_or_path")]
    if run.is_run():
        named.insert(0, (run, f"{run.recipe_path} model.name_or_path"))
    for source, where in named:
        try:
            name = resolve_base(source)
        except NoBaseModel:
            continue
        except FinetuneError as exc:  # the recipe or the adapter config cannot be read; an unknown built-in model
            raise MergeError(str(exc)) from None
        if Path(name).is_dir():
            return Path(name)
        tried.append(f"{where}={name!r}")
    if not tried:
        raise MergeError(f"{run_dir}: no {RECIPE_FILE} and no base_model_name_or_path in the adapter config; pass --base")
    raise MergeError(f"base model not found locally ({'; '.join(tried)}); "
                     "download it (huggingface-cli download ID --local-dir DIR) and pass --base DIR")


def base_local_dir(base: Path) -> None:
    """finetune.recipe.references.require_model_dir, as merge's error; a hub id says merge reads local files."""
    hint = ""
    if not base.exists() and re.fullmatch(r"[\w.-]+/[\w.-]+", str(base)):
        hint = (f"merge reads local files only, so for a hub id download it first "
                f"(huggingface-cli download {base} --local-dir DIR) and pass --base DIR")
    try:
        require_model_dir(base, "base model", hint)
    except FinetuneError as exc:
        raise MergeError(str(exc)) from None


def adapter_weights(adapter: Path) -> Path:
    """finetune.rundir.adapter.adapter_weights, as merge's error (what merge and export catch)."""
    try:
        return whole_adapter(adapter)
    except FinetuneError as exc:
        raise MergeError(str(exc)) from None
