"""The "auto" rules (DS170-DS175), the last phase: every "auto" that no earlier rule has judged.

Under the HF Trainer, HfTrainerDeepSpeedConfig and accelerate's DeepSpeedPlugin fill some "auto" values
(schema.HF_FILLED, schema.ACCELERATE_DEFAULTS) and accelerate stops on any other; without the HF integration
nothing fills them, and DeepSpeed's pydantic sections drop them.
"""

from __future__ import annotations

from typing import Iterator

from finetune.lint.deepspeed.context import RawFinding
from finetune.lint.deepspeed.schema import ACCELERATE_DEFAULTS, HF_FILLED
from finetune.lint.deepspeed.values import auto_leaves, dotted, read_by_pydantic, show
from finetune.lint.deepspeed.view import ConfigView, Seen, rule


@rule("auto")
def auto_values(v: ConfigView, seen: Seen) -> Iterator[RawFinding]:
    for path, in_list in auto_leaves(v.config, ()):
        if seen.claimed(path) or (in_list and seen.claimed(path[:-1])):
            continue
        if seen.below_unknown(path):
            continue
        if in_list:
            parent = path[:-1]
            yield RawFinding("DS171", "error", parent, f"`{dotted(parent)}` holds \"auto\" inside a list: HF and "
                             "accelerate only fill a whole value, so DeepSpeed gets the string \"auto\"",
                             f'write "{dotted(parent)}": "auto" (the whole value) or the numbers')
            continue
        if v.hf:
            yield from hf_auto(v, path)
        else:
            yield from raw_auto(v, path)


def hf_auto(v: ConfigView, path: tuple) -> Iterator[RawFinding]:
    if path in HF_FILLED:
        return
    if path in ACCELERATE_DEFAULTS:
        default, env = ACCELERATE_DEFAULTS[path]
        if path[-1] == "nvme_path":
            return  # DS133 judges it when the device is nvme; otherwise it is unused
        if path[-1] == "stage3_gather_16bit_weights_on_model_save":
            if v.stage == 3:
                yield RawFinding(
                    "DS172", "warning", path, "`stage3_gather_16bit_weights_on_model_save` \"auto\" becomes "
                    f"accelerate's default false (or ${env}): at ZeRO-3 the Trainer then saves no "
                    "usable model weights, only the sharded checkpoint", "write true")
            return
        yield RawFinding("DS172", "warning", path, f"`{dotted(path)}` \"auto\" is not taken from TrainingArguments: "
                         f"accelerate fills it with its own default {show(default)} (or ${env})",
                         f"write the value you want, e.g. {show(default)}")
        return
    if path == ("data_types", "keep_in_fp32_modules"):
        yield RawFinding(
            "DS170", "error", path, "`data_types.keep_in_fp32_modules` \"auto\" is DeepSpeed's own default, "
            "but under the HF Trainer accelerate treats every \"auto\" as a placeholder and stops "
            "(\"`data_types.keep_in_fp32_modules` not found in kwargs\")",
            "delete the key: DeepSpeed's default is already \"auto\"")
        return
    yield RawFinding("DS170", "error", path, f"`{dotted(path)}` is \"auto\", but neither HF nor accelerate fills this "
                     "key: accelerate stops with \"`" + dotted(path) + "` not found in kwargs\"",
                     "write a concrete value (\"auto\" works for batch sizes, gradient_clipping, fp16/bf16.enabled, "
                     "optimizer lr/betas/eps/weight_decay, scheduler warmup/total steps and the ZeRO bucket sizes)")


def raw_auto(v: ConfigView, path: tuple) -> Iterator[RawFinding]:
    fix = "write a concrete value: without the HF Trainer nothing replaces \"auto\""
    if not read_by_pydantic(path):
        yield RawFinding(
            "DS175", "error", path, f"`{dotted(path)}` is \"auto\", but without the HF integration nothing "
            "fills it in: DeepSpeed gets the string \"auto\" and fails or misbehaves with it", fix)
    elif path[-1] in ("enabled", "stage", "device"):
        meaning = {"enabled": "disabled", "stage": "stage 0 (no ZeRO)", "device": "no offload"}[path[-1]]
        yield RawFinding("DS175", "error", path, f"`{dotted(path)}` is \"auto\": without the HF integration DeepSpeed "
                         f"drops it, which means {meaning}", fix)
    else:
        yield RawFinding(
            "DS175", "warning", path, f"`{dotted(path)}` is \"auto\": without the HF integration DeepSpeed "
            "drops it and uses its default", fix)
