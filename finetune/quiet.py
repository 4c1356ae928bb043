"""Library messages that say nothing a user can act on, kept off the screen (issue 24: every line on
screen is worth reading). Standard library only: installed before torch or transformers is imported.

- bitsandbytes (>= 0.48, CPU with AVX512-BF16) logs "Failed to load CPU gemm_4bit_forward from
  kernels-community ... pip install kernels" at import, on every command that imports transformers once
  the qlora extra is installed: its CPU 4-bit path then runs without that optional kernel
  (bitsandbytes/backends/cpu/ops.py sets gemm_4bit_forward_kernel = None and carries on).
- datasets' "Generating train split" bars when `eval` reads a file: the command's own lines say what
  it reads.
"""

from __future__ import annotations

import logging
import os

BNB_CPU_OPS_LOGGER = "bitsandbytes.backends.cpu.ops"


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def install() -> None:
    """Idempotent; the loggers exist before their modules are imported, so the filters are in place then."""
    logger = logging.getLogger(BNB_CPU_OPS_LOGGER)
    if not any(isinstance(f, _DropMessage) for f in logger.filters):
        logger.addFilter(_DropMessage("Failed to load CPU gemm_4bit_forward"))


def no_progress_bars() -> None:
    """For commands whose output is a table or a conversation (eval, chat): datasets reads this at import."""
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
