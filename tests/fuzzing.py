"""How many examples each fuzz test draws: a fifth in CI, the full count with FINETUNE_FUZZ=full.

    FINETUNE_FUZZ=full python -m pytest tests/test_lint_fuzz.py tests/test_cli_fuzz.py   # the full counts

The examples are derandomized, so a CI run draws the first fifth of the full run's examples.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

FULL = os.environ.get("FINETUNE_FUZZ") == "full"


def fuzz(examples: int):
    """Hypothesis settings for a test whose full count is `examples`."""
    count = examples if FULL else max(examples // 5, 10)
    return settings(max_examples=count, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
