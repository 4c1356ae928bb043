"""Loading a recipe: YAML with line numbers, `extends:` chains, `--set a.b=value` overrides, and
error reports that name the file, line and key (with a fix for a misplaced or peer-tool key)."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, Optional, Union

from pydantic import ValidationError

from finetune.recipe.references import DATA_SUFFIXES
from finetune.errors import FinetuneError
from finetune.recipe.schema import Recipe, section_model
from finetune.recipe.yamlio import DocumentError, load_yaml, read_text, shorten
from finetune.suggest import closest


class RecipeProblem(FinetuneError):
    """One or more problems in a recipe, each with file, line, column and key.

    `partial` is the recipe validated without the offending keys (None when that is impossible), so
    lint can still report the run-time rules in the same pass: all problems at once.
    """

    def __init__(self, problems: list["Problem"], partial: Optional["LoadedRecipe"] = None):
        super().__init__("\n".join(p.render() for p in problems))
        self.problems = problems
        self.partial = partial

    def lines(self) -> list[str]:
        return [problem.render() for problem in self.problems]


class Problem:
    """One finding while loading: `rule` is the stable lint id (R001 document, R002 unknown key, ...)."""

    __slots__ = ("path", "line", "col", "key", "message", "fix", "rule", "loc")

    def __init__(self, path: str, line: int, col: int, key: Optional[str], message: str,
                 fix: Optional[str] = None, rule: str = "R001", loc: tuple = ()):
        self.path, self.line, self.col, self.key, self.message, self.fix = path, line, col, key, message, fix
        self.rule = rule
        self.loc = loc  # the key path, for schema problems (R002/R004)

    def render(self) -> str:
        where = f"{self.path}:{self.line}:{self.col}"
        key = f" `{self.key}`" if self.key else ""
        fix = f" ({self.fix})" if self.fix else ""
        return f"{where}:{key} {self.message}{fix}"


class LoadedRecipe:
    """A validated recipe plus the merged raw data and where every key came from."""

    def __init__(self, recipe: Recipe, raw: dict, origin: dict, path: Path):
        self.recipe = recipe
        self.raw = raw  # merged data after extends and --set
        self.origin = origin  # key path -> (file, line, col)
        self.path = path

    def where(self, key_path: tuple) -> tuple[str, int, int]:
        key_path = tuple(key_path)
        while key_path:
            if key_path in self.origin:
                return self.origin[key_path]
            key_path = key_path[:-1]
        return self.origin.get((), (str(self.path), 1, 1))


MAX_EXTENDS = 16


def load_recipe(path: Union[str, Path], overrides: Optional[list[str]] = None) -> LoadedRecipe:
    """Read, merge (`extends`), override (`--set`) and validate a recipe. Raises RecipeProblem."""
    path = Path(path)
    raw, origin = _load_chain(path, [])
    for item in overrides or []:
        apply_set(raw, origin, item)
    try:
        recipe = validate(raw, origin, str(path))
    except RecipeProblem as exc:
        exc.partial = _without_bad_keys(raw, origin, path, exc.problems)
        raise
    if recipe.name is None:
        recipe.name = path.stem
    return LoadedRecipe(recipe, raw, origin, path)


def _without_bad_keys(raw: dict, origin: dict, path: Path, problems: list[Problem]) -> Optional[LoadedRecipe]:
    """The recipe with every unknown or invalid key dropped (defaults apply), if that validates."""
    if any(p.rule not in ("R002", "R004") or not p.loc for p in problems):
        return None
    pruned = copy.deepcopy(raw)
    for problem in problems:
        node = pruned
        for part in problem.loc[:-1]:
            node = node[part] if isinstance(node, (dict, list)) and _has(node, part) else None
        if isinstance(node, (dict, list)) and _has(node, problem.loc[-1]):
            if isinstance(node, dict):
                del node[problem.loc[-1]]
            else:
                node[problem.loc[-1]] = None  # keep list indexes stable; the retry decides
    try:
        recipe = Recipe.model_validate(pruned)
    except ValidationError:
        return None
    if recipe.name is None:
        recipe.name = path.stem
    return LoadedRecipe(recipe, pruned, origin, path)


def _has(node: Any, part: Any) -> bool:
    return part in node if isinstance(node, dict) else isinstance(part, int) and 0 <= part < len(node)


def _problem_at(path: str, exc: DocumentError) -> RecipeProblem:
    return RecipeProblem([Problem(path, exc.line, exc.col, exc.key, exc.message)])


def _load_chain(path: Path, seen: list[Path]) -> tuple[dict, dict]:
    shown = str(path)
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError):
        resolved = path
    if resolved in seen:
        chain = " -> ".join(str(p) for p in seen + [resolved])
        raise RecipeProblem([Problem(shown, 1, 1, "extends", f"`extends` loop: {chain}", rule="R003")])
    if len(seen) >= MAX_EXTENDS:
        raise RecipeProblem([Problem(shown, 1, 1, "extends", f"`extends` chain longer than {MAX_EXTENDS} files", rule="R003")])
    unusable = _not_a_file(path)
    if unusable:
        raise RecipeProblem([Problem(_short(shown), 1, 1, None, f"recipe file {unusable}")])
    try:
        doc = load_yaml(read_text(path), shown)
    except DocumentError as exc:
        raise _problem_at(shown, exc) from None
    data = doc.data
    if data is None:
        raise RecipeProblem([Problem(shown, 1, 1, None, "recipe is empty", "start from recipes/demo.yaml")])
    if not isinstance(data, dict):
        raise RecipeProblem([Problem(shown, *doc.pos(()), None, f"a recipe is a mapping of keys, not a {type(data).__name__}")])
    origin = {kp: (shown, line, col) for kp, (line, col) in doc.positions.items()}
    _rebase_paths(data, path.parent)
    parent = data.get("extends")
    if parent is None:
        return data, origin
    if not isinstance(parent, str) or not parent:
        line, col = doc.pos(("extends",))
        raise RecipeProblem([Problem(shown, line, col, "extends", "`extends` takes the path of another recipe file", rule="R003")])
    parent_path = Path(parent) if Path(parent).is_absolute() else path.parent / parent
    unusable = _not_a_file(parent_path)
    if unusable:
        line, col = doc.pos(("extends",))
        raise RecipeProblem([Problem(shown, line, col, "extends", f"extended recipe {_short(str(parent_path))} {unusable}", rule="R003")])
    base, base_origin = _load_chain(parent_path, seen + [resolved])
    if isinstance(data.get("data"), dict) and "sources" in data["data"] and isinstance(base.get("data"), dict):
        base["data"] = {k: v for k, v in base["data"].items() if k != "path"}  # sources replace the parent's one path
    merged = _deep_merge(base, data)
    merged.pop("extends", None)
    base_origin.update(origin)
    base_origin.pop(("extends",), None)
    return merged, base_origin


def _not_a_file(path: Path) -> Optional[str]:
    """Why `path` cannot be read as a recipe, or None. Never raises: a 300-character name makes
    stat() fail with ENAMETOOLONG, which pathlib's is_file() passes on."""
    from finetune.fsutil import special_kind

    kind = special_kind(path)
    if kind:
        return f"is {kind}, not a regular file"
    try:
        if path.is_file():
            return None
        return "is a directory, not a recipe file" if path.is_dir() else "does not exist"
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the name
        return f"cannot be opened ({getattr(exc, 'strerror', None) or exc})"


