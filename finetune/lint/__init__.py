"""`finetune lint`: recipes and raw DeepSpeed JSON checked in CI, without torch, in well under a second.

The engine finds files, reads them with positions (finetune.recipe.yamlio), runs the rule modules and turns
each rule's key path into `file:line:col`:

- recipe loading problems (R001-R006: YAML, unknown keys, types, extends, --set) come from finetune.recipe,
- recipe combinations that only fail at run time (R1xx) from finetune.lint.recipe_rules,
- DeepSpeed config rules (DSxxx) from finetune.lint.deepspeed, applied to raw JSON files and to
  the config each recipe renders to,
- the memory planner (P001) when the recipe declares `hardware` or --gpus/--gpu-memory are given.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

from finetune.recipe import LoadedRecipe, RecipeProblem, load_recipe, parse_size
from finetune.recipe.yamlio import DocumentError, load_json, read_text
from finetune.models.attention import default_attention

from finetune.lint.files import DS_SUFFIXES, discover

SEVERITIES = ("error", "warning", "info")

PLAN_RULES: dict[str, str] = {
    "P001": "Predicted out of memory on the declared (or --gpus/--gpu-memory) hardware, with the breakdown.",
    "P002": "Memory not checked: the planner does not know the model (info).",
}


@dataclass(frozen=True)
class Finding:
    rule: str
    severity: str
    path: str
    line: int
    col: int
    key: Optional[str]
    message: str
    fix: Optional[str] = None

    def to_dict(self) -> dict:
        return {"rule": self.rule, "severity": self.severity, "file": self.path, "line": self.line,
                "col": self.col, "key": self.key, "message": self.message, "fix": self.fix}


@dataclass
class LintOptions:
    world_size: Optional[int] = None
    recipe: Optional[Path] = None  # DeepSpeed JSON files are checked against this recipe's TrainingArguments
    gpus: Optional[int] = None
    gpu_memory: Optional[str] = None
    overrides: list[str] = field(default_factory=list)
    hf: bool = True  # DeepSpeed JSON goes to the HF Trainer (TrainingArguments fill "auto"); else deepspeed.initialize

    def validate(self) -> None:
        if self.gpu_memory is not None:
            parse_size(self.gpu_memory)  # ValueError -> usage error


@dataclass
class LintResult:
    findings: list[Finding] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    skipped: dict[tuple[str, str], int] = field(default_factory=dict)  # finetune.lint.files.discover: what and how many

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]

    def exit_code(self, strict: bool = False) -> int:
        if self.errors or (strict and self.warnings):
            return 1
        return 0


def lint_paths(paths: Iterable[Path], options: Optional[LintOptions] = None) -> LintResult:
    options = options or LintOptions()
    result = LintResult()
    reference = _reference_training_args(options, result)
    found = discover(paths)
    result.skipped = found.skipped
    for path in found.files:
        result.files.append(str(path))
        if path.suffix in DS_SUFFIXES:
            result.findings.extend(lint_deepspeed_file(path, options, reference))
        else:
            result.findings.extend(lint_recipe_file(path, options))
    return result


def lint_recipe_file(path: Path, options: LintOptions) -> list[Finding]:
    try:
        loaded = default_attention(load_recipe(path, options.overrides))
    except RecipeProblem as exc:
        findings = [Finding(p.rule, "error", p.path, p.line, p.col, p.key, p.message, p.fix) for p in exc.problems]
        if exc.partial is not None:  # keep going without the bad keys: every problem in one pass
            findings += [f for f in lint_loaded(default_attention(exc.partial), options).findings
                         if f.key not in {p.key for p in exc.problems}]
        return _sorted(findings)
    return lint_loaded(loaded, options).findings


def lint_loaded(loaded: LoadedRecipe, options: Optional[LintOptions] = None) -> LintResult:
    """Every check on an already loaded recipe (also used by `finetune train`'s preflight)."""
    from finetune.render import render_deepspeed, render_training_args
    from finetune.lint import (  # noqa: F401 - they register their rules
        deepspeed, moe_rules, objective_rules, parallel_rules, recipe_rules, speed_rules, vision_rules,
    )

    options = options or LintOptions()
    recipe = loaded.recipe
    findings: list[Finding] = []
    for raw in recipe_rules.check_recipe(loaded):
        findings.append(_at_recipe(loaded, raw.key, raw))
    world = options.world_size or recipe.world_size
    config = render_deepspeed(recipe, world)
    ctx = deepspeed.DSContext(world_size=world, training_args=render_training_args(recipe),
                                    hf_integration=True, from_recipe=True)
    for raw in deepspeed.check_config(config, ctx):
        findings.append(_at_recipe(loaded, recipe_key_for(raw.key, recipe.deepspeed.overrides), raw))
    findings.extend(_plan_findings(loaded, options))
    result = LintResult(findings=_sorted(findings), files=[str(loaded.path)])
    return result


def _plan_findings(loaded: LoadedRecipe, options: LintOptions) -> list[Finding]:
    recipe = loaded.recipe
    hardware = recipe.hardware
    gpus = options.gpus or (hardware.gpus if hardware else None)
    memory = options.gpu_memory or (hardware.gpu_memory if hardware else None)
    if memory is None:
        return []
    from finetune.plan import PlanError, machine_for, plan_recipe, resolve_auto

    try:
        # the recipe as it would run there: its auto keys decided for that memory (finetune.plan.auto)
        recipe = resolve_auto(recipe, machine_for(recipe, gpus, parse_size(memory))).recipe
        result = plan_recipe(recipe, gpus=gpus, gpu_memory_bytes=parse_size(memory), nodes=recipe.launch.nodes)
    except PlanError as exc:
        path, line, col = loaded.where(("model", "name_or_path"))
        return [Finding("P002", "info", path, line, col, "model.name_or_path", f"memory not checked: {exc}")]
    if result.fits is False:
        path, line, col = loaded.where(("hardware",) if hardware else ("deepspeed",))
        return [Finding("P001", "error", path, line, col, "hardware" if hardware else "deepspeed",
                        ("predicted out of memory" if result.gpu_fits is False and result.per_gpu["total"] >
                         result.setup.gpu_memory else "may run out of memory") + f": {result.summary()}",
                        "run `finetune plan RECIPE --recommend` for a setup that fits")]
    return []


def _at_recipe(loaded: LoadedRecipe, key: tuple, raw) -> Finding:
    path, line, col = loaded.where(key)
    dotted = ".".join(str(k) for k in key) or None
    return Finding(raw.rule, raw.severity, path, line, col, dotted, raw.message, raw.fix)


# Rendered DeepSpeed key -> the recipe key that produced it (for findings on rendered configs).
_RECIPE_KEY = {
    ("train_micro_batch_size_per_gpu",): ("training", "micro_batch_size"),
    ("gradient_accumulation_steps",): ("training", "gradient_accumulation_steps"),
    ("train_batch_size",): ("training", "micro_batch_size"),
    ("gradient_clipping",): ("training", "max_grad_norm"),
    ("bf16",): ("model", "dtype"),
    ("fp16",): ("model", "dtype"),
    ("optimizer",): ("training", "optimizer"),
    ("optimizer", "params", "lr"): ("training", "learning_rate"),
    ("optimizer", "params", "weight_decay"): ("training", "weight_decay"),
    ("optimizer", "params", "eps"): ("training", "adam_epsilon"),
    ("optimizer", "params", "betas"): ("training", "adam_beta1"),
    ("zero_optimization", "stage3_gather_16bit_weights_on_model_save"): ("deepspeed", "gather_16bit_weights_on_model_save"),
}


def recipe_key_for(ds_key: tuple, overrides: dict) -> tuple:
    """The recipe key to point at for a finding on the rendered config's `ds_key`."""
    ds_key = tuple(ds_key)
    node = overrides
    for depth, part in enumerate(ds_key):
        if not isinstance(node, dict) or part not in node:
            break
        node = node[part]
        if depth == len(ds_key) - 1 or not isinstance(node, dict):
            return ("deepspeed", "overrides") + ds_key[: depth + 1]
    for length in range(len(ds_key), 0, -1):
        if ds_key[:length] in _RECIPE_KEY:
            return _RECIPE_KEY[ds_key[:length]]
    if ds_key[:1] == ("zero_optimization",) and len(ds_key) >= 2:
        return ("deepspeed", ds_key[1])
    return ("deepspeed",)


def lint_deepspeed_file(path: Path, options: LintOptions, reference: Optional[dict] = None) -> list[Finding]:
    from finetune.lint import deepspeed

    shown = str(path)
    try:
        doc = load_json(read_text(path), shown)
    except DocumentError as exc:
        return [Finding("DS001", "error", shown, exc.line, exc.col, exc.key, exc.message,
                        "DeepSpeed, HF and accelerate read the file with json.load: plain JSON only")]
    ctx = deepspeed.DSContext(world_size=options.world_size or (reference or {}).get("_world_size"),
                                    training_args=(reference or {}).get("args"), hf_integration=options.hf,
                                    from_recipe=False, duplicates=list(doc.duplicates))
    findings = []
    for raw in deepspeed.check_config(doc.data, ctx):
        line, col = _dup_pos(doc, raw.key) or doc.pos(raw.key)
        dotted = ".".join(str(k) for k in raw.key) or None
        findings.append(Finding(raw.rule, raw.severity, shown, line, col, dotted, raw.message, raw.fix))
    return _sorted(findings)


def _dup_pos(doc, key: tuple):
    for dup_key, line, col in doc.duplicates:
        if tuple(dup_key) == tuple(key):
            return line, col
    return None


def _reference_training_args(options: LintOptions, result: LintResult) -> Optional[dict]:
    """With --recipe, JSON files are compared to the TrainingArguments that recipe implies."""
    if options.recipe is None:
        return None
    from finetune.render import render_training_args

    try:
        loaded = default_attention(load_recipe(options.recipe, options.overrides))
    except RecipeProblem as exc:
        result.findings.extend(Finding(p.rule, "error", p.path, p.line, p.col, p.key, p.message, p.fix) for p in exc.problems)
        return None
    return {"args": render_training_args(loaded.recipe), "_world_size": loaded.recipe.world_size}


def _sorted(findings: list[Finding]) -> list[Finding]:
    order = {s: i for i, s in enumerate(SEVERITIES)}
    unique = list(dict.fromkeys(findings))
    return sorted(unique, key=lambda f: (f.path, f.line, f.col, order.get(f.severity, 9), f.rule))
