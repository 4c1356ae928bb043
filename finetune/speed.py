"""How fast a run trains once warmed up: steady tokens/s, step times, model FLOPs and MFU (torch-free).

- Steady state: the runner stamps the host clock at each optimizer step's end (TrainClock, no added
  synchronisation); the first WARMUP_STEPS steps (cuBLAS and allocator warm-up, DeepSpeed's first-step
  bookkeeping, a first checkpoint) are left out, and the window from the end of step WARMUP_STEPS to the
  last step's end gives tokens/s. Host stamps of single steps are uneven where the host runs ahead of the
  GPU and waits at the next synchronising call (a logged loss, DeepSpeed's overflow check), so p50/p90 of
  single steps describe the host's rhythm while the window's tokens/s is the speed; the runner synchronises
  the device once where the window opens and once where it closes, so the window measures finished work.
- Model FLOPs, the basis of the published anchors (docs/gpu-acceptance.md): 6 x N per trained token, N the
  parameters of every matmul a token runs through (each layer's attention and MLP, the experts it is routed
  to, the output head; not the embedding lookup), for every method, plus 12 x layers x attention width x
  Σ len² / tokens for attention (PaLM, appendix B; pytorch/torchtitan's get_num_flop_per_token). LoRA and
  QLoRA are counted like a full fine-tune, as LLaMA-Factory's scripts/stat_utils/cal_mfu.py does for its
  LoRA figures (the frozen weights' gradients are not computed, so the GPU does about 2/3 of that work).
  Recomputation (gradient checkpointing) is not counted: MFU, not hardware FLOPs utilisation.
- MFU = model FLOP/s / (GPUs x dense bf16 peak of the GPU), where the peak is known (PEAK_BF16_TFLOPS).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

WARMUP_STEPS = 5  # optimizer steps left out of the steady window (issue 35)
MIN_STEADY_STEPS = 2  # steps the window needs after the warm-up; a shorter run reports no steady figures

# Dense (no sparsity) bf16 tensor-core peak of one GPU in TFLOP/s, matched against torch.cuda.get_device_name()
# in this order (the first substring that matches wins): half of each datasheet's "with sparsity" figure.
PEAK_BF16_TFLOPS: tuple[tuple[str, Optional[float], str], ...] = (
    ("H100 PCIe", 756.0, "NVIDIA H100 datasheet (PCIe: 1,513 with sparsity)"),
    ("H100 NVL", 835.0, "NVIDIA H100 datasheet (NVL: 1,671 with sparsity)"),
    ("H100", 989.0, "NVIDIA H100 datasheet (SXM: 1,979 with sparsity)"),
    ("H200", 989.0, "NVIDIA H200 datasheet (SXM: 1,979 with sparsity)"),
    ("H800", 989.0, "NVIDIA H800 datasheet (SXM: 1,979 with sparsity)"),
    ("A100", 312.0, "NVIDIA A100 datasheet (624 with sparsity)"),
    ("A800", 312.0, "NVIDIA A800 datasheet (624 with sparsity)"),
    ("L40S", 362.0, "NVIDIA L40S datasheet (733 with sparsity)"),
    ("L4", 121.0, "NVIDIA L4 datasheet (242 with sparsity)"),
    ("A10G", None, "A10G: no NVIDIA datasheet figure (AWS's variant of the A10); MFU left out"),
    ("A10", 125.0, "NVIDIA A10 datasheet (250 with sparsity)"),
)


def peak_bf16_flops(device_name: str) -> tuple[Optional[float], Optional[str]]:
    """(FLOP/s, source) of one GPU named `device_name`; (None, None) for a GPU the table does not know."""
    for key, tflops, source in PEAK_BF16_TFLOPS:
        if key in device_name:
            return (tflops * 1e12 if tflops else None), source
    return None, None


FLOPS_BASIS = ("6 x matmul parameters per token + 12 x layers x attention width x sum(len^2) per sequence "
               "(PaLM appendix B, torchtitan; LoRA/QLoRA counted as full, as LLaMA-Factory's cal_mfu.py)")


def matmul_params(arch) -> int:
    """Weights of the matmuls one token runs through (finetune.plan.archs.Arch): every layer's attention
    projections, its MLP (a MoE layer: the experts it is routed to and the shared one), the output head."""
    attention = sum(l.weight_numel for l in arch.attention_linears())
    mlp = 3 * arch.hidden * (arch.dense_mlp_layers * arch.intermediate + arch.moe_layers * arch.active_mlp_width)
    return arch.layers * attention + mlp + arch.vocab * arch.hidden


def step_flops(arch, tokens: int, squares: int) -> float:
    """Model FLOPs of trained `tokens` whose sequences' lengths squared sum to `squares` (module docstring)."""
    return 6.0 * matmul_params(arch) * tokens + 12.0 * arch.layers * arch.q_dim * squares


