"""Byte counts as people read them: memory in GiB (2**30, what GPUs and `nvidia-smi` report), files in
decimal kB/MB/GB (what `ls -h --si` and download pages show). The one place a byte count becomes text."""

from __future__ import annotations

GiB = 2**30
MiB = 2**20


def gib(n: float, digits: int = 2) -> str:
    """The number of GiB, without the unit (plan tables print the unit once in the header)."""
    return f"{n / GiB:.{digits}f}"


def gib_text(n: float, digits: int = 2) -> str:
    """`1.50 GiB`."""
    return f"{gib(n, digits)} GiB"


def human_size(n: float) -> str:
    """A file size: `1.23 GB`, `45.6 MB` or `7.8 kB`."""
    if n >= 1e8:
        return f"{n / 1e9:.2f} GB"
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"
