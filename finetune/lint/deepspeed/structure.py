"""Structural rules of a DeepSpeed config: duplicate, removed and unknown keys, value types, sections.

Phases "duplicates" and "structure" (finetune.lint.deepspeed.view.PHASES): they run first, and the keys they
report are claimed, so the semantic rules after them judge only values that have the right shape.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

from finetune.lint.deepspeed.context import RawFinding
from finetune.lint.deepspeed.schema import (
    DTYPE_NAMES, Field, INTERNAL_NAMES, LENIENT, REMOVED_TOP, REMOVED_ZERO, SECTIONS, TOP, ZERO_FIELD_NAMES)
from finetune.lint.deepspeed.values import (
    BOOL_STRINGS, KIND_WORDS, SECTION_WORDS, TRUE_STRINGS, as_int, did_you_mean, dotted, json_type,
    read_by_pydantic, pydantic_number, section_example, show, suggest, violated_bound)
from finetune.lint.deepspeed.view import ConfigView, Seen, rule


# ------------------------------------------------------------------------------------------
# DS101 duplicates

@rule("duplicates")
def duplicates(v: ConfigView, seen: Seen) -> Iterator[RawFinding]:
    for entry in v.ctx.duplicates or ():
        first = entry[0] if isinstance(entry, (tuple, list)) and entry else ()
        path = tuple(first) if isinstance(first, (tuple, list)) else ()
        yield RawFinding("DS101", "error", path,
                         f"duplicate key `{dotted(path)}`: DeepSpeed refuses the file when it reads it itself, while "
                         "HF and accelerate (json.load) silently keep the last value", "keep one of the two entries")


# ------------------------------------------------------------------------------------------
# Structure: keys and types (DS102-DS115, DS138)

@rule("structure")
def structure(v: ConfigView, seen: Seen) -> Iterator[RawFinding]:
    for key, value in v.config.items():
        path = (key,)
        if key in REMOVED_TOP:
            yield RawFinding(
                "DS102", "error", path, f"`{key}` configures {REMOVED_TOP[key]}, which DeepSpeed has removed: "
                "DeepSpeed refuses a config that still has it", f"delete `{key}`")
            continue
        spec = TOP.get(key)
        if spec is None:
            yield from unknown(v, path, value, list(TOP), strict=False)
            continue
        if spec.deprecated:
            yield from deprecated_top(v, key, spec)
        if value == "auto":
            continue  # judged by the "auto" rules
        yield from check_value(v, path, value, spec)


def deprecated_top(v: ConfigView, key: str, spec: Field) -> Iterator[RawFinding]:
    if key == "bfloat16":
        if "bf16" in v.config:
            yield RawFinding(
                "DS138", "warning", (key,), "`bfloat16` is DeepSpeed's old name for `bf16`; with both present "
                "DeepSpeed reads only `bf16`", "delete `bfloat16`")
        elif v.hf:
            yield RawFinding(
                "DS138", "warning", (key,), "`bfloat16` is DeepSpeed's old name for `bf16`; under the HF "
                "Trainer accelerate adds a `bf16` block from TrainingArguments, and DeepSpeed then ignores "
                "`bfloat16`", "rename it to `bf16`")
        else:
            yield RawFinding("DS138", "warning", (key,), "`bfloat16` is deprecated", "rename it to `bf16`")
    elif key == "allgather_size":
        yield RawFinding("DS138", "warning", (key,), "`allgather_size` is only read with the deprecated "
                         '`"zero_optimization": true` form', "use zero_optimization.allgather_bucket_size")


def unknown(v: ConfigView, path: tuple, value: Any, candidates: list, strict: bool,
            section: str = "") -> Iterator[RawFinding]:
    """The key is not a setting of its section: findings marked so that nothing below it is judged again."""
    key = str(path[-1])
    suggestion = suggest(key, candidates)
    fix = f"did you mean `{suggestion}`?" if suggestion else None
    where = f"`{dotted(path)}`"
    if strict and value == "auto":
        tail = ("; under the HF Trainer accelerate then stops with \"`...` not found in kwargs\"" if v.hf
                else ", and the setting you meant keeps DeepSpeed's default")
        yield _unknown_key(
            "DS104", "error", path, f"{where} is not a {section} setting: DeepSpeed drops \"auto\" values "
            f"before validating, so DeepSpeed itself lets the misspelling pass{tail}", fix or "delete it")
    elif strict:
        yield _unknown_key("DS103", "error", path, f"{where} is not a {section} setting: DeepSpeed refuses the config",
                           fix or f"delete it (valid keys: {', '.join(sorted(candidates)[:8])}, ...)")
    elif value == "auto" and v.hf:
        yield _unknown_key(
            "DS104", "error", path, f"{where} is not a DeepSpeed setting, and its \"auto\" is never filled "
            "in: accelerate stops with \"`...` not found in kwargs\"", fix or "delete it")
    elif suggestion:
        yield _unknown_key("DS105", "error", path, f"{where} is not a DeepSpeed setting: DeepSpeed ignores it, so the "
                           "setting you meant keeps its default", fix)
    elif key.startswith("_"):  # "_comment": the usual way to annotate a JSON file
        yield _unknown_key("DS105", "info", path, f"{where} is not a DeepSpeed setting (taken as a comment); DeepSpeed "
                           "ignores it")
    elif len(path) == 1 and key in INTERNAL_NAMES:
        yield _unknown_key("DS105", "warning", path, f"{where} is not a DeepSpeed setting (it names one of DeepSpeed's "
                           "internal config classes); DeepSpeed ignores it", f"use `{INTERNAL_NAMES[key]}`")
    else:
        yield _unknown_key("DS105", "warning", path, f"{where} is not a DeepSpeed setting; DeepSpeed ignores it",
                           "delete it, or check DeepSpeed's config reference")


def _unknown_key(rule_id: str, severity: str, path: tuple, message: str, fix: Any = None) -> RawFinding:
    return RawFinding(rule_id, severity, path, message, fix, unknown_key=True)


def check_value(v: ConfigView, path: tuple, value: Any, spec: Field) -> Iterator[RawFinding]:
    """Type, choices and range of one value, the way pydantic (lax mode) or DeepSpeed's code reads it."""
    if value is None:
        if not spec.optional and spec.kind not in ("any",):
            crash = spec.kind in ("section", "lenient")
            yield RawFinding("DS110", "error", path, f"`{dotted(path)}` is null" +
                             (": DeepSpeed expects an object and crashes on null" if crash else
                              f", DeepSpeed expects {KIND_WORDS.get(spec.kind, spec.kind)}"),
                             "delete the key to get DeepSpeed's default")
        return
    kind = spec.kind
    if kind == "section":
        yield from check_section(v, path, value, spec.section or "")
    elif kind == "lenient":
        yield from check_lenient(v, path, value, spec.section or "")
    elif kind == "bool":
        yield from check_bool(v, path, value)
    elif kind in ("int", "float"):
        yield from check_number(v, path, value, spec)
    elif kind == "str":
        if not isinstance(value, str):
            yield RawFinding("DS110", "error", path, f"`{dotted(path)}` must be a string, not {json_type(value)} "
                             f"{show(value)}", "quote it")
    elif kind == "path":
        if not isinstance(value, str):
            yield RawFinding("DS110", "error", path, f"`{dotted(path)}` must be a directory path (a string)",
                             "write the path in quotes")
        elif value.strip() == "":
            yield RawFinding("DS113", "warning", path, f"`{dotted(path)}` is empty: DeepSpeed reads it as the current "
                             "directory", "set a directory on a fast local disk")
    elif kind == "list":
        if not isinstance(value, list):
            yield RawFinding("DS110", "error", path, f"`{dotted(path)}` must be a list, not {json_type(value)}")
    elif kind == "dict":
        if not isinstance(value, dict):
            yield RawFinding("DS110", "error", path, f"`{dotted(path)}` must be an object, not {json_type(value)}: "
                             "DeepSpeed crashes reading it")
    elif kind == "enum":
        yield from check_enum(v, path, value, spec)
    elif kind == "pyobject":
        yield RawFinding("DS110", "error", path, f"`{dotted(path)}` takes a Python object (a torch.dtype), which JSON "
                         f"cannot hold: DeepSpeed refuses {show(value)}", "delete it")


