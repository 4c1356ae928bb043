"""A recipe's `auto` keys decided for a machine (issue 35): speed by default, within the plan's stated bound.

    resolution = resolve(loaded.recipe, Machine(gpus_per_node=1, gpu_memory=80 * 2**30, on_gpu=True))
    resolution.recipe    # a copy with every auto key decided (a key the recipe wrote is kept as written)
    resolution.choices   # one Choice per auto key: its value and the reason, in the user's numbers

The keys (finetune.recipe.schema.AUTO_WITHOUT_MACHINE holds what each is without a machine):
- deepspeed.enabled: the plain Trainer (torch's fused AdamW, no engine) for LoRA/QLoRA SFT on one GPU with
  nothing to offload, where ZeRO partitions nothing and DeepSpeed's bf16 optimizer wrapper adds host work every
  step (its overflow check syncs per trainable tensor, it flattens every gradient to fp32 and back); the choice
  with fewer per-step syncs, until a GPU measures both (scripts/gpu_speed.py). DeepSpeed everywhere else.
- training.gradient_checkpointing, training.loss_kernel, training.micro_batch_size (sft; the last two): of the
  setups whose upper bound fits the GPU (finetune.plan.bound: `fits`), the one that computes the least per token
  (finetune.plan.recommendation.compute_cost: checkpointing recomputes the forward, a small micro batch leaves the
  GPU idle, the chunked loss recomputes the output head). The micro batch is a divisor of the rows per GPU per
  step the recipe asks for (micro batch x accumulation, accumulation alone when the micro batch is auto), so
  micro x accumulation x data-parallel processes stays what it was. Without GPU memory to judge by, the values
  of AUTO_WITHOUT_MACHINE (memory-safe, deterministic).

The one place these decisions are made: `finetune plan` prints them, `finetune train` writes them into the run
directory (auto.json, read back by the runner: finetune.recipe.auto.with_auto_values) beside the recipe as written
(finetune.run.start.resolve_auto, which scripts/bench_hf.py calls too, to train a recipe the way they make it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

from finetune import objectives
from finetune.plan.recommendation import SATURATION_TOKENS, compute_cost
from finetune.plan.result import gib
from finetune.plan.setup import PlanError

ENGINE, CHECKPOINTING, KERNEL, MICRO = ("deepspeed.enabled", "training.gradient_checkpointing",
                                       "training.loss_kernel", "training.micro_batch_size")
ACCUMULATION = "training.gradient_accumulation_steps"
PAD = "data.pad_to_multiple_of"
PLAIN_OPTIMIZERS = ("adamw",)  # what the plain Trainer runs as the recipe's optimizer (torch's fused AdamW)


@dataclass(frozen=True)
class Machine:
    """What the decisions depend on: processes, GPU memory (None: unknown), whether there is a GPU at all."""

    gpus_per_node: int = 1
    nodes: int = 1
    gpu_memory: Optional[int] = None
    gpu_type: Optional[str] = None
    cpu_memory: Optional[int] = None
    on_gpu: bool = True

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass
class Choice:
    key: str
    value: Any
    reason: str
    auto: bool = True  # False: the recipe wrote the value (listed when another choice depends on it)

    def line(self) -> str:
        value = json.dumps(self.value)
        return f"{self.key} = {value}" + ("" if self.auto else " (written)") + f": {self.reason}"


@dataclass
class Resolution:
    recipe: Any  # finetune.recipe.Recipe with every auto key decided
    choices: list[Choice] = field(default_factory=list)

    def values(self) -> dict[str, Any]:
        """{dotted key: value} of the decisions (auto.json in a run directory; finetune.recipe.auto.with_auto_values reads it back)."""
        return {c.key: c.value for c in self.choices if c.auto}

    def to_json(self) -> list[dict[str, Any]]:
        return [{"key": c.key, "value": c.value, "auto": c.auto, "reason": c.reason} for c in self.choices]

    def lines(self) -> list[str]:
        return [c.line() for c in self.choices]


def _set(recipe, key: str, value: Any) -> None:
    section, name = key.split(".")
    setattr(getattr(recipe, section), name, value)


def _get(recipe, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(recipe, section), name)


# ------------------------------------------------------------------------------------------------
# The engine


def engine_choice(recipe, machine: Machine) -> tuple[bool, str]:
    """(deepspeed.enabled, why) for a recipe that leaves it auto."""
    t, ds = recipe.training, recipe.deepspeed
    offload = ds.offload_optimizer != "none" or ds.offload_param != "none"
    blockers = [
        (not machine.on_gpu, "no GPU: DeepSpeed's CPU accelerator (what the CPU runs are tested with)"),
        (machine.world > 1, f"{machine.world} processes: ZeRO stage {ds.stage} partitions across them"),
        (offload, "offload needs DeepSpeed's engine"),
        (recipe.method == "full", "a full fine-tune keeps fp32 master weights in DeepSpeed's optimizer (the plain "
                                  "Trainer would step the 16-bit weights themselves)"),
        (not objectives.get(recipe.objective).plain_trainer,
         f"objective {recipe.objective}: TRL's trainer is tested under DeepSpeed here"),
        (ds.stage == 3, "ZeRO-3 was asked for (deepspeed.stage: 3)"),
        (recipe.parallel.model_parallel > 1, "sequence or tensor parallelism is DeepSpeed's"),
        (t.tiled_mlp, "training.tiled_mlp is DeepSpeed's TiledMLP"),
        (t.optimizer not in PLAIN_OPTIMIZERS, f"optimizer {t.optimizer} is built by DeepSpeed here"),
        (bool(ds.overrides), "deepspeed.overrides are DeepSpeed settings"),
    ]
    for blocked, why in blockers:
        if blocked:
            return True, why
    return False, (f"one GPU, nothing to offload: transformers' Trainer with torch's fused AdamW; DeepSpeed's ZeRO-{ds.stage} "
                   "engine would partition nothing on one process and its bf16 optimizer wrapper syncs with the host for "
                   "every trainable tensor (overflow check) and copies every gradient to fp32 and back, each step "
                   "(fewer per-step syncs; on an H200, a 1B model at 1 x 2,048 tokens: LoRA 6,693 tokens/s against "
                   "5,290 through ZeRO-0, Q-LoRA 10,020 against 6,367, one run each, "
                   "docs/gpu_acceptance/2026-11-28_h200_speed_third.md and _fourth_profile.md)")


def pad_choice(recipe, machine: Machine) -> tuple[int, str]:
    """(data.pad_to_multiple_of, why) for a recipe that leaves it auto (finetune.data.packing.gpu_pad_multiple)."""
    from finetune.data.packing import gpu_pad_multiple

    if not machine.on_gpu:
        return 1, "no GPU: each micro batch as long as its longest row (no kernel here keeps a plan per length)"
    return gpu_pad_multiple(recipe)


# ------------------------------------------------------------------------------------------------
# Memory-bound choices


@dataclass(frozen=True)
class _Candidate:
    micro: int
    checkpointing: bool
    kernel: str

    def apply(self, recipe, rows: int):
        out = recipe.model_copy(deep=True)
        out.training.micro_batch_size = self.micro
        out.training.gradient_accumulation_steps = rows // self.micro
        out.training.gradient_checkpointing = self.checkpointing
        out.training.loss_kernel = self.kernel
        return out


def _sized_by_plan(recipe) -> bool:
    """Whether the plan sizes the micro batch and the loss kernel (finetune's own SFT loss, one row per sequence)."""
    return objectives.get(recipe.objective).sized_by_plan and recipe.parallel.sequence == 1


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def memory_choices(recipe, machine: Machine, keys: frozenset) -> tuple[Any, list[Choice]]:
    """(recipe with the memory-bound auto keys decided, their choices), by the plan on `machine`."""
    from finetune.plan.from_recipe import setup_from_recipe
    from finetune.plan.planner import plan

    t = recipe.training
    sized = _sized_by_plan(recipe)
    micro_auto = MICRO in keys and sized
    kernel_auto = KERNEL in keys and sized
    rows = t.gradient_accumulation_steps * (1 if MICRO in keys else t.micro_batch_size)
    micros = sorted(_divisors(rows), reverse=True) if micro_auto else [t.micro_batch_size]
    checkpointing = [False, True] if CHECKPOINTING in keys and not t.activation_offload else [t.gradient_checkpointing]
    kernels = ["default", "chunked"] if kernel_auto else [t.loss_kernel]
    candidates = [_Candidate(m, c, k) for m in micros for c in checkpointing for k in kernels]
    results = []
    for candidate in candidates:
        setup = setup_from_recipe(candidate.apply(recipe, rows), machine.gpus_per_node, machine.gpu_memory,
                                  machine.nodes, machine.cpu_memory)
        if machine.gpu_type and setup.gpu_type is None:
            from dataclasses import replace

            setup = replace(setup, gpu_type=machine.gpu_type)
        results.append((candidate, plan(setup)))
    fitting = [(c, r) for c, r in results if r.fits]
    if fitting:
        chosen, result = min(fitting, key=lambda cr: (round(compute_cost(cr[1].setup), 6), cr[0].checkpointing,
                                                      cr[0].kernel != "default"))
    else:  # nothing fits: the setup that needs the least, and `finetune plan` says it does not fit
        chosen, result = min(results, key=lambda cr: (cr[1].upper_bound, not cr[0].checkpointing, cr[0].kernel != "default"))
    out = chosen.apply(recipe, rows)
    return out, _explain(recipe, machine, keys, rows, chosen, result, bool(fitting), results, micro_auto, kernel_auto)


def _explain(recipe, machine: Machine, keys: frozenset, rows: int, chosen: _Candidate, result, fits: bool,
             results, micro_auto: bool, kernel_auto: bool) -> list[Choice]:
    memory = gib(machine.gpu_memory)
    bound = f"upper bound {gib(result.upper_bound)} of {memory} GiB"
    choices: list[Choice] = []
    if not fits:
        note = f"nothing fits {memory} GiB: the setup that needs the least ({bound}; finetune plan says it does not fit)"
    if CHECKPOINTING in keys:
        if recipe.training.activation_offload:
            reason = "training.activation_offload moves the checkpointed inputs: it needs checkpointing"
        elif not fits:
            reason = note
        elif chosen.checkpointing:
            reason = f"without it nothing fits {memory} GiB under the plan's bound; with it, {bound}"
        else:
            saved = [r for c, r in results if c.checkpointing and c.micro == chosen.micro and c.kernel == chosen.kernel]
            extra = f" (it would save {gib(result.per_gpu['activations'] - saved[0].per_gpu['activations'])} GiB " \
                    "of activations for ~33% more compute)" if saved else ""
            reason = f"the activations fit without recomputing them: {bound}{extra}"
        choices.append(Choice(CHECKPOINTING, chosen.checkpointing, reason))
    if KERNEL in keys:
        if not kernel_auto:
            reason = f"objective {recipe.objective}: the loss is TRL's own" \
                if not objectives.get(recipe.objective).sized_by_plan else \
                "parallel.sequence: the loss is Ulysses' own"
        elif not fits:
            reason = note
        elif chosen.kernel == "chunked":
            reason = (f"the logits ({gib(_logits(results, chosen, 'default'))} GiB with the default loss, "
                      f"{gib(result.per_gpu['logits'])} chunked) stand between this GPU and micro batch {chosen.micro}"
                      f"{'' if chosen.checkpointing else ' without checkpointing'}: {bound}")
        else:
            reason = (f"the full fp32 logits ({gib(result.per_gpu['logits'])} GiB) fit beside the rest: {bound}; the "
                      "chunked loss would recompute the output head")
        choices.append(Choice(KERNEL, chosen.kernel, reason))
    if MICRO in keys:
        accumulation = rows // chosen.micro
        if not micro_auto:
            reason = f"objective {recipe.objective}: one row per forward" \
                if not objectives.get(recipe.objective).sized_by_plan else \
                "parallel.sequence: one row per forward"
        elif not fits:
            reason = note
        else:
            tokens = chosen.micro * recipe.data.max_length
            busy = (f"{tokens:,} tokens per forward keep the GPU busy about {tokens / (tokens + SATURATION_TOKENS):.0%} "
                    f"of the time (finetune.plan.recommendation): {bound}")
            larger = [d for d in _divisors(rows) if d > chosen.micro]
            if rows == 1:
                why = ("the recipe asks for 1 row per GPU per step (micro batch x gradient_accumulation_steps); with "
                       "more rows per step, auto runs them in as few forwards as fit")
            elif not larger:
                why = f"all {rows} rows per GPU per step in one forward (accumulation {accumulation})"
            else:
                why = (f"{rows} rows per GPU per step = micro batch {chosen.micro} x accumulation {accumulation}; "
                       f"micro batch {larger[0]} does not fit")
            reason = f"{why}; {busy}"
        choices.append(Choice(MICRO, chosen.micro, reason))
        if micro_auto and accumulation != recipe.training.gradient_accumulation_steps:
            choices.append(Choice(ACCUMULATION, accumulation,
                                  f"with micro batch {chosen.micro}, the {rows} rows per GPU per step of the recipe"))
    return choices


def _logits(results, chosen: _Candidate, kernel: str) -> int:
    for c, r in results:
        if c.micro == chosen.micro and c.checkpointing == chosen.checkpointing and c.kernel == kernel:
            return r.per_gpu["logits"]
    return 0


# ------------------------------------------------------------------------------------------------
# The resolution


def resolve(recipe, machine: Machine) -> Resolution:
    """Every auto key of `recipe` decided for `machine` (the module docstring); a recipe without auto keys is
    returned as a copy with no choices."""
    keys = recipe.auto_keys
    out = recipe.model_copy(deep=True)
    choices: list[Choice] = []
    if ENGINE in keys:
        enabled, why = engine_choice(out, machine)
        out.deepspeed.enabled = enabled
        choices.append(Choice(ENGINE, enabled, why))
    if PAD in keys:
        multiple, why = pad_choice(out, machine)
        out.data.pad_to_multiple_of = multiple
        choices.append(Choice(PAD, multiple, why))
    memory_keys = keys & {CHECKPOINTING, KERNEL, MICRO}
    if not memory_keys:
        return Resolution(out, choices)
    if machine.gpu_memory is None or not machine.on_gpu:
        why = ("no GPU memory to judge by (finetune plan --gpu-memory, hardware.gpu_memory, or a GPU at launch): the "
               "memory-safe value" if machine.on_gpu else "no GPU: the memory-safe value")
        if out.training.activation_offload and CHECKPOINTING in memory_keys:
            out.training.gradient_checkpointing = True
        choices += [Choice(k, _get(out, k), why) for k in (CHECKPOINTING, KERNEL, MICRO) if k in memory_keys]
        return Resolution(out, choices)
    try:
        out, decided = memory_choices(out, machine, memory_keys)
    except PlanError as exc:  # a model the planner cannot size: the memory-safe values, and why
        decided = [Choice(k, _get(out, k), f"the plan cannot size this model ({exc}): the memory-safe value")
                   for k in (CHECKPOINTING, KERNEL, MICRO) if k in memory_keys]
    return Resolution(out, choices + decided)


def memory_safe_values(resolution: Resolution) -> dict[str, Any]:
    """{key: memory-safe value} for every memory-bound key `resolution` decided, when one of them was decided for
    speed (else {}): what a run that ran out of GPU memory under the plan's bound runs again with. Every such key is
    pinned, not only the ones that moved: left auto, the micro batch would grow again once checkpointing is on.
    Keys the recipe wrote are the user's and keep their values."""
    safe: dict[str, Any] = {CHECKPOINTING: True}
    if _sized_by_plan(resolution.recipe):
        safe.update({MICRO: 1, KERNEL: "chunked"})  # micro batch 1: the recipe's accumulation is the rows per step again
    decided = {key: value for key, value in resolution.values().items() if key in safe}
    if all(value == safe[key] for key, value in decided.items()):
        return {}
    return {key: safe[key] for key in decided}


def machine_from_facts(world_per_node: int, nodes: int, gpus) -> Machine:
    """The Machine a launch runs on: finetune.run.machine.Facts' GPUs (the smallest one's memory decides)."""
    if not gpus:
        return Machine(gpus_per_node=world_per_node, nodes=nodes, on_gpu=False)
    smallest = min(gpus, key=lambda g: g.memory_bytes)
    return Machine(gpus_per_node=world_per_node, nodes=nodes, gpu_memory=smallest.memory_bytes,
                   gpu_type=smallest.name, on_gpu=True)


def machine_for(recipe, gpus: Optional[int] = None, gpu_memory: Optional[int] = None, nodes: Optional[int] = None,
                cpu_memory: Optional[int] = None) -> Machine:
    """The Machine `finetune plan` plans for: the flags, else the recipe's launch and hardware sections (as
    finetune.plan.from_recipe.setup_from_recipe reads them); a GPU either way."""
    from finetune.recipe import parse_size

    hw = recipe.hardware
    if gpus is None:
        gpus = recipe.launch.procs_per_node if isinstance(recipe.launch.procs_per_node, int) else \
            (hw.gpus if hw is not None else 1)
    if gpu_memory is None and hw is not None and hw.gpu_memory:
        gpu_memory = parse_size(hw.gpu_memory)
    if cpu_memory is None and hw is not None and hw.cpu_memory:
        cpu_memory = parse_size(hw.cpu_memory)
    return Machine(gpus_per_node=gpus, nodes=nodes if nodes is not None else recipe.launch.nodes,
                   gpu_memory=gpu_memory, gpu_type=hw.gpu_type if hw is not None else None, cpu_memory=cpu_memory)
