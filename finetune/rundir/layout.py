"""The run directory `finetune train` writes before launch: everything the ranks (and later `convert`,
`merge` and resume) read about the run, so it describes itself.

    RUN/recipe.yaml          the resolved recipe (extends and --set applied, local paths absolute, the
                             defaults of settings this objective and method do not read left out)
    RUN/deepspeed.json       finetune.render.render_deepspeed(recipe, real world size)
    RUN/training_args.json   finetune.render.render_training_args(recipe, output_dir=RUN)
    RUN/resume_key.json      what a resumed run must share with this one (finetune.rundir.resume_key)
    RUN/format.json          the run directory's format version (finetune.rundir.format)
    RUN/auto.json            the recipe's `auto` keys as decided for this machine, and why (finetune.plan.auto)
    RUN/logs/                launcher output, per-rank logs (logs/first-attempt/: an attempt that ran out of GPU
                             memory under `auto`, run again with the memory-safe values: finetune.cli.train)

The runner adds env.json, adapter/ or model/, tokenizer/ and summary.json.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any, Callable, Optional

from finetune.fsutil import atomic_dir
from finetune.recipe import LoadedRecipe, Recipe
from finetune.recipe.references import is_local, is_model_path
from finetune.builtin import is_builtin

from finetune.rundir.names import (
    AUTO_FILE, DEEPSPEED_FILE, LOGS_DIR, RECIPE_FILE, RECIPE_HEADER, RUN_INPUTS, TRAINING_ARGS_FILE,
)
from finetune.rundir.errors import RunDirError
from finetune.rundir.run_dir import RunDir
from finetune.recipe.auto import with_auto, with_auto_values


def resolved_recipe(recipe: Recipe, run_dir: Path) -> dict[str, Any]:
    """The recipe as plain data, as the run sees it: local paths absolute, output_dir = the run dir."""
    data = recipe.model_dump(mode="json")
    data.pop("extends", None)  # already applied
    data["output_dir"] = str(Path(run_dir).absolute())
    for block in [data["data"], *(data["data"].get("sources") or [])]:
        if block.get("path") and is_local(block["path"]):
            block["path"] = str(Path(block["path"]).expanduser().absolute())
    for section, key in ((data["model"], "name_or_path"), (data["model"], "tokenizer"), (data["model"], "adapter"),
                         (data["preference"]["reference"], "name_or_path")):
        value = section.get(key)
        if value and not is_builtin(value) and is_model_path(value):
            section[key] = str(Path(value).expanduser().absolute())
    if data["launch"].get("hostfile"):
        data["launch"]["hostfile"] = str(Path(data["launch"]["hostfile"]).expanduser().absolute())
    for reward in data["grpo"]["rewards"]:
        # `file.py:function`, rebased onto the recipe's folder when loaded: absolute, so that the record read from
        # inside the run directory names the same file (issue 34).
        file, _, function = reward["function"].rpartition(":")
        if file.endswith(".py"):
            reward["function"] = f"{Path(file).expanduser().absolute()}:{function}"
    return data


def recorded_recipe(recipe: Recipe, run_dir: Path) -> dict[str, Any]:
    """resolved_recipe without what nothing reads with this objective and method: the record lints as the recipe
    did (issue 34: it failed R118 on the `preference` and `grpo` defaults finetune wrote). The sections another
    method reads go whole; elsewhere only values equal to their default are left out, so the file reads back as
    a recipe that renders, plans and resumes as this one."""
    from finetune.recipe.schema import METHOD_SECTIONS

    data = resolved_recipe(recipe, run_dir)
    for section, methods in METHOD_SECTIONS.items():
        if recipe.method not in methods:
            del data[section]
    for path in unused_keys(recipe):
        _drop_defaults(data, path, _default_at(recipe, path))
    return data


def unused_keys(recipe: Recipe) -> list[tuple]:
    """Key paths nothing reads with this recipe's objective, adapter, rewards and checkpointing (what lint's R104,
    R118, R119, R120 and R121 warn about when a recipe writes them; R111's sections: recorded_recipe)."""
    from finetune import objectives
    from finetune.recipe.schema import PreferenceSection, GrpoSection

    record = objectives.get(recipe.objective)
    sections = sorted({o.section for o in objectives.OBJECTIVES.values() if o.section})
    keys: list[tuple] = [(s,) for s in sections if s != record.section]
    fields = {"preference": PreferenceSection.model_fields, "grpo": GrpoSection.model_fields}.get(record.section or "", {})
    keys += [(record.section, k) for k in fields if k not in record.keys]
    if record.uses_trl:
        keys += list(objectives.TRL_IGNORED)
        if not record.data_formats:
            keys += [("data", "format")] + [("data", "sources", i, "format") for i in range(len(recipe.data.sources or []))]
    if recipe.model.adapter is not None:
        keys.append(("lora",))  # the adapter keeps its own rank, alpha and targets
    for i, spec in enumerate(recipe.grpo.rewards):
        reads = objectives.REWARD_SETTINGS.get(spec.function, frozenset())
        keys += [("grpo", "rewards", i, k) for k in objectives.REWARD_SETTING_KEYS if k not in reads]
    t = recipe.training
    if not t.gradient_checkpointing or (recipe.method != "full" and recipe.deepspeed.stage == 3):
        keys.append(("training", "gradient_checkpointing_reentrant"))  # finetune.render.reentrant_checkpointing
    return keys


