"""LoRA as PEFT defines it: the adapter's saved format, scaling and rank/alpha patterns, and the merge
arithmetic (delta, DoRA, lora_B bias, fan_in_fan_out, tied embeddings), mirroring peft/tuners/lora."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import torch

from finetune.rundir.names import ADAPTER_CONFIG
from finetune.weights.merge_inputs import adapter_weights
from finetune.weights.errors import MergeError
from finetune.weights.safetensors_io import ST_TO_TORCH, BaseModel, OutTensor, read_json

PEFT_PREFIX = "base_model.model."

# LoRA variants (PEFT's LoraConfig fields tagged is_lora_variant) whose merge is not W + s * B @ A.
# DoRA is the exception: merge_lora() implements it.
# `target_parameters` (LoRA on parameters: a mixture of experts' fused experts and router) is merged by
# finetune.weights.experts.
_UNSUPPORTED_VARIANTS = ("velora_config", "alora_invocation_tokens", "monteclora_config", "use_bdlora",
                         "arrow_config", "kasa_config", "use_qalora", "layer_replication",
                         "trainable_token_indices", "megatron_config")
# init_lora_weights values that rewrite the base weights at init (PiSSA and friends): the adapter is then
# only meaningful on that residual base, not on the original one this merge reads.
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")

_LORA_KEY = re.compile(
    r"^(?P<module>.+)\.(?P<part>lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)"
    r"(?:\.(?P<param>weight|bias))?$")


# ------------------------------------------------------------------------------------------------
# The adapter: PEFT's saved format, read the way PeftModel.from_pretrained reads it


@dataclass
class LoraUpdate:
    """One adapted layer. A and B are float32: PEFT upcasts adapter weights on load
    (autocast_adapter_dtype=True, the default), and merges with them in that dtype."""

    module: str
    A: torch.Tensor
    B: torch.Tensor
    scaling: float
    embedding: bool = False
    bias: Optional[torch.Tensor] = None  # lora_B.bias (lora_bias=True)
    magnitude: Optional[torch.Tensor] = None  # DoRA's magnitude vector
    fan_in_fan_out: bool = False  # decided against the base shape in plan_merge
    # LoRA on a 2-D parameter (peft's ParamWrapper, e.g. a router's weight): the merge casts the delta to the
    # weight's dtype before adding it, as Embedding's merge does (Linear's adds the float32 delta).
    rounded_delta: bool = False

    def delta_shape(self) -> tuple:
        """Shape of B @ A as the base holds it: (out, in) for nn.Linear, (num_embeddings, dim) for nn.Embedding."""
        if self.embedding:
            return (self.A.shape[1], self.B.shape[0])
        return (self.B.shape[0], self.A.shape[1])


@dataclass
class Adapter:
    path: Path
    config: dict
    updates: dict[str, LoraUpdate]  # by module name (model.layers.0.self_attn.q_proj)
    # base tensor name -> (tensor saved whole, True for a modules_to_save module / False for a base_layer tensor)
    replacements: dict[str, tuple[torch.Tensor, bool]]
    experts: dict = field(default_factory=dict)  # fused expert parameter path -> experts.ExpertUpdate


def read_adapter(path: Path) -> Adapter:
    weights_file = adapter_weights(path)
    from finetune.rundir.names import ADAPTER_CONFIG

    config = read_json(path / ADAPTER_CONFIG)
    check_adapter_config(config, path / ADAPTER_CONFIG)
    state = _load_adapter_state(weights_file)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    replacements: dict[str, tuple[torch.Tensor, bool]] = {}
    for key, tensor in state.items():
        if not key.startswith(PEFT_PREFIX):
            raise MergeError(f"{weights_file}: key {key!r} is not in PEFT's LoRA format (base_model.model.*)")
        rest = key[len(PEFT_PREFIX):]
        match = _LORA_KEY.match(rest)
        if match:
            part = match["part"] + ("." + match["param"] if match["param"] else "")
            parts.setdefault(match["module"], {})[part] = tensor
        else:
            # Saved whole: modules_to_save (saved under the module's own name), trained biases
            # (bias="all"/"lora_only", saved as <layer>.base_layer.bias) and the base weights of
            # LoRA-wrapped embedding layers (saved as <layer>.base_layer.weight).
            replacements[rest.replace(".base_layer.", ".")] = (tensor, ".base_layer." not in rest)
    from finetune.weights.experts import ExpertUpdate, parameter_of, wrapped_parameters

    wrapped = wrapped_parameters(config)
    updates: dict[str, LoraUpdate] = {}
    experts: dict[str, ExpertUpdate] = {}
    for module, p in parts.items():
        param = parameter_of(module, wrapped)
        if param is None:
            updates[module] = _lora_update(module, p, config, weights_file)
        elif param.endswith(".weight"):  # a 2-D parameter: an ordinary pair, merged onto that weight
            owner = param[: -len(".weight")]
            updates[owner] = replace(_lora_update(param, p, config, weights_file), module=owner, rounded_delta=True)
        else:
            r, scaling = lora_scaling(config, param)
            A, B = p.get("lora_A.weight"), p.get("lora_B.weight")
            if A is None or B is None or A.dim() != 2 or B.dim() != 2 or A.shape[0] % r or A.shape[0] != B.shape[1]:
                raise MergeError(f"{weights_file}: LoRA on {param} is not a (rank x experts) pair of rank {r}")
            experts[param] = ExpertUpdate(param, A.float(), B.float(), scaling, r)
    return Adapter(path, config, updates, replacements, experts)


def check_adapter_config(config: dict, where: Path) -> None:
    kind = config.get("peft_type")
    if kind != "LORA":
        raise MergeError(f"{where}: peft_type {kind!r} is not supported; merge handles LoRA (and QLoRA) adapters")
    for key in _UNSUPPORTED_VARIANTS:
        if config.get(key):
            raise MergeError(f"{where}: `{key}` is set; merge handles plain LoRA and DoRA adapters only")
    init = config.get("init_lora_weights", True)
    if init == "mica":  # a LoRA variant selected through its init
        raise MergeError(f"{where}: init_lora_weights='mica' is a LoRA variant; merge handles plain LoRA and DoRA only")
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise MergeError(f"{where}: init_lora_weights={init!r} changes the base weights at init, so the adapter "
                         "does not apply to the original base; save it with PEFT's "
                         "path_initial_model_for_weight_conversion first")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), (int, float)) or isinstance(config.get(key), bool) or config[key] <= 0:
            raise MergeError(f"{where}: `{key}` must be a positive number, got {config.get(key)!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(key) or {}, dict):
            raise MergeError(f"{where}: `{key}` must be a mapping")


def _load_adapter_state(path: Path) -> dict[str, torch.Tensor]:
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        return torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated file, pickle with objects, ...
        raise MergeError(f"{path}: cannot read adapter weights ({exc})") from None


def pattern_key(patterns, module: str) -> str:
    """PEFT's get_pattern_key: the first pattern that matches the end of the module name at a dot boundary."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return module


