"""What tokenizing reads of a recipe: its data section, typed and frozen, built once (`DataSpec.of(recipe)`).

The launcher (finetune.data.prepare_recipe), every rank (finetune.train.runner) and `finetune eval` build it
from the same recipe and name the same cache entry with `cache_key`: a hash of the data section, every
source file's identity and the tokenizer. Nothing here has a default of its own: every value comes from the
recipe's schema (finetune.recipe.schema.DataSection), the mixture's seed from training.seed when data.seed is
unset, and a vision-language model's image sizing from finetune.data.images.vision_data.

No torch, no datasets: the light core imports this module.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Optional, Union

from finetune.data.sources import Source, data_files, sources_of
from finetune.recipe.references import is_local

# Bump when tokenization or the cache layout changes, so caches written by an older version are never reused.
TOKENIZE_VERSION = 4  # 4: the manifest records each file's size and digest (finetune.data.cache_entry)


@dataclass(frozen=True)
class SourceSpec:
    """One entry of data.sources, as the schema's SourceSection holds it (field for field)."""
    path: str
    format: str
    split: str
    columns: dict[str, str]
    roles: dict[str, str]
    weight: Optional[float]
    samples: Optional[int]


@dataclass(frozen=True)
class DataSpec:
    """The data section as tokenizing reads it. `path`, `format`, `split`, `columns` and `roles` are the one
    source of the `data.path` shorthand (with `sources`, they are the section's values, unread but still part
    of the cache key, as they always were)."""
    path: Optional[str]
    format: str
    split: str
    columns: dict[str, str]
    roles: dict[str, str]
    sources: Optional[tuple[SourceSpec, ...]]
    seed: int  # of the mixture: data.seed, else training.seed
    think: str
    chat_template: Optional[str]
    max_length: int
    packing: bool
    mask_prompt: bool
    num_proc: Union[str, int]  # how many processes tokenize; not in the key (the same rows on any count)
    vision: Optional[dict[str, Any]]  # a VLM's image sizing (finetune.data.images.vision_data), else None

    @classmethod
    def of(cls, recipe: Any) -> "DataSpec":
        """The spec of a validated recipe (finetune.recipe.schema.Recipe); a VLM's image sizing is read from
        its model's files (downloaded for a hub model)."""
        from finetune.data.images import vision_data

        data = recipe.data
        seed = recipe.training.seed if data.seed is None else data.seed
        return cls._of_dump(data.model_dump(mode="json"), seed, vision_data(recipe) or None)

    @classmethod
    def from_section(cls, section: dict[str, Any]) -> "DataSpec":
        """The spec of a data section written as a dict (tests, scripts): validated by the schema, which fills in
        what it leaves out. `seed` unset: training.seed's default; `vision`: a VLM's sizing, as `of` reads it."""
        from finetune.recipe.schema import DataSection, TrainingSection

        section = dict(section)
        vision = section.pop("vision", None)
        data = DataSection.model_validate(section)
        seed = TrainingSection.model_fields["seed"].default if data.seed is None else data.seed
        return cls._of_dump(data.model_dump(mode="json"), seed, vision or None)

    @classmethod
    def _of_dump(cls, dump: dict[str, Any], seed: int, vision: Optional[dict[str, Any]]) -> "DataSpec":
        sources = tuple(SourceSpec(**item) for item in dump["sources"]) if dump["sources"] else None
        names = {f.name for f in fields(cls)} - {"sources", "seed", "vision"}
        return cls(**{name: dump[name] for name in names}, sources=sources, seed=seed, vision=vision)

    def read_sources(self) -> list[Source]:
        """The sources with how their rows read (finetune.data.sources.Source), a VLM's with their images."""
        return sources_of(self, vision=self.vision)

    def source_paths(self) -> list[str]:
        return [source.path for source in self.sources] if self.sources else [str(self.path)]

    def cache_key(self, tokenizer) -> str:
        """Hash of the data section, every source file's identity and the tokenizer (vocabulary + template).

        The same bytes as the key of the data section's dict (before issue 39): the caches made then are found."""
        # padding_free and num_proc are left out on purpose: they change how rows are batched or made, not the rows.
        section: dict[str, Any] = {"path": _absolute(self.path), "format": self.format, "split": self.split,
                                   "columns": self.columns, "roles": self.roles, "seed": self.seed, "think": self.think,
                                   "chat_template": self.chat_template, "max_length": self.max_length,
                                   "packing": self.packing, "mask_prompt": self.mask_prompt}
        # The launcher reads `data/x.jsonl`, the ranks the run directory's absolute path: one key for both.
        section["sources"] = [{**asdict(item), "path": _absolute(item.path)} for item in self.sources or ()] or None
        if self.vision:  # a VLM's image sizing: another limit gives other rows
            section["vision"] = self.vision
        files = [_identity(path) for path in self.source_paths()]
        backend = getattr(tokenizer, "backend_tokenizer", None)
        vocab = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
        blob = json.dumps({"v": TOKENIZE_VERSION, "data": section, "source": files,
                           "template": tokenizer.chat_template, "bos": tokenizer.bos_token_id,
                           "eos": tokenizer.eos_token_id, "class": type(tokenizer).__name__}, sort_keys=True, default=str)
        digest = hashlib.sha256(blob.encode())
        digest.update(vocab.encode())
        return digest.hexdigest()[:16]


def _absolute(path: Any) -> Any:
    """A local path as finetune.rundir.layout.resolved_recipe writes it into the run directory."""
    if isinstance(path, str) and is_local(path):
        return str(Path(path).expanduser().absolute())
    return path


def _identity(path: str) -> Any:
    """(path, size, mtime) of each local file of a source: other rows under the same name change the key."""
    local = Path(path).expanduser()
    if not is_local(path) or not local.exists():
        return None
    try:
        files = data_files(local) if local.is_dir() else [local]
    except Exception:  # noqa: BLE001 - an unreadable folder has no identity; loading it will say why
        return None
    return [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
