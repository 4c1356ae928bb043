"""Streaming LoRA merge: base safetensors + PEFT LoRA adapter -> merged, sharded safetensors.

PEFT's `merge_and_unload` (and the tools built on it) needs the whole model in memory. This merge
reads the base shards tensor by tensor with safetensors (memory-mapped: file pages, not allocations),
computes W + scale * B @ A the way PEFT does, and streams each result into an output shard whose
header was written up front (every name, dtype and shape is known before the first byte of data, so
nothing is buffered). What it allocates is the adapter plus scratch space for the largest adapted
layer (float32 B @ A, two output buffers): 0.25 GiB in all for a 1.1B model, about 3 GiB for a 70B one
with a rank-16 adapter on every linear layer (140 GB of weights). The output is bit-identical to PEFT's
`merge_and_unload()` followed by `save_pretrained()`; tests/test_merge.py checks that with torch.equal.

    $ finetune merge runs/llama3-8b-qlora -o merged/llama3-8b-qlora
    $ finetune merge --base ~/models/Meta-Llama-3-8B-Instruct --adapter runs/x/adapter -o merged/x --verify

Only torch and safetensors are imported here (transformers and peft only for --verify), so the
merge process stays small: see scripts/bench_merge.py for time and memory against PEFT.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import struct
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, NamedTuple, Optional

import torch
from safetensors import safe_open

from finetune.fsutil import atomic_dir, remove_stale_partials, write_atomic

PEFT_PREFIX = "base_model.model."
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # "5GB", save_pretrained's default

# Files copied next to the merged weights. Tokenizer files come from the adapter (or run) directory
# when training saved a tokenizer there (it may have added tokens or a chat template), else from the base.
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt", "merges.txt",
    "chat_template.jinja", "chat_template.json",
)
TOKENIZER_DIRS = ("additional_chat_templates",)

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float32": torch.float32, "fp32": torch.float32}

# safetensors dtype names <-> torch (the subset a language model checkpoint holds).
ST_TO_TORCH = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("U16", "uint16"),
                     ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _attr):
        ST_TO_TORCH[_name] = getattr(torch, _attr)
TORCH_TO_ST = {v: k for k, v in ST_TO_TORCH.items()}

# LoRA variants (PEFT's LoraConfig fields tagged is_lora_variant) whose merge is not W + s * B @ A.
# DoRA is the exception: merge_lora() implements it.
_UNSUPPORTED_VARIANTS = ("velora_config", "alora_invocation_tokens", "monteclora_config", "use_bdlora",
                         "arrow_config", "kasa_config", "use_qalora", "layer_replication", "target_parameters",
                         "trainable_token_indices", "megatron_config")
# init_lora_weights values that rewrite the base weights at init (PiSSA and friends): the adapter is then
# only meaningful on that residual base, not on the original one this merge reads.
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")

_LORA_KEY = re.compile(
    r"^(?P<module>.+)\.(?P<part>lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)"
    r"(?:\.(?P<param>weight|bias))?$")


class MergeError(Exception):
    """A problem with the inputs or the environment, worded for the user (no traceback)."""


# ------------------------------------------------------------------------------------------------
# Inputs


@dataclass
class Inputs:
    base: Path
    adapter: Path
    tokenizer_dirs: tuple = ()  # searched for tokenizer files after the adapter, before the base


def resolve_inputs(run_dir: Optional[Path], base: Optional[Path], adapter: Optional[Path]) -> Inputs:
    """Base and adapter from a run directory, or from --base/--adapter (which override the run's)."""
    tokenizer_dirs: tuple = ()
    if run_dir is not None:
        if not run_dir.is_dir():
            raise MergeError(f"{run_dir}: no such run directory")
        adapter = adapter or _run_adapter(run_dir)
        base = base or _run_base(run_dir, adapter)
        # `finetune train` saves the tokenizer it trained with (chat template included) in tokenizer/.
        tokenizer_dirs = (run_dir / "tokenizer", run_dir)
    if base is None or adapter is None:
        raise MergeError("give a run directory, or both --base and --adapter")
    adapter_weights(adapter)  # fails early and clearly when the adapter is incomplete
    base_local_dir(base)
    return Inputs(base, adapter, tokenizer_dirs)


def _run_adapter(run_dir: Path) -> Path:
    for candidate in (run_dir / "adapter", run_dir):
        if (candidate / "adapter_config.json").is_file():
            return candidate
    hint = ""
    if any(run_dir.glob("checkpoint-*/global_step*")):
        hint = " (it has DeepSpeed checkpoints: `finetune convert RUN_DIR/checkpoint-N -o ADAPTER` makes one)"
    elif (run_dir / "model").is_dir() or (run_dir / "model.safetensors").is_file():
        hint = " (it holds full weights: a full fine-tune needs no merge)"
    elif not (run_dir / "recipe.yaml").is_file():
        runs = sorted(str(p.parent) for p in run_dir.glob("*/recipe.yaml"))
        if runs:  # `finetune merge runs -o x`: the folder that holds the run directories
            hint = f" (it holds run directories: {', '.join(runs)}; give one of them)"
    raise MergeError(f"{run_dir}: no adapter/adapter_config.json{hint}")


def _run_base(run_dir: Path, adapter: Path) -> Path:
    """The base model path from the run's resolved recipe, else from adapter_config.json."""
    tried = []
    recipe = run_dir / "recipe.yaml"
    if recipe.is_file():
        from finetune.yamlio import DocumentError, load_yaml, read_text

        try:
            data = load_yaml(read_text(recipe), str(recipe)).data
        except (DocumentError, OSError) as exc:
            raise MergeError(f"{recipe}: cannot read: {exc}") from None
        name = (data.get("model") or {}).get("name_or_path") if isinstance(data, dict) else None
        if isinstance(name, str) and name.startswith("builtin:"):
            from finetune.tiny import resolve_model_path  # the demo model, built locally on first use

            name = resolve_model_path(name)
        if isinstance(name, str) and name:
            path = Path(name) if Path(name).is_absolute() else run_dir / name
            if path.is_dir():
                return path
            tried.append(f"{recipe} model.name_or_path={name!r}")
    config = _read_json(adapter / "adapter_config.json")
    name = config.get("base_model_name_or_path")
    if isinstance(name, str) and name:
        if Path(name).is_dir():
            return Path(name)
        tried.append(f"{adapter / 'adapter_config.json'} base_model_name_or_path={name!r}")
    if not tried:
        raise MergeError(f"{run_dir}: no recipe.yaml and no base_model_name_or_path in the adapter config; pass --base")
    raise MergeError(f"base model not found locally ({'; '.join(tried)}); "
                     "download it (huggingface-cli download ID --local-dir DIR) and pass --base DIR")


def base_local_dir(base: Path) -> None:
    if base.is_dir():
        if not (base / "config.json").is_file():
            raise MergeError(f"{base}: no config.json (not a transformers model directory)")
        return
    if base.exists():
        raise MergeError(f"{base}: the base model must be a directory, not a file")
    if re.fullmatch(r"[\w.-]+/[\w.-]+", str(base)):
        raise MergeError(f"{base}: no such directory; merge reads local files only, so for a hub id download "
                         f"it first (huggingface-cli download {base} --local-dir DIR) and pass --base DIR")
    raise MergeError(f"{base}: no such base model directory")


def adapter_weights(adapter: Path) -> Path:
    if not adapter.is_dir():
        raise MergeError(f"{adapter}: no such adapter directory")
    if not (adapter / "adapter_config.json").is_file():
        raise MergeError(f"{adapter}: no adapter_config.json (not a PEFT adapter directory)")
    for name in ADAPTER_WEIGHTS:
        if (adapter / name).is_file():
            return adapter / name
    raise MergeError(f"{adapter}: no {ADAPTER_WEIGHTS[0]} (or {ADAPTER_WEIGHTS[1]})")


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise MergeError(f"{path}: missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MergeError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise MergeError(f"{path}: expected a JSON object")
    return data


# ------------------------------------------------------------------------------------------------
# The base model: names, dtypes and shapes of every tensor, read from the shard headers only


@dataclass
class BaseTensor:
    name: str
    file: Path
    dtype: str  # safetensors name, e.g. BF16
    shape: tuple


@dataclass
class BaseModel:
    path: Path
    config: dict
    tensors: dict[str, BaseTensor]  # in reading order: shard by shard

    @property
    def tied_embeddings(self) -> bool:
        text = self.config.get("text_config") if isinstance(self.config.get("text_config"), dict) else {}
        return bool(self.config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))


def read_base(path: Path) -> BaseModel:
    config = _read_json(path / "config.json")
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?")
        raise MergeError(f"{path}: the base is quantized ({method}); merge needs the 16/32-bit base "
                         "(for QLoRA: the original model the 4-bit one was made from)")
    index = path / INDEX_NAME
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise MergeError(f"{index}: no weight_map")
        files = sorted(set(weight_map.values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        other = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        hint = f" (found {', '.join(sorted(other)[:3])}: save it with safetensors first)" if other else ""
        raise MergeError(f"{path}: no model.safetensors or {INDEX_NAME}{hint}")
    tensors: dict[str, BaseTensor] = {}
    for name in files:
        file = path / name
        if not file.is_file():
            raise MergeError(f"{file}: listed in {INDEX_NAME} but missing")
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for key in handle.keys():
                    info = handle.get_slice(key)
                    tensors[key] = BaseTensor(key, file, info.get_dtype(), tuple(info.get_shape()))
        except MergeError:
            raise
        except Exception as exc:  # safetensors raises its own error types for truncated or corrupt files
            raise MergeError(f"{file}: not a readable safetensors file ({exc})") from None
    if not tensors:
        raise MergeError(f"{path}: the safetensors files hold no tensors")
    return BaseModel(path, config, tensors)


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


def read_adapter(path: Path) -> Adapter:
    weights_file = adapter_weights(path)
    config = _read_json(path / "adapter_config.json")
    check_adapter_config(config, path / "adapter_config.json")
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
    updates = {module: _lora_update(module, p, config, weights_file) for module, p in parts.items()}
    return Adapter(path, config, updates, replacements)


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
        raise MergeError(f"{where}: layer {module} has rank {A.shape[0]} but adapter_config.json gives it r={r} "
                         "(r / rank_pattern do not describe these weights)")
    magnitude = parts.get("lora_magnitude_vector")
    if magnitude is not None and embedding:
        raise MergeError(f"{where}: DoRA on embedding layer {module} is not supported")
    bias = parts.get("lora_B.bias")
    # PEFT upcasts 16-bit adapter weights to float32 on load; float32 ones stay as they are.
    return LoraUpdate(module, A.float(), B.float(), scaling, embedding,
                      None if bias is None else bias.float(),
                      None if magnitude is None else magnitude.float())


# ------------------------------------------------------------------------------------------------
# Planning: every output tensor, its dtype and what happens to it, checked before anything is written


@dataclass
class OutTensor:
    name: str
    source: BaseTensor
    dtype: str  # output dtype (safetensors name)
    nbytes: int
    update: Optional[LoraUpdate] = None  # LoRA delta added to this weight
    bias_of: Optional[LoraUpdate] = None  # lora_B.bias added to this bias
    replacement: Optional[torch.Tensor] = None


@dataclass
class Plan:
    tensors: list[OutTensor]
    shards: list[list[OutTensor]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
             "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def plan_merge(base: BaseModel, adapter: Adapter, dtype: Optional[torch.dtype]) -> Plan:
    """Match every adapter tensor to a base tensor, check shapes, and fix each output's dtype and size."""
    problems: list[str] = []
    warnings: list[str] = []
    targets: dict[str, LoraUpdate] = {}
    for module, update in adapter.updates.items():
        name = _target_name(base, module + ".weight")
        if name is None:
            problems.append(f"LoRA layer {module} matches no base tensor ({module}.weight)")
            continue
        if not _orient(update, base.tensors[name].shape, adapter.config):
            problems.append(f"LoRA layer {module} makes a {update.delta_shape()} update but the base "
                            f"{name} is {base.tensors[name].shape}")
            continue
        if name in targets:
            problems.append(f"LoRA layers {targets[name].module} and {module} both update {name} "
                            "(tied embeddings: untie them before training)")
            continue
        if name == _tied_embedding(base):
            # PEFT merges into the shared tensor too (with its own warning): the update reaches both the input
            # embeddings and the output head, while training applied it to one of them only.
            warnings.append(f"LoRA layer {module} updates {name}, which the base shares between the input "
                            "embeddings and the output head: the merged update changes both (as PEFT's merge does)")
        targets[name] = update
    biases: dict[str, LoraUpdate] = {}
    for update in adapter.updates.values():
        if update.bias is not None:
            name = update.module + ".bias"
            if name not in base.tensors:
                problems.append(f"LoRA layer {update.module} has lora_B.bias but the base has no {name}")
            elif tuple(base.tensors[name].shape) != tuple(update.bias.shape):
                problems.append(f"lora_B.bias of {update.module} is {tuple(update.bias.shape)}, "
                                f"base {name} is {base.tensors[name].shape}")
            else:
                biases[name] = update
    replacements: dict[str, torch.Tensor] = {}
    tied = _tied_embedding(base)
    for key, (tensor, whole_module) in adapter.replacements.items():
        name = _target_name(base, key)
        if name is None:
            problems.append(f"adapter tensor {key} matches no base tensor")
        elif name == tied and whole_module:
            # modules_to_save trains a copy, so the head and the embeddings were untied during training;
            # a tied checkpoint cannot hold that (PEFT's save writes both and keeps tie_word_embeddings=true).
            problems.append(f"adapter trains {key} as a whole module, but the base ties the input embeddings "
                            "and the output head; untie them (tie_word_embeddings=false) before training")
        elif tuple(tensor.shape) != base.tensors[name].shape:
            problems.append(f"adapter tensor {key} is {tuple(tensor.shape)} but the base has "
                            f"{base.tensors[name].shape} (a resized vocabulary? resize the base first)")
        elif name in replacements and not torch.equal(replacements[name], tensor):
            # e.g. a tied head and embedding both saved, with different values: one would silently win
            problems.append(f"adapter holds two different values for {name}")
        else:
            replacements[name] = tensor
    if problems:
        arch = _architecture_hint(base, adapter)
        shown = problems[:5] + ([f"... and {len(problems) - 5} more"] if len(problems) > 5 else [])
        raise MergeError(f"adapter {adapter.path} does not fit base {base.path}{arch}:\n  " + "\n  ".join(shown))

    tensors = []
    for name, info in base.tensors.items():
        if info.dtype not in _ITEMSIZE:
            raise MergeError(f"{info.file}: tensor {name} has dtype {info.dtype}, which merge does not handle")
        out_dtype = info.dtype
        if dtype is not None and info.dtype in ("F32", "F16", "BF16"):
            out_dtype = TORCH_TO_ST[dtype]
        nbytes = math.prod(info.shape) * _ITEMSIZE[out_dtype]
        tensors.append(OutTensor(name, info, out_dtype, nbytes, targets.get(name), biases.get(name),
                                 replacements.get(name)))
    for t in tensors:
        if (t.update or t.bias_of or t.replacement is not None) and t.source.dtype not in ("F32", "F16", "BF16"):
            raise MergeError(f"{t.source.file}: {t.name} is {t.source.dtype}; merge needs a float base "
                             "(a quantized checkpoint cannot take a LoRA update)")
    return Plan(tensors, warnings=warnings)


# Input embeddings by architecture family, for checkpoints that tie the output head to them.
_EMBEDDINGS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "transformer.wte.weight",
               "gpt_neox.embed_in.weight", "transformer.word_embeddings.weight")
_HEADS = ("lm_head", "embed_out")


def _tied_embedding(base: BaseModel) -> Optional[str]:
    """The input embedding tensor when the base ties the output head to it (and so does not store the head)."""
    if not base.tied_embeddings:
        return None
    return next((name for name in _EMBEDDINGS if name in base.tensors), None)


def _target_name(base: BaseModel, name: str) -> Optional[str]:
    """The base tensor an adapter name refers to. With tied embeddings the output head (lm_head) is not
    in the base files: it is the input embedding, and PEFT merging into the head changes that tensor."""
    if name in base.tensors:
        return name
    module, _, param = name.rpartition(".")
    if param == "weight" and module.split(".")[-1] in _HEADS:
        return _tied_embedding(base)
    return None


def _orient(update: LoraUpdate, shape: tuple, config: dict) -> bool:
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


def _architecture_hint(base: BaseModel, adapter: Adapter) -> str:
    want = (adapter.config.get("auto_mapping") or {}).get("base_model_class")
    have = base.config.get("architectures") or []
    if want and have and want not in have:
        return f" (the adapter was trained on a {want}, the base is a {', '.join(have)})"
    return ""


def assign_shards(plan: Plan, max_shard_size: int) -> None:
    """Greedy split in reading order, like huggingface_hub's split_torch_state_dict_into_shards:
    a shard closes when the next tensor would push it past max_shard_size; a bigger tensor stands alone."""
    shards: list[list[OutTensor]] = [[]]
    size = 0
    for t in plan.tensors:
        if shards[-1] and size + t.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    plan.shards = shards


def shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


# ------------------------------------------------------------------------------------------------
# The arithmetic, mirroring peft/tuners/lora/layer.py (Linear/Embedding.get_delta_weight and merge)


def lora_delta(update: LoraUpdate) -> torch.Tensor:
    """transpose(B @ A, fan_in_fan_out) * scaling in float32, exactly as get_delta_weight does it."""
    delta = update.B @ update.A
    if update.embedding or update.fan_in_fan_out:
        delta = delta.T
    # In place: the same kernel and rounding as PEFT's `* scaling`, without a second full-size buffer.
    return delta.mul_(update.scaling)


# Rows of a weight processed at a time by the fast path: ~256K float32 values (1 MiB), so the scale, add
# and cast passes run on data that is still in the CPU cache instead of streaming 4 x 46 MB through RAM.
_CHUNK_ELEMENTS = 1 << 18


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
    plain = update.magnitude is None and not update.embedding and not update.fan_in_fan_out
    if ws is not None and plain and weight.is_contiguous() and weight.dtype in (torch.bfloat16, torch.float16, torch.float32):
        return _merge_linear_chunked(weight, update, out_dtype, ws, slot)
    delta = lora_delta(update)
    if update.magnitude is not None:
        out = _merge_dora(weight, delta, update, out_dtype)
    else:
        if update.embedding:
            # Embedding.merge rounds the delta to the base dtype before adding (Linear.merge does not).
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
    low = high = None
    for i in range(0, rows_total, rows):
        d = delta[i:i + rows]
        d.mul_(update.scaling)
        w = weight[i:i + rows]
        if w32 is not None:
            w = w32[: d.shape[0]].copy_(w)  # bf16/fp16 -> fp32 is exact
        d.add_(w)  # fp32 addition is commutative: W + delta == delta + W, bit for bit
        out[i:i + rows].copy_(d)  # the one rounding to the output dtype (round to nearest even)
        lo, hi = torch.aminmax(d)
        low = lo if low is None else torch.minimum(low, lo)
        high = hi if high is None else torch.maximum(high, hi)
    # All finite (and inside the output dtype's range) iff min and max are; NaN propagates through aminmax.
    limit = torch.finfo(out_dtype).max
    if low is not None and not (float(low) >= -limit and float(high) <= limit):
        _check_finite(update.module, out)
    return out


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
        return merge_lora(tensor, t.update, out_dtype, ws, slot)
    if t.bias_of is not None:
        tensor = merge_bias(tensor, t.bias_of, out_dtype)
    elif tensor.dtype != out_dtype:
        tensor = tensor.to(out_dtype)
    if t.bias_of is not None or t.replacement is not None:
        _check_finite(t.name, tensor)
    return tensor


# ------------------------------------------------------------------------------------------------
# Writing safetensors one tensor at a time


_WRITEBACK_BYTES = 1 << 20


class ShardWriter:
    """Writes a safetensors file whose header (names, dtypes, shapes, offsets) is known up front, then
    each tensor's bytes as it is produced. The format: 8-byte little-endian header length, the JSON
    header padded with spaces to a multiple of 8, then the tensors' bytes back to back."""

    def __init__(self, path: Path, tensors: list[OutTensor], early_writeback: bool = False):
        if sys.byteorder != "little":
            raise MergeError("safetensors files are little-endian; this machine is not")
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for t in tensors:
            header[t.name] = {"dtype": t.dtype, "shape": list(t.source.shape), "data_offsets": [offset, offset + t.nbytes]}
            offset += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        self.path = path
        self.expected = [(t.name, t.nbytes) for t in tensors]
        self.position = 0
        self.early_writeback = early_writeback and hasattr(os, "posix_fadvise")
        self.handle = open(path, "wb")
        self.handle.write(struct.pack("<Q", len(raw)))
        self.handle.write(raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want_name, want_bytes = self.expected[self.position]
        data = tensor.contiguous().reshape(-1).view(torch.uint8)
        if name != want_name or data.numel() != want_bytes:
            raise RuntimeError(f"internal error: wrote {name} ({data.numel()} bytes), header says {want_name} ({want_bytes})")
        self.handle.write(data.numpy().data)  # the tensor's own memory, no bytes copy
        self.position += 1
        if self.early_writeback and want_bytes >= _WRITEBACK_BYTES:
            # Start writing this tensor to disk now (Linux starts writeback of dirty pages on DONTNEED, and
            # drops them from the page cache once clean), so that the disk works while the next tensors are
            # computed and the fsync at the end has little left to wait for.
            self.handle.flush()
            end = self.handle.tell()
            os.posix_fadvise(self.handle.fileno(), end - want_bytes, want_bytes, os.POSIX_FADV_DONTNEED)

    def close(self, sync: bool = True) -> None:
        if self.position != len(self.expected):
            raise RuntimeError(f"internal error: {self.path} got {self.position} of {len(self.expected)} tensors")
        self.handle.flush()
        if sync:
            os.fsync(self.handle.fileno())
        self.handle.close()


class _Reader:
    """One base shard open at a time (safe_open maps the file; tensors come out as views of the mapping)."""

    def __init__(self) -> None:
        self.file: Optional[Path] = None
        self.handle = None

    def get(self, file: Path, name: str) -> torch.Tensor:
        if file != self.file:
            self.close()
            self.handle = safe_open(str(file), framework="pt", device="cpu").__enter__()
            self.file = file
        return self.handle.get_tensor(name)

    def close(self) -> None:
        if self.handle is not None:
            self.handle.__exit__(None, None, None)
        self.handle, self.file = None, None


class Written(NamedTuple):
    """How far a merge or convert is: bytes and tensors written so far, out of the totals."""
    bytes: int
    tensors: int
    total_bytes: int
    total_tensors: int


OnWrite = Callable[[Written], None]


class WriteCounter:
    """Counts the tensors written and reports the running totals to an optional callback."""

    def __init__(self, total_bytes: int, total_tensors: int, on_write: Optional[OnWrite]) -> None:
        self.done = Written(0, 0, total_bytes, total_tensors)
        self.on_write = on_write

    def add(self, nbytes: int, tensors: int = 1) -> None:
        self.done = self.done._replace(bytes=self.done.bytes + nbytes, tensors=self.done.tensors + tensors)
        if self.on_write is not None:
            self.on_write(self.done)


def write_shards(plan: Plan, names: list[str], folder: Path, log: Callable[[str], None], fsync: bool = False,
                 on_write: Optional[OnWrite] = None) -> None:
    """Compute each output tensor and write it, the arithmetic of one tensor overlapping the write of the
    previous one (a second thread; torch and file writes release the GIL). With fsync, each shard is
    flushed to disk on a third thread while the next one is produced, and all of them before returning.
    on_write gets the running totals after each tensor's bytes are written (from the writer thread)."""
    from concurrent.futures import Future, ThreadPoolExecutor

    ws = Workspace()
    reader = _Reader()
    threads = torch.get_num_threads()
    # One core stays free for the writer thread. On a 2-core box that leaves one compute thread, which
    # measured faster than two (their OpenMP barriers wait on the core the writer holds); B @ A gives the
    # same bits with any thread count (the sum over the rank is never split between threads).
    torch.set_num_threads(max(1, _cpu_count() - 1))
    writes = ThreadPoolExecutor(max_workers=1, thread_name_prefix="merge-write")
    syncs = ThreadPoolExecutor(max_workers=1, thread_name_prefix="merge-fsync")
    pending: Optional[Future] = None
    closing: list[Future] = []
    writers: list[ShardWriter] = []
    counter = WriteCounter(plan.total_bytes, len(plan.tensors), on_write)

    def write(writer: ShardWriter, t: OutTensor, tensor: torch.Tensor) -> None:
        writer.write(t.name, tensor)
        counter.add(t.nbytes)

    slot = 0
    try:
        for shard_name, shard in zip(names, plan.shards):
            writer = ShardWriter(folder / shard_name, shard, early_writeback=fsync)
            writers.append(writer)
            for t in shard:
                if t.source.file != reader.file and pending is not None:
                    pending.result()  # the last write may still read from the mapping about to be closed
                tensor = output_tensor(t, reader.get(t.source.file, t.name), ws, f"out{slot}")
                if pending is not None:
                    pending.result()  # at most one write in flight: its buffer is the other slot
                pending = writes.submit(write, writer, t, tensor)
                slot ^= 1
            pending.result()
            pending = None
            writer.close(sync=False)
            if fsync:
                closing.append(syncs.submit(_fsync, writer.path))
            log(f"wrote {shard_name} ({human_size(sum(t.nbytes for t in shard))})")
        for future in closing:
            future.result()
    finally:
        torch.set_num_threads(threads)
        writes.shutdown(wait=True)  # never remove the folder under a running write
        syncs.shutdown(wait=True)
        reader.close()
        for writer in writers:
            writer.handle.close()


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------------
# The merge


@dataclass
class MergeResult:
    output: Path
    shards: int
    total_bytes: int
    merged_layers: int
    replaced: int
    seconds: float


def merge(base_path: Path, adapter_path: Path, output: Path, *, dtype: Optional[str] = None, overwrite: bool = False,
          max_shard_size: int = DEFAULT_MAX_SHARD_SIZE, log: Callable[[str], None] = lambda s: None,
          source_dirs: tuple = (), fsync: bool = False, on_write: Optional[OnWrite] = None) -> MergeResult:
    """Merge `adapter_path` into `base_path`, writing `output`. Raises MergeError for bad inputs.

    source_dirs: extra directories (e.g. the run directory) searched for tokenizer files after the adapter's.
    fsync: wait until the shards are on disk before publishing `output` (a power cut then cannot leave a
    truncated model behind). Off by default, like save_pretrained: it makes the merge as slow as the disk
    (1.1B model here: 3.5 s without, 7.5 s with).
    on_write: called with the running Written totals after each tensor is written (a progress bar)."""
    start = time.perf_counter()
    base_path, adapter_path, output = Path(base_path), Path(adapter_path), Path(output)
    out_dtype = _parse_dtype(dtype)
    _check_output_location(output, [base_path, adapter_path], overwrite)
    base = read_base(base_path)
    adapter = read_adapter(adapter_path)
    plan = plan_merge(base, adapter, out_dtype)
    for line in plan.warnings:
        log(f"warning: {line}")
    assign_shards(plan, max_shard_size)
    check_disk_space(output, plan.total_bytes)
    names = shard_names(len(plan.shards))
    for line in remove_stale_partials(output):
        log(line)
    with sigterm_as_interrupt(), atomic_dir(output, overwrite=overwrite) as tmp:
        write_shards(plan, names, tmp, log, fsync=fsync, on_write=on_write)
        if len(names) > 1:
            write_index(tmp, plan, names)
        copy_side_files(base_path, [adapter_path, *source_dirs], tmp, out_dtype)
    merged = sum(1 for t in plan.tensors if t.update is not None)
    replaced = sum(1 for t in plan.tensors if t.replacement is not None)
    return MergeResult(output, len(names), plan.total_bytes, merged, replaced, time.perf_counter() - start)


def _parse_dtype(dtype: Optional[str]) -> Optional[torch.dtype]:
    if dtype is None:
        return None
    if dtype not in DTYPES:
        raise MergeError(f"--dtype must be one of bfloat16, float16, float32, got {dtype!r}")
    return DTYPES[dtype]


def _check_output_location(output: Path, inputs: list[Path], overwrite: bool) -> None:
    out = output.resolve()
    for path in inputs:
        src = path.resolve()
        if out == src or src in out.parents:
            raise MergeError(f"-o {output} is inside the input {path}; merge never writes into its inputs")
        if out in src.parents:
            raise MergeError(f"the input {path} is inside -o {output}, which merge would replace")
    if output.exists() and not overwrite:
        raise MergeError(f"{output} already exists (use --overwrite to replace it)")
    if output.exists() and not output.is_dir():
        raise MergeError(f"{output} exists and is not a directory")


def check_disk_space(output: Path, need: int) -> None:
    """Refuse before writing when the output's filesystem cannot hold the merged model."""
    probe = output.parent.resolve()
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    need = int(need * 1.01) + 64 * 2**20  # headers, config and tokenizer files, some slack
    if free < need:
        raise MergeError(f"not enough disk space in {probe}: the merged model needs {human_size(need)}, {human_size(free)} free")


def write_index(tmp: Path, plan: Plan, names: list[str]) -> None:
    weight_map = {t.name: name for name, shard in zip(names, plan.shards) for t in shard}
    index = {
        "metadata": {"total_parameters": sum(math.prod(t.source.shape) for t in plan.tensors),
                     "total_size": plan.total_bytes},
        "weight_map": dict(sorted(weight_map.items())),
    }
    write_atomic(tmp / INDEX_NAME, json.dumps(index, indent=2) + "\n")


def copy_side_files(base: Path, tokenizer_sources: list[Path], out: Path, dtype: Optional[torch.dtype]) -> None:
    """config.json and generation_config.json from the base; tokenizer files and chat template from the first
    of the adapter / run / base directories that has a tokenizer."""
    for name in CONFIG_FILES:
        if (base / name).is_file():
            shutil.copy2(base / name, out / name)
    if dtype is not None:
        config = json.loads((out / "config.json").read_text(encoding="utf-8"))
        name = str(dtype).removeprefix("torch.")
        for key in ("dtype", "torch_dtype"):
            if key in config:
                config[key] = name
        if "dtype" not in config and "torch_dtype" not in config:
            config["dtype"] = name
        write_atomic(out / "config.json", json.dumps(config, indent=2) + "\n")
    copy_tokenizer([*tokenizer_sources, base], out)
    for source in tokenizer_sources:
        if (source / "recipe.yaml").is_file():  # the run's data format: `finetune chat MERGED` prompts the same way
            shutil.copy2(source / "recipe.yaml", out / "finetune_recipe.yaml")
            break


def copy_tokenizer(sources: list[Path], out: Path) -> bool:
    """Tokenizer files and chat template from the first of `sources` that holds a tokenizer."""
    for source in sources:
        if (source / "tokenizer_config.json").is_file() or (source / "tokenizer.json").is_file():
            for name in TOKENIZER_FILES:
                if (source / name).is_file():
                    shutil.copy2(source / name, out / name)
            for name in TOKENIZER_DIRS:
                if (source / name).is_dir():
                    shutil.copytree(source / name, out / name)
            return True
    return False


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: unwinds like Ctrl-C (the partial output is removed); the CLI exits 143 (128 + 15)."""


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (a scheduler or `kill`) unwinds like Ctrl-C, so the partial output is removed."""
    def handler(signum, frame):
        raise Terminated

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def human_size(n: int) -> str:
    if n >= 1e8:
        return f"{n / 1e9:.2f} GB"
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


# ------------------------------------------------------------------------------------------------
# --verify: compare logits of the merged model with base + adapter (transformers + peft, CPU)


@dataclass
class VerifyResult:
    max_abs_diff: float
    adapter_effect: float  # how much the adapter moves the logits (base vs base + adapter)
    tolerance: float
    rounding: float = 0.0  # what storing base + adapter in the output's dtype costs, measured

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.tolerance


# The tolerance is measured, not assumed: PEFT merges the same base + adapter in float32, the result is
# rounded to the dtype the merged model is stored in, and the logit change that rounding causes is what
# a correct merge may differ by. A fixed fraction of the logits (2% for bf16) was larger than the whole
# effect of a small adapter, so a merge that lost the adapter passed. The floor covers float32 merges,
# where only the order of operations differs (x @ (W + BA) against x @ W + (x @ A) @ B).
_VERIFY_ROUNDING_FACTOR = 2.0
_VERIFY_FLOOR = 1e-5  # of the largest |logit|


def verify(output: Path, base: Path, adapter: Path, prompt: str = "The quick brown fox jumps over the lazy dog.") -> VerifyResult:
    """Logits of the merged model vs. base + adapter (unmerged), all computed in float32 on CPU."""
    import warnings

    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    # Loading progress bars and PEFT's notes would bury the one line verify prints.
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    ids = _prompt_ids(output, prompt)
    weight_dtype = _stored_dtype(output)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        ids = ids % model.config.get_text_config().vocab_size
        peft_model = PeftModel.from_pretrained(model, str(adapter))
        peft_model.eval()
        reference = peft_model(input_ids=ids).logits
        with peft_model.disable_adapter():
            plain = peft_model(input_ids=ids).logits
        expected = peft_model.merge_and_unload()
        for param in expected.parameters():
            param.copy_(param.to(weight_dtype).to(torch.float32))
        rounded = expected(input_ids=ids).logits
        del model, peft_model, expected
        merged = AutoModelForCausalLM.from_pretrained(str(output), dtype=torch.float32)
        merged.eval()
        logits = merged(input_ids=ids).logits
        del merged
    rounding = float((rounded - reference).abs().max())
    scale = max(1.0, float(reference.abs().max()))
    return VerifyResult(float((logits - reference).abs().max()), float((reference - plain).abs().max()),
                        _VERIFY_ROUNDING_FACTOR * rounding + _VERIFY_FLOOR * scale, rounding)


def _prompt_ids(model_dir: Path, prompt: str) -> torch.Tensor:
    try:
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(str(model_dir))(prompt, return_tensors="pt").input_ids
        if ids.numel() >= 4:
            return ids
    except Exception:  # no tokenizer, or one transformers cannot load: fixed ids do as well for a comparison
        pass
    return torch.arange(1, 33).unsqueeze(0)


def _stored_dtype(model_dir: Path) -> torch.dtype:
    files = sorted(model_dir.glob("*.safetensors"))
    with safe_open(str(files[0]), framework="pt") as handle:
        for key in handle.keys():
            dtype = ST_TO_TORCH.get(handle.get_slice(key).get_dtype())
            if dtype in (torch.bfloat16, torch.float16, torch.float32):
                return dtype
    return torch.float32