def lora_scaling(config: dict, module: str) -> tuple[int, float]:
    """(r, scaling) for one module, as PEFT's LoraModel._create_and_replace + LoraLayer.update_layer compute them."""
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    r = rank_pattern.get(pattern_key(rank_pattern.keys(), module), config["r"])
    alpha = alpha_pattern.get(pattern_key(alpha_pattern.keys(), module), config["lora_alpha"])
    if config.get("use_rslora"):
        return r, alpha / math.sqrt(r)
    return r, alpha / r


def _lora_update(module: str, parts: dict[str, torch.Tensor], config: dict, where: Path) -> LoraUpdate:
    embedding = "lora_embedding_A" in parts or "lora_embedding_B" in parts
    a_key, b_key = ("lora_embedding_A", "lora_embedding_B") if embedding else ("lora_A.weight", "lora_B.weight")
    unknown = set(parts) - {a_key, b_key, "lora_B.bias", "lora_magnitude_vector"}
    if unknown or a_key not in parts or b_key not in parts:
        found = ", ".join(sorted(parts))
        raise MergeError(f"{where}: layer {module} has {found}; expected {a_key} and {b_key}")
    A, B = parts[a_key], parts[b_key]
    if A.dim() != 2 or B.dim() != 2 or A.shape[0] != B.shape[1]:
        raise MergeError(f"{where}: layer {module}: {a_key} {tuple(A.shape)} and {b_key} {tuple(B.shape)} "
                         "are not a rank-r pair (conv layers are not supported)")
    r, scaling = lora_scaling(config, module)
    if A.shape[0] != r:
        raise MergeError(f"{where}: layer {module} has rank {A.shape[0]} but {ADAPTER_CONFIG} gives it r={r} "
                         "(r / rank_pattern do not describe these weights)")
    magnitude = parts.get("lora_magnitude_vector")
    if magnitude is not None and embedding:
        raise MergeError(f"{where}: DoRA on embedding layer {module} is not supported")
    bias = parts.get("lora_B.bias")
    # PEFT upcasts 16-bit adapter weights to float32 on load; float32 ones stay as they are.
    return LoraUpdate(module, A.float(), B.float(), scaling, embedding,
                      None if bias is None else bias.float(),
                      None if magnitude is None else magnitude.float())


