"""What `finetune export` reads: a run directory (its adapter merged first, or its full weights) or a model directory
(merged by `finetune merge`, or any transformers checkpoint), with the recipe that says how it was prompted."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from finetune.errors import FinetuneError
from finetune.recipe import Recipe
from finetune.recipe.references import MODEL_CONFIG, is_model_dir
from finetune.rundir.errors import RunDirError
from finetune.rundir.run_dir import RunDir, merged_recipe, not_a_run_dir_message


class ExportError(FinetuneError):
    """An export that cannot be made: the message names the file or setting and what to do."""


@dataclass
class ExportSource:
    path: Path                      # what the user named
    name: str                       # the run's name: the GGUF's general.name and the file names
    recipe: Optional[Recipe]
    model_dir: Optional[Path]       # full weights to convert (None until an adapter is merged)
    run: Optional[RunDir] = None    # set when the weights are an adapter to merge first
    tokenizer_dir: Optional[Path] = None

    @property
    def needs_merge(self) -> bool:
        return self.model_dir is None


def resolve(path: Path) -> ExportSource:
    """A run directory or a model directory; anything else is one line saying what it is not."""
    path = Path(path)
    if not path.is_dir():
        raise ExportError(f"{path}: no such directory (give a run directory or a model directory)")
    run = RunDir(path)
    if run.is_run():
        try:
            recipe = run.recipe()
        except RunDirError as exc:
            raise ExportError(str(exc)) from None
        name = recipe.name or path.name
        tokenizer = run.tokenizer()
        if run.has_model():
            return ExportSource(path, name, recipe, run.model_path, tokenizer_dir=tokenizer or run.model_path)
        if run.adapter() is not None:
            return ExportSource(path, name, recipe, None, run=run, tokenizer_dir=tokenizer)
        from finetune.rundir.run_dir import no_model_yet

        raise ExportError(no_model_yet(path))
    if is_model_dir(path):
        try:
            recipe = merged_recipe(path)
        except RunDirError as exc:
            raise ExportError(str(exc)) from None
        name = (recipe.name if recipe is not None and recipe.name else None) or path.name
        _check_weights_present(path)
        return ExportSource(path, name, recipe, path, tokenizer_dir=path)
    raise ExportError(f"{not_a_run_dir_message(path)}, and not a model directory (no {MODEL_CONFIG})")


def _check_weights_present(path: Path) -> None:
    if not any(path.glob("*.safetensors")) and not any(path.glob("pytorch_model*.bin")):
        raise ExportError(f"{path}: {MODEL_CONFIG} but no weights (*.safetensors)")


def architecture(model_dir: Path) -> str:
    """config.json's architectures[0] (what llama.cpp's converter dispatches on), or one line why not."""
    try:
        config = json.loads((model_dir / MODEL_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ExportError(f"{model_dir / MODEL_CONFIG}: cannot read: {exc}") from None
    names = config.get("architectures") if isinstance(config, dict) else None
    if not isinstance(names, list) or not names or not isinstance(names[0], str):
        raise ExportError(f"{model_dir / MODEL_CONFIG}: no `architectures` list (llama.cpp's converter needs it)")
    return names[0]


def prompt_format(source: ExportSource) -> str:
    """How the run prompted its model: alpaca, messages or text; `messages` for a model without a recipe."""
    if source.recipe is None:
        return "messages"
    from finetune.data.show import trained_format

    return trained_format(source.recipe)


def context_length(source: ExportSource) -> Optional[int]:
    return source.recipe.data.max_length if source.recipe is not None else None


def base_hub_id(source: ExportSource) -> Optional[str]:
    """The base model as a hub id (`org/name`), or None when it is a local folder or a built-in model: a local path
    never goes into published metadata (issue 36)."""
    if source.recipe is None:
        return None
    import re

    from finetune.builtin import is_builtin
    from finetune.recipe.references import is_model_path

    name = source.recipe.model.name_or_path
    if is_builtin(name) or is_model_path(name) or not re.fullmatch(r"[\w.-]+/[\w.-]+", name):
        return None
    return name
