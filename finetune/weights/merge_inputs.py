"""What `finetune merge` reads: the base model and adapter directories, found from a run directory or given."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from finetune.weights.errors import MergeError
from finetune.weights.safetensors_io import read_json
from finetune.builtin import is_builtin
from finetune.recipe.references import MODEL_CONFIG
from finetune.rundir.run_dir import (
    ADAPTER_CONFIG, ADAPTER_WEIGHTS, CHECKPOINT_PREFIX, RECIPE_FILE, RunDir, RunDirError, no_adapter_message,
)


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
    """The base model path from the run's resolved recipe, else from adapter_config.json."""
    tried = []
    run = RunDir(run_dir)
    recipe = run.recipe_path
    if run.is_run():
        try:
            name = run.recipe().model.name_or_path
        except RunDirError as exc:
            raise MergeError(str(exc)) from None
        if isinstance(name, str) and is_builtin(name):
            from finetune.builtin import resolve_model_path  # the demo model, built locally on first use

            name = resolve_model_path(name)
        if isinstance(name, str) and name:
            path = Path(name) if Path(name).is_absolute() else run_dir / name
            if path.is_dir():
                return path
            tried.append(f"{recipe} model.name_or_path={name!r}")
    config = read_json(adapter / ADAPTER_CONFIG)
    name = config.get("base_model_name_or_path")
    if isinstance(name, str) and name:
        if Path(name).is_dir():
            return Path(name)
        tried.append(f"{adapter / ADAPTER_CONFIG} base_model_name_or_path={name!r}")
    if not tried:
        raise MergeError(f"{run_dir}: no {RECIPE_FILE} and no base_model_name_or_path in the adapter config; pass --base")
    raise MergeError(f"base model not found locally ({'; '.join(tried)}); "
                     "download it (huggingface-cli download ID --local-dir DIR) and pass --base DIR")


def base_local_dir(base: Path) -> None:
    if base.is_dir():
        if not (base / MODEL_CONFIG).is_file():
            raise MergeError(f"{base}: no config.json (not a transformers model directory)")
        return
    if base.exists():
        raise MergeError(f"{base}: the base model must be a directory, not a file")
    if re.fullmatch(r"[\w.-]+/[\w.-]+", str(base)):
        raise MergeError(f"{base}: no such directory; merge reads local files only, so for a hub id download "
                         f"it first (huggingface-cli download {base} --local-dir DIR) and pass --base DIR")
    raise MergeError(f"{base}: no such base model directory")


def adapter_weights(adapter: Path) -> Path:
    if not adapter.is_dir():
        raise MergeError(f"{adapter}: no such adapter directory")
    if not (adapter / ADAPTER_CONFIG).is_file():
        raise MergeError(f"{adapter}: no {ADAPTER_CONFIG} (not a PEFT adapter directory)")
    for name in ADAPTER_WEIGHTS:
        if (adapter / name).is_file():
            return adapter / name
    raise MergeError(f"{adapter}: no {ADAPTER_WEIGHTS[0]} (or {ADAPTER_WEIGHTS[1]})")