def _default_at(recipe: Recipe, path: tuple) -> Any:
    """The schema's default for `path` (list items: a source, or a reward with this recipe's function)."""
    from finetune.recipe.schema import RewardSection, SourceSection

    if path[:2] == ("data", "sources"):
        node: Any = SourceSection(path="-").model_dump(mode="json")
        path = path[3:]
    elif path[:2] == ("grpo", "rewards"):
        node = RewardSection(function=recipe.grpo.rewards[path[2]].function).model_dump(mode="json")
        path = path[3:]
    else:
        node = Recipe.model_validate({"model": {"name_or_path": "-"}, "data": {"path": "-"}}).model_dump(mode="json")
    for part in path:
        node = node[part]
    return node


def _drop_defaults(data: dict[str, Any], path: tuple, default: Any) -> None:
    """Delete data[path] where it equals `default`; in a mapping, the keys that do (and the mapping once empty)."""
    parent: Any = data
    for part in path[:-1]:
        parent = parent[part]
    key = path[-1]
    if not isinstance(parent, dict) or key not in parent:
        return
    value = parent[key]
    if isinstance(value, dict) and isinstance(default, dict):
        for sub in [k for k in value if k in default]:
            _drop_defaults(value, (sub,), default[sub])
        if not value:
            del parent[key]
    elif value == default:
        del parent[key]


def dump_yaml(data: dict[str, Any], header: str = "") -> str:
    from ruamel.yaml import YAML

    yaml = YAML(typ="safe", pure=True)
    yaml.default_flow_style = False
    yaml.sort_base_mapping_type_on_output = False  # keep the schema's order: model, method, lora, ...
    buffer = io.StringIO()
    yaml.dump(data, buffer)
    return header + buffer.getvalue()


def run_files(loaded: LoadedRecipe, run_dir: Path, world_size: int, auto=None) -> dict[str, str]:
    """File name -> text of everything written before launch. `auto`: the recipe's auto keys as decided for this
    machine (finetune.plan.auto.Resolution): auto.json; recipe.yaml keeps `auto` where the recipe has it."""
    from finetune.render import dumps, render_deepspeed, render_training_args

    recipe = loaded.recipe
    run_dir = Path(run_dir).absolute()
    header = (f"{RECIPE_HEADER} from {Path(loaded.path).absolute()}\n"
              f"# (extends and --set applied, every default it reads written out, local paths absolute).\n")
    from finetune.rundir.format import format_text
    from finetune.rundir.names import FORMAT_FILE
    from finetune.rundir.resume_key import RESUME_KEY_FILE, resume_fields, resume_key_text

    resolved = resolved_recipe(recipe, run_dir)
    # Written in this order, recipe.yaml last: another node of the same run that sees recipe.yaml
    # (what makes a folder a run directory) sees the rest too.
    files = {RESUME_KEY_FILE: resume_key_text(resume_fields(resolved, world_size))}
    if auto is not None:
        files[AUTO_FILE] = json.dumps({"values": auto.values(), "choices": auto.to_json()}, indent=2) + "\n"
    return {
        FORMAT_FILE: format_text(),
        **files,
        DEEPSPEED_FILE: dumps(render_deepspeed(recipe, world_size)),
        TRAINING_ARGS_FILE: dumps(render_training_args(recipe, output_dir=str(run_dir))),
        RECIPE_FILE: dump_yaml(with_auto(recorded_recipe(recipe, run_dir), recipe.auto_keys), header),
    }


