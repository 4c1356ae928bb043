"""What `finetune publish` uploads from what it is given, an allow-list per kind of folder:

    run directory, LoRA   adapter_model.safetensors, adapter_config.json (finetune.serve.portable_adapter_config:
                          no local base path, lora_alpha an integer when it is one), the run's tokenizer files,
                          trained_chat_template.jinja (where the trained prompt differs from the tokenizer's),
                          loss.png, finetune_recipe.yaml (scrubbed) with finetune_format.json, README.md (the card)
    run directory, full   model/ and tokenizer/ files, the same extras
    merged model          its weights, config and tokenizer files (finetune merge's output), the extras it has
    GGUF export           NAME-TYPE.gguf, Modelfile, export.json (finetune export's output)

Never: checkpoints, logs, TensorBoard files, tokenized data, eval records (their numbers go into the card), PEFT's
README template, hidden files, or a link that leaves its folder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from finetune import objectives
from finetune.errors import FinetuneError
from finetune.export.gguf_export import EXPORT_RECORD
from finetune.recipe.references import MODEL_CONFIG, is_model_dir
from finetune.rundir.names import ADAPTER_CONFIG, EVAL_FILE, MERGED_FORMAT, MERGED_RECIPE, PLOT_FILE, SUMMARY_FILE

CARD_FILE = "README.md"
# A model folder's files that belong in a model repository (weights, configs, tokenizer, templates).
MODEL_SUFFIXES = (".safetensors", ".json", ".jinja", ".model", ".txt", ".tiktoken")


class PublishError(FinetuneError):
    """What cannot be published, or a refusal of the Hub: the message says why and what to do."""


@dataclass
class Item:
    path: str                        # in the repository
    source: Union[Path, bytes]       # a file sent as it is, or bytes finetune wrote

    @property
    def size(self) -> int:
        return len(self.source) if isinstance(self.source, bytes) else self.source.stat().st_size

    def data(self) -> bytes:
        return self.source if isinstance(self.source, bytes) else self.source.read_bytes()


@dataclass
class Publication:
    kind: str                              # adapter | model | gguf
    name: str
    folder: Path
    recipe: Any = None                     # finetune.recipe.Recipe, when known
    recipe_yaml: Optional[str] = None      # scrubbed
    relation: Optional[str] = None         # the Hub's base_model_relation
    library: str = "transformers"
    summary: dict = field(default_factory=dict)
    evals: dict = field(default_factory=dict)
    export: dict = field(default_factory=dict)
    adapter_config: dict = field(default_factory=dict)
    template: Optional[str] = None         # the trained prompt's Jinja template, when it is a file in the repo
    items: list[Item] = field(default_factory=list)

    def item(self, name: str) -> Optional[Item]:
        return next((i for i in self.items if i.path == name), None)


def collect(path: Path) -> Publication:
    """The publication of a run directory, a model directory or an export folder; one line for anything else."""
    from finetune.rundir.errors import RunDirError
    from finetune.rundir.run_dir import RunDir, not_a_run_dir_message

    path = Path(path)
    if not path.is_dir():
        raise PublishError(f"{path}: no such directory (give a run directory, a merged model or an export folder)")
    run = RunDir(path)
    try:
        if run.is_run():
            return _from_run(run)
        if (path / EXPORT_RECORD).is_file():
            return _from_export(path)
        if is_model_dir(path):
            return _from_model(path)
    except RunDirError as exc:
        raise PublishError(str(exc)) from None
    raise PublishError(f"{not_a_run_dir_message(path)}, a model directory (no {MODEL_CONFIG}) or an export folder "
                       f"(no {EXPORT_RECORD})")


def base_hub_id(recipe) -> Optional[str]:
    """The recipe's base model as a hub id, or None (a local folder or a built-in model is never published)."""
    import re

    from finetune.builtin import is_builtin
    from finetune.recipe.references import is_model_path

    name = recipe.model.name_or_path if recipe is not None else None
    if not name or is_builtin(name) or is_model_path(name) or not re.fullmatch(r"[\w.-]+/[\w.-]+", name):
        return None
    return name


def _from_run(run) -> Publication:
    from finetune.serve import portable_adapter_config, trained_template_file

    recipe = run.recipe()
    name = recipe.name or run.path.name
    pub = Publication("adapter", name, run.path, recipe=recipe, summary=_json(run.path / SUMMARY_FILE),
                      evals=_json(run.path / EVAL_FILE))
    if objectives.get(recipe.objective).score_head:
        raise PublishError(f"{run.path} is a reward model (a score head): publish supports language models")
    if run.has_model():
        pub.kind, pub.relation = "model", "finetune"
        pub.items += _model_files(run.model_path)
    elif run.adapter() is not None:
        from finetune.rundir.adapter import adapter_weights

        adapter = run.adapter()
        weights = adapter_weights(adapter)  # NotAnAdapter (a RunDirError: collect words it as PublishError)
        config = _json(adapter / ADAPTER_CONFIG)
        pub.adapter_config = portable_adapter_config(config, base_hub_id(recipe))
        pub.relation, pub.library = "adapter", "peft"
        pub.items += [Item(weights.name, weights),
                      Item(ADAPTER_CONFIG, (json.dumps(pub.adapter_config, indent=2) + "\n").encode())]
    else:
        from finetune.rundir.run_dir import no_model_yet

        raise PublishError(no_model_yet(run.path))
    if run.tokenizer() is not None:
        pub.items += [i for i in _model_files(run.tokenizer()) if pub.item(i.path) is None]
    template = trained_template_file(run.path, run.tokenizer(), recipe)
    _extras(pub, template, run.path / PLOT_FILE)
    return pub


