"""A tokenized cache entry is checked before it is trusted (issue 34 item 6).

A truncated, garbage or bit-flipped Arrow file in the cache was "found in the cache" by the launcher and by
`finetune prepare` ("already there"); rank 0 then died on it (SIGSEGV for garbage: Arrow trusts the offsets
it maps), and every rerun the same way. So the manifest, written last when the entry is made, also records
every file's size and xxh3-64 digest (xxhash: datasets' own dependency, 5.7 GiB/s on one core of the
development box, where blake2b does 0.25 and sha256 0.42). Before an entry is used:

- `finetune prepare` and the launcher read every file against the manifest (sizes, then digests); an entry
  that differs is set aside as `.KEY.damaged` (one line naming it) and tokenized again;
- each rank compares the sizes only (the launcher has just read the bytes), so a file cut short after the
  launch is an error naming the entry, not a crash.

What it costs (scripts/bench_cache_check.py, 100,000 alpaca rows, max_length 512, on the shared 2-core box under
load): a 279 MB entry tokenized in 202 s was checked in 0.11 s with its files in the page cache (2.4 GiB/s) and
2.6 s from a cold disk (this disk reads ~110 MB/s; the ranks read the same pages anyway, and now find them
cached); the ranks' size check took 0.2 ms. A 1M-row entry (~2.8 GB) is about ten times that.
"""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path
from typing import Any, Optional

from finetune.fsutil import damaged_name, remove_path

_CHUNK = 64 * 2**20


def file_digest(path: Path) -> str:
    """xxh3-64 of the file's bytes, read through a memory map (no copy)."""
    import xxhash

    digest = xxhash.xxh3_64()
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size:
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                view = memoryview(mapped)
                try:
                    for start in range(0, size, _CHUNK):
                        digest.update(view[start:start + _CHUNK])
                finally:
                    view.release()
    return digest.hexdigest()


def seal(folder: Path, names: list[str]) -> dict[str, Any]:
    """What the manifest records of the files `names` in `folder`: {"sizes": ..., "xxh3": ...}."""
    folder = Path(folder)
    return {"sizes": {name: (folder / name).stat().st_size for name in names},
            "xxh3": {name: file_digest(folder / name) for name in names}}


def read_manifest(target: Path, manifest_name: str) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """(the manifest, None) or (None, why it is unusable)."""
    try:
        manifest = json.loads((Path(target) / manifest_name).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return None, f"{manifest_name} unreadable ({exc})"
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), list) or not manifest["files"] \
            or not isinstance(manifest.get("sizes"), dict) or not isinstance(manifest.get("xxh3"), dict):
        return None, f"{manifest_name} does not describe an entry (files, sizes, xxh3)"
    names = [*manifest["files"], *([manifest["order"]] if manifest.get("order") else [])]
    for name in names:
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            return None, f"{manifest_name} names {str(name)[:80]!r}, not a file of the entry"
        if name not in manifest["sizes"] or name not in manifest["xxh3"]:
            return None, f"{manifest_name} has no size or digest for {name}"
    return manifest, None


def identity(target: Path, manifest_name: str) -> Optional[tuple[int, int, int]]:
    """Which manifest is at `target` now (device, inode, mtime): an entry made again since has another."""
    try:
        stat = (Path(target) / manifest_name).stat()
    except OSError:
        return None
    return stat.st_dev, stat.st_ino, stat.st_mtime_ns


# Verdicts with digests, per entry as it was judged: the launcher asks twice (where to tokenize, then prepare).
_judged: dict[tuple[str, Optional[tuple[int, int, int]]], Optional[str]] = {}


def problem(target: Path, manifest_name: str, digests: bool = True) -> Optional[str]:
    """Why the entry at `target` cannot be used, or None: its manifest, every file it lists (sizes; with
    `digests`, their bytes)."""
    key = (str(target), identity(target, manifest_name))
    if digests and key in _judged:
        return _judged[key]
    found = _problem(target, manifest_name, digests)
    if digests:
        _judged[key] = found
    return found


def _problem(target: Path, manifest_name: str, digests: bool) -> Optional[str]:
    manifest, why = read_manifest(target, manifest_name)
    if manifest is None:
        return why
    for name, size in manifest["sizes"].items():
        path = Path(target) / str(name)
        try:
            if path.is_symlink() or not path.is_file():
                return f"{name} is missing"
            actual = path.stat().st_size
        except OSError as exc:
            return f"{name}: {exc.strerror or exc}"
        if actual != size:
            return f"{name} has {actual} bytes, the manifest says {size}"
    if digests:
        for name, expected in manifest["xxh3"].items():
            try:
                if file_digest(Path(target) / str(name)) != expected:
                    return f"{name} does not hold the bytes it was written with (xxh3 differs)"
            except OSError as exc:
                return f"{name}: {exc.strerror or exc}"
    return None


def set_aside(target: Path, manifest_name: str, judged: Optional[tuple[int, int, int]]) -> Path:
    """Move a damaged entry out of the way (kept once, hidden, for a look); the next prepare makes it again.

    `judged`: identity() of the entry found damaged. Another process sharing the cache may have set it aside
    and made it again since: that entry is left alone."""
    aside = damaged_name(Path(target))
    if identity(target, manifest_name) != judged:
        return aside
    remove_path(aside)
    try:
        os.replace(target, aside)
    except FileNotFoundError:
        pass  # set aside by another process meanwhile
    return aside
