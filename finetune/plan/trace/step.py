"""`finetune plan --trace`: run the real training step on fake tensors and record what is live.

The model is transformers' own modeling code for the architecture, built from a config alone (on the
meta device: no weights, no initialisation), wrapped as training wraps it (gradient checkpointing,
peft LoRA; QLoRA's 4-bit linears emulated in finetune/plan/trace/qlora.py), then its parameters become
FakeTensors (torch._subclasses.fake_tensor.FakeTensorMode: shapes, dtypes and strides, no storage). Two training
steps run under a dispatch mode (finetune.plan.trace.live_tensors.LiveTensors) that counts the bytes of every
tensor storage each aten op creates and drops: forward, the loss (transformers' ForCausalLMLoss),
backward and the optimizer step (torch's AdamW, fused), then zero_grad. The first step creates the
optimizer's states, as in training; the second is the one reported, so its backward sees them.

What runs is the CPU kernels' view (FakeTensorMode dispatches to each op's meta function; its device
is the CPU). Where a CUDA kernel allocates something the CPU path does not, a cited constant is added
(CUDA_ONLY below). Not traced: DeepSpeed (its partitions and buckets are the analytic planner's terms,
checked against DeepSpeed's own estimators and allocations in tests/plan/test_planner.py), and allocator
rounding / caching (finetune.plan.allocator).

Why not torch.distributed._tools.mem_tracker.MemTracker: its module pre-forward hook registers a
gradient hook on every parameter of the module and raises on frozen ones ("cannot register a hook on
a tensor that doesn't require gradient"), which every LoRA model has. The dispatch-mode bookkeeping
here is the same idea (storages by weak reference, categorised when created).

Torch, transformers and peft are imported inside functions: `finetune plan` without --trace stays pure.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from finetune import objectives
from finetune.units import GiB, MiB, gib_text
from finetune.plan.setup import PlanError, Setup
from finetune.plan.states import trainable_weight_bytes
from finetune.recipe.references import MODEL_CONFIG

KINDS = ("weights", "optimizer", "gradients", "activations", "logits", "temporaries")


@dataclass
class TraceResult:
    setup: Setup
    peak: int  # bytes of live tensors at the step's peak (CUDA_ONLY included)
    phase: str  # forward | backward | step
    module: str  # the innermost module running at the peak
    by_kind: dict[str, int]  # what was live at the peak
    phase_peaks: dict[str, int]
    cuda_only: list[tuple[str, int, str]] = field(default_factory=list)  # (name, bytes, source)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    # The step's allocations replayed through the caching allocator's rules (finetune/plan/allocator.py): what
    # max_memory_reserved would show after two steps of this shape; None when it could not be extrapolated.
    reserved: Optional[int] = None

    def to_json(self) -> dict[str, Any]:
        return {"peak": self.peak, "phase": self.phase, "module": self.module, "by_kind": self.by_kind,
                "phase_peaks": self.phase_peaks, "reserved": self.reserved,
                "cuda_only": [{"name": n, "bytes": b, "source": s} for n, b, s in self.cuda_only],
                "seconds": round(self.seconds, 2), "notes": self.notes}

    def render_text(self) -> str:
        lines = [f"trace    one training step of transformers' model code on fake tensors ({self.seconds:.1f} s)",
                 f"  peak {_size(self.peak)} in {self.phase}, inside {self.module or 'the model'}; live then:"]
        for kind in KINDS:
            lines.append(f"    {kind:<34}{_size(self.by_kind.get(kind, 0)):>12}")
        for name, size, source in self.cuda_only:
            lines.append(f"    {name:<34}{_size(size):>12}  CUDA only: {source}")
        lines.append("  phase peaks: " + ", ".join(f"{p} {_size(b)}" for p, b in self.phase_peaks.items()))
        if self.reserved is not None:
            alloc = "on" if self.setup.expandable_segments else "off"
            lines.append(f"  as max_memory_reserved {_size(self.reserved)}: the step's allocations replayed through the "
                         f"caching allocator's rules (expandable segments {alloc}, one shape)")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines) + "\n"


def _size(value: int) -> str:
    return gib_text(value) if value >= GiB else f"{value / MiB:.1f} MiB"


def hf_config(setup: Setup, config: Optional[dict] = None) -> dict:
    """The transformers config of the setup's architecture: `config` (a config.json) when given, else
    the planner's table shapes written as config keys."""
    arch = setup.arch
    if arch is None:
        raise PlanError("--trace needs the model's shapes: a config.json or an architecture name, not a parameter count")
    if config is not None:
        return dict(config)
    if arch.experts:
        raise PlanError("--trace of a mixture-of-experts model needs its config.json (pass --model PATH)")
    out = {"model_type": arch.model_type, "hidden_size": arch.hidden, "intermediate_size": arch.intermediate,
           "num_hidden_layers": arch.layers, "num_attention_heads": arch.heads,
           "num_key_value_heads": arch.kv_heads, "vocab_size": arch.vocab, "tie_word_embeddings": arch.tied,
           "max_position_embeddings": max(setup.seq_len * max(1, setup.micro_batch), 4096)}
    if arch.head_dim:
        out["head_dim"] = arch.head_dim
    if arch.qkv_bias and arch.model_type not in ("qwen2", "qwen2_moe"):
        out["attention_bias"] = True
    if not arch.logit_softcap and arch.model_type == "gemma2":
        out["final_logit_softcapping"] = None
    if arch.model_type == "mistral":
        # The table states no sliding window (nor does the analytic plan model one): MistralConfig's default
        # (4,096) would make transformers build a sliding-window mask for sdpa. v0.3's config has none.
        out["sliding_window"] = None
    return out


