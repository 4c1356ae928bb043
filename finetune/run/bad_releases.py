"""DeepSpeed releases that broke training, by version range and the setups they break (issue 24 item 8).

Each row names the upstream issue; the range comes from the DeepSpeed sources and the issue threads:
- #7116 (OOM with gradient checkpointing under ZeRO-3): reported from 0.16.4; the cause, #6726, was
  rolled back by #7258, first released in v0.16.8.
- #7203 ('Linear' object has no attribute 'ds_grads_remaining' under ZeRO-3): reported on 0.16.5, the
  release that moved ZeRO-3's backward hooks (#7062); the reporter's 0.16.4 and 0.15.0 run.
- #7615 (the same AttributeError on 0.17.6 when a LoRA adapter trains `modules_to_save`): the guards
  proposed for it (commits 7380eb94, 06f9b0f2) are not on DeepSpeed's master as of 2026-08-22, so no
  release is known to fix it: a warning, not a refusal.
- #7718 and #7749 (wrong ZeRO-2 gradients, a grad norm 2-3x too low, from 0.17.6): fixed in 0.18.3
  (the reporters' and TRL's maintainers' finding, huggingface/trl#4540).
`finetune doctor` warns about a matching installed release on the machine as a whole; `finetune train`
refuses a recipe that uses the broken setup (severity "fail"), or warns ("warn").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    from finetune.recipe import Recipe


@dataclass(frozen=True)
class BadRelease:
    versions: str  # a PEP 440 specifier of the broken releases
    issue: str  # where the breakage is reported
    what: str  # what goes wrong, as the user would see it
    setup: str  # the setup it breaks, in recipe words
    uses: Callable[["Recipe"], bool]  # whether a recipe uses that setup
    good: Optional[str]  # a specifier that leaves the range for a release not reported broken (None: none known)
    severity: str = "fail"  # for a recipe that uses the setup
    avoid: str = ""  # the recipe change that sidesteps it

    @property
    def fix(self) -> str:
        install = f"pip install -U 'deepspeed{self.good}'" if self.good else "no fixed release is known"
        return f"{install}, or {self.avoid}" if self.avoid else install


def _zero(recipe: "Recipe", stage: int) -> bool:
    """The recipe trains through DeepSpeed's engine at ZeRO `stage`. A recipe without the engine (deepspeed.enabled
    false, or `auto` decided so: finetune.plan.auto) keeps its stage unused, and no DeepSpeed release breaks it."""
    return recipe.deepspeed.enabled is not False and recipe.deepspeed.stage == stage


def _zero3(recipe: "Recipe") -> bool:
    return _zero(recipe, 3)


BAD_DEEPSPEED: tuple[BadRelease, ...] = (
    BadRelease(">=0.16.4,<0.16.8", "deepspeedai/DeepSpeed#7116", "runs out of memory with gradient checkpointing",
               "ZeRO-3 with training.gradient_checkpointing",
               lambda r: _zero3(r) and r.training.gradient_checkpointing, ">=0.16.8"),
    BadRelease("==0.16.5", "deepspeedai/DeepSpeed#7203", "crashes in backward: object has no attribute 'ds_grads_remaining'",
               "ZeRO-3", _zero3, "!=0.16.5"),
    BadRelease(">=0.16.5", "deepspeedai/DeepSpeed#7615", "crashes in backward ('ds_grads_remaining') when LoRA trains modules_to_save",
               "ZeRO-3 with lora.modules_to_save",
               lambda r: _zero3(r) and r.method != "full" and bool(r.lora.modules_to_save), None, severity="warn",
               avoid="train modules_to_save under deepspeed.stage 2, or drop lora.modules_to_save"),
    BadRelease(">=0.17.6,<0.18.3", "deepspeedai/DeepSpeed#7718, #7749", "computes wrong gradients (grad norm 2-3x too low)",
               "ZeRO-2", lambda r: _zero(r, 2), ">=0.18.3", avoid="set deepspeed.stage: 1 or 3"),
)


def matching(version: Optional[str], table: tuple[BadRelease, ...] = BAD_DEEPSPEED) -> list[BadRelease]:
    """The rows whose range holds `version` (none when DeepSpeed is not installed)."""
    from finetune.run.requirements import satisfies

    return [row for row in table if version is not None and satisfies(version, row.versions)]
