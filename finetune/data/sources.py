"""The data sources of a recipe: `data.sources`, or the one source of the `data.path` shorthand.

A source is a local file (.jsonl, .json, .parquet, .csv), a folder of such files, a folder written by
`datasets.Dataset.save_to_disk` (arrow), or a hub dataset id (read at launch; not checked before).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from finetune.data.formats import RowSpec
from finetune.errors import FinetuneError
from finetune.fsutil import special_kind
from finetune.objectives import get as objective_record
from finetune.recipe.references import DATA_SUFFIXES, is_local

ARROW_MARKER = "dataset_info.json"  # written by Dataset.save_to_disk next to its .arrow files
SPLITS_MARKER = "dataset_dict.json"  # DatasetDict.save_to_disk: one such folder per split


@dataclass(frozen=True)
class Source:
    path: str
    split: str
    spec: RowSpec
    weight: Optional[float] = None
    samples: Optional[int] = None

    @property
    def format(self) -> str:
        return self.spec.format

    @property
    def name(self) -> str:
        return Path(self.path).name if is_local(self.path) else self.path


def sources_of(data: Any, objective: str = "sft", vision: Optional[dict] = None) -> list[Source]:
    """The sources of a recipe's data section (a pydantic DataSection, a finetune.data.spec.DataSpec, or a dict of
    one). The objective decides how rows read (finetune.objectives): a preference objective's own row format, GRPO's
    prompt reader. `vision` (or a dict's `vision` key, finetune.data.images.vision_data): a VLM's rows, read with
    their images."""
    get = data.get if isinstance(data, dict) else (lambda key, default=None: getattr(data, key, default))
    listed = get("sources")
    blocks = listed or [data]
    vision = vision or (data.get("vision") if isinstance(data, dict) else None)
    out = []
    for item in blocks:
        item_get = item.get if isinstance(item, dict) else (lambda key, default=None, item=item: getattr(item, key, default))
        spec = row_spec(item_get("format"), item_get("columns"), item_get("roles"), objective)
        if vision:
            from finetune.data.images import with_images

            spec = with_images(spec, str(item_get("path")), vision)
        out.append(Source(str(item_get("path")), item_get("split") or "train", spec,
                          item_get("weight") if listed else None, item_get("samples") if listed else None))
    return out


def row_spec(data_format: Optional[str], columns: Any, roles: Any, objective: str = "sft") -> RowSpec:
    record = objective_record(objective)
    if record.row_format and not record.data_formats:  # preference rows: data.format is not read
        return RowSpec(record.row_format, dict(columns or {}), {})
    return RowSpec(data_format or "alpaca", dict(columns or {}), dict(roles or {}), reader=record.row_format)


def describe(data: Any) -> str:
    return ", ".join(source.path for source in sources_of(data))


def is_arrow_dir(path: Path) -> bool:
    return path.is_dir() and ((path / ARROW_MARKER).is_file() or (path / SPLITS_MARKER).is_file())


class SourceProblem(FinetuneError):
    """A source that cannot be read at all (missing, wrong type): the message names the path."""


def data_files(path: Path, split: str = "train") -> list[Path]:
    """The files of a local source, in a stable order (a folder of shards: sorted)."""
    if is_arrow_dir(path):
        if (path / SPLITS_MARKER).is_file():
            if not (path / split / ARROW_MARKER).is_file():
                found = sorted(p.name for p in path.iterdir() if (p / ARROW_MARKER).is_file())
                raise SourceProblem(f"{path}: no split `{split}` in this saved dataset (found {', '.join(found) or 'none'})")
            path = path / split
        files = sorted(path.glob("*.arrow"))
        if not files:
            raise SourceProblem(f"{path}: a saved dataset folder without .arrow files")
        return files
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in DATA_SUFFIXES and not p.name.startswith("."))
        if not files:
            raise SourceProblem(f"{path}: directory holds no {'/'.join(DATA_SUFFIXES)} files")
        return files
    if not path.exists():
        looked = "" if path.is_absolute() else f" (looked for {path.absolute()})"
        raise SourceProblem(f"{path}: file does not exist{looked}{_did_you_mean(path)}")
    kind = special_kind(path)
    if kind:
        raise SourceProblem(f"{path}: {kind}, not a regular file: give a data file (or a folder of them)")
    if path.suffix not in DATA_SUFFIXES:
        raise SourceProblem(f"{path}: unsupported file type `{path.suffix}` (use {', '.join(DATA_SUFFIXES)}, "
                            f"or a folder written by datasets' save_to_disk)")
    return [path]


def _did_you_mean(path: Path) -> str:
    """The data files beside a missing one whose names are close to it (a typo, .json for .jsonl)."""
    from finetune.suggest import NEAR, close_matches

    try:
        names = [p.name for p in path.absolute().parent.iterdir() if p.suffix in DATA_SUFFIXES or p.is_dir()]
    except OSError:
        return ""
    close = close_matches(path.name, names, n=3, cutoff=NEAR)
    return f"; did you mean {' or '.join(f'`{path.parent / n}`' for n in close)}?" if close else ""