def config_of(name_or_path: str) -> Optional[dict]:
    """The config.json dict of a model reference when there is one here (a `builtin:` model or a local
    directory / file), else None (the planner's table shapes are used)."""
    from pathlib import Path

    from finetune.builtin import builtin_config, is_builtin

    if is_builtin(name_or_path):
        return {"model_type": "llama", **builtin_config(name_or_path)}
    path = Path(name_or_path).expanduser()
    file = path / MODEL_CONFIG if path.is_dir() else path
    if file.is_file():
        from finetune.fsutil import read_json

        try:
            data = read_json(file)
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None
    return None


def _torch_dtype(name: str):
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def build_model(setup: Setup, config: dict):
    """The model as training holds it, on the meta device: dtype, attention kernel, checkpointing, LoRA."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(config)
    model_type = cfg.pop("model_type", "llama")
    for key in ("architectures", "_name_or_path", "transformers_version", "torch_dtype", "dtype",
                "quantization_config", "auto_map"):
        cfg.pop(key, None)
    # Flash attention has no CPU kernel; sdpa without a mask runs torch's flash kernel for CPU, which
    # saves what flash-attn saves (q, k, v, out and an fp32 log-sum-exp per head and query).
    attn = "sdpa" if setup.attn.startswith("flash") else setup.attn
    try:
        hf = AutoConfig.for_model(model_type, **cfg)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf, dtype=_torch_dtype(setup.dtype), attn_implementation=attn)
    except (ValueError, KeyError, TypeError) as exc:  # a model_type or config this transformers cannot build
        import transformers

        raise PlanError(f"--trace cannot build model_type {str(model_type)[:80]!r} with transformers "
                        f"{transformers.__version__} ({' '.join(str(exc).split()).split('. ')[0][:200]}); the plan without --trace "
                        "does not need it") from None
    if setup.gradient_checkpointing:
        # finetune.train.model.prepare_model: non-reentrant, and the embedding output requires grad.
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if setup.method != "full":
        from peft import LoraConfig, get_peft_model

        if setup.gradient_checkpointing:
            model.enable_input_require_grads()
        # The adapters' dtype as training leaves them (states.trainable_weight_bytes): DeepSpeed's engine casts
        # them to the 16-bit dtype; without it peft keeps them fp32, or with adapter_dtype "model" (peft
        # 0.7-0.11) in the base weight's dtype (fp32 over a 4-bit base, whose packed weight is no float; the
        # emulation below quantizes after this).
        fp32 = trainable_weight_bytes(setup) == 4
        model = get_peft_model(model, autocast_adapter_dtype=fp32, peft_config=LoraConfig(
            task_type="CAUSAL_LM", r=setup.lora_r, lora_alpha=2 * setup.lora_r, lora_dropout=setup.lora_dropout,
            target_modules=list(setup.lora_targets), modules_to_save=list(setup.modules_to_save) or None))
        if setup.method == "qlora":
            from finetune.plan.trace.qlora import four_bit_linears, prepare_for_kbit_training

            four_bit_linears(model, setup)
            if setup.kbit_prepared:
                prepare_for_kbit_training(model)
    if setup.loss_kernel == "chunked":  # what finetune.train.runner sets up: the same chunks
        from finetune.chunks import chunk_count
        from finetune.loss_kernel import use_chunked_loss

        use_chunked_loss(model, chunk_count(setup.micro_batch * setup.seq_len, hf.vocab_size, setup.loss_chunk_tokens))
    model.train()
    return model


def fake_parameters(model, mode) -> None:
    """Each meta parameter and buffer becomes a FakeTensor on the CPU of the same shape and dtype. A tensor held
    in two places (tied embeddings, peft's wrappers) becomes one fake tensor held in both."""
    import torch

    made: dict[int, tuple] = {}  # id(meta tensor) -> (the meta tensor, kept alive so ids stay unique; its fake)

    def fake(t, make):
        if id(t) not in made:
            made[id(t)] = (t, make(t))
        return made[id(t)][1]

    with mode:
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is not None:
                    module._parameters[name] = fake(p, lambda p: torch.nn.Parameter(
                        torch.empty(p.shape, dtype=p.dtype, device="cpu"), requires_grad=p.requires_grad))
            for name, b in list(module._buffers.items()):
                if b is not None:
                    module._buffers[name] = fake(b, lambda b: torch.zeros(b.shape, dtype=b.dtype, device="cpu"))


def run_step(model, optimizer, batch: dict, tracker=None, autocast=contextlib.nullcontext()) -> None:
    """One training step as the Trainer runs it: forward with labels (under `autocast`, the Trainer's
    mixed-precision context, trainer_autocast: forward and loss only), backward, step, zero_grad."""
    if tracker is not None:
        tracker.phase = "forward"
    with autocast:
        loss = model(**batch).loss
    if tracker is not None:
        tracker.phase = "backward"
    loss.backward()
    del loss
    if tracker is not None:
        tracker.phase = "step"
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def accumulate(model, batch: dict, autocast=contextlib.nullcontext()) -> None:
    """Forward and backward of one micro batch without the optimizer step (gradient accumulation)."""
    with autocast:
        loss = model(**batch).loss
    loss.backward()
    del loss


def make_batch(setup: Setup, vocab: int, device: str = "cpu") -> dict:
    """micro_batch rows of seq_len tokens, labels = inputs (the collator's labels for SFT). A padded batch
    (what the collator makes unless every row is full, Setup.full_rows) carries its 2D attention mask;
    flash attention takes none (boundaries instead)."""
    import torch

    ids = torch.zeros((setup.micro_batch, setup.seq_len), dtype=torch.long, device=device)
    batch = {"input_ids": ids, "labels": ids.clone()}
    if not setup.full_rows and not setup.attn.startswith("flash"):
        batch["attention_mask"] = torch.ones_like(ids)
    return batch


@contextlib.contextmanager
def data_decisions(setup: Setup):
    """Decisions transformers takes from the batch's values, which fake tensors do not have, taken from
    the setup instead. masking_utils.find_packed_sequence_indices reads the position ids for restarts
    (packed rows); a 2D attention mask is checked for padding (transformers cannot on fake tensors, so it
    builds the 4D mask, as for a padded batch: make_batch passes one only when rows are padded)."""
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices
    if not (setup.packing or setup.padding_free):
        masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


@contextlib.contextmanager
def cuda_paths():
    """Where an op decomposes differently on CPU than on CUDA, the CUDA path. aten/src/ATen/native/
    Dropout.cpp: dropout takes the fused native_dropout (a bool mask) only for CUDA/XPU inputs
    (is_fused_kernel_acceptable); on the CPU it multiplies by an fp32 noise tensor, 4 bytes per element
    kept for backward instead of 1."""
    import torch
    import torch.nn.functional as F

    original = F.dropout

    def dropout(input, p=0.5, training=True, inplace=False):
        if training and 0 < p < 1 and input.numel():
            return torch.native_dropout(input, p, True)[0]
        return original(input, p, training, inplace)

    F.dropout = dropout
    try:
        yield
    finally:
        F.dropout = original


def trainer_autocast(setup: Setup):
    """The HF Trainer's autocast around forward and loss (Setup.trainer_autocast: no DeepSpeed, a 16-bit
    dtype). Over 16-bit weights it casts nothing; it decides which matmuls run in 16 bits over fp32 weights:
    peft's fp32 adapters (lora_A then saves a 16-bit cast of its input) and the fp32 norms, embeddings and
    head prepare_model_for_kbit_training leaves (Setup.kbit_prepared)."""
    import torch

    if not setup.trainer_autocast:
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=_torch_dtype(setup.dtype))


