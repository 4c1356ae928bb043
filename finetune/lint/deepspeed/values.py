"""Value parsing and message-formatting helpers shared by the DeepSpeed config checks."""

from __future__ import annotations

import math
from typing import Any, Iterator, Optional

from finetune.lint.deepspeed.schema import COMMON_MISNAMES, PYDANTIC_TOP, TA_DEFAULTS, Field
from finetune.suggest import NEAR, closest


BOOL_STRINGS = {"0", "off", "f", "false", "n", "no", "1", "on", "t", "true", "y", "yes"}
TRUE_STRINGS = {"1", "on", "t", "true", "y", "yes"}


class _Unknown:
    """A value that depends on something lint does not know (an unfilled "auto", a bad type)."""

    def __repr__(self) -> str:
        return "<unknown>"


UNKNOWN = _Unknown()
MISSING = object()


# ----------------------------------------------------------------------------------------------
# Helpers


KIND_WORDS = {"bool": "true or false", "int": "an integer", "float": "a number", "str": "a string",
               "path": "a directory path", "list": "a list", "dict": "an object", "enum": "one of its choices",
               "section": "an object", "lenient": "an object", "pyobject": "a Python object"}
SECTION_WORDS = {"zero_optimization": "ZeRO", "offload_param": "offload_param", "offload_optimizer": "offload_optimizer",
                  "fp16": "fp16", "bf16": "bf16", "bfloat16": "bf16"}


def with_ta_defaults(args: dict) -> dict:
    merged = dict(TA_DEFAULTS)
    merged.update({k: v for k, v in dict(args).items() if v is not None or k not in TA_DEFAULTS})
    return merged


def hf_warmup_steps(warmup: Any, steps: int) -> Optional[int]:
    """TrainingArguments.get_warmup_steps: >= 1 is a step count, below 1 a ratio of the total."""
    if isinstance(warmup, bool) or not isinstance(warmup, (int, float)):
        return None
    return int(warmup) if warmup >= 1 else math.ceil(steps * warmup)


def auto_leaves(node: Any, path: tuple, in_list: bool = False) -> Iterator[tuple[tuple, bool]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield from auto_leaves(value, path + (key,), False)
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from auto_leaves(value, path + (index,), True)
    elif node == "auto":
        yield path, in_list


def as_int(value: Any, allow_bool: bool = False) -> Optional[int]:
    """The integer pydantic/DeepSpeed arithmetic would get from `value`, or None."""
    if isinstance(value, bool):
        return int(value) if allow_bool else None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if math.isfinite(value) and value.is_integer() else None
    if isinstance(value, str):
        number = parse_number(value)
        if number is not None and math.isfinite(number) and float(number).is_integer():
            return int(number)
    return None


def as_bool(value: Any) -> Optional[bool]:
    """pydantic's lax bool: true/false, 0/1, and the usual strings; None when it would refuse."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in BOOL_STRINGS:
        return value.strip().lower() in TRUE_STRINGS
    return None


def parse_number(text: str) -> Optional[float]:
    try:
        number = float(text.strip())
    except (ValueError, AttributeError):
        return None
    return int(number) if number.is_integer() and "e" not in text.lower() and "." not in text else number


def read_by_pydantic(path: tuple) -> bool:
    """Whether DeepSpeed reads `path` through a pydantic model (lax conversion, "auto" dropped)."""
    return path[0] in PYDANTIC_TOP or tuple(path[:2]) == ("timers", "throughput")


def pydantic_number(text: str, kind: str) -> Optional[float]:
    """The number pydantic's lax mode makes of a string: ints accept "12" and "2.0" but not "5e8"."""
    number = parse_number(text)
    if number is None or kind != "int":
        return number
    stripped = text.strip().lstrip("+-")
    digits, _, fraction = stripped.partition(".")
    if digits.isdigit() and (not fraction or set(fraction) == {"0"}):
        return int(number)
    return None


def violated_bound(number: Any, spec: Field) -> Optional[str]:
    if spec.gt is not None and not number > spec.gt:
        return f"> {_num(spec.gt)}"
    if spec.ge is not None and not number >= spec.ge:
        return f">= {_num(spec.ge)}"
    if spec.lt is not None and not number < spec.lt:
        return f"< {_num(spec.lt)}"
    if spec.le is not None and not number <= spec.le:
        return f"<= {_num(spec.le)}"
    return None


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def suggest(name: str, candidates: list, case_insensitive: bool = False) -> Optional[str]:
    """The closest real key (finetune.suggest), or a known confusion (micro_batch_size -> train_micro_...)."""
    if name in COMMON_MISNAMES and COMMON_MISNAMES[name] != name:
        target = COMMON_MISNAMES[name]
        if target.split(".")[0] in candidates or " " in target:
            return target
    words = [str(c) for c in candidates]
    if case_insensitive:
        return closest(name, words, cutoff=NEAR, ignore_case=True)
    match = closest(name, words, cutoff=NEAR)
    if match is None:  # a prefix/suffix slip such as `stage3_` on a key that has none
        stripped = name[7:] if name.startswith("stage3_") else f"stage3_{name}"
        match = stripped if stripped in words else None
    return match


def did_you_mean(value: str, choices: list) -> Optional[str]:
    match = closest(str(value).lower(), [str(c).lower() for c in choices])
    return f"did you mean {show(match)}?" if match else None


def dotted(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "list"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def show(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, str):
        return '"' + (value if len(value) <= 40 else value[:37] + "...") + '"'
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def section_example(section: str) -> Optional[str]:
    return {"zero_optimization": 'e.g. "zero_optimization": {"stage": 2}', "fp16": 'e.g. "fp16": {"enabled": true}',
            "bf16": 'e.g. "bf16": {"enabled": true}'}.get(section)


def batch_fix(hf: bool) -> str:
    if hf:
        return 'set train_batch_size, train_micro_batch_size_per_gpu and gradient_accumulation_steps to "auto"'
    return "make train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size"