def check_section(v: ConfigView, path: tuple, value: Any, section: str) -> Iterator[RawFinding]:
    fields = SECTIONS[section]
    if path == ("zero_optimization",) and isinstance(value, bool):
        if v.hf:
            yield RawFinding(
                "DS110", "error", path, '`"zero_optimization": true/false` is DeepSpeed\'s deprecated form; '
                "HF and accelerate expect an object and crash on it (`'bool' object has no attribute 'get'`)",
                'write {"stage": 1} (true) or {"stage": 0} (false)')
        else:
            yield RawFinding(
                "DS138", "warning", path, '`"zero_optimization": true/false` is deprecated (DeepSpeed reads '
                "it as stage 1 or 0)", 'write {"stage": 1} or {"stage": 0}')
        return
    if not isinstance(value, dict):
        yield RawFinding("DS110", "error", path, f"`{dotted(path)}` must be an object, not {json_type(value)}: "
                         "DeepSpeed crashes reading it", section_example(section))
        return
    shown = SECTION_WORDS.get(section, f"`{dotted(path)}`")
    for key, item in value.items():
        child = path + (key,)
        if section == "zero_optimization" and key in REMOVED_ZERO:
            yield RawFinding(
                "DS102", "error", child, f"`{dotted(child)}` configures {REMOVED_ZERO[key]}, which DeepSpeed "
                "has removed: DeepSpeed refuses a config that still has it", "delete it")
            continue
        spec = fields.get(key)
        if spec is None:
            candidates = [k for k in fields if k not in ZERO_FIELD_NAMES]
            yield from unknown(v, child, item, candidates, strict=True, section=shown)
            continue
        if spec.deprecated:
            yield from deprecated_field(v, value, child, spec)
        if item == "auto":
            continue
        if section == "zero_optimization" and key == "stage":
            yield from check_stage(v, child, item)
            continue
        yield from check_value(v, child, item, spec)
    if section == "zero_optimization":
        for name, alias in ZERO_FIELD_NAMES.items():
            if name in value and alias in value:
                yield RawFinding("DS103", "error", path + (name,), f"`{alias}` is given twice, also as `{name}`: "
                                 f"DeepSpeed refuses `{name}` as an unknown key", f"delete `{name}`")