def make_optimizer(model, setup: Setup):
    """torch's AdamW as the setup's step runs it: fused, or multi-tensor (Setup.optimizer_impl "foreach"; torch
    2.0's version, "foreach_torch20", kept one more temporary than today's, which the trace cannot run)."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    if setup.optimizer_impl.startswith("foreach"):
        return torch.optim.AdamW(params, lr=1e-5, foreach=True)
    return torch.optim.AdamW(params, lr=1e-5, fused=True)


def cuda_only_terms(setup: Setup, config: dict) -> list[tuple[str, str, int, str]]:
    """(name, phase, bytes, source) of what a CUDA step allocates that the CPU kernels do not."""
    from finetune.plan.constants import CUBLAS_HANDLES, CUBLAS_WORKSPACE
    from finetune.plan.planner import is_hopper

    workspace = CUBLAS_WORKSPACE["hopper" if is_hopper(setup.gpu_type) else "other"]
    out = [("cuBLAS workspaces", "all", CUBLAS_HANDLES * workspace,
            "CublasHandlePool.cpp, one per handle (forward + autograd thread)")]
    if setup.attn.startswith("flash") or (setup.attn == "sdpa" and setup.full_rows):
        # flash-attn csrc/flash_attn/flash_api.cpp mha_bwd (torch's sdpa runs the same kernel for
        # unmasked rows): fp32 softmax_d (batch, heads, seq rounded to 128) and dq_accum (batch, seq
        # rounded to 128, heads, head_dim rounded to 32, 64 above 128), and with grouped KV heads dk/dv
        # expanded to every query head in the model dtype, for one layer's attention at a time.
        heads = config["num_attention_heads"]
        kv = config.get("num_key_value_heads") or heads
        dim = config.get("head_dim") or config["hidden_size"] // heads
        rows = setup.micro_batch
        seq = -(-setup.seq_len // 128) * 128
        dim_r = -(-dim // (32 if dim <= 128 else 64)) * (32 if dim <= 128 else 64)
        size = 4 * rows * heads * seq + 4 * rows * seq * heads * dim_r
        if kv != heads:
            size += 2 * rows * setup.seq_len * heads * dim * setup.element_bytes
        out.append(("flash-attention backward buffers", "backward", size,
                    "flash_api.cpp mha_bwd: softmax_d, dq_accum, dk/dv expanded (one layer)"))
    return out


def _trace_depth(setup: Setup, cfg: dict):
    """The tracker of one traced step of the model with cfg's depth."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from finetune.plan.trace.live_tensors import LiveTensors

    model = build_model(setup, cfg)
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    fake_parameters(model, mode)
    autocast = trainer_autocast(setup)
    with mode, data_decisions(setup), cuda_paths():
        batch = make_batch(setup, cfg["vocab_size"])
        optimizer = make_optimizer(model, setup)
        run_step(model, optimizer, batch, autocast=autocast)  # creates the optimizer's states
        if setup.gradient_accumulation > 1:
            # A later micro batch of the accumulation: the Trainer calls zero_grad only after the
            # optimizer step, so backward starts with the earlier micro batches' gradients alive.
            accumulate(model, batch, autocast=autocast)
        tracker = LiveTensors(model, optimizer, vocab=cfg["vocab_size"], inputs=batch.values())
        with tracker:
            run_step(model, optimizer, batch, tracker, autocast=autocast)
    return tracker