def _short(text: str, limit: int = 120) -> str:
    """A path as shown in a one-line message: its head and tail when it is absurdly long."""
    return text if len(text) <= limit else f"{text[:limit // 2]}...{text[-limit // 2:]}"


# Keys whose string value is a filesystem path, resolved against the recipe that wrote it.
_PATH_KEYS = (("data", "path"), ("model", "name_or_path"), ("model", "tokenizer"), ("model", "adapter"),
              ("launch", "hostfile"), ("preference", "reference", "name_or_path"))


def _rebase_paths(data: dict, base: Path) -> None:
    """Make relative local paths relative to the recipe's folder (hub ids are left alone)."""
    sources = data.get("data", {}).get("sources") if isinstance(data.get("data"), dict) else None
    blocks = []
    for *sections, key in _PATH_KEYS:
        block = data
        for section in sections:
            block = block.get(section) if isinstance(block, dict) else None
        blocks.append((block, key))
    blocks += [(item, "path") for item in (sources if isinstance(sources, list) else [])]
    for block, key in blocks:
        if not isinstance(block, dict):
            continue
        value = block.get(key)
        if not isinstance(value, str) or not value or Path(value).is_absolute():
            continue
        # A data file name (data.jsonl) is local even when missing: rebased, its error names the recipe's
        # folder, not the directory the command ran in.
        data_file = key == "path" and Path(value).suffix in DATA_SUFFIXES
        if value.startswith(("./", "../")) or _exists(base / value) or key == "hostfile" or data_file:
            block[key] = _rebased(base, value)
    _rebase_reward_files(data, base)