def _from_model(path: Path) -> Publication:
    from finetune.rundir.run_dir import merged_recipe
    from finetune.serve import TRAINED_TEMPLATE

    recipe = merged_recipe(path)
    name = (recipe.name if recipe is not None and recipe.name else None) or path.name
    pub = Publication("model", name, path, recipe=recipe, relation="finetune" if recipe is not None else None)
    _check_weights(path)
    pub.items += [i for i in _model_files(path) if i.path != TRAINED_TEMPLATE]
    template = path / TRAINED_TEMPLATE
    _extras(pub, template if template.is_file() else None, None)
    return pub


def _from_export(path: Path) -> Publication:
    from finetune.export.modelfile import MODELFILE

    record = _json(path / EXPORT_RECORD)
    gguf = record.get("gguf")
    if not isinstance(gguf, str) or not (path / gguf).is_file() or Path(gguf).name != gguf:
        raise PublishError(f"{path / EXPORT_RECORD}: names no GGUF file in {path} (an export finetune wrote has one)")
    name = str(record.get("source") or path.name)
    pub = Publication("gguf", name, path, export=record, library="gguf",
                      relation="finetune" if record.get("base_model") else None)
    pub.items += [Item(gguf, _inside(path, path / gguf)), Item(EXPORT_RECORD, _inside(path, path / EXPORT_RECORD))]
    if (path / MODELFILE).is_file():
        pub.items.append(Item(MODELFILE, _inside(path, path / MODELFILE)))
    return pub


def _extras(pub: Publication, template: Optional[Path], plot: Optional[Path]) -> None:
    """The trained template, the loss plot and the scrubbed recipe, where there are."""
    from finetune.rundir.layout import dump_yaml
    from finetune.serve import TRAINED_TEMPLATE

    from finetune.publish.scrub import scrub

    if template is not None:
        pub.template = template.read_text(encoding="utf-8")
        pub.items.append(Item(TRAINED_TEMPLATE, pub.template.encode()))
    elif pub.recipe is not None:
        pub.template = _tokenizer_template(pub)
    if plot is not None and plot.is_file():
        pub.items.append(Item(PLOT_FILE, _inside(plot.parent, plot)))
    if pub.recipe is not None:
        data = scrub(pub.recipe.model_dump(mode="json"))
        pub.recipe_yaml = ("# The recipe this model trained with (finetune), its local paths reduced to file names and "
                           "secrets removed.\n" + dump_yaml(data))
        pub.items.append(Item(MERGED_RECIPE, pub.recipe_yaml.encode()))
        from finetune.rundir.format import format_text

        pub.items.append(Item(MERGED_FORMAT, format_text().encode()))  # the recipe above is in this finetune's format


def _tokenizer_template(pub: Publication) -> Optional[str]:
    for item in pub.items:
        if item.path == "chat_template.jinja":
            return item.data().decode("utf-8", "replace")
    config = next((i for i in pub.items if i.path == "tokenizer_config.json"), None)
    if config is not None:
        value = json.loads(config.data()).get("chat_template")
        return value if isinstance(value, str) else None
    return None


def _model_files(folder: Path) -> list[Item]:
    items = []
    for path in sorted(folder.iterdir()):
        if path.name.startswith(".") or path.name in (MERGED_RECIPE, MERGED_FORMAT, "README.md") or \
                path.suffix not in MODEL_SUFFIXES:
            continue
        if path.is_file():
            items.append(Item(path.name, _inside(folder, path)))
    return items


def _inside(folder: Path, path: Path) -> Path:
    """`path`, refused when it is a link that leaves `folder` (nothing is published through such a link)."""
    resolved = path.resolve()
    if folder.resolve() not in resolved.parents:
        raise PublishError(f"{path}: a link to {resolved}, outside {folder}; publish never follows it (copy the file in)")
    return resolved


def _check_weights(path: Path) -> None:
    if not any(path.glob("*.safetensors")):
        raise PublishError(f"{path}: {MODEL_CONFIG} but no *.safetensors weights (publish sends safetensors only)")


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError) as exc:
        raise PublishError(f"{path}: cannot read: {exc}") from None
    return data if isinstance(data, dict) else {}
