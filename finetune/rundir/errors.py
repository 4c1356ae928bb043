"""The error a run directory's readers raise: a file missing, or one that cannot be read (the message names it).
The run directory's other errors (finetune.rundir.run_dir.NotARunDir, finetune.rundir.adapter.NotAnAdapter,
NoBaseModel) are kinds of it, so a command catches one type."""

from __future__ import annotations

from finetune.errors import FinetuneError


class RunDirError(FinetuneError):
    """A run directory is missing a file, or holds one that cannot be read (the message names the file)."""
