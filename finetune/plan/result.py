"""The planner's result (`PlanResult`): its totals per phase and counter, and its text and JSON renderings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from finetune.plan.archs import names
from finetune.plan.bound import bounded, width_for
from finetune.plan.constants import BOUND_QUANTILE, COUNTERS, FIELDS, TRAINING_ALLOC_CONF
from finetune.plan.setup import Setup, Term
from finetune.units import gib


@dataclass
class PlanResult:
    setup: Setup
    terms: list[Term]
    cpu_terms: list[Term]
    notes: list[str] = field(default_factory=list)
    complete: bool = True  # False when activations/logits are unknown (a bare parameter count)
    trainable: int = 0

    # -- the numbers ---------------------------------------------------------------------------

    def field_bytes(self, name: str) -> int:
        return sum(t.bytes for t in self.terms if t.field == name)

    def phase_bytes(self, phase: str, counters: tuple[str, ...] = COUNTERS) -> int:
        return sum(t.bytes if t.live is None else t.live for t in self.terms
                   if t.phase in ("both", phase) and t.counter in counters)

    @property
    def memory_views(self) -> dict[str, int]:
        """The peak as each counter reports it: torch.cuda.max_memory_allocated, max_memory_reserved
        and nvidia-smi's process usage. `total` and `fits` use the last, the largest."""
        def peak(counters: tuple[str, ...]) -> int:
            return max(self.phase_bytes(p, counters) for p in ("backward", "step"))

        return {"allocated": peak(("allocated",)), "reserved": peak(("allocated", "reserved")),
                "nvidia_smi": peak(COUNTERS)}

    @property
    def bound_width(self) -> tuple[float, str, int]:
        """(width, setup class, its corpus cases): finetune/plan/bound.py."""
        return width_for(self.setup)

    @property
    def upper_bounds(self) -> dict[str, int]:
        """Each counter's stated bound (finetune/plan/bound.py)."""
        return bounded(self.memory_views, self.bound_width[0])

    @property
    def upper_bound(self) -> int:
        """The bound on what the GPU must hold (the allocator's reserved memory widened, plus the CUDA
        context and NCCL): what `fits` and `--recommend` decide on."""
        return self.upper_bounds["nvidia_smi"]

    @property
    def bound_fits(self) -> Optional[bool]:
        if self.setup.gpu_memory is None:
            return None
        return self.upper_bound <= self.setup.gpu_memory

    @property
    def peak_phase(self) -> str:
        return "step" if self.phase_bytes("step") > self.phase_bytes("backward") else "backward"

    @property
    def per_gpu(self) -> dict[str, int]:
        out = {name: self.field_bytes(name) for name in FIELDS}
        out["model_states"] = out["weights"] + out["gradients"] + out["optimizer"]
        out["total"] = max(self.phase_bytes("backward"), self.phase_bytes("step"))
        # JSON order: model states first, then what DeepSpeed's estimators leave out.
        order = ("weights", "gradients", "optimizer", "model_states", "buffers", "activations", "logits",
                 "overhead", "total")
        return {k: out[k] for k in order}

    @property
    def cpu(self) -> dict[str, int]:
        """Per node: offloaded states while training, the checkpoint while loading (not at the same
        time: the loaded copy has moved to the GPUs before DeepSpeed allocates its CPU states), and
        the training processes themselves."""
        offload = sum(t.bytes for t in self.cpu_terms if t.field == "cpu" and t.phase != "load")
        loading = sum(t.bytes for t in self.cpu_terms if t.phase == "load")
        processes = sum(t.bytes for t in self.cpu_terms if t.field == "process")
        return {"offload": offload, "loading": loading, "processes": processes,
                "total": processes + max(offload, loading)}

    @property
    def gpu_fits(self) -> Optional[bool]:
        """Decided on the upper bound, not the point estimate: a run the GPU may refuse does not fit."""
        return self.bound_fits

    @property
    def cpu_fits(self) -> Optional[bool]:
        if self.setup.cpu_memory is None:
            return None
        return self.cpu["total"] <= self.setup.cpu_memory

    @property
    def fits(self) -> Optional[bool]:
        """True/False against the GPU (and CPU, when given) memory; None when no GPU memory is known."""
        gpu = self.gpu_fits
        if gpu is None:
            return None
        return gpu and self.cpu_fits is not False

    @property
    def headroom(self) -> Optional[int]:
        if self.setup.gpu_memory is None:
            return None
        return self.setup.gpu_memory - self.upper_bound

    def _verdict(self) -> str:
        """Against the GPU: decided on the upper bound; when only the bound is over, what the estimate says."""
        gpu = self.setup.gpu_memory
        if self.headroom >= 0:
            return f"fits under the upper bound ({gib(self.upper_bound)} GiB), {gib(self.headroom)} GiB headroom"
        text = f"does NOT fit: the upper bound {gib(self.upper_bound)} GiB is {gib(-self.headroom)} GiB over"
        views = self.memory_views
        # PyTorch's allocator frees its cache and retries before it reports out of memory, so a run over
        # only by the cached part may still start (tight: fragmentation can then make it fail).
        uncached = views["allocated"] + views["nvidia_smi"] - views["reserved"]
        if views["nvidia_smi"] <= gpu:
            text += f" (the estimate, {gib(views['nvidia_smi'])} GiB, fits: it may run, with no margin for what the " \
                    "estimate has missed before)"
        elif uncached <= gpu:
            text += f" (without the allocator's cache {gib(uncached)} GiB: it may start, with no margin for " \
                    "fragmentation)"
        return text

    # -- output --------------------------------------------------------------------------------

    def summary(self) -> str:
        """One line: total against capacity, with the breakdown (used by `finetune lint` rule P001)."""
        g = self.per_gpu
        parts = ", ".join(f"{name} {gib(g[name])}" for name in FIELDS if g[name] or name == "weights")
        head = f"{gib(g['total'])} GiB per GPU"
        if self.setup.gpu_memory is not None:
            head += f" of {gib(self.setup.gpu_memory)} GiB"
        text = f"{head} ({parts}; {self.setup.describe()})"
        if self.headroom is not None:
            text += f": {self._verdict()}"
        if self.cpu_fits is False:
            text += f"; CPU needs {gib(self.cpu['total'])} GiB of {gib(self.setup.cpu_memory)} GiB"
        if not self.complete:
            text += " (model states and buffers only: activations unknown without a config)"
        return text

    def to_json(self) -> dict[str, Any]:
        s = self.setup
        return {
            "model": s.model_label,
            "params": s.params,
            "trainable_params": self.trainable,
            "setup": {"method": s.method, "zero": s.stage if s.deepspeed else None, "deepspeed": s.deepspeed,
                      "offload_optimizer": s.offload_optimizer, "offload_param": s.offload_param,
                      "gpus_per_node": s.gpus_per_node, "nodes": s.nodes, "micro_batch": s.micro_batch,
                      "seq_len": s.seq_len, "gradient_checkpointing": s.gradient_checkpointing,
                      "attn_implementation": s.attn, "dtype": s.dtype, "loss_kernel": s.loss_kernel,
                      "reduce_bucket_size": s.reduce_bucket_size, "overlap_comm": s.overlap,
                      "lora_dropout": s.lora_dropout, "full_rows": s.full_rows, "ds_fused_adam": s.ds_fused_adam},
            "per_gpu": self.per_gpu,
            "memory": {"allocated_peak": self.memory_views["allocated"],
                       "reserved_peak": self.memory_views["reserved"],
                       "nvidia_smi": self.memory_views["nvidia_smi"], "fits_uses": "upper_bound",
                       "upper_bound": self.upper_bound, "upper_bound_fits": self.bound_fits,
                       "upper_bounds": self.upper_bounds,
                       "upper_bound_width": round(self.bound_width[0], 4),
                       "upper_bound_class": self.bound_width[1],
                       "upper_bound_method": f"reserved x (1 + width) + CUDA context and NCCL; width: the "
                                             f"{BOUND_QUANTILE:.0%} quantile of measured / planned - 1 over the "
                                             f"{self.bound_width[2]} cases of tests/data/plan_corpus.json in the "
                                             "class (finetune/plan/bound.py)",
                       "expandable_segments": s.expandable_segments, "shapes_vary": s.shapes_vary,
                       "training_alloc_conf": TRAINING_ALLOC_CONF},
            "phases": {"backward": self.phase_bytes("backward"), "step": self.phase_bytes("step"),
                       "peak": self.peak_phase},
            "cpu": self.cpu,
            "gpu_memory": s.gpu_memory,
            "cpu_memory": s.cpu_memory,
            "fits": self.fits,
            "headroom": self.headroom,
            "complete": self.complete,
            "terms": [{"field": t.field, "name": t.name, "bytes": t.bytes, "phase": t.phase, "note": t.note}
                      for t in self.terms + self.cpu_terms if t.bytes],
            "notes": self.notes,
        }

    def render_text(self) -> str:
        s = self.setup
        lines = [f"model    {s.model_label}"]
        lines.append(f"method   {_method_line(self)}")
        lines.append(f"setup    {s.describe()}")
        if s.launch_note:
            lines.append(f"launch   {s.launch_note}")
        if s.data_note:
            lines.append(f"data     {s.data_note}")
        lines.append("")
        lines.append(f"per GPU{'':35}GiB")
        g = self.per_gpu
        for name in FIELDS:
            terms = [t for t in self.terms if t.field == name and t.bytes]
            lines.append(f"  {name:<36}{gib(g[name]):>7}")
            for t in terms:
                when = "" if t.phase == "both" else f" [{t.phase} only]"
                note = f"  {t.note}" if t.note else ""
                lines.append(f"    {t.name:<34}{gib(t.bytes):>7}{when}{note}")
            if name == "optimizer":
                lines.append(f"  {'= model states':<36}{gib(g['model_states']):>7}")
        total = f"  {'total (peak, ' + self.peak_phase + ')':<36}{gib(g['total']):>7}"
        if s.gpu_memory is not None:
            total += f"  of {gib(s.gpu_memory)}: {self._verdict()}"
        lines.append(total)
        if self.peak_phase == "backward" and self.phase_bytes("step") != self.phase_bytes("backward"):
            lines.append(f"  {'optimizer step phase':<36}{gib(self.phase_bytes('step')):>7}")
        views = self.memory_views
        lines.append(f"  {'as torch.cuda.max_memory_allocated':<36}{gib(views['allocated']):>7}")
        lines.append(f"  {'as torch.cuda.max_memory_reserved':<36}{gib(views['reserved']):>7}"
                     "  + allocator rounding and fragmentation")
        lines.append(f"  {'as nvidia-smi':<36}{gib(views['nvidia_smi']):>7}  + CUDA context and NCCL")
        width, klass, cases = self.bound_width
        lines.append(f"  {'upper bound (nvidia-smi)':<36}{gib(self.upper_bound):>7}  reserved + {width:.0%}: "
                     f"{BOUND_QUANTILE:.0%} of {cases} published measurements of '{klass}' setups were at or "
                     "below it (docs/plan.md); `fits` uses this one")
        alloc_conf = (f"expandable_segments on (training sets PYTORCH_CUDA_ALLOC_CONF={TRAINING_ALLOC_CONF} unless "
                      "it or PYTORCH_ALLOC_CONF is set)" if s.expandable_segments else "expandable_segments off")
        shapes = "a new shape per batch" if s.shapes_vary else "one shape per batch"
        history = "" if s.expandable_segments or not s.shapes_vary else \
            ": the cache keeps segments of earlier, shorter batches (allocator history above)"
        lines.append(f"  allocator: {alloc_conf}, {shapes}{history}")
        c = self.cpu
        lines.append("")
        lines.append(f"per node CPU{'':30}GiB")
        for t in self.cpu_terms:
            if t.bytes:
                when = {"load": " [while loading]"}.get(t.phase, "")
                note = f"  {t.note}" if t.note else ""
                lines.append(f"    {t.name:<34}{gib(t.bytes):>7}{when}{note}")
        cpu_total = f"  {'total':<36}{gib(c['total']):>7}"
        if s.cpu_memory is not None:
            cpu_total += f"  of {gib(s.cpu_memory)}: " + ("fits" if self.cpu_fits else "does NOT fit")
        lines.append(cpu_total)
        if not self.complete:
            lines.append("")
            lines.append("activations and logits are not included: pass --model with a config.json or an "
                         f"architecture name ({', '.join(names()[:3])}, ...) for them")
        for note in self.notes:
            lines.append(f"note: {note}")
        return "\n".join(lines) + "\n"


def _method_line(result: PlanResult) -> str:
    s = result.setup
    t = result.trainable
    share = f"{100 * t / s.params:.2f}%" if s.params else "?"
    if s.method == "full":
        return f"full fine-tune: {t / 1e6:,.1f}M trainable (100%)"
    targets = ",".join(s.lora_targets) + (",experts" if s.lora_experts else "") + (",router" if s.lora_router else "")
    base = "frozen base 4-bit NF4" + (" + double quant" if s.double_quant else "") if s.method == "qlora" \
        else f"frozen base {s.dtype}"
    return f"{s.method} r={s.lora_r} on {targets}: {t:,} trainable ({share}), {base}"
