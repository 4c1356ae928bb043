"""MergeError: what merge and convert (and the commands that read their inputs: chat, eval, export) raise for
a problem with their inputs or the environment. Imports nothing heavy, so the CLI can catch it without torch."""

from __future__ import annotations

from finetune.errors import FinetuneError


class MergeError(FinetuneError):
    """A problem with the inputs or the environment, worded for the user (no traceback)."""