def write_run_dir(loaded: LoadedRecipe, run_dir: Path, world_size: int, overwrite: bool = False,
                  in_place: bool = False, before_swap: Optional[Callable[[Path], None]] = None, auto=None) -> Path:
    """Create RUN with the files above, all at once: a failure leaves no half-written run directory.

    An existing directory is replaced only with `overwrite` (preflight has checked it is a run dir);
    `before_swap(new_dir)` runs when the new directory is complete and not yet in place (finetune.run.start
    takes the new directory's lock there, so the run directory is owned across the swap). A symlinked
    run directory is replaced at its target: the link stays and points at the new run.
    `in_place` (resuming, or another node of the same run wrote it): rewrite the files one by one,
    each atomically, and keep everything else (checkpoints, logs)."""
    from finetune.rundir.lock import is_lock_file

    run_dir = Path(run_dir).absolute()
    files = run_files(loaded, run_dir, world_size, auto)
    if in_place and not overwrite:
        from finetune.render import dumps

        config = json.loads(files[DEEPSPEED_FILE])
        kept = with_recorded_optimizer(config, run_dir)
        if kept is not config:
            files[DEEPSPEED_FILE] = dumps(kept)
        run_dir.mkdir(parents=True, exist_ok=True)  # the other nodes may be creating it at the same time
    # An empty directory (made by hand, a mount point, or by `finetune train` to hold its lock) is filled in place.
    if run_dir.is_dir() and (in_place and not overwrite or all(is_lock_file(p.name) for p in run_dir.iterdir())):
        _write_into(run_dir, files)
        return run_dir
    target = run_dir.resolve() if run_dir.is_symlink() else run_dir
    with atomic_dir(target, overwrite=overwrite) as tmp:
        _write_into(tmp, files)
        if before_swap is not None:
            before_swap(tmp)
    return run_dir


def with_recorded_optimizer(config: dict, run_dir: Path) -> dict:
    """The DeepSpeed config with the Adam implementation the run directory's deepspeed.json records, where both name
    the same optimizer: a resumed run steps the optimizer that wrote its checkpoints, and compiles what it needs
    (finetune.run.deepspeed_ops.recipe_ops). `config` is left as it is; a changed copy is returned.

    Up to 2026-11-28 finetune rendered Adam/AdamW as DeepSpeed's FusedAdam (finetune.render.with_torch_adam). Its
    saved param groups replace torch's on loading, so a run resumed with torch's AdamW loses `fused` and steps the
    slower foreach path (seen on the CPU, ZeRO-2); the other way FusedAdam fails on the first step (KeyError
    'bias_correction'); and at ZeRO-0 the two have other DeepSpeed wrappers, with other state dicts."""
    try:
        recorded = json.loads(RunDir(run_dir).file(DEEPSPEED_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return config  # a run directory without one (an empty folder filled in place): nothing recorded
    old, new = recorded.get("optimizer") if isinstance(recorded, dict) else None, config.get("optimizer")
    if not (isinstance(old, dict) and isinstance(new, dict) and isinstance(new.get("params"), dict)) \
            or str(old.get("type", "")).lower() != str(new.get("type", "")).lower():
        return config
    kept = old.get("params") if isinstance(old.get("params"), dict) else {}
    params = {key: value for key, value in new["params"].items() if key not in ("torch_adam", "fused")}
    params.update({key: kept[key] for key in ("torch_adam", "fused") if key in kept})
    if params == new["params"]:
        return config
    return {**config, "optimizer": {**new, "params": dict(sorted(params.items()))}}


def _write_into(directory: Path, files: dict[str, str]) -> None:
    from finetune.fsutil import write_atomic

    # mkdtemp/mkstemp create 0700/0600; a run directory is for the whole team on a shared box: use the umask.
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for name, text in files.items():
        write_atomic(directory / name, text)
        (directory / name).chmod(0o666 & ~umask)
    (directory / LOGS_DIR).mkdir(exist_ok=True)


def read_run_dir(run_dir: Path) -> tuple[Recipe, dict[str, Any], dict[str, Any]]:
    """(recipe, DeepSpeed config, TrainingArguments kwargs) as write_run_dir left them (the runner reads them)."""
    run = RunDir(run_dir)
    missing = [name for name in RUN_INPUTS if not run.file(name).is_file()]
    if missing:
        raise RunDirError(f"{run_dir}: missing {', '.join(missing)} (start runs with `finetune train RECIPE`)")
    try:
        recipe = run.recipe()
        ds_config = json.loads(run.file(DEEPSPEED_FILE).read_text(encoding="utf-8"))
        training_args = json.loads(run.file(TRAINING_ARGS_FILE).read_text(encoding="utf-8"))
        auto = run.file(AUTO_FILE)
        if auto.is_file():  # the recipe's auto keys as `finetune train` decided them (older runs: none)
            recipe = with_auto_values(recipe, json.loads(auto.read_text(encoding="utf-8")).get("values") or {})
    except (RunDirError, ValueError, OSError, AttributeError) as exc:
        raise RunDirError(f"{run_dir}: cannot read the run inputs: {exc}") from None
    return recipe, ds_config, training_args
