"""The DeepSpeed rules' engine: a read-only view of the config, what earlier rules reported, ordered phases.

A rule is a function registered with `@rule(phase)`; it reads the config through a ConfigView and yields
RawFindings. Phases run in PHASES order, and the rules of one phase in the order their module defines them
(each phase lives in one module). A rule may ask `seen` what earlier rules (or earlier yields of its own)
reported, so that one mistake gives one finding: a key already judged is "claimed".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

from finetune.lint.deepspeed.context import DSContext, RawFinding
from finetune.lint.deepspeed.values import MISSING, UNKNOWN, as_bool, as_int, hf_warmup_steps, with_ta_defaults
from finetune.render import offload_device

# structure.py: duplicates, structure; setup.py: trainer .. zero, misc; optimizer.py: optimizer, scheduler;
# auto.py: auto (last: it reports only the "auto" values nothing before has judged).
PHASES = ("duplicates", "structure", "trainer", "batch", "precision", "zero", "optimizer", "scheduler", "misc", "auto")


@dataclass(frozen=True)
class ConfigView:
    """The config and the context it is judged in; rules read it, nothing writes it."""

    config: dict
    ctx: DSContext
    hf: bool  # through the HF Trainer + accelerate ("auto" gets filled)
    ta: Optional[dict]  # TrainingArguments with HF's defaults, when known and used through HF
    stage: Optional[int]  # the ZeRO stage DeepSpeed will run, or None when the value is invalid

    @classmethod
    def of(cls, config: dict, ctx: DSContext) -> "ConfigView":
        hf = ctx.hf_integration
        ta = with_ta_defaults(ctx.training_args) if (ctx.training_args is not None and hf) else None
        return cls(config, ctx, hf, ta, _effective_stage(config, hf))

    def get(self, *path: Any, node: Any = MISSING) -> Any:
        node = self.config if node is MISSING else node
        for part in path:
            if not isinstance(node, dict) or part not in node:
                return MISSING
            node = node[part]
        return node

    def zero(self) -> dict:
        zero = self.config.get("zero_optimization")
        return zero if isinstance(zero, dict) else {}

    def device(self, block: str) -> Optional[str]:
        """Effective offload device of zero_optimization.<block>: none, cpu, nvme, or None if invalid."""
        return offload_device(self.config, block)

    def enabled(self, section: str) -> Any:
        """Whether fp16/bf16 ends up enabled: True, False or UNKNOWN."""
        block = self.config.get(section, MISSING)
        if section == "bf16" and block is MISSING and not self.hf:
            block = self.config.get("bfloat16", MISSING)  # DeepSpeed's legacy spelling
        if block is MISSING or (isinstance(block, dict) and "enabled" not in block):
            if self.hf and block is MISSING:
                # accelerate's set_mixed_precision adds the block from TrainingArguments
                return UNKNOWN if self.ta is None else bool(self.ta[section])
            return False
        if not isinstance(block, dict):
            return UNKNOWN
        value = block["enabled"]
        if value == "auto":
            if not self.hf:
                return False  # dropped by DeepSpeed -> disabled
            return UNKNOWN if self.ta is None else bool(self.ta[section] or self.ta[f"{section}_full_eval"])
        coerced = as_bool(value)
        return UNKNOWN if coerced is None else coerced

    def resolved(self, path: tuple) -> Any:
        """A value after HF's fill (when TrainingArguments are known): MISSING, UNKNOWN or the value."""
        value = self.get(*path)
        if value != "auto":
            return value
        if not self.hf or self.ta is None:
            return UNKNOWN
        return self.hf_expected().get(path, (UNKNOWN, ""))[0]

    def hf_expected(self) -> dict[tuple, tuple[Any, str]]:
        """What HF's trainer_config_process/finalize fill "auto" with and compare concrete values against:
        key path -> (value, the TrainingArguments name HF shows in its mismatch message)."""
        ta, world = self.ta, self.ctx.world_size
        assert ta is not None
        expected: dict[tuple, tuple[Any, str]] = {
            ("train_micro_batch_size_per_gpu",): (ta["per_device_train_batch_size"], "per_device_train_batch_size"),
            ("gradient_accumulation_steps",): (ta["gradient_accumulation_steps"], "gradient_accumulation_steps"),
            ("gradient_clipping",): (ta["max_grad_norm"], "max_grad_norm"),
            ("optimizer", "params", "lr"): (ta["learning_rate"], "learning_rate"),
            ("optimizer", "params", "betas"): ([ta["adam_beta1"], ta["adam_beta2"]], "adam_beta1+adam_beta2"),
            ("optimizer", "params", "eps"): (ta["adam_epsilon"], "adam_epsilon"),
            ("optimizer", "params", "weight_decay"): (ta["weight_decay"], "weight_decay"),
            ("scheduler", "params", "warmup_max_lr"): (ta["learning_rate"], "learning_rate"),
            ("fp16", "enabled"): (bool(ta["fp16"] or ta["fp16_full_eval"]), "fp16|fp16_full_eval"),
            ("bf16", "enabled"): (bool(ta["bf16"] or ta["bf16_full_eval"]), "bf16|bf16_full_eval"),
        }
        micro, gas = as_int(ta["per_device_train_batch_size"]), as_int(ta["gradient_accumulation_steps"])
        if world and micro is not None and gas is not None:
            expected[("train_batch_size",)] = (world * micro * gas, "train_batch_size (calculated)")
        steps = as_int(ta["max_steps"])
        if steps is not None and steps > 0:  # the Trainer's num_training_steps is max_steps when that is set
            expected[("scheduler", "params", "total_num_steps")] = (steps, "num_training_steps (calculated)")
            warmup = hf_warmup_steps(ta["warmup_steps"], steps)
            if warmup is not None:  # HF keeps it >= 1: deepspeed >= 0.19.6 refuses 0
                expected[("scheduler", "params", "warmup_num_steps")] = (max(1, warmup), "warmup_steps")
        return expected


