"""`finetune plan --recommend`: tries stages, offload, micro batch and checkpointing, picks the fastest that fits."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Optional

from finetune.units import MiB
from finetune.plan.planner import FLOAT16_SETS, bf16_note, plan
from finetune.plan.result import PlanResult, gib
from finetune.plan.setup import PlanError, Setup, overflow_as_plan_error


# How much slower each choice is, as a sort key (first difference decides), from the documented
# costs: offloading moves the optimizer (and parameters) over PCIe and runs Adam on the CPU, the
# slowest; ZeRO-3 all-gathers parameters in forward and backward, ~1.5x the communication of
# ZeRO-0/1/2 (which move as much as plain data parallel); then compute per sequence: gradient
# checkpointing recomputes the forward (x 4/3), and a micro batch of t tokens keeps the GPU busy
# about t / (t + 1024) of the time (small matmuls leave it idle), so the cost per token is
# (1 + 1024 / t); then fewer parameters gathered ahead; among stages with equal communication,
# the lower one (less bookkeeping). The chunked loss recomputes the output head's forward in backward:
# hidden x vocab of the ~3 x params multiply-adds per token a training step does (forward + backward).
SATURATION_TOKENS = 1024


def compute_cost(setup: Setup) -> float:
    tokens = setup.micro_batch * setup.seq_len
    cost = (4 / 3 if setup.gradient_checkpointing else 1.0) * (1 + SATURATION_TOKENS / tokens)
    if setup.loss_kernel == "chunked" and setup.arch is not None and setup.params:
        cost *= 1 + setup.arch.hidden * setup.arch.vocab / (3 * setup.params)
    return cost


OFFLOAD_LEVELS = (("none", "none"), ("cpu", "none"), ("cpu", "cpu"))
# The stage3_max_live_parameters --recommend tries besides the recipe's (DeepSpeed's default is 1e9).
FEWER_LIVE_PARAMETERS = 100_000_000


def speed_key(setup: Setup) -> tuple:
    offload = OFFLOAD_LEVELS.index((setup.offload_optimizer, setup.offload_param)) \
        if (setup.offload_optimizer, setup.offload_param) in OFFLOAD_LEVELS else len(OFFLOAD_LEVELS)
    return (offload, setup.deepspeed and setup.stage == 3, round(compute_cost(setup), 6),
            -setup.max_live_parameters, setup.stage if setup.deepspeed else -1, setup.loss_kernel == "chunked")


@dataclass
class Recommendation:
    current: PlanResult
    chosen: Optional[PlanResult]
    tried: list[PlanResult]
    reasons: list[str]
    gradient_accumulation_steps: Optional[int] = None
    larger: Optional[PlanResult] = None  # a larger micro batch that fits too (larger_micro_batch)

    def to_json(self) -> dict[str, Any]:
        c = self.chosen
        return {
            "chosen": None if c is None else {
                "zero": c.setup.stage, "dtype": c.setup.dtype, "offload_optimizer": c.setup.offload_optimizer,
                "offload_param": c.setup.offload_param, "micro_batch": c.setup.micro_batch,
                "gradient_checkpointing": c.setup.gradient_checkpointing, "loss_kernel": c.setup.loss_kernel,
                "gradient_accumulation_steps": self.gradient_accumulation_steps,
                "per_gpu": c.per_gpu, "cpu": c.cpu, "headroom": c.headroom,
                "set": recommendation_overrides(self)},
            "reasons": self.reasons,
            "larger_micro_batch": None if self.larger is None else {
                "micro_batch": self.larger.setup.micro_batch, "total": self.larger.per_gpu["total"],
                "upper_bound": self.larger.upper_bound},
            "tried": [{"zero": r.setup.stage, "offload_optimizer": r.setup.offload_optimizer,
                       "offload_param": r.setup.offload_param, "micro_batch": r.setup.micro_batch,
                       "gradient_checkpointing": r.setup.gradient_checkpointing, "loss_kernel": r.setup.loss_kernel,
                       "total": r.per_gpu["total"], "upper_bound": r.upper_bound, "cpu_total": r.cpu["total"],
                       "fits": r.fits}
                      for r in self.tried],
        }

    def render_text(self) -> str:
        lines = [f"recommendation ({self.current.setup.gpus_per_node * self.current.setup.nodes} GPU"
                 f"{'s' if self.current.setup.world != 1 else ''} of {gib(self.current.setup.gpu_memory or 0)} GiB):"]
        if self.chosen is None:
            lines.append("  nothing tried fits: fewer tokens per micro batch (data.max_length), more GPUs, "
                         "or QLoRA instead of LoRA")
        else:
            c = self.chosen
            lines.append(f"  {c.setup.describe()}")
            lines.append(f"  {c.summary()}")
            sets = recommendation_overrides(self)
            if sets:
                lines.append("  apply with: " + " ".join(f"--set {s}" for s in sets))
            else:
                lines.append("  the recipe's own setup is already the fastest that fits")
        for reason in self.reasons:
            lines.append(f"  why: {reason}")
        lines.append("")
        lines.append("  tried (GiB per GPU: estimate, upper bound; micro batch " + str(self.current.setup.micro_batch)
                     + ", checkpointing as in the recipe):")
        cur = self.current.setup
        shown = [r for r in self.tried if _as_recipe(r.setup, cur)]
        shown += [r for r in (self.chosen, self.larger) if r is not None and r not in shown]
        for r in shown:
            s = r.setup
            what = _short(s, cur.max_live_parameters) + _differences(s, cur)
            mark = {id(self.chosen): "  <- recommended", id(self.larger): "  <- fits too (more rows per step)"}
            lines.append(f"    {what:<56}{gib(r.per_gpu['total']):>7}{gib(r.upper_bound):>7}  "
                         f"{'fits' if r.fits else 'no'}{mark.get(id(r), '')}")
        return "\n".join(lines) + "\n"


def _as_recipe(s: Setup, cur: Setup) -> bool:
    """A tried setup with the recipe's micro batch, checkpointing and loss: one row of the table."""
    return (s.micro_batch, s.loss_kernel, s.gradient_checkpointing) == \
        (cur.micro_batch, cur.loss_kernel, cur.gradient_checkpointing)


