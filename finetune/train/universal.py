"""Resuming on another process count: DeepSpeed's universal checkpoint.

A ZeRO checkpoint holds each rank's partition of the optimizer states (and, at stage 3, of the weights), cut
for the process count that wrote it; DeepSpeed cannot load it on another count. Its universal format stores
every parameter's fp32 weight and Adam moments whole (deepspeed/checkpoint/ds_to_universal.py), and an
engine with `checkpoint.load_universal: true` re-partitions them for whatever count it runs on
(DeepSpeedEngine.load_checkpoint reads the tag from `latest_universal`). So before the Trainer resumes:

    checkpoint-N/COMPLETE says world_size 2, this run has 1
    -> rank 0 runs ds_to_universal on checkpoint-N/global_stepN into checkpoint-N/global_stepN_universal
       (under a temporary name, renamed when complete), then writes checkpoint-N/latest_universal
    -> the DeepSpeed config gets checkpoint.load_universal: true

The rest of the checkpoint (trainer_state.json, the scheduler, rng_state_0.pth) is the Trainer's and does
not depend on the count (ranks without an RNG file of their own start from the seed, with a warning).
`finetune train` allows exactly this change (finetune.rundir.resume_key.process_count_change).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from finetune.errors import FinetuneError
from finetune.fsutil import remove_path, write_atomic

UNIVERSAL_SUFFIX = "_universal"
LATEST_UNIVERSAL = "latest_universal"  # the file DeepSpeed reads the tag from with load_universal


class UniversalCheckpointError(FinetuneError):
    """The checkpoint could not be converted (one line, no traceback)."""


def saved_world_size(checkpoint: Path) -> Optional[int]:
    """The process count that wrote `checkpoint` (its COMPLETE marker), or None when it does not say."""
    from finetune.rundir.checkpoint import MARKER

    try:
        value = json.loads((Path(checkpoint) / MARKER).read_text(encoding="utf-8")).get("world_size")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) else None


def deepspeed_tag(checkpoint: Path) -> str:
    """The DeepSpeed tag (global_stepN) inside a Trainer checkpoint, from DeepSpeed's `latest` file; refused when
    anything there leads out of the checkpoint (finetune.rundir.verify.links_outside: the conversion unpickles
    every shard and writes beside the tag)."""
    from finetune.rundir.verify import links_outside, read_tag

    checkpoint = Path(checkpoint)
    escape = links_outside(checkpoint)
    if escape:
        raise UniversalCheckpointError(f"{escape}; nothing is converted through a link that leaves the checkpoint")
    tag = read_tag(checkpoint) or ""
    if not tag or not (checkpoint / tag).is_dir():
        tags = sorted(p.name for p in checkpoint.glob("global_step*") if p.is_dir() and not p.name.endswith(UNIVERSAL_SUFFIX))
        if not tags:
            raise UniversalCheckpointError(f"{checkpoint} holds no DeepSpeed checkpoint (global_step*) to convert")
        tag = tags[-1]
    return tag


def convert(checkpoint: Path, run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> Path:
    """checkpoint/global_stepN -> checkpoint/global_stepN_universal (+ latest_universal); reused when present."""
    checkpoint = Path(checkpoint)
    tag = deepspeed_tag(checkpoint)
    target = checkpoint / f"{tag}{UNIVERSAL_SUFFIX}"
    if not target.is_dir():
        partial = checkpoint / f".{target.name}.partial"
        remove_path(partial)
        argv = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(checkpoint / tag),
                "--output_folder", str(partial), "--num_extract_workers", "1", "--num_merge_workers", "1",
                # the engine writes universal_checkpoint_info only for models that describe their own slicing
                # (Megatron, AutoTP, AutoEP); for a plain HF model DeepSpeed's converter adds the version key itself
                "--inject_missing_state"]
        result = run(argv, capture_output=True, text=True)
        if result.returncode != 0:
            remove_path(partial)
            tail = (result.stderr or result.stdout or "").strip().splitlines()[-1:] or ["no output"]
            raise UniversalCheckpointError(f"converting {checkpoint.name} to DeepSpeed's universal checkpoint failed "
                                           f"(deepspeed.checkpoint.ds_to_universal: {tail[0]}); resume on the process "
                                           "count that saved it, or start over with --overwrite")
        shutil.rmtree(partial / "tmp", ignore_errors=True)  # ds_to_universal's extracted fragments
        partial.rename(target)
    write_atomic(checkpoint / LATEST_UNIVERSAL, target.name)  # replaces a link there instead of writing through it
    return target


def converts_here(ds_config: dict[str, Any]) -> bool:
    """Rank 0 converts a shared run directory; each node's local rank 0 its own copy (node-local checkpoints,
    finetune.train.preemption)."""
    from finetune.train.dist import local_rank, rank

    node_local = bool(ds_config.get("checkpoint", {}).get("use_node_local_storage"))
    return local_rank() == 0 if node_local else rank() == 0


def prepare_resume(checkpoint: Optional[str], ds_config: dict[str, Any], world_size: int, converts: bool,
                   log: Callable[[str], None]) -> dict[str, Any]:
    """The DeepSpeed config to resume `checkpoint` with; converts it first when another process count wrote it.

    Collective: every rank calls it; `converts` is true on the rank(s) that write (rank 0, or each node's local
    rank 0 when the nodes keep their own copies)."""
    from finetune.train.dist import all_gather, barrier

    saved = saved_world_size(Path(checkpoint)) if checkpoint else None
    if checkpoint is None or saved is None or saved == world_size:
        return ds_config
    error = None
    if converts:
        try:
            target = convert(Path(checkpoint))
            log(f"{Path(checkpoint).name} was saved by {saved} processes, this run has {world_size}: converted to "
                f"DeepSpeed's universal checkpoint ({target.relative_to(Path(checkpoint).parent)}, "
                "deepspeed.checkpoint.ds_to_universal); loading it with checkpoint.load_universal")
        except (UniversalCheckpointError, OSError) as exc:
            error = str(exc)
    errors = [e for e in all_gather(error) if e]
    barrier()
    if errors:
        raise UniversalCheckpointError(errors[0])
    return {**ds_config, "checkpoint": {**ds_config.get("checkpoint", {}), "load_universal": True}}