def flops_per_token(arch, seq_len: int) -> float:
    """Model FLOPs per token of sequences `seq_len` long (every sequence full)."""
    return step_flops(arch, 1, seq_len)


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


PER_STEP_KEPT = 200  # steps of the steady window summary.json lists one by one


def steady(stamps: Sequence[float], tokens: Sequence[int], squares: Sequence[int], world: int = 1,
           arch=None, peak_flops: Optional[float] = None, warmup: int = WARMUP_STEPS) -> dict[str, Any]:
    """summary.json's `steady`: the steps after `warmup`, from the step-end stamps (stamps[0] is the start of
    training, stamps[k] the end of step k) and each step's trained tokens and sum of squared sequence lengths,
    summed over every rank. `reason` says why a figure is missing."""
    steps = max(0, len(stamps) - 1)
    out: dict[str, Any] = {"warmup_steps": warmup, "steps": max(0, steps - warmup), "tokens_per_second": None,
                           "step_seconds_p50": None, "step_seconds_p90": None, "mfu": None, "flops_per_token": None,
                           "flops_basis": FLOPS_BASIS, "reason": None}
    if steps - warmup < MIN_STEADY_STEPS:
        out["reason"] = (f"{steps} step{'s' if steps != 1 else ''} in this start: the steady window needs "
                         f"{warmup + MIN_STEADY_STEPS} (the first {warmup} are warm-up)")
        return out
    window = stamps[warmup:]
    seconds = window[-1] - window[0]
    intervals = [b - a for a, b in zip(window, window[1:])]
    trained = sum(tokens[warmup:])
    out.update(step_seconds_p50=_quantile(intervals, 0.5), step_seconds_p90=_quantile(intervals, 0.9),
               tokens_per_second=trained / seconds if seconds > 0 and trained else None, seconds=seconds,
               tokens=trained,
               # the window's first steps one by one: which steps were slow, and how long their rows were
               per_step={"seconds": [round(x, 5) for x in intervals[:PER_STEP_KEPT]],
                         "tokens": list(tokens[warmup:warmup + PER_STEP_KEPT])})
    if arch is not None and trained and seconds > 0:
        flops = step_flops(arch, trained, sum(squares[warmup:]))
        out["flops_per_token"] = flops / trained
        if peak_flops:
            out["mfu"] = flops / seconds / (world * peak_flops)
        else:
            out["reason"] = "no MFU: the GPU's peak is not in finetune.speed.PEAK_BF16_TFLOPS (or no GPU)"
    return out


def steady_text(steady: Optional[dict[str, Any]]) -> str:
    """One line for the console and report.html: 'steady 1,234 tokens/s, step p50 0.81 s / p90 0.84 s, MFU 31.2%'."""
    if not steady:
        return "steady: n/a"
    if steady.get("tokens_per_second") is None:
        return f"steady: n/a ({steady.get('reason') or 'no tokens counted'})"
    text = (f"steady {steady['tokens_per_second']:,.0f} tokens/s over steps {steady['warmup_steps'] + 1}-"
            f"{steady['warmup_steps'] + steady['steps']}, step p50 {steady['step_seconds_p50']:.3g} s / "
            f"p90 {steady['step_seconds_p90']:.3g} s")
    if steady.get("mfu") is not None:
        text += f", MFU {100 * steady['mfu']:.1f}%"
    return text
