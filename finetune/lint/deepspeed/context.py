"""What the DeepSpeed config checks take and give: the context they judge a config in, and their raw findings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class DSContext:
    world_size: Optional[int] = None  # --world-size or the recipe's; None = unknown
    training_args: Optional[dict] = None  # TrainingArguments kwargs when a recipe is given (render_training_args)
    hf_integration: bool = True  # used through HF Trainer (auto values get filled); False = raw deepspeed.initialize
    from_recipe: bool = False  # config was rendered by finetune from a recipe
    duplicates: list = field(default_factory=list)  # [(key path, line, col)] duplicate keys found by the loader


@dataclass
class RawFinding:
    rule: str  # stable id, e.g. "DS110"
    severity: str  # "error" | "warning" | "info"
    key: tuple  # key path in the config; () for the whole file
    message: str
    fix: Optional[str] = None
    # The key itself is not a DeepSpeed setting: later rules judge nothing below it. Not part of the
    # finding's identity (equality, repr), only a note from the structure rules to the "auto" rules.
    unknown_key: bool = field(default=False, compare=False, repr=False)