def deprecated_field(v: ConfigView, block: dict, path: tuple, spec: Field) -> Iterator[RawFinding]:
    replacement = spec.deprecated or ""
    direct = replacement.split(" ")[0].split(".")[0]
    if direct in block:
        yield RawFinding("DS138", "error", path, f"`{dotted(path)}` is the deprecated form of `{direct}`, and both are "
                         "given: DeepSpeed refuses the pair", f"delete `{path[-1]}`")
    else:
        yield RawFinding("DS138", "warning", path, f"`{dotted(path)}` is deprecated", f"use `{replacement}`")


def check_lenient(v: ConfigView, path: tuple, value: Any, section: str) -> Iterator[RawFinding]:
    fields = LENIENT[section]
    if not isinstance(value, dict):
        yield RawFinding("DS110", "error", path, f"`{dotted(path)}` must be an object, not {json_type(value)}: "
                         "DeepSpeed crashes reading it")
        return
    for key, item in value.items():
        child = path + (key,)
        spec = fields.get(key)
        if spec is None:
            if section in ("optimizer", "scheduler") and key in ("lr", "betas", "eps", "weight_decay",
                                                                 "warmup_num_steps", "total_num_steps"):
                yield RawFinding("DS105", "error", child, f"`{dotted(child)}` belongs inside `{section}.params`: "
                                 "DeepSpeed ignores it here", f"move it into `{section}.params`")
            else:
                yield from unknown(v, child, item, list(fields), strict=False)
            continue
        if item == "auto":
            continue
        if section == "checkpoint" and key == "tag_validation":
            yield from check_tag_validation(v, child, item)
        elif section in ("data_types", "torch_autocast") and spec.kind == "enum":
            yield from check_dtype(v, child, item)
        elif section == "parallel_write" and key == "pipeline_stage":
            if item not in (True, False):  # DeepSpeed: `in [True, False]` (so 0/1 pass too)
                yield RawFinding("DS110", "error", child, "`checkpoint.parallel_write.pipeline_stage` must be true or "
                                 "false: DeepSpeed refuses anything else", "write true or false")
        else:
            yield from check_value(v, child, item, spec)


