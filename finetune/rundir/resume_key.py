"""The resume key: the parts of a resolved recipe that a resumed run must share with the run that
wrote its checkpoints (model, method, LoRA, data, objective, optimisation, ZeRO stage, world size).
`RUN/resume_key.json` keeps them and their hash; `finetune train` names every change before it
refuses to resume (finetune.rundir.checkpoint.plan_resume). No torch here."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Optional

RESUME_KEY_FILE = "resume_key.json"

# Dotted keys of the resolved recipe. Left out on purpose: logging, eval and save cadence,
# report_to, data loader workers, gradient checkpointing, attention kernel, DeepSpeed buckets and
# offload, launch details (except the world size, added separately), hardware, names and paths of
# the run: changing those does not change what the next optimizer step computes.
RESUME_KEYS = (
    "model.name_or_path", "model.revision", "model.dtype", "method",
    "lora.r", "lora.alpha", "lora.dropout", "lora.target_modules", "lora.modules_to_save", "lora.rslora",
    "lora.dora", "lora.bias",
    "data.path", "data.format", "data.split", "data.chat_template", "data.max_length", "data.packing",
    "data.validation_split", "data.mask_prompt",
    "training.epochs", "training.max_steps", "training.micro_batch_size", "training.gradient_accumulation_steps",
    "training.learning_rate", "training.lr_scheduler", "training.warmup_ratio", "training.warmup_steps",
    "training.weight_decay", "training.adam_beta1", "training.adam_beta2", "training.adam_epsilon",
    "training.max_grad_norm", "training.optimizer", "training.seed",
    "deepspeed.stage",
)
# Keys added after run directories existed, with their defaults: written only when set, so that a
# run directory started before them still resumes.
KEYS_IF_SET = {"data.sources": None, "data.seed": None, "data.think": "train", "data.columns": {}, "data.roles": {},
               "objective": "sft", "model.adapter": None, "parallel.sequence": 1, "parallel.tensor": 1,
               # a checkpoint without DeepSpeed is the Trainer's own format (issue 35)
               "deepspeed.enabled": True}
# What a change of process count may change with it: DeepSpeed's universal checkpoint re-partitions the saved
# states for any count (finetune.train.universal), and the rows per step stay the same when micro x accumulation x
# data-parallel size does (the Trainer then skips exactly the rows already trained).
PROCESS_COUNT_KEYS = ("world_size", "training.gradient_accumulation_steps", "parallel.sequence", "parallel.tensor")
QLORA_KEYS = ("quantization.quant_type", "quantization.double_quant", "quantization.compute_dtype",
              "quantization.storage_dtype")


def objective_section(name: Any) -> Optional[str]:
    from finetune.objectives import OBJECTIVES

    record = OBJECTIVES.get(name) if isinstance(name, str) else None
    return record.section if record else None


def resume_fields(resolved: dict[str, Any], world_size: int) -> dict[str, Any]:
    """The resume-relevant values of a resolved recipe (finetune.rundir.layout.resolved_recipe)."""
    keys = tuple(k for k in RESUME_KEYS if not _unread(k, resolved.get("method")))
    keys += QLORA_KEYS if resolved.get("method") == "qlora" else ()
    fields: dict[str, Any] = {key: _lookup(resolved, key) for key in keys}
    for key, default in KEYS_IF_SET.items():
        if _lookup(resolved, key) not in (None, default):
            fields[key] = _lookup(resolved, key)
    section = objective_section(fields.get("objective", "sft"))
    if section:  # preference (beta, loss, reference), grpo (generations, rewards): the loss itself
        fields[section] = resolved.get(section)
    data = resolved.get("data", {})
    paths = [str(s.get("path", "")) for s in data.get("sources") or [] if isinstance(s, dict)] or [str(data.get("path") or "")]
    sizes = [_data_size(path) for path in paths]
    size = None if all(s is None for s in sizes) else sum(s or 0 for s in sizes)
    if size is not None:
        fields["data.bytes"] = size  # the same file name with other rows changes the data order
    fields["world_size"] = world_size  # batches are split across ranks; ZeRO shards per rank
    return fields


def resume_hash(fields: dict[str, Any]) -> str:
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def resume_key_text(fields: dict[str, Any]) -> str:
    return json.dumps({"hash": resume_hash(fields), "fields": fields}, indent=2) + "\n"


def read_resume_key(run_dir: Path) -> Optional[dict[str, Any]]:
    """The fields a run directory was started with, or None when it does not say."""
    try:
        data = json.loads((Path(run_dir) / RESUME_KEY_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    fields = data.get("fields") if isinstance(data, dict) else None
    return fields if isinstance(fields, dict) else None


def _unread(key: str, method: Any) -> bool:
    """A LoRA key of a full fine-tune: nothing reads it (a run's recipe.yaml leaves the section out)."""
    return method == "full" and key.startswith("lora.")


def changed_fields(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """`key: old -> new` for every field that differs (a full fine-tune's LoRA keys, which run directories written
    before issue 34 kept, are not compared)."""
    changes = []
    for key in sorted(set(old) | set(new)):
        if _unread(key, old.get("method")) and _unread(key, new.get("method")):
            continue
        if old.get(key) != new.get(key):
            label = "world size (processes)" if key == "world_size" else key
            changes.append(f"{label}: {_show(old.get(key))} -> {_show(new.get(key))}")
    return changes


def _show(value: Any) -> str:
    return "unset" if value is None else json.dumps(value) if not isinstance(value, str) else value


def _lookup(data: dict[str, Any], dotted: str) -> Any:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def _data_size(path: str) -> Optional[int]:
    if not path:
        return None
    p = Path(path).expanduser()
    try:
        if p.is_file():
            return p.stat().st_size
        if p.is_dir():
            return sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
    except OSError:
        return None
    return None


def global_batch(fields: dict[str, Any]) -> Optional[int]:
    """Sequences per optimizer step: micro x accumulation x world / (sequence x tensor)."""
    try:
        model_parallel = int(fields.get("parallel.sequence", 1)) * int(fields.get("parallel.tensor", 1))
        world = int(fields["world_size"])
        return int(fields["training.micro_batch_size"]) * int(fields["training.gradient_accumulation_steps"]) * \
            (world // model_parallel)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None


def process_count_change(old: dict[str, Any], new: dict[str, Any]) -> tuple[list[str], Optional[str]]:
    """(changes left that block a resume, a note) for a change of process count.

    Exactly a change of process count resumes (no --force-resume): the runner converts the checkpoint to
    DeepSpeed's universal format. It may bring a new gradient accumulation (or parallel.*) only when the rows per
    step stay the same; otherwise the note says which accumulation would keep them."""
    changes = changed_fields(old, new)
    if old.get("world_size") == new.get("world_size") or old.get("world_size") is None:
        return changes, None
    if int(old.get("parallel.sequence", 1) or 1) > 1:
        # deepspeed 0.19.8 records a Ulysses run's sequence-parallel size as the checkpoint's tensor-parallel degree,
        # and ds_to_universal then refuses it ("model-state file count 1 does not match pp_degree=1 * tp_degree=2")
        return changes, (f"a checkpoint of a parallel.sequence {old['parallel.sequence']} run cannot be converted for "
                         f"another process count (DeepSpeed's ds_to_universal reads its sequence groups as tensor "
                         f"parallelism): resume on {old['world_size']} processes")
    others = [c for c in changes if not any(c.startswith(_label(k) + ":") for k in PROCESS_COUNT_KEYS)]
    before, after = global_batch(old), global_batch(new)
    if others or before is None or before != after:
        hint = _accumulation_hint(old, new)
        return changes, hint
    return others, (f"process count {old['world_size']} -> {new['world_size']} with the same {after} sequences per "
                    "step: the checkpoint is converted to DeepSpeed's universal format (ds_to_universal) at start")


def _accumulation_hint(old: dict[str, Any], new: dict[str, Any]) -> Optional[str]:
    before = global_batch(old)
    per_accumulation = global_batch({**new, "training.gradient_accumulation_steps": 1})
    if not before or not per_accumulation:
        return None
    if before % per_accumulation:
        return (f"the checkpoint's {before} sequences per step cannot be kept on {new.get('world_size')} processes with "
                f"micro_batch_size {new.get('training.micro_batch_size')}")
    return (f"to resume on {new.get('world_size')} processes keep {before} sequences per step: set "
            f"training.gradient_accumulation_steps: {before // per_accumulation}")


def _label(key: str) -> str:
    return "world size (processes)" if key == "world_size" else key