def _differences(s: Setup, cur: Setup) -> str:
    """', micro batch 4, no checkpointing, chunked loss' where a table row differs from the recipe."""
    out = []
    if s.micro_batch != cur.micro_batch:
        out.append(f"micro batch {s.micro_batch}")
    if s.gradient_checkpointing != cur.gradient_checkpointing:
        out.append("checkpointing" if s.gradient_checkpointing else "no checkpointing")
    if s.loss_kernel != cur.loss_kernel:
        out.append(f"{s.loss_kernel} loss")
    return "".join(f", {part}" for part in out)


def _short(s: Setup, live_default: Optional[int] = None) -> str:
    if not s.deepspeed:
        return "no DeepSpeed"
    text = f"ZeRO-{s.stage}"
    if s.offload_optimizer != "none":
        text += f" + optimizer->{s.offload_optimizer}"
    if s.offload_param != "none":
        text += f" + params->{s.offload_param}"
    if live_default is not None and s.stage == 3 and s.max_live_parameters != live_default:
        text += f", max_live {s.max_live_parameters:.0e}"
    return text


def recommendation_overrides(rec: Recommendation) -> list[str]:
    """`--set` strings that turn the recipe's setup into the chosen one."""
    if rec.chosen is None:
        return []
    a, b = rec.current.setup, rec.chosen.setup
    out = list(FLOAT16_SETS[a.method == "qlora"]) if b.dtype != a.dtype else []
    if b.stage != a.stage:
        out.append(f"deepspeed.stage={b.stage}")
    if b.offload_optimizer != a.offload_optimizer:
        out.append(f"deepspeed.offload_optimizer={b.offload_optimizer}")
    if b.offload_param != a.offload_param:
        out.append(f"deepspeed.offload_param={b.offload_param}")
    if b.micro_batch != a.micro_batch:
        out.append(f"training.micro_batch_size={b.micro_batch}")
        if rec.gradient_accumulation_steps is not None:
            out.append(f"training.gradient_accumulation_steps={rec.gradient_accumulation_steps}")
    if b.gradient_checkpointing != a.gradient_checkpointing:
        out.append(f"training.gradient_checkpointing={'true' if b.gradient_checkpointing else 'false'}")
    if b.loss_kernel != a.loss_kernel:
        out.append(f"training.loss_kernel={b.loss_kernel}")
    if b.max_live_parameters != a.max_live_parameters:
        out.append(f"deepspeed.stage3_max_live_parameters={b.max_live_parameters}")
    return out