def check_bool(v: ConfigView, path: tuple, value: Any) -> Iterator[RawFinding]:
    if isinstance(value, bool):
        return
    shown = dotted(path)
    if isinstance(value, str) and value.strip().lower() in BOOL_STRINGS:
        read_by_hf = path[-1] == "enabled" and path[0] in ("fp16", "bf16", "bfloat16")
        if read_by_hf:
            yield RawFinding(
                "DS110", "error", path, f"`{shown}` is the string {show(value)}: DeepSpeed converts it, but "
                "HF and accelerate test it with Python truthiness (so \"false\" counts as enabled)",
                f"write {str(value.strip().lower() in TRUE_STRINGS).lower()} without quotes")
        elif read_by_pydantic(path):
            yield RawFinding("DS113", "warning", path, f"`{shown}` is the string {show(value)}; DeepSpeed converts it",
                             f"write {str(value.strip().lower() in TRUE_STRINGS).lower()} without quotes")
        else:
            # dict.get readers (top-level keys, lenient sections) keep the string: "false" is truthy
            yield RawFinding(
                "DS110", "error", path, f"`{shown}` is the string {show(value)}: DeepSpeed keeps it as a "
                "string, and any non-empty string counts as true",
                f"write {str(value.strip().lower() in TRUE_STRINGS).lower()} without quotes")
        return
    if isinstance(value, (int, float)) and value in (0, 1):
        yield RawFinding("DS113", "warning", path, f"`{shown}` is the number {show(value)}; DeepSpeed reads it as "
                         f"{str(bool(value)).lower()}", f"write {str(bool(value)).lower()}")
        return
    yield RawFinding("DS110", "error", path, f"`{shown}` must be true or false, not {json_type(value)} {show(value)}",
                     "write true or false")


def check_number(v: ConfigView, path: tuple, value: Any, spec: Field) -> Iterator[RawFinding]:
    shown = dotted(path)
    want = "an integer" if spec.kind == "int" else "a number"
    strict_reader = read_by_pydantic(path)  # pydantic converts strings; dict.get readers keep them
    number: Any = None
    if isinstance(value, bool):
        yield RawFinding("DS110", "error", path, f"`{shown}` must be {want}, not {str(value).lower()}",
                         f"write {want[2:] if want.startswith('a ') else want}")
        return
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value) and path != ("steps_per_print",):
            yield RawFinding("DS111", "error", path, f"`{shown}` is {value}: DeepSpeed needs a finite number")
            return
        number = value
    elif isinstance(value, str) and strict_reader and pydantic_number(value, spec.kind) is not None:
        number = pydantic_number(value, spec.kind)
        yield RawFinding("DS113", "warning", path, f"`{shown}` is the string {show(value)}; DeepSpeed converts it",
                         "write the number without quotes")
    else:
        yield RawFinding("DS110", "error", path, f"`{shown}` must be {want}, not {json_type(value)} {show(value)}"
                         + ("" if strict_reader else ": DeepSpeed does arithmetic with it and crashes"),
                         "write the number without quotes" if isinstance(value, str) else None)
        return
    if spec.kind == "int" and isinstance(number, float) and math.isfinite(number) and not number.is_integer():
        yield RawFinding("DS110", "error", path, f"`{shown}` must be a whole number, not {show(value)}",
                         f"use {math.floor(number)} or {math.ceil(number)}")
        return
    bound = violated_bound(number, spec)
    if bound:
        yield RawFinding("DS111", "error", path, f"`{shown}` is {show(value)}, DeepSpeed needs a value {bound}",
                         f"use a value {bound}, or delete the key for DeepSpeed's default")