def _phases(tracker) -> dict[str, tuple[int, dict[str, int], str]]:
    return {p: (tracker.phase_peaks[p], tracker.phase_kinds[p], tracker.phase_modules[p]) for p in tracker.phase_peaks}


SHALLOW = (2, 3, 4)  # depths traced when the model is deeper: two differences to check, one to extrapolate


def trace(setup: Setup, config: Optional[dict] = None, extrapolate: bool = True) -> TraceResult:
    """Trace one training step of `setup` (see the module docstring); model code that fails on this config
    (transformers' or peft's: a model_type it cannot build, LoRA targets the model lacks) is a PlanError."""
    try:
        return _trace(setup, config, extrapolate)
    except PlanError:
        raise
    except Exception as exc:  # noqa: BLE001 - the model's own code raises what it likes on a config it does not fit
        text = " ".join(str(exc).split()).split(". ")[0][:300]
        raise PlanError(f"--trace cannot trace this model: {type(exc).__name__}: {text}; the plan without --trace "
                        "does not run the model's code") from None


def _trace(setup: Setup, config: Optional[dict], extrapolate: bool) -> TraceResult:
    """Trace one training step of `setup` (see the module docstring).

    Decoder layers are identical, so what is live at each place of a phase grows by the same bytes per
    layer: a model deeper than 4 layers is traced at 2, 3 and 4 layers, and when the two differences
    agree to the byte for every place and kind, extrapolated to its depth (else traced whole; _extrapolate).
    tests/plan/trace/test_trace.py checks the extrapolation against a full-depth trace."""
    if objectives.get(setup.objective).uses_trl:  # TRL's step is not the Trainer's causal-LM step traced here
        raise PlanError(f"--trace runs the SFT step only (objective {setup.objective} is planned analytically)")
    if setup.loss_kernel == "liger":
        raise PlanError("--trace cannot run Liger's loss kernel (Triton, CUDA only); it is planned analytically")
    if setup.quant_format != "bnb-nf4":
        raise PlanError("--trace models bitsandbytes 4-bit only")
    if setup.optimizer not in ("adamw", "adam"):
        raise PlanError(f"--trace runs torch's AdamW; optimizer {setup.optimizer} is planned analytically")
    start = time.perf_counter()
    cfg = hf_config(setup, config)
    depth = cfg["num_hidden_layers"]
    phases = reserved = None
    how = f"all {depth} layers traced"
    if extrapolate and depth > SHALLOW[-1]:
        trackers = [_trace_depth(setup, {**cfg, "num_hidden_layers": d}) for d in SHALLOW]
        phases = _extrapolate([t.place_peaks for t in trackers], depth)
        if phases is not None:
            how = f"traced at {', '.join(map(str, SHALLOW))} layers, extrapolated to {depth} (exactly linear)"
            reserved = _extrapolate_reserved([_replayed(t, setup, cfg) for t in trackers], depth)
    if phases is None:
        tracker = _trace_depth(setup, cfg)
        phases, reserved = _phases(tracker), _replayed(tracker, setup, cfg)
    extra = cuda_only_terms(setup, cfg)
    totals = {p: size + sum(b for _, when, b, _ in extra if when in ("all", p)) for p, (size, _, _) in phases.items()}
    peak_phase = max(totals, key=totals.get)
    result = TraceResult(setup=setup, peak=totals[peak_phase], phase=peak_phase, module=phases[peak_phase][2],
                         by_kind=dict(phases[peak_phase][1]), phase_peaks=totals,
                         cuda_only=[(n, b, src) for n, when, b, src in extra if when in ("all", peak_phase)],
                         seconds=time.perf_counter() - start, notes=[how], reserved=reserved)
    if setup.attn.startswith("flash"):
        result.notes.append("flash attention traced as torch's CPU flash kernel (same saved tensors)")
    if setup.method == "qlora":
        result.notes.append("bitsandbytes 4-bit linears emulated: packed weight, absmax, dequantized copy while each runs")
    if setup.deepspeed:
        result.notes.append("one GPU, no DeepSpeed: ZeRO's partitions and buckets are the analytic plan's terms")
    return result