# Input embeddings by architecture family, for checkpoints that tie the output head to them.
_EMBEDDINGS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "transformer.wte.weight",
               "gpt_neox.embed_in.weight", "transformer.word_embeddings.weight")
_HEADS = ("lm_head", "embed_out")


def tied_embedding(base: BaseModel) -> Optional[str]:
    """The input embedding tensor when the base ties the output head to it (and so does not store the head)."""
    if not base.tied_embeddings:
        return None
    return next((name for name in _EMBEDDINGS if name in base.tensors), None)


def target_name(base: BaseModel, name: str) -> Optional[str]:
    """The base tensor an adapter name refers to. With tied embeddings the output head (lm_head) is not
    in the base files: it is the input embedding, and PEFT merging into the head changes that tensor."""
    if name in base.tensors:
        return name
    from finetune.weights.checkpoint_names import checkpoint_name

    stored = checkpoint_name(base, name)  # transformers 5's module layout over an older checkpoint's (a VLM)
    if stored is not None:
        return stored
    module, _, param = name.rpartition(".")
    if param == "weight" and module.split(".")[-1] in _HEADS:
        return tied_embedding(base)
    return None


def orient_update(update: LoraUpdate, shape: tuple, config: dict) -> bool:
    """Set update.fan_in_fan_out from the base shape; False if the update fits neither way.

    PEFT decides fan_in_fan_out by the module type (Conv1D layers such as GPT-2's store (in, out));
    a merge without the model sees only shapes, and falls back to the config for square weights."""
    want = update.delta_shape()
    if update.embedding:
        return tuple(shape) == want
    if tuple(shape) == want and tuple(shape) == want[::-1]:
        update.fan_in_fan_out = bool(config.get("fan_in_fan_out", False))
        return True
    if tuple(shape) == want:
        return True
    if tuple(shape) == want[::-1]:
        update.fan_in_fan_out = True
        return True
    return False


# ------------------------------------------------------------------------------------------------
# The arithmetic, mirroring peft/tuners/lora/layer.py (Linear/Embedding.get_delta_weight and merge)