def _rebase_reward_files(data: dict, base: Path) -> None:
    """grpo.rewards[].function `file.py:function`: the file is relative to the recipe, like data paths."""
    grpo = data.get("grpo")
    rewards = grpo.get("rewards") if isinstance(grpo, dict) else None
    for item in rewards if isinstance(rewards, list) else []:  # any other shape is the schema's to report
        value = item.get("function") if isinstance(item, dict) else None
        if isinstance(value, str) and ".py:" in value:
            file, _, function = value.rpartition(":")
            if not Path(file).is_absolute():
                item["function"] = f"{_rebased(base, file)}:{function}"


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):  # a name too long to stat is no local file
        return False


def _rebased(base: Path, value: str) -> str:
    joined = str(base / value)
    # Keep a relative result recognisably a path: "./weights", not "weights", which reads as a hub id.
    if not Path(joined).is_absolute() and not joined.startswith(("./", "../")) and joined != "..":
        joined = "./" + joined
    return joined


def _deep_merge(base: dict, top: dict) -> dict:
    """`top` wins key by key; sections (and deepspeed.overrides) merge recursively."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def apply_set(raw: dict, origin: dict, item: str) -> None:
    """`--set deepspeed.stage=3`: the value is read as YAML (numbers, booleans, lists)."""
    where = "--set"
    if "=" not in item:
        raise RecipeProblem([Problem(where, 1, 1, None, f"`--set {shorten(item)}` needs the form key.path=value", rule="R006")])
    dotted, _, text = item.partition("=")
    keys = [k for k in dotted.strip().split(".")]
    if not all(keys):
        raise RecipeProblem([Problem(where, 1, 1, shorten(dotted), f"`--set {shorten(item)}`: empty key in `{shorten(dotted)}`", rule="R006")])
    try:
        value = load_yaml(text, where).data if text.strip() else ""
    except DocumentError as exc:
        raise RecipeProblem([Problem(where, 1, 1, dotted, f"cannot read value: {exc.message}", rule="R006")]) from None
    node = raw
    for i, key in enumerate(keys[:-1]):
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise RecipeProblem([Problem(where, 1, 1, dotted, f"`{'.'.join(keys[:i + 1])}` is not a section", rule="R006")])
        node = child
    node[keys[-1]] = value
    origin[tuple(keys)] = (f"--set {shorten(item)}", 1, 1)


def validate(raw: dict, origin: dict, path: str) -> Recipe:
    """Validate merged data; every pydantic error becomes a Problem with a position."""
    try:
        return Recipe.model_validate(raw)
    except ValidationError as exc:
        problems = [_to_problem(err, raw, origin, path) for err in exc.errors(include_url=False)]
        raise RecipeProblem(_dedupe(problems)) from None


def _dedupe(problems: list[Problem]) -> list[Problem]:
    seen, out = set(), []
    for p in problems:
        k = (p.path, p.line, p.col, p.key, p.message)
        if k not in seen:
            seen.add(k)
            out.append(p)
    return sorted(out, key=lambda p: (p.path, p.line, p.col))


def _to_problem(err: dict, raw: dict, origin: dict, path: str) -> Problem:
    # pydantic inserts union-member and literal names into loc; keep only real keys and indexes.
    loc = tuple(part for part in err["loc"] if _is_real_key(raw, err["loc"], part))
    key = ".".join(str(p) for p in loc)
    file, line, col = _where(origin, loc, path)
    kind = err["type"]
    if kind == "extra_forbidden":
        return Problem(file, line, col, key, "unknown key", unknown_key_fix(loc), rule="R002", loc=loc)
    if kind == "missing":
        return Problem(file, line, col, key, "required key is missing", rule="R005")
    value = err.get("input")
    shown = _short(repr(value), 60) if not isinstance(value, (dict, list)) else type(value).__name__
    message = err["msg"]
    if kind == "literal_error":
        expected = err.get("ctx", {}).get("expected", "")
        message = f"expected one of {expected}"
        guess = closest(str(value), re.findall(r"'([^']*)'", expected))
        if guess:
            return Problem(file, line, col, key, f"{message}, got {shown}", f"did you mean `{guess}`?", rule="R004", loc=loc)
    return Problem(file, line, col, key, f"{message}, got {shown}", rule="R004", loc=loc)


def _is_real_key(raw: Any, full_loc: tuple, part: Any) -> bool:
    node = raw
    for p in full_loc:
        if p is part:
            break
        if isinstance(node, dict) and p in node:
            node = node[p]
        elif isinstance(node, list) and isinstance(p, int) and p < len(node):
            node = node[p]
    if isinstance(part, int):
        return isinstance(node, list)
    return isinstance(node, dict) or node is None or not isinstance(node, (list,))


def _where(origin: dict, loc: tuple, path: str) -> tuple[str, int, int]:
    loc = tuple(loc)
    while loc:
        if loc in origin:
            return origin[loc]
        loc = loc[:-1]
    return origin.get((), (path, 1, 1))


# Names other tools (HF TrainingArguments, axolotl, LLaMA-Factory, PEFT, DeepSpeed) give to recipe keys.
PEER_KEYS = {
    "num_epochs": "training.epochs", "num_train_epochs": "training.epochs", "epoch": "training.epochs",
    "lr": "training.learning_rate", "learning_rate": "training.learning_rate",
    "per_device_train_batch_size": "training.micro_batch_size", "train_micro_batch_size_per_gpu": "training.micro_batch_size",
    "micro_batch_size": "training.micro_batch_size", "batch_size": "training.micro_batch_size",
    "gradient_accumulation": "training.gradient_accumulation_steps",
    "gradient_accumulation_steps": "training.gradient_accumulation_steps",
    "lr_scheduler_type": "training.lr_scheduler", "optim": "training.optimizer", "warmup": "training.warmup_ratio",
    "lora_r": "lora.r", "rank": "lora.r", "lora_rank": "lora.r", "lora_alpha": "lora.alpha",
    "lora_dropout": "lora.dropout", "lora_target_modules": "lora.target_modules", "lora_target": "lora.target_modules",
    "target_modules": "lora.target_modules", "use_rslora": "lora.rslora", "use_dora": "lora.dora",
    "zero_stage": "deepspeed.stage", "zero": "deepspeed.stage", "stage": "deepspeed.stage",
    "base_model": "model.name_or_path", "model_name_or_path": "model.name_or_path", "model_name": "model.name_or_path",
    "torch_dtype": "model.dtype", "dtype": "model.dtype",
    "sequence_len": "data.max_length", "max_seq_length": "data.max_length", "cutoff_len": "data.max_length",
    "max_seq_len": "data.max_length", "max_length": "data.max_length", "sample_packing": "data.packing",
    "dataset": "data.path", "datasets": "data.path", "val_set_size": "data.validation_split",
    "output": "output_dir", "adapter": "method", "finetuning_type": "method",
    "load_in_4bit": "method", "bnb_4bit_quant_type": "quantization.quant_type",
}


def unknown_key_fix(loc: tuple) -> Optional[str]:
    """The suggestion for an unknown key: the same key in another section, a peer tool's name for a
    key, or a close spelling in this section."""
    name = str(loc[-1])
    section = tuple(loc[:-1])
    here = ".".join(str(p) for p in section)
    elsewhere = [f"{s}.{name}" if s else name for s in _sections() if s != here and name in _known_keys(tuple(s.split(".")) if s else ())]
    if elsewhere:
        return f"did you mean `{elsewhere[0]}`? (`{name}` belongs in the {elsewhere[0].rsplit('.', 1)[0] or 'top'} section)"
    peer = PEER_KEYS.get(name.lower())
    if peer is not None and peer != (f"{here}.{name}" if here else name):
        if peer == "method":
            return "the method is one key: `method: lora` or `method: qlora` (4-bit base)"
        return f"did you mean `{peer}`? (`{name}` is what other tools call it)"
    options = _known_keys(section)
    guess = closest(name, options)
    if guess:
        return f"did you mean `{guess}`?"
    return f"known keys: {', '.join(sorted(options))}" if options else None


def _sections() -> list[str]:
    """"" (the top level) and the name of every section of the recipe."""
    return [""] + [name for name, field in Recipe.model_fields.items() if section_model(field.annotation) is not None]


def _known_keys(section_loc: tuple) -> list[str]:
    model: Any = Recipe
    for part in section_loc:
        if isinstance(part, int):
            return []
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = section_model(field.annotation)
        if model is None:
            return []
    return list(getattr(model, "model_fields", {}).keys())