def _replayed(tracker, setup: Setup, cfg: dict) -> int:
    """max_memory_reserved after two steps of the traced shape, by the caching allocator's rules (the resident
    storages, the cuBLAS workspaces, then the step's allocations and frees twice)."""
    from finetune.plan.allocator import replay

    workspaces = [b for name, _, b, _ in cuda_only_terms(setup, cfg) if name.startswith("cuBLAS")]
    return replay(tracker.resident + workspaces, [tracker.events] * 2, setup.expandable_segments).peak_reserved


def _extrapolate_reserved(shallow: list[int], depth: int) -> Optional[int]:
    """The replayed reserved bytes at `depth` from those at SHALLOW depths when each layer adds the same
    (within one 20 MiB segment or page: the rules pack blocks into them), else None."""
    from finetune.plan.allocator import K_LARGE_BUFFER

    a, b, c = shallow
    if abs((c - b) - (b - a)) > K_LARGE_BUFFER:
        return None
    return c + (depth - SHALLOW[-1]) * (c - b)


def _extrapolate(shallow: list[dict], depth: int) -> Optional[dict]:
    """Each phase's peak and kinds at `depth` layers from its places' peaks at SHALLOW depths (LiveTensors
    .place_peaks), or None when a place does not grow exactly linearly. A phase's peak can move from one place
    to another as layers are added (the loss's buffers at the start of backward, every gradient at its end), so
    each place is extrapolated and the largest taken. The middle layers' places are left out: with identical
    layers what is live in layer k's backward (or forward) is linear in k, so the first or the last one holds
    the phase's peak over the layers."""
    import re

    a, b, c = shallow
    if not (a.keys() == b.keys() == c.keys()):
        return None
    out = {}
    extra, last = depth - SHALLOW[-1], SHALLOW[-1] - 1
    for phase in c:
        common = a[phase].keys() & b[phase].keys() & c[phase].keys()
        if not common:
            return None
        if any(max(x[phase][p][0] for p in common) != max(v[0] for v in x[phase].values()) for x in shallow):
            return None  # the peak at a shallow depth was in a middle layer
        places = []
        for place in common:
            (pa, ka, _), (pb, kb, _), (pc, kc, module) = a[phase][place], b[phase][place], c[phase][place]
            if pc - pb != pb - pa or any(kc[k] - kb[k] != kb[k] - ka[k] for k in kc):
                return None
            module = re.sub(r"layers\.(\d+)",
                            lambda m: f"layers.{int(m.group(1)) + (extra if int(m.group(1)) == last else 0)}", module)
            places.append((pc + extra * (pc - pb), {k: kc[k] + extra * (kc[k] - kb[k]) for k in kc}, module))
        out[phase] = max(places, key=lambda p: p[0])
    return out