def lora_delta(update: LoraUpdate) -> torch.Tensor:
    """transpose(B @ A, fan_in_fan_out) * scaling in float32, exactly as get_delta_weight does it."""
    delta = update.B @ update.A
    if update.embedding or update.fan_in_fan_out:
        delta = delta.T
    # In place: the same kernel and rounding as PEFT's `* scaling`, without a second full-size buffer.
    return delta.mul_(update.scaling)


# Rows of a weight processed at a time by the fast path: ~128K float32 values (512 KiB), so the convert, add
# and cast passes run on data that is still in the CPU cache instead of streaming 4 x 46 MB through RAM.
# 64K, 128K and 256K measured the same (issue 20); 128K keeps the float32 copy of W's rows at 512 KiB, which
# pays for the direct-I/O write block (safetensors_io.OutputFile) in the merge's peak anonymous memory.
_CHUNK_ELEMENTS = 1 << 17


class Workspace:
    """Scratch tensors reused from one layer to the next. Fresh 50 MB tensors per layer cost page faults
    (kernel time) and let the allocator's heap grow; two output buffers alternate so one can be written
    to disk while the next layer is computed into the other."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, key: str, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
        numel = math.prod(shape)
        buf = self._buffers.get(key)
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            self._buffers.pop(key, None)
            buf = self._buffers[key] = torch.empty(numel, dtype=dtype)
        return buf[:numel].view(shape)


def merge_lora(weight: torch.Tensor, update: LoraUpdate, out_dtype: torch.dtype,
               ws: Optional[Workspace] = None, slot: str = "out0") -> torch.Tensor:
    """The merged weight in out_dtype, checked finite. PEFT does `base.weight.data += delta` (bf16 += fp32:
    the sum is formed in float32 and rounded once to bf16); every path here rounds the same way, and none
    writes into the (memory-mapped) base tensor."""
    plain = update.magnitude is None and not update.embedding and not update.fan_in_fan_out and not update.rounded_delta
    if ws is not None and plain and weight.is_contiguous() and weight.dtype in (torch.bfloat16, torch.float16, torch.float32):
        return _merge_linear_chunked(weight, update, out_dtype, ws, slot)
    delta = lora_delta(update)
    if update.magnitude is not None:
        out = _merge_dora(weight, delta, update, out_dtype)
    else:
        if update.embedding or update.rounded_delta:
            # Embedding.merge and ParamWrapper.merge round the delta to the base dtype before adding (Linear's does not).
            delta = delta.to(weight.dtype)
        out = torch.empty(weight.shape, dtype=out_dtype)
        torch.add(weight, delta, out=out)
    _check_finite(update.module, out)
    return out


def _merge_linear_chunked(weight: torch.Tensor, update: LoraUpdate, out_dtype: torch.dtype, ws: Workspace,
                          slot: str) -> torch.Tensor:
    """Linear.get_delta_weight + merge, row block by row block, with the same roundings as PEFT:
    delta = (B @ A) * scaling in float32 (one full matmul, as PEFT calls it, so the kernel and its
    summation order are the same), then float32(W) + delta, rounded once to out_dtype. Elementwise
    steps give the same bits whatever the blocking."""
    rows_total, cols = weight.shape
    delta = ws.get("delta", torch.float32, (rows_total, cols))
    torch.mm(update.B, update.A, out=delta)
    out = ws.get(slot, out_dtype, (rows_total, cols))
    rows = max(1, _CHUNK_ELEMENTS * torch.get_num_threads() // max(cols, 1))
    w32 = ws.get("w32", torch.float32, (min(rows, rows_total), cols)) if weight.dtype != torch.float32 else None
    fold = _scaling_is_exact(update)
    squares = []
    for i in range(0, rows_total, rows):
        d = delta[i:i + rows]
        w = weight[i:i + rows]
        if w32 is not None:
            w = w32[: d.shape[0]].copy_(w)  # bf16/fp16 -> fp32 is exact
        if fold:
            # W + scaling * BA in one pass; scaling * BA is exact here, so this is PEFT's W + (BA * scaling).
            torch.add(w, d, alpha=update.scaling, out=d)
        else:
            d.mul_(update.scaling)
            d.add_(w)  # fp32 addition is commutative: W + delta == delta + W, bit for bit
        out[i:i + rows].copy_(d)  # the one rounding to the output dtype (round to nearest even)
        flat = d.view(-1)
        squares.append(torch.dot(flat, flat))
    # Finite check, one BLAS pass: a sum of squares is finite and <= limit^2 only if every value is finite
    # and within the output dtype's range (inf/NaN make it inf/NaN; all terms are >= 0, so none exceeds the sum).
    # Otherwise (NaN, inf, or only very large values), the exact check on the output decides.
    limit = float(torch.finfo(out_dtype).max)
    if squares and not float(torch.stack(squares).max()) <= limit * limit:
        _check_finite(update.module, out)
    return out


def _scaling_is_exact(update: LoraUpdate) -> bool:
    """Whether BA * scaling is exact for this update, so that it can fold into the addition: scaling a power
    of two >= 1 (alpha = r, 2r, ...: it only shifts exponents), and BA too small to overflow when scaled
    (|BA| <= r * max|B| * max|A|, checked on the small factors)."""
    mantissa, exponent = math.frexp(update.scaling)
    if mantissa != 0.5 or exponent < 1:
        return False
    bound = update.A.shape[0] * float(update.B.abs().max()) * float(update.A.abs().max()) * update.scaling
    return bound < 2.0 ** 100


def _check_finite(name: str, tensor: torch.Tensor) -> None:
    if not bool(torch.isfinite(tensor).all()):
        raise MergeError(f"merged {name} has inf/NaN values; the adapter (or the --dtype) is broken for this base")


def _merge_dora(weight: torch.Tensor, delta: torch.Tensor, update: LoraUpdate, out_dtype: torch.dtype) -> torch.Tensor:
    """DoraLinearVariant.merge_unsafe: scale each output row to the trained magnitude."""
    t = (lambda x: x.T) if update.fan_in_fan_out else (lambda x: x)
    # get_weight_norm(base, transpose(delta), scaling=1): the row norm of W + delta, in float32
    norm = torch.linalg.norm(t(weight) + 1 * t(delta), dim=1).to(torch.float32)
    factor = t((update.magnitude / norm).view(-1, 1))
    return (factor * (weight + delta)).to(out_dtype)


def merge_bias(bias: torch.Tensor, update: LoraUpdate, out_dtype: torch.dtype) -> torch.Tensor:
    """`base.bias.data += lora_B.bias * scaling` (lora_bias=True)."""
    out = torch.empty(bias.shape, dtype=out_dtype)
    torch.add(bias, update.bias * update.scaling, out=out)
    return out


def output_tensor(t: OutTensor, tensor: torch.Tensor, ws: Optional[Workspace] = None, slot: str = "out0") -> torch.Tensor:
    """The tensor to write for one base tensor, with replacement, LoRA update and dtype applied.
    With a workspace the result may live in its `slot` buffer, valid until that slot is used again."""
    out_dtype = ST_TO_TORCH[t.dtype]
    if t.replacement is not None:
        # ModulesToSaveWrapper copies the base module and loads the saved weight into it: a cast to the base dtype.
        tensor = t.replacement.to(tensor.dtype)
    if t.update is not None:
        from finetune.weights.experts import ExpertSlice, merge_expert

        if isinstance(t.update, ExpertSlice):
            return merge_expert(tensor, t.update, out_dtype)
        return merge_lora(tensor, t.update, out_dtype, ws, slot)
    if t.bias_of is not None:
        tensor = merge_bias(tensor, t.bias_of, out_dtype)
    elif tensor.dtype != out_dtype:
        tensor = tensor.to(out_dtype)
    if t.bias_of is not None or t.replacement is not None:
        _check_finite(t.name, tensor)
    return tensor