def check_enum(v: ConfigView, path: tuple, value: Any, spec: Field) -> Iterator[RawFinding]:
    shown = dotted(path)
    choices = spec.choices
    if path[-1] in ("communication_data_type", "seq_parallel_communication_data_type", "gradient_allreduce_op"):
        if not isinstance(value, str):
            yield RawFinding(
                "DS110", "error", path, f"`{shown}` must be a string, one of {', '.join(map(str, choices))}: "
                "DeepSpeed crashes on anything else")
        elif value.lower() not in choices:
            yield RawFinding("DS112", "error", path, f"`{shown}` is {show(value)}, DeepSpeed accepts "
                             f"{', '.join(map(str, choices))}", did_you_mean(value, list(choices)))
        return
    if value in choices and not isinstance(value, bool):
        return
    suggestion = did_you_mean(str(value), [str(c) for c in choices])
    if isinstance(value, str) and value.lower() in choices:
        suggestion = f"write {show(value.lower())}"
    yield RawFinding("DS112", "error", path, f"`{shown}` is {show(value)}, DeepSpeed accepts "
                     f"{', '.join(show(c) for c in choices)}", suggestion)


def check_stage(v: ConfigView, path: tuple, value: Any) -> Iterator[RawFinding]:
    if isinstance(value, int) and not isinstance(value, bool):
        if value not in (0, 1, 2, 3):
            yield RawFinding("DS112", "error", path, f"ZeRO stage {value} does not exist: DeepSpeed accepts 0, 1, 2, 3",
                             "use 3 for the most memory savings")
        return
    stage = as_int(value, allow_bool=True)
    if stage not in (0, 1, 2, 3):
        yield RawFinding(
            "DS112", "error", path, f"`zero_optimization.stage` is {show(value)}: DeepSpeed accepts 0, 1, 2, 3",
            "write the stage as a number, e.g. 2")
        return
    if isinstance(value, float):
        yield RawFinding("DS113", "warning", path, f"the ZeRO stage is the float {value}", f"write {stage}")
        return
    if isinstance(value, bool):
        why = f"DeepSpeed reads {str(value).lower()} as stage {stage}, HF's stage checks see no ZeRO-2/3"
    elif v.hf:
        why = (f"DeepSpeed converts it to stage {stage}, but HF compares the raw value with the number "
               f"{stage}" + (": `is_deepspeed_zero3_enabled()` is false, so the model is loaded whole on every "
                              "GPU instead of being partitioned while it loads (zero.Init), and ZeRO-3's "
                              "\"auto\" bucket sizes are not filled by HF" if stage == 3 else ""))
    else:
        yield RawFinding("DS113", "warning", path, f"the ZeRO stage is the string {show(value)}; DeepSpeed converts it",
                         f"write {stage} without quotes")
        return
    yield RawFinding("DS115", "error", path, f"`zero_optimization.stage` is {show(value)}, not an integer: {why}",
                     f"write {stage}" + (" without quotes" if isinstance(value, str) else ""))


def check_dtype(v: ConfigView, path: tuple, value: Any) -> Iterator[RawFinding]:
    if path[-1] == "keep_in_fp32_modules":
        return
    if not isinstance(value, str) or value not in DTYPE_NAMES:
        yield RawFinding("DS112", "error", path, f"`{dotted(path)}` is {show(value)}, not a dtype DeepSpeed knows",
                         did_you_mean(str(value), ["bf16", "fp16", "fp32"]) or "use bf16, fp16 or fp32")


def check_tag_validation(v: ConfigView, path: tuple, value: Any) -> Iterator[RawFinding]:
    if not isinstance(value, str):
        yield RawFinding(
            "DS110", "error", path, "`checkpoint.tag_validation` must be a string: DeepSpeed calls .upper() "
            "on it and crashes", 'use "Warn", "Ignore" or "Fail"')
    elif value.upper() not in ("WARN", "IGNORE", "FAIL"):
        yield RawFinding("DS112", "error", path, f"`checkpoint.tag_validation` is {show(value)}: DeepSpeed accepts "
                         "Warn, Ignore, Fail", did_you_mean(value.upper(), ["WARN", "IGNORE", "FAIL"])
                         or 'use "Fail" to refuse checkpoints whose tags differ across ranks')