def _effective_stage(config: dict, hf: bool) -> Optional[int]:
    zero = config.get("zero_optimization", MISSING)
    if zero is MISSING or zero is None:
        return 0
    if isinstance(zero, bool):  # the deprecated `"zero_optimization": true` means stage 1
        return int(zero)
    if not isinstance(zero, dict):
        return None
    raw = zero.get("stage", 0)
    if raw == "auto":
        return 2 if hf else 0  # accelerate's default; raw DeepSpeed drops "auto" -> 0
    value = as_int(raw, allow_bool=True)
    return value if value in (0, 1, 2, 3) else None


class Seen:
    """What the rules have reported so far. Rules only ask; the engine records each finding as it is yielded."""

    def __init__(self) -> None:
        self.findings: list[RawFinding] = []
        self._claimed: set[tuple] = set()
        self._unknown: set[tuple] = set()

    def record(self, finding: RawFinding) -> None:
        self.findings.append(finding)
        if finding.rule != "DS101":  # a duplicate is about the key written twice, not the value that was kept
            self._claimed.add(finding.key)
        if finding.unknown_key:
            self._unknown.add(finding.key)

    def claimed(self, path: tuple) -> bool:
        """Whether a finding already points at exactly this key (so a later rule stays quiet about it)."""
        return tuple(path) in self._claimed

    def below_unknown(self, path: tuple) -> bool:
        """Whether the key sits under a key that is not a DeepSpeed setting (nothing there is judged twice)."""
        return any(path[:n] in self._unknown for n in range(1, len(path)))

    def has(self, rule: str, severity: Optional[str] = None, keys: Optional[Iterable[tuple]] = None) -> bool:
        wanted = None if keys is None else set(keys)
        return any(f.rule == rule and (severity is None or f.severity == severity)
                   and (wanted is None or f.key in wanted) for f in self.findings)


Rule = Callable[[ConfigView, Seen], Iterator[RawFinding]]
_RULES: dict[str, list[Rule]] = {phase: [] for phase in PHASES}


def rule(phase: str) -> Callable[[Rule], Rule]:
    def register(fn: Rule) -> Rule:
        _RULES[phase].append(fn)
        return fn
    return register


def run(config: dict, ctx: DSContext) -> list[RawFinding]:
    view, seen = ConfigView.of(config, ctx), Seen()
    for phase in PHASES:
        for fn in _RULES[phase]:
            for finding in fn(view, seen):
                seen.record(finding)
    return seen.findings