def candidates(setup: Setup) -> list[Setup]:
    """Stages 0-3 x offload {none, optimizer, optimizer + params} x micro batch (halving down to 1, and doubling
    while gradient accumulation keeps the rows per step) x gradient checkpointing on/off x the chunked loss (when the recipe's is the default), and for
    ZeRO-3 a smaller stage3_max_live_parameters. speed_key ranks these cheap fixes before offload."""
    micro = []
    m = setup.micro_batch
    while m >= 1:
        micro.append(m)
        m //= 2
    # Larger micro batches that gradient accumulation absorbs (the rows per step stay): fewer, fuller steps.
    rows, m = setup.micro_batch * setup.gradient_accumulation, setup.micro_batch * 2
    while m <= rows and rows % m == 0:
        micro.insert(0, m)
        m *= 2
    kernels = [setup.loss_kernel] + (["chunked"] if setup.loss_kernel == "default" else [])
    out = []
    for stage in (0, 1, 2, 3):
        for opt, par in OFFLOAD_LEVELS:
            if (opt != "none" and stage == 0) or (par != "none" and stage != 3):
                continue
            # ZeRO-3 also tries keeping fewer parameters gathered ahead (stage3_max_live_parameters).
            lives = {setup.max_live_parameters}
            if stage == 3:
                lives.add(min(setup.max_live_parameters, FEWER_LIVE_PARAMETERS))
            for mb in micro:
                for ckpt in (False, True):
                    for live in sorted(lives, reverse=True):
                        out.extend(replace(setup, deepspeed=True, stage=stage, offload_optimizer=opt,
                                           offload_param=par, micro_batch=mb, gradient_checkpointing=ckpt,
                                           max_live_parameters=live, loss_kernel=kernel) for kernel in kernels)
    return out


@overflow_as_plan_error
def recommend(setup: Setup, accumulation: Optional[int] = None) -> Recommendation:
    """The fastest setup that fits (speed_key), with the reasons in the user's numbers."""
    if setup.gpu_memory is None:
        raise PlanError("--recommend needs the GPU memory: --gpu-memory 24GiB or hardware.gpu_memory in the recipe")
    current = plan(setup)
    # Never a bf16 setup on a card without bf16 (issue 34): the candidates train in float16, the same bytes.
    base = replace(setup, dtype="float16") if bf16_note(setup) else setup
    tried = [plan(c) for c in candidates(base)]
    # `fits` is decided on each candidate's upper bound (finetune/plan/bound.py): the margin for what the
    # estimate misses is the bound's width, measured on the corpus, not a share of the GPU.
    fitting = sorted((r for r in tried if r.fits), key=lambda r: speed_key(r.setup))
    chosen = fitting[0] if fitting else None
    steps = None
    if chosen is not None and accumulation is not None and chosen.setup.micro_batch != setup.micro_batch:
        # Keep the sequences per optimizer step: micro batch x accumulation x GPUs.
        steps = max(1, math.ceil(setup.micro_batch * accumulation / chosen.setup.micro_batch))
    rec = Recommendation(current, chosen, tried, [], steps)
    rec.larger = larger_micro_batch(chosen) if chosen is not None else None
    rec.reasons = explain(rec)
    return rec


def larger_micro_batch(chosen: PlanResult, doublings: int = 3) -> Optional[PlanResult]:
    """The largest of 2x, 4x, 8x the chosen micro batch that still fits, or None: GiB to spare buy fuller steps,
    but more rows per step than the recipe's (gradient accumulation cannot absorb it), so it is a suggestion."""
    larger = None
    for k in range(1, doublings + 1):
        result = plan(replace(chosen.setup, micro_batch=chosen.setup.micro_batch * 2 ** k))
        if not result.fits:
            break
        larger = result
    return larger


