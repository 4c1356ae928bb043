"""Structural checks of a DeepSpeed config: duplicate, removed and unknown keys, value types, sections."""

from __future__ import annotations

import math
from typing import Any

from finetune.lint.ds_context import RawFinding
from finetune.lint.ds_schema import (
    DTYPE_NAMES, Field, INTERNAL_NAMES, LENIENT, REMOVED_TOP, REMOVED_ZERO, SECTIONS, TOP, ZERO_FIELD_NAMES)
from finetune.lint.ds_values import (
    BOOL_STRINGS, KIND_WORDS, SECTION_WORDS, TRUE_STRINGS, as_int, did_you_mean, dotted, json_type,
    read_by_pydantic, pydantic_number, section_example, show, suggest, violated_bound)


class StructureChecks:
    """The structural half of the DeepSpeed checker (mixed into deepspeed_rules._Checker, which supplies
    config, ctx, add, get and the other reading helpers)."""

    # ------------------------------------------------------------------------------------------
    # DS101 duplicates

    def duplicates(self) -> None:
        for entry in self.ctx.duplicates or ():
            first = entry[0] if isinstance(entry, (tuple, list)) and entry else ()
            path = tuple(first) if isinstance(first, (tuple, list)) else ()
            shown = dotted(path)
            self.findings.append(RawFinding(
                "DS101", "error", path,
                f"duplicate key `{shown}`: DeepSpeed refuses the file when it reads it itself, while HF and "
                "accelerate (json.load) silently keep the last value",
                "keep one of the two entries"))

    # ------------------------------------------------------------------------------------------
    # Structure: keys and types (DS102-DS115, DS138)

    def structure(self) -> None:
        for key, value in self.config.items():
            path = (key,)
            if key in REMOVED_TOP:
                self.add("DS102", "error", path, f"`{key}` configures {REMOVED_TOP[key]}, which DeepSpeed has removed: "
                         "DeepSpeed refuses a config that still has it", f"delete `{key}`")
                continue
            spec = TOP.get(key)
            if spec is None:
                self.unknown(path, value, list(TOP), strict=False)
                continue
            if spec.deprecated:
                self.deprecated_top(key, spec)
            if value == "auto":
                continue  # judged by auto_rules
            self.check_value(path, value, spec)

    def deprecated_top(self, key: str, spec: Field) -> None:
        if key == "bfloat16":
            if "bf16" in self.config:
                self.add("DS138", "warning", (key,), "`bfloat16` is DeepSpeed's old name for `bf16`; with both present "
                         "DeepSpeed reads only `bf16`", "delete `bfloat16`")
            elif self.hf:
                self.add("DS138", "warning", (key,), "`bfloat16` is DeepSpeed's old name for `bf16`; under the HF "
                         "Trainer accelerate adds a `bf16` block from TrainingArguments, and DeepSpeed then ignores "
                         "`bfloat16`", "rename it to `bf16`")
            else:
                self.add("DS138", "warning", (key,), "`bfloat16` is deprecated", "rename it to `bf16`")
        elif key == "allgather_size":
            self.add("DS138", "warning", (key,), "`allgather_size` is only read with the deprecated "
                     '`"zero_optimization": true` form', "use zero_optimization.allgather_bucket_size")

    def unknown(self, path: tuple, value: Any, candidates: list, strict: bool, section: str = "") -> None:
        self.unknown_paths.add(tuple(path))
        key = str(path[-1])
        suggestion = suggest(key, candidates)
        fix = f"did you mean `{suggestion}`?" if suggestion else None
        where = f"`{dotted(path)}`"
        if strict and value == "auto":
            tail = ("; under the HF Trainer accelerate then stops with \"`...` not found in kwargs\"" if self.hf
                    else ", and the setting you meant keeps DeepSpeed's default")
            self.add("DS104", "error", path, f"{where} is not a {section} setting: DeepSpeed drops \"auto\" values "
                     f"before validating, so DeepSpeed itself lets the misspelling pass{tail}", fix or "delete it")
        elif strict:
            self.add("DS103", "error", path, f"{where} is not a {section} setting: DeepSpeed refuses the config",
                     fix or f"delete it (valid keys: {', '.join(sorted(candidates)[:8])}, ...)")
        elif value == "auto" and self.hf:
            self.add("DS104", "error", path, f"{where} is not a DeepSpeed setting, and its \"auto\" is never filled "
                     "in: accelerate stops with \"`...` not found in kwargs\"", fix or "delete it")
        elif suggestion:
            self.add("DS105", "error", path, f"{where} is not a DeepSpeed setting: DeepSpeed ignores it, so the "
                     "setting you meant keeps its default", fix)
        elif key.startswith("_"):  # "_comment": the usual way to annotate a JSON file
            self.add("DS105", "info", path, f"{where} is not a DeepSpeed setting (taken as a comment); DeepSpeed "
                     "ignores it")
        elif len(path) == 1 and key in INTERNAL_NAMES:
            self.add("DS105", "warning", path, f"{where} is not a DeepSpeed setting (it names one of DeepSpeed's "
                     "internal config classes); DeepSpeed ignores it", f"use `{INTERNAL_NAMES[key]}`")
        else:
            self.add("DS105", "warning", path, f"{where} is not a DeepSpeed setting; DeepSpeed ignores it",
                     "delete it, or check DeepSpeed's config reference")

    def check_value(self, path: tuple, value: Any, spec: Field) -> None:
        """Type, choices and range of one value, the way pydantic (lax mode) or DeepSpeed's code reads it."""
        if value is None:
            if not spec.optional and spec.kind not in ("any",):
                crash = spec.kind in ("section", "lenient")
                self.add("DS110", "error", path, f"`{dotted(path)}` is null" +
                         (": DeepSpeed expects an object and crashes on null" if crash else
                          f", DeepSpeed expects {KIND_WORDS.get(spec.kind, spec.kind)}"),
                         "delete the key to get DeepSpeed's default")
            return
        kind = spec.kind
        if kind == "section":
            self.check_section(path, value, spec.section or "")
        elif kind == "lenient":
            self.check_lenient(path, value, spec.section or "")
        elif kind == "bool":
            self.check_bool(path, value)
        elif kind in ("int", "float"):
            self.check_number(path, value, spec)
        elif kind == "str":
            if not isinstance(value, str):
                self.add("DS110", "error", path, f"`{dotted(path)}` must be a string, not {json_type(value)} "
                         f"{show(value)}", "quote it")
        elif kind == "path":
            if not isinstance(value, str):
                self.add("DS110", "error", path, f"`{dotted(path)}` must be a directory path (a string)",
                         "write the path in quotes")
            elif value.strip() == "":
                self.add("DS113", "warning", path, f"`{dotted(path)}` is empty: DeepSpeed reads it as the current "
                         "directory", "set a directory on a fast local disk")
        elif kind == "list":
            if not isinstance(value, list):
                self.add("DS110", "error", path, f"`{dotted(path)}` must be a list, not {json_type(value)}")
        elif kind == "dict":
            if not isinstance(value, dict):
                self.add("DS110", "error", path, f"`{dotted(path)}` must be an object, not {json_type(value)}: "
                         "DeepSpeed crashes reading it")
        elif kind == "enum":
            self.check_enum(path, value, spec)
        elif kind == "pyobject":
            self.add("DS110", "error", path, f"`{dotted(path)}` takes a Python object (a torch.dtype), which JSON "
                     f"cannot hold: DeepSpeed refuses {show(value)}", "delete it")

    def check_section(self, path: tuple, value: Any, section: str) -> None:
        fields = SECTIONS[section]
        if path == ("zero_optimization",) and isinstance(value, bool):
            if self.hf:
                self.add("DS110", "error", path, '`"zero_optimization": true/false` is DeepSpeed\'s deprecated form; '
                         "HF and accelerate expect an object and crash on it (`'bool' object has no attribute 'get'`)",
                         'write {"stage": 1} (true) or {"stage": 0} (false)')
            else:
                self.add("DS138", "warning", path, '`"zero_optimization": true/false` is deprecated (DeepSpeed reads '
                         "it as stage 1 or 0)", 'write {"stage": 1} or {"stage": 0}')
            return
        if not isinstance(value, dict):
            self.add("DS110", "error", path, f"`{dotted(path)}` must be an object, not {json_type(value)}: "
                     "DeepSpeed crashes reading it", section_example(section))
            return
        shown = SECTION_WORDS.get(section, f"`{dotted(path)}`")
        for key, item in value.items():
            child = path + (key,)
            if section == "zero_optimization" and key in REMOVED_ZERO:
                self.add("DS102", "error", child, f"`{dotted(child)}` configures {REMOVED_ZERO[key]}, which DeepSpeed "
                         "has removed: DeepSpeed refuses a config that still has it", "delete it")
                continue
            spec = fields.get(key)
            if spec is None:
                self.unknown(child, item, [k for k in fields if k not in ZERO_FIELD_NAMES], strict=True, section=shown)
                continue
            if spec.deprecated:
                self.deprecated_field(value, child, spec)
            if item == "auto":
                continue
            if section == "zero_optimization" and key == "stage":
                self.check_stage(child, item)
                continue
            self.check_value(child, item, spec)
        if section == "zero_optimization":
            for name, alias in ZERO_FIELD_NAMES.items():
                if name in value and alias in value:
                    self.add("DS103", "error", path + (name,), f"`{alias}` is given twice, also as `{name}`: "
                             f"DeepSpeed refuses `{name}` as an unknown key", f"delete `{name}`")

    def deprecated_field(self, block: dict, path: tuple, spec: Field) -> None:
        replacement = spec.deprecated or ""
        direct = replacement.split(" ")[0].split(".")[0]
        if direct in block:
            self.add("DS138", "error", path, f"`{dotted(path)}` is the deprecated form of `{direct}`, and both are "
                     "given: DeepSpeed refuses the pair", f"delete `{path[-1]}`")
        else:
            self.add("DS138", "warning", path, f"`{dotted(path)}` is deprecated", f"use `{replacement}`")

    def check_lenient(self, path: tuple, value: Any, section: str) -> None:
        fields = LENIENT[section]
        if not isinstance(value, dict):
            self.add("DS110", "error", path, f"`{dotted(path)}` must be an object, not {json_type(value)}: "
                     "DeepSpeed crashes reading it")
            return
        for key, item in value.items():
            child = path + (key,)
            spec = fields.get(key)
            if spec is None:
                if section in ("optimizer", "scheduler") and key in ("lr", "betas", "eps", "weight_decay",
                                                                     "warmup_num_steps", "total_num_steps"):
                    self.add("DS105", "error", child, f"`{dotted(child)}` belongs inside `{section}.params`: "
                             "DeepSpeed ignores it here", f"move it into `{section}.params`")
                else:
                    self.unknown(child, item, list(fields), strict=False)
                continue
            if item == "auto":
                continue
            if section == "checkpoint" and key == "tag_validation":
                self.check_tag_validation(child, item)
            elif section in ("data_types", "torch_autocast") and spec.kind == "enum":
                self.check_dtype(child, item)
            elif section == "parallel_write" and key == "pipeline_stage":
                if item not in (True, False):  # DeepSpeed: `in [True, False]` (so 0/1 pass too)
                    self.add("DS110", "error", child, "`checkpoint.parallel_write.pipeline_stage` must be true or "
                             "false: DeepSpeed refuses anything else", "write true or false")
            else:
                self.check_value(child, item, spec)

    def check_bool(self, path: tuple, value: Any) -> None:
        if isinstance(value, bool):
            return
        shown = dotted(path)
        if isinstance(value, str) and value.strip().lower() in BOOL_STRINGS:
            read_by_hf = path[-1] == "enabled" and path[0] in ("fp16", "bf16", "bfloat16")
            if read_by_hf:
                self.add("DS110", "error", path, f"`{shown}` is the string {show(value)}: DeepSpeed converts it, but "
                         "HF and accelerate test it with Python truthiness (so \"false\" counts as enabled)",
                         f"write {str(value.strip().lower() in TRUE_STRINGS).lower()} without quotes")
            elif read_by_pydantic(path):
                self.add("DS113", "warning", path, f"`{shown}` is the string {show(value)}; DeepSpeed converts it",
                         f"write {str(value.strip().lower() in TRUE_STRINGS).lower()} without quotes")
            else:
                # dict.get readers (top-level keys, lenient sections) keep the string: "false" is truthy
                self.add("DS110", "error", path, f"`{shown}` is the string {show(value)}: DeepSpeed keeps it as a "
                         "string, and any non-empty string counts as true", f"write {str(value.strip().lower() in TRUE_STRINGS).lower()} without quotes")
            return
        if isinstance(value, (int, float)) and value in (0, 1):
            self.add("DS113", "warning", path, f"`{shown}` is the number {show(value)}; DeepSpeed reads it as "
                     f"{str(bool(value)).lower()}", f"write {str(bool(value)).lower()}")
            return
        self.add("DS110", "error", path, f"`{shown}` must be true or false, not {json_type(value)} {show(value)}",
                 "write true or false")

    def check_number(self, path: tuple, value: Any, spec: Field) -> None:
        shown = dotted(path)
        want = "an integer" if spec.kind == "int" else "a number"
        strict_reader = read_by_pydantic(path)  # pydantic converts strings; dict.get readers keep them
        number: Any = None
        if isinstance(value, bool):
            self.add("DS110", "error", path, f"`{shown}` must be {want}, not {str(value).lower()}",
                     f"write {want[2:] if want.startswith('a ') else want}")
            return
        if isinstance(value, (int, float)):
            if isinstance(value, float) and not math.isfinite(value) and path != ("steps_per_print",):
                self.add("DS111", "error", path, f"`{shown}` is {value}: DeepSpeed needs a finite number")
                return
            number = value
        elif isinstance(value, str) and strict_reader and pydantic_number(value, spec.kind) is not None:
            number = pydantic_number(value, spec.kind)
            self.add("DS113", "warning", path, f"`{shown}` is the string {show(value)}; DeepSpeed converts it",
                     "write the number without quotes")
        else:
            self.add("DS110", "error", path, f"`{shown}` must be {want}, not {json_type(value)} {show(value)}"
                     + ("" if strict_reader else ": DeepSpeed does arithmetic with it and crashes"),
                     "write the number without quotes" if isinstance(value, str) else None)
            return
        if spec.kind == "int" and isinstance(number, float) and math.isfinite(number) and not number.is_integer():
            self.add("DS110", "error", path, f"`{shown}` must be a whole number, not {show(value)}",
                     f"use {math.floor(number)} or {math.ceil(number)}")
            return
        bound = violated_bound(number, spec)
        if bound:
            self.add("DS111", "error", path, f"`{shown}` is {show(value)}, DeepSpeed needs a value {bound}",
                     f"use a value {bound}, or delete the key for DeepSpeed's default")

    def check_enum(self, path: tuple, value: Any, spec: Field) -> None:
        shown = dotted(path)
        choices = spec.choices
        if path[-1] in ("communication_data_type", "seq_parallel_communication_data_type", "gradient_allreduce_op"):
            if not isinstance(value, str):
                self.add("DS110", "error", path, f"`{shown}` must be a string, one of {', '.join(map(str, choices))}: "
                         "DeepSpeed crashes on anything else")
            elif value.lower() not in choices:
                self.add("DS112", "error", path, f"`{shown}` is {show(value)}, DeepSpeed accepts "
                         f"{', '.join(map(str, choices))}", did_you_mean(value, list(choices)))
            return
        if value in choices and not isinstance(value, bool):
            return
        suggestion = did_you_mean(str(value), [str(c) for c in choices])
        if isinstance(value, str) and value.lower() in choices:
            suggestion = f"write {show(value.lower())}"
        self.add("DS112", "error", path, f"`{shown}` is {show(value)}, DeepSpeed accepts "
                 f"{', '.join(show(c) for c in choices)}", suggestion)

    def check_stage(self, path: tuple, value: Any) -> None:
        if isinstance(value, int) and not isinstance(value, bool):
            if value not in (0, 1, 2, 3):
                self.add("DS112", "error", path, f"ZeRO stage {value} does not exist: DeepSpeed accepts 0, 1, 2, 3",
                         "use 3 for the most memory savings")
            return
        stage = as_int(value, allow_bool=True)
        if stage not in (0, 1, 2, 3):
            self.add("DS112", "error", path, f"`zero_optimization.stage` is {show(value)}: DeepSpeed accepts 0, 1, 2, 3",
                     "write the stage as a number, e.g. 2")
            return
        if isinstance(value, float):
            self.add("DS113", "warning", path, f"the ZeRO stage is the float {value}", f"write {stage}")
            return
        if isinstance(value, bool):
            why = f"DeepSpeed reads {str(value).lower()} as stage {stage}, HF's stage checks see no ZeRO-2/3"
        elif self.hf:
            why = (f"DeepSpeed converts it to stage {stage}, but HF compares the raw value with the number "
                   f"{stage}" + (": `is_deepspeed_zero3_enabled()` is false, so the model is loaded whole on every "
                                  "GPU instead of being partitioned while it loads (zero.Init), and ZeRO-3's "
                                  "\"auto\" bucket sizes are not filled by HF" if stage == 3 else ""))
        else:
            self.add("DS113", "warning", path, f"the ZeRO stage is the string {show(value)}; DeepSpeed converts it",
                     f"write {stage} without quotes")
            return
        self.add("DS115", "error", path, f"`zero_optimization.stage` is {show(value)}, not an integer: {why}",
                 f"write {stage}" + (" without quotes" if isinstance(value, str) else ""))

    def check_dtype(self, path: tuple, value: Any) -> None:
        if path[-1] == "keep_in_fp32_modules":
            return
        if not isinstance(value, str) or value not in DTYPE_NAMES:
            self.add("DS112", "error", path, f"`{dotted(path)}` is {show(value)}, not a dtype DeepSpeed knows",
                     did_you_mean(str(value), ["bf16", "fp16", "fp32"]) or "use bf16, fp16 or fp32")

    def check_tag_validation(self, path: tuple, value: Any) -> None:
        if not isinstance(value, str):
            self.add("DS110", "error", path, "`checkpoint.tag_validation` must be a string: DeepSpeed calls .upper() "
                     "on it and crashes", 'use "Warn", "Ignore" or "Fail"')
        elif value.upper() not in ("WARN", "IGNORE", "FAIL"):
            self.add("DS112", "error", path, f"`checkpoint.tag_validation` is {show(value)}: DeepSpeed accepts "
                     "Warn, Ignore, Fail", did_you_mean(value.upper(), ["WARN", "IGNORE", "FAIL"])
                     or 'use "Fail" to refuse checkpoints whose tags differ across ranks')
