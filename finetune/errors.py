"""The one base of finetune's own errors: a problem worded for the user, and the exit code it ends a command with.

Every module raises a subclass (RecipeProblem, PlanError, DataError, MergeError, ...); the CLI maps them in
one place (finetune.cli.common.handled): the lines of `lines()` on stderr, exit `exit_code`, no traceback.
"""

from __future__ import annotations

from typing import Optional


class FinetuneError(Exception):
    """A problem the user can fix; its message names the file, key or option and says what to do."""

    exit_code = 1  # 2 for usage errors (a subclass or the raiser says so)

    def __init__(self, *args: object, exit_code: Optional[int] = None):
        super().__init__(*args)
        if exit_code is not None:
            self.exit_code = exit_code

    def lines(self) -> list[str]:
        """What the user reads on stderr."""
        return [f"error: {self}"]