def explain(rec: Recommendation) -> list[str]:
    """Why: the recipe's own setup against capacity, and what ZeRO buys or costs for this model."""
    cur = rec.current
    s = cur.setup
    out = []
    needs = (f"The recipe as written needs {gib(cur.per_gpu['total'])} GiB on each GPU (upper bound "
             f"{gib(cur.upper_bound)} GiB), which has {gib(s.gpu_memory)} GiB")
    if cur.fits:
        out.append(f"{needs}: it fits.")
    elif cur.cpu_fits is False:
        out.append(f"{needs}, and {gib(cur.cpu['total'])} GiB of CPU memory of {gib(s.cpu_memory)} GiB: it does not fit.")
    else:
        out.append(f"{needs}: it does not fit, {gib(-cur.headroom)} GiB over.")
    # The table's rows (render_text): the numbers quoted below are the ones it shows.
    base = {(r.setup.stage, r.setup.offload_optimizer, r.setup.offload_param): r for r in rec.tried
            if _as_recipe(r.setup, s) and r.setup.max_live_parameters == s.max_live_parameters}
    zero0 = base.get((0, "none", "none"))
    for stage in (1, 2):
        r = base.get((stage, "none", "none"))
        if r is None or zero0 is None:
            continue
        saved = zero0.per_gpu["model_states"] - r.per_gpu["model_states"]
        cost = sum(t.bytes for t in r.terms if t.field == "buffers") - \
            sum(t.bytes for t in zero0.terms if t.field == "buffers" and t.phase != "step")
        if cost > saved and stage == 2:
            what = f"{ {'full': 'full fine-tune', 'lora': 'LoRA', 'qlora': 'QLoRA'}[s.method]} of {s.params / 1e9:.1f}B"
            out.append(f"ZeRO-2 on {s.world} GPU{'s' if s.world != 1 else ''} adds {gib(cost)} GiB of gradient "
                       f"buckets (reduce_bucket_size {s.reduce_bucket_size:,}"
                       f"{', doubled by overlap_comm' if r.setup.overlap else ''}) but saves only "
                       f"{gib(max(saved, 0))} GiB of gradients and optimizer states for this {what}, so stay on "
                       "ZeRO-0 (or one GPU), or lower reduce_bucket_size"
                       + (f" (\"auto\" gives hidden^2 = {s.arch.hidden ** 2:,})" if s.arch else "") + ".")
    r3 = base.get((3, "none", "none"))
    r2 = base.get((2, "none", "none"))
    if r3 is not None and r2 is not None:
        gathered = sum(t.bytes for t in r3.terms if t.name == "prefetched / retained params")
        partition_saving = r2.per_gpu["weights"] - r3.per_gpu["weights"]
        if r3.per_gpu["total"] > r2.per_gpu["total"]:
            # A negative saving (a 4-bit base stored in 16-bit under ZeRO-3) reads as a cost, never "saves -x".
            partitioned = (f"partitioning the weights saves {gib(partition_saving)} GiB" if partition_saving > 0 else
                           f"partitioning the weights saves nothing (it adds {gib(-partition_saving)} GiB)")
            out.append(f"ZeRO-3 needs more than ZeRO-2 here ({gib(r3.per_gpu['total'])} against "
                       f"{gib(r2.per_gpu['total'])} GiB): {partitioned}, but ZeRO-3 keeps {gib(gathered)} GiB of "
                       f"gathered parameters (stage3_max_live_parameters {s.max_live_parameters:,}, prefetch "
                       f"{s.prefetch_bucket_size:,}, reuse distance {s.max_reuse_distance:,}).")
    for r in (cur, rec.chosen):
        if r is None or not r.setup.deepspeed or r.setup.stage != 3:
            continue
        gathered = sum(t.bytes for t in r.terms if t.name == "prefetched / retained params")
        fewer = plan(replace(r.setup, max_live_parameters=min(r.setup.max_live_parameters, FEWER_LIVE_PARAMETERS)))
        saved = r.per_gpu["total"] - fewer.per_gpu["total"]
        if saved > 256 * MiB:
            out.append(f"ZeRO-3 keeps {gib(gathered)} GiB of parameters gathered beyond the module at work "
                       f"(prefetched up to stage3_max_live_parameters {r.setup.max_live_parameters:,}); "
                       f"--set deepspeed.stage3_max_live_parameters={FEWER_LIVE_PARAMETERS} saves {gib(saved)} GiB "
                       f"at the cost of less prefetching, so some speed.")
            break
    if s.arch is not None and s.gpu_memory and cur.per_gpu["logits"] > 0.2 * s.gpu_memory:
        out.append(f"The loss alone needs {gib(cur.per_gpu['logits'])} GiB ({s.micro_batch} x {s.seq_len} tokens "
                   f"x a vocabulary of {s.arch.vocab:,} x 12 bytes); a smaller micro batch shrinks it"
                   + (", and so does the chunked loss (--set training.loss_kernel=chunked)." if s.loss_kernel == "default" else "."))
    out += [f"{note}; every setup tried does." for note in bf16_note(s)]
    out.append("Only setups whose upper bound fits count as fitting: the estimate widened by how far published "
               "measurements of such setups came out above it (docs/plan.md, 'The bound').")
    chosen = rec.chosen
    if chosen is not None and chosen.setup != s:
        c = chosen.setup
        out.append(f"{_short(c)} with micro batch {c.micro_batch}, gradient checkpointing "
                   f"{'on' if c.gradient_checkpointing else 'off'}"
                   + (" and the chunked loss" if c.loss_kernel == "chunked" else "") + " is the fastest setup that fits. "
                   "Setups that offload to the CPU rank last (PCIe and a CPU Adam step), then ZeRO-3 (about 1.5x the "
                   "communication), then those that compute more per token: checkpointing recomputes the forward "
                   f"(x4/3), a micro batch of t tokens keeps the GPU busy about t/(t + {SATURATION_TOKENS}) of the "
                   "time, the chunked loss recomputes the output head.")
    if rec.larger is not None and chosen is not None:
        m, big = chosen.setup.micro_batch, rec.larger
        out.append(f"With {gib(chosen.headroom)} GiB to spare, micro batch {big.setup.micro_batch} fits too "
                   f"({gib(big.per_gpu['total'])} GiB, upper bound {gib(big.upper_bound)}): fuller steps, "
                   f"{big.setup.micro_batch // m}x the rows per optimizer step, so the learning rate may want retuning "
                   f"(--set training.micro_batch_size={big.setup.micro_batch}).")
    return out
