"""The recipe: one YAML file that is the single source of truth for a fine-tuning run.

This module holds the schema (pydantic: defaults, types, docs and validation in one place) and
loading: YAML with line numbers, `extends:` chains, `--set a.b=value` overrides, and error
reports that name the file, line and key. It never imports torch.

A minimal recipe:

    model: {name_or_path: meta-llama/Meta-Llama-3-8B-Instruct}
    method: qlora
    data: {path: data/alpaca.jsonl, format: alpaca}
    deepspeed: {stage: 3}
"""

from __future__ import annotations

import copy
import difflib
import re
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from finetune.yamlio import DocumentError, load_yaml, read_text

Dtype = Literal["bfloat16", "float16", "float32"]
Offload = Literal["none", "cpu", "nvme"]
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
# Upper bounds far above any real run: they turn a typo (or 400 digits) into a finding instead of
# an OverflowError in the planner's float arithmetic or in DeepSpeed's int64 fields.
MAX_BATCH = 1 << 20  # sequences per micro batch, micro batches per step
MAX_COUNT = 10**12  # steps
MAX_PROCS = 1 << 16  # nodes, GPUs per node, processes, workers
MAX_ELEMENTS = 1 << 50  # bucket sizes in elements
MAX_SECONDS = 10**7  # ~116 days
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(value: Union[str, int, float]) -> int:
    """'24GiB' -> 25769803776; '12GB' -> 12e9; a bare number is bytes."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as 24GiB")
    if isinstance(value, (int, float)):
        return int(value)
    match = _SIZE_RE.match(str(value))
    if not match:
        raise ValueError(f"expected a size such as 24GiB or 12GB, got {value!r}")
    number, unit = match.groups()
    return int(float(number) * _UNITS[(unit or "B").lower()])


NAME_MAX = 255  # bytes in one path component on Linux, macOS and Windows filesystems
PATH_MAX = 4096  # bytes in a whole path on Linux, the terminating NUL included


def plain_path(value: Optional[str]) -> Optional[str]:
    """A path (or hub id) the OS can look up: a component over NAME_MAX bytes, or a NUL, makes every
    stat() raise (ENAMETOOLONG, ValueError) in each check that touches it; refuse it here, once."""
    if value is None:
        return value
    if "\0" in value:
        raise ValueError("must not contain a NUL character")
    longest = max((len(part.encode("utf-8", "surrogatepass")) for part in re.split(r"[/\\]", value)), default=0)
    if longest > NAME_MAX:
        raise ValueError(f"has a path component of {longest} bytes; file systems allow {NAME_MAX}")
    if len(value.encode("utf-8", "surrogatepass")) >= PATH_MAX:
        raise ValueError(f"is a path of {len(value.encode('utf-8', 'surrogatepass')):,} bytes; Linux allows {PATH_MAX - 1}")
    return value


class _Section(BaseModel):
    # extra="forbid": a misspelled key is an error, never silently dropped (axolotl's `lora_rr`).
    # allow_inf_nan=False: `.inf` or `.nan` in a recipe is a typo, and the planner cannot size it.
    model_config = ConfigDict(extra="forbid", validate_default=True, allow_inf_nan=False)


class ModelSection(_Section):
    name_or_path: str = Field(min_length=1, description="Hub id or local directory of the base model.")
    revision: Optional[str] = Field(None, description="Git revision (branch, tag or commit) of a hub model.")
    dtype: Dtype = Field("bfloat16", description="Dtype the weights are loaded and trained in (mixed precision follows it).")
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2", "flash_attention_3"] = Field(
        "sdpa", description="Attention kernel passed to from_pretrained.")
    trust_remote_code: bool = Field(False, description="Run modelling code shipped with the checkpoint. Off by default: it executes code from the hub.")
    tokenizer: Optional[str] = Field(None, description="Tokenizer location when it differs from the model's.")
    adapter: Optional[str] = Field(None, description="LoRA adapter to continue training (lora/qlora): an SFT run directory (its adapter/) or an adapter directory. Full fine-tunes start from an SFT run's model/ through name_or_path instead.")

    _paths = field_validator("name_or_path", "tokenizer", "adapter")(plain_path)


class LoraSection(_Section):
    r: int = Field(16, ge=1, le=4096, description="LoRA rank.")
    alpha: float = Field(32, gt=0, description="lora_alpha; the update is scaled by alpha / r (alpha / sqrt(r) with rslora).")
    dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the LoRA input.")
    target_modules: Union[Literal["all-linear"], list[str]] = Field(
        "all-linear", description="Module names to adapt, or `all-linear` for every linear layer except the output head.")
    modules_to_save: Optional[list[str]] = Field(None, description="Modules trained in full and saved with the adapter (e.g. embed_tokens, lm_head).")
    rslora: bool = Field(False, description="Rank-stabilised LoRA: scale by alpha / sqrt(r).")
    dora: bool = Field(False, description="Weight-decomposed LoRA (DoRA).")
    bias: Literal["none", "all", "lora_only"] = Field("none", description="Which biases are trained.")


class QuantizationSection(_Section):
    quant_type: Literal["nf4", "fp4"] = Field("nf4", description="4-bit data type.")
    double_quant: bool = Field(True, description="Quantize the quantization constants too (saves ~0.4 bit/param).")
    compute_dtype: Dtype = Field("bfloat16", description="Dtype of the matmuls on dequantized weights.")
    storage_dtype: Dtype = Field("bfloat16", description="bnb_4bit_quant_storage. ZeRO-3 shards it like any tensor, so it must equal compute_dtype (and the model dtype) under ZeRO-3.")


def known_roles(value: dict[str, str]) -> dict[str, str]:
    bad = sorted({v for v in value.values() if v not in ("system", "user", "assistant", "tool")})
    if bad:
        raise ValueError(f"roles map to system, user, assistant or tool, not {', '.join(bad)}")
    return value


DataFormat = Literal["alpaca", "messages", "sharegpt", "text"]
_FORMAT_DOC = ("alpaca: instruction/input/output columns; messages: OpenAI-style list of {role, content} (system/user/assistant/tool); "
               "sharegpt: `conversations` of {from, value} (human/gpt/system/function_call/observation); text: one `text` column.")


class SourceSection(_Section):
    path: str = Field(min_length=1, description="Local .json/.jsonl/.parquet/.csv file, folder of them or save_to_disk folder (relative to the recipe), or a hub dataset id.")
    format: DataFormat = Field("alpaca", description=_FORMAT_DOC)
    split: str = Field("train", description="Split to read from a hub dataset.")
    columns: dict[str, str] = Field(default_factory=dict, description="Column names of this source, by the name the format uses (e.g. {output: completion}, {messages: dialog}, {role: speaker}).")
    roles: dict[str, str] = Field(default_factory=dict, description="Role names of this source mapped to system/user/assistant/tool (e.g. {bot: assistant}).")
    weight: Optional[float] = Field(None, gt=0, le=1e6, description="Share of the mixture, relative to the other sources' weights; the largest-weighted source is used whole.")
    samples: Optional[int] = Field(None, ge=1, le=MAX_COUNT, description="Exactly this many examples of the source (a seeded subset, or repeated when larger).")

    _paths = field_validator("path")(plain_path)
    _roles = field_validator("roles")(known_roles)


class DataSection(_Section):
    path: Optional[str] = Field(None, description="One source: local .json/.jsonl/.parquet/.csv file, folder or save_to_disk folder (relative to the recipe), or a hub dataset id. Or give `sources`.")
    format: DataFormat = Field("alpaca", description=_FORMAT_DOC)
    split: str = Field("train", description="Split to read from a hub dataset.")
    columns: dict[str, str] = Field(default_factory=dict, description="Column names, by the name the format uses (as in sources[].columns).")
    roles: dict[str, str] = Field(default_factory=dict, description="Role names mapped to system/user/assistant/tool (as in sources[].roles).")
    sources: Optional[list[SourceSection]] = Field(None, description="Several sources mixed by weight or samples (keys below); replaces path. README: Mixing sources.")
    seed: Optional[int] = Field(None, ge=0, le=2**32 - 1, description="Seed of the mixture's subsets, repeats and order (default: training.seed).")
    think: Literal["train", "mask"] = Field("train", description="`<think>...</think>` spans in assistant turns: train on them, or keep them in the context but out of the loss.")
    chat_template: Optional[str] = Field(None, description="Jinja chat template for messages/sharegpt (default: the tokenizer's own).")
    max_length: int = Field(2048, ge=8, le=1_048_576, description="Sequences are truncated to this many tokens.")
    packing: bool = Field(False, description="Concatenate examples into max_length blocks (no padding waste); examples never attend to each other, with every model.attn_implementation.")
    padding_free: bool = Field(False, description="No padding: each micro batch becomes one row of its examples end to end (up to micro_batch_size x max_length tokens), kept apart like packed ones. The throughput mode for flash attention.")
    validation_split: float = Field(0.0, ge=0, lt=1, description="Fraction of examples held out for evaluation (0 = no eval).")
    mask_prompt: bool = Field(True, description="Exclude prompt tokens from the loss (train on responses only).")

    _paths = field_validator("path")(plain_path)
    _roles = field_validator("roles")(known_roles)

    @model_validator(mode="after")
    def _one_way_to_name_the_data(self) -> "DataSection":
        if self.sources and self.path:
            raise ValueError("give either data.path (one source) or data.sources, not both")
        if not self.sources and not self.path:
            raise ValueError("data needs `path` (one source) or `sources` (a list of them)")
        return self

    def source_formats(self) -> list[str]:
        return [s.format for s in self.sources] if self.sources else [self.format]


PREFERENCE_OBJECTIVES = ("dpo", "orpo", "kto", "simpo")
# TRL's loss variants per objective (trl 1.16: DPOConfig.loss_type, KTOConfig.loss_type); ORPO has one loss,
# SimPO is CPOConfig(loss_type="simpo").
DPO_LOSSES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
              "aot_unpaired", "apo_zero", "apo_down", "discopop", "sigmoid_norm")
KTO_LOSSES = ("kto", "apo_zero_unpaired")


class ReferenceSection(_Section):
    mode: Literal["adapter_disabled", "model", "precomputed"] = Field(
        "adapter_disabled", description="adapter_disabled (lora/qlora): the policy with its adapter switched off is the reference, no second copy; model: load a reference model (full fine-tunes; sharded like the policy under ZeRO-3); precomputed: reference log-probs computed once before training, then no reference in memory.")
    name_or_path: Optional[str] = Field(None, description="mode model: the reference model (default: model.name_or_path, i.e. the policy's starting point).")

    _paths = field_validator("name_or_path")(plain_path)


class PreferenceSection(_Section):
    beta: Optional[float] = Field(None, gt=0, le=1000, description="Strength of the preference term: DPO/KTO/SimPO beta, ORPO's lambda (default: TRL's, 0.1; SimPO papers use 2-10).")
    loss_type: Optional[str] = Field(None, description=f"dpo: one of {', '.join(DPO_LOSSES)} (default sigmoid); kto: one of {', '.join(KTO_LOSSES)} (default kto).")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="dpo (robust, cDPO) and simpo: probability that a preference label is flipped.")
    max_completion_length: Optional[int] = Field(None, ge=1, le=1_048_576, description="orpo and simpo: answers are cut to this many tokens (data.max_length bounds prompt + answer; TRL 1.16 has no separate prompt limit).")
    reference: ReferenceSection = Field(default_factory=ReferenceSection, description="dpo and kto: where the reference log-probs come from.")
    simpo_gamma: float = Field(0.5, ge=0, le=100, description="simpo: target reward margin (gamma).")
    cpo_alpha: float = Field(0.0, ge=0, le=100, description="simpo: weight of the added NLL term on the chosen answer (0: pure SimPO; 1: CPO).")
    desirable_weight: float = Field(1.0, gt=0, le=100, description="kto: loss weight of desirable (label true) rows.")
    undesirable_weight: float = Field(1.0, gt=0, le=100, description="kto: loss weight of undesirable (label false) rows.")

    @field_validator("loss_type")
    @classmethod
    def _known_loss(cls, value: Optional[str]) -> Optional[str]:
        known = DPO_LOSSES + KTO_LOSSES
        if value is not None and value not in known:
            guess = difflib.get_close_matches(value, known, n=1, cutoff=0.6)
            raise ValueError(f"unknown loss_type {value!r}" + (f", did you mean {guess[0]!r}?" if guess else "")
                             + f" (dpo: {', '.join(DPO_LOSSES)}; kto: {', '.join(KTO_LOSSES)})")
        return value


class TrainingSection(_Section):
    epochs: float = Field(1.0, gt=0, le=1_000_000, description="Passes over the data (ignored when max_steps is set).")
    max_steps: Optional[int] = Field(None, ge=1, le=MAX_COUNT, description="Stop after this many optimizer steps.")
    micro_batch_size: int = Field(1, ge=1, le=MAX_BATCH, description="Sequences per GPU per forward pass (train_micro_batch_size_per_gpu).")
    gradient_accumulation_steps: int = Field(1, ge=1, le=MAX_BATCH, description="Micro batches per optimizer step.")
    learning_rate: float = Field(2e-4, gt=0, le=1, description="Peak learning rate.")
    lr_scheduler: Literal["linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup", "inverse_sqrt"] = Field(
        "cosine", description="HF scheduler type.")
    warmup_ratio: float = Field(0.03, ge=0, lt=1, description="Fraction of steps spent warming up (ignored when warmup_steps > 0).")
    warmup_steps: int = Field(0, ge=0, le=MAX_COUNT, description="Warm-up steps.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="AdamW beta2.")
    adam_epsilon: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    max_grad_norm: float = Field(1.0, ge=0, description="Gradient clipping (0 disables it).")
    optimizer: Literal["adamw", "adam", "lion", "adagrad", "sgd", "adamw_bnb_8bit"] = Field(
        "adamw", description="Optimizer. DeepSpeed builds adamw/adam/lion/adagrad itself (CPU-offloadable); sgd and adamw_bnb_8bit come from the HF Trainer and cannot be offloaded.")
    loss_kernel: Literal["default", "chunked", "liger"] = Field(
        "default", description="default: full fp32 logits (12 B per token and vocabulary entry); chunked: head + cross-entropy over ~256 MiB token chunks, recomputed in backward (any device); liger: Liger-Kernel's fused linear cross-entropy (CUDA, `pip install liger-kernel`).")
    loss_chunk_tokens: Optional[int] = Field(
        None, ge=1, description="Tokens per chunk with loss_kernel: chunked (default: as many as fit 256 MiB of fp32 logits, 523 at a 128k vocabulary).")
    gradient_checkpointing: bool = Field(True, description="Recompute activations in backward (less memory, ~30% more compute).")
    gradient_checkpointing_reentrant: bool = Field(False, description="Reentrant checkpointing; breaks gradients with frozen inputs (LoRA), keep false.")
    seed: int = Field(42, ge=0, le=2**32 - 1, description="Seed for init, data order and dropout.")
    logging_steps: int = Field(10, ge=1, le=MAX_COUNT, description="Log loss and learning rate every N steps.")
    eval_steps: Optional[int] = Field(None, ge=1, le=MAX_COUNT, description="Evaluate every N steps (needs data.validation_split).")
    save_steps: Optional[int] = Field(None, ge=1, le=MAX_COUNT, description="Checkpoint every N steps (default: at the end only).")
    save_total_limit: Optional[int] = Field(2, ge=1, le=MAX_COUNT, description="Keep the newest N complete checkpoints (older ones are removed once a newer one is complete; null keeps all).")
    resume: bool = Field(True, description="When the run directory holds a complete checkpoint, continue from the newest one (--resume/--no-resume override).")
    report_to: list[Literal["tensorboard", "wandb", "mlflow", "none"]] = Field(
        ["tensorboard"], description="Where metrics go.")
    dataloader_num_workers: int = Field(0, ge=0, le=MAX_PROCS, description="Data loader worker processes per rank.")


class DeepSpeedSection(_Section):
    stage: Literal[0, 1, 2, 3] = Field(2, description="ZeRO stage: 0 plain data parallel, 1 optimizer states, 2 + gradients, 3 + parameters.")
    offload_optimizer: Offload = Field("none", description="Where optimizer states (and the Adam step) live. Needs stage >= 1.")
    offload_param: Offload = Field("none", description="Where parameters live between uses. Needs stage 3.")
    nvme_path: Optional[str] = Field(None, description="Directory on a fast local NVMe disk, for nvme offload.")
    overlap_comm: Optional[bool] = Field(None, description="Overlap reduction with backward (default: DeepSpeed's, true for stage 3). Doubles the gradient bucket memory.")
    contiguous_gradients: bool = Field(True, description="Copy gradients into one contiguous buffer as they are produced (less fragmentation).")
    reduce_bucket_size: Union[int, Literal["auto"]] = Field("auto", description="Elements per gradient reduction bucket (auto: hidden_size^2).")
    allgather_bucket_size: Optional[int] = Field(None, ge=1, le=MAX_ELEMENTS, description="Elements per all-gather bucket in stages 1-2 (DeepSpeed default 5e8).")
    stage3_prefetch_bucket_size: Union[int, Literal["auto"]] = Field("auto", description="Elements prefetched ahead in stage 3 (auto: 0.9 x hidden_size^2).")
    stage3_param_persistence_threshold: Union[int, Literal["auto"]] = Field("auto", description="Parameters smaller than this stay unpartitioned in stage 3 (auto: 10 x hidden_size).")
    stage3_max_live_parameters: Optional[int] = Field(None, ge=1, le=MAX_ELEMENTS, description="Upper bound of gathered parameters in stage 3 (DeepSpeed default 1e9).")
    gather_16bit_weights_on_model_save: bool = Field(True, description="Stage 3: gather the full 16-bit weights when saving, so the run directory holds usable weights.")
    overrides: dict[str, Any] = Field(default_factory=dict, description="Raw DeepSpeed JSON merged last, key by key (linted like any config).")

    _paths = field_validator("nvme_path")(plain_path)

    @field_validator("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
    @classmethod
    def _bucket_bound(cls, value: Any) -> Any:
        if isinstance(value, int) and value > MAX_ELEMENTS:
            raise ValueError(f"must be at most {MAX_ELEMENTS:,} elements or 'auto'")
        return value


class LaunchSection(_Section):
    procs_per_node: Union[int, Literal["auto"]] = Field("auto", description="Processes per machine (auto: one per visible GPU, or cpu_procs without a GPU).")
    cpu_procs: int = Field(1, ge=1, le=MAX_PROCS, description="With procs_per_node: auto and no GPU visible: CPU processes on DeepSpeed's CPU accelerator (CI, demos).")
    nodes: int = Field(1, ge=1, le=MAX_PROCS, description="Number of machines.")
    node_rank: int = Field(0, ge=0, le=MAX_PROCS - 1, description="Rank of this machine (torchrun rendezvous).")
    hostfile: Optional[str] = Field(None, description="DeepSpeed hostfile (`host slots=N` lines); launches through the deepspeed launcher.")
    master_addr: str = Field("127.0.0.1", description="Address of node 0.")
    master_port: int = Field(29500, ge=1, le=65535, description="Rendezvous port on node 0.")
    launcher: Literal["auto", "torchrun", "deepspeed"] = Field("auto", description="auto: deepspeed with a hostfile, torchrun otherwise.")
    nccl_timeout: int = Field(1800, ge=60, le=MAX_SECONDS, description="Seconds a collective (NCCL/gloo) may wait for the other ranks before the run fails instead of hanging (ddp_timeout; deepspeed.init_distributed).")
    stop_timeout: int = Field(300, ge=10, le=MAX_SECONDS, description="Seconds the ranks get after SIGTERM/SIGINT to save a checkpoint before the launcher kills them (torchrun; DeepSpeed's launcher always waits 30).")

    _paths = field_validator("hostfile")(plain_path)

    @field_validator("procs_per_node")
    @classmethod
    def _positive(cls, value: Any) -> Any:
        if isinstance(value, int) and not 1 <= value <= MAX_PROCS:
            raise ValueError(f"must be 1 to {MAX_PROCS} or 'auto'")
        return value


class HardwareSection(_Section):
    gpus: int = Field(1, ge=1, le=MAX_PROCS, description="GPUs per node the recipe is meant for.")
    gpu_memory: Optional[str] = Field(None, description="Memory per GPU, e.g. 24GiB.")
    gpu_type: Optional[str] = Field(None, description="GPU model, e.g. A100, RTX 4070, P40 (enables bf16/feature checks).")
    cpu_memory: Optional[str] = Field(None, description="RAM per node, e.g. 256GiB (checks offload).")

    @field_validator("gpu_memory", "cpu_memory")
    @classmethod
    def _size(cls, value: Optional[str]) -> Optional[str]:
        if value is not None:
            parse_size(value)
        return value


class Recipe(_Section):
    """A fine-tuning recipe."""

    extends: Optional[str] = Field(None, description="Path of a recipe this one starts from (relative to this file); keys here win.")
    name: Optional[str] = Field(None, description="Run name (default: the recipe's file name).")
    model: ModelSection = Field(description="The base model.")
    method: Literal["full", "lora", "qlora"] = Field("lora", description="full: every weight; lora: adapters on a frozen 16-bit base; qlora: adapters on a frozen 4-bit base.")
    objective: Literal["sft", "dpo", "orpo", "kto", "simpo"] = Field("sft", description="sft: next-token loss on the data; dpo, orpo, kto, simpo: preference optimisation with TRL's trainers on prompt/chosen/rejected rows (kto: prompt/completion/label).")
    preference: PreferenceSection = Field(default_factory=PreferenceSection, description="Preference objectives' settings (dpo, orpo, kto, simpo).")
    lora: LoraSection = Field(default_factory=LoraSection, description="LoRA adapter settings (lora and qlora).")
    quantization: QuantizationSection = Field(default_factory=QuantizationSection, description="4-bit quantization of the frozen base (qlora).")
    data: DataSection = Field(description="The training data.")
    training: TrainingSection = Field(default_factory=TrainingSection, description="Optimisation hyper-parameters (HF TrainingArguments).")
    deepspeed: DeepSpeedSection = Field(default_factory=DeepSpeedSection, description="ZeRO stage, offload and buckets (rendered to DeepSpeed JSON).")
    launch: LaunchSection = Field(default_factory=LaunchSection, description="Processes and machines.")
    hardware: Optional[HardwareSection] = Field(None, description="The machines the recipe is meant for (used by lint and plan).")
    output_dir: str = Field("runs/{name}", description="Run directory ({name} is replaced by the run name); relative to the current directory.")

    _paths = field_validator("output_dir")(plain_path)

    @field_validator("name")
    @classmethod
    def _one_path_component(cls, value: Optional[str]) -> Optional[str]:
        # `name` fills output_dir's {name}: `../../x` would put the run (and --overwrite's delete) outside runs/.
        if value is not None and (value in ("", ".", "..") or any(c in value for c in "/\\\0")):
            raise ValueError("must be a plain name without path separators (not `.` or `..`); "
                             "choose the place with output_dir or --output-dir")
        return value

    @property
    def world_size(self) -> Optional[int]:
        """Total processes, or None when it depends on the GPUs found at launch."""
        if isinstance(self.launch.procs_per_node, int):
            return self.launch.procs_per_node * self.launch.nodes
        if self.hardware is not None:
            return self.hardware.gpus * self.launch.nodes
        return None


# ----------------------------------------------------------------------------------------------
# Loading


class RecipeProblem(Exception):
    """One or more problems in a recipe, each with file, line, column and key.

    `partial` is the recipe validated without the offending keys (None when that is impossible), so
    lint can still report the run-time rules in the same pass: all problems at once.
    """

    def __init__(self, problems: list["Problem"], partial: Optional["LoadedRecipe"] = None):
        super().__init__("\n".join(p.render() for p in problems))
        self.problems = problems
        self.partial = partial


class Problem:
    """One finding while loading: `rule` is the stable lint id (R001 document, R002 unknown key, ...)."""

    __slots__ = ("path", "line", "col", "key", "message", "fix", "rule", "loc")

    def __init__(self, path: str, line: int, col: int, key: Optional[str], message: str,
                 fix: Optional[str] = None, rule: str = "R001", loc: tuple = ()):
        self.path, self.line, self.col, self.key, self.message, self.fix = path, line, col, key, message, fix
        self.rule = rule
        self.loc = loc  # the key path, for schema problems (R002/R004)

    def render(self) -> str:
        where = f"{self.path}:{self.line}:{self.col}"
        key = f" `{self.key}`" if self.key else ""
        fix = f" ({self.fix})" if self.fix else ""
        return f"{where}:{key} {self.message}{fix}"


class LoadedRecipe:
    """A validated recipe plus the merged raw data and where every key came from."""

    def __init__(self, recipe: Recipe, raw: dict, origin: dict, path: Path):
        self.recipe = recipe
        self.raw = raw  # merged data after extends and --set
        self.origin = origin  # key path -> (file, line, col)
        self.path = path

    def where(self, key_path: tuple) -> tuple[str, int, int]:
        key_path = tuple(key_path)
        while key_path:
            if key_path in self.origin:
                return self.origin[key_path]
            key_path = key_path[:-1]
        return self.origin.get((), (str(self.path), 1, 1))


MAX_EXTENDS = 16


def load_recipe(path: Union[str, Path], overrides: Optional[list[str]] = None) -> LoadedRecipe:
    """Read, merge (`extends`), override (`--set`) and validate a recipe. Raises RecipeProblem."""
    path = Path(path)
    raw, origin = _load_chain(path, [])
    for item in overrides or []:
        apply_set(raw, origin, item)
    try:
        recipe = validate(raw, origin, str(path))
    except RecipeProblem as exc:
        exc.partial = _without_bad_keys(raw, origin, path, exc.problems)
        raise
    if recipe.name is None:
        recipe.name = path.stem
    return LoadedRecipe(recipe, raw, origin, path)


def _without_bad_keys(raw: dict, origin: dict, path: Path, problems: list[Problem]) -> Optional[LoadedRecipe]:
    """The recipe with every unknown or invalid key dropped (defaults apply), if that validates."""
    if any(p.rule not in ("R002", "R004") or not p.loc for p in problems):
        return None
    pruned = copy.deepcopy(raw)
    for problem in problems:
        node = pruned
        for part in problem.loc[:-1]:
            node = node[part] if isinstance(node, (dict, list)) and _has(node, part) else None
        if isinstance(node, (dict, list)) and _has(node, problem.loc[-1]):
            if isinstance(node, dict):
                del node[problem.loc[-1]]
            else:
                node[problem.loc[-1]] = None  # keep list indexes stable; the retry decides
    try:
        recipe = Recipe.model_validate(pruned)
    except ValidationError:
        return None
    if recipe.name is None:
        recipe.name = path.stem
    return LoadedRecipe(recipe, pruned, origin, path)


def _has(node: Any, part: Any) -> bool:
    return part in node if isinstance(node, dict) else isinstance(part, int) and 0 <= part < len(node)


def _problem_at(path: str, exc: DocumentError) -> RecipeProblem:
    return RecipeProblem([Problem(path, exc.line, exc.col, exc.key, exc.message)])


def _load_chain(path: Path, seen: list[Path]) -> tuple[dict, dict]:
    shown = str(path)
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError):
        resolved = path
    if resolved in seen:
        chain = " -> ".join(str(p) for p in seen + [resolved])
        raise RecipeProblem([Problem(shown, 1, 1, "extends", f"`extends` loop: {chain}", rule="R003")])
    if len(seen) >= MAX_EXTENDS:
        raise RecipeProblem([Problem(shown, 1, 1, "extends", f"`extends` chain longer than {MAX_EXTENDS} files", rule="R003")])
    unusable = _not_a_file(path)
    if unusable:
        raise RecipeProblem([Problem(_short(shown), 1, 1, None, f"recipe file {unusable}")])
    try:
        doc = load_yaml(read_text(path), shown)
    except DocumentError as exc:
        raise _problem_at(shown, exc) from None
    data = doc.data
    if data is None:
        raise RecipeProblem([Problem(shown, 1, 1, None, "recipe is empty", "start from recipes/demo.yaml")])
    if not isinstance(data, dict):
        raise RecipeProblem([Problem(shown, *doc.pos(()), None, f"a recipe is a mapping of keys, not a {type(data).__name__}")])
    origin = {kp: (shown, line, col) for kp, (line, col) in doc.positions.items()}
    _rebase_paths(data, path.parent)
    parent = data.get("extends")
    if parent is None:
        return data, origin
    if not isinstance(parent, str) or not parent:
        line, col = doc.pos(("extends",))
        raise RecipeProblem([Problem(shown, line, col, "extends", "`extends` takes the path of another recipe file", rule="R003")])
    parent_path = Path(parent) if Path(parent).is_absolute() else path.parent / parent
    unusable = _not_a_file(parent_path)
    if unusable:
        line, col = doc.pos(("extends",))
        raise RecipeProblem([Problem(shown, line, col, "extends", f"extended recipe {_short(str(parent_path))} {unusable}", rule="R003")])
    base, base_origin = _load_chain(parent_path, seen + [resolved])
    if isinstance(data.get("data"), dict) and "sources" in data["data"] and isinstance(base.get("data"), dict):
        base["data"] = {k: v for k, v in base["data"].items() if k != "path"}  # sources replace the parent's one path
    merged = _deep_merge(base, data)
    merged.pop("extends", None)
    base_origin.update(origin)
    base_origin.pop(("extends",), None)
    return merged, base_origin


def _not_a_file(path: Path) -> Optional[str]:
    """Why `path` cannot be read as a recipe, or None. Never raises: a 300-character name makes
    stat() fail with ENAMETOOLONG, which pathlib's is_file() passes on."""
    try:
        if path.is_file():
            return None
        return "is a directory, not a recipe file" if path.is_dir() else "does not exist"
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the name
        return f"cannot be opened ({getattr(exc, 'strerror', None) or exc})"


def _short(text: str, limit: int = 120) -> str:
    """A path as shown in a one-line message: its head and tail when it is absurdly long."""
    return text if len(text) <= limit else f"{text[:limit // 2]}...{text[-limit // 2:]}"


# Keys whose string value is a filesystem path, resolved against the recipe that wrote it.
_PATH_KEYS = (("data", "path"), ("model", "name_or_path"), ("model", "tokenizer"), ("model", "adapter"),
              ("launch", "hostfile"), ("preference", "reference", "name_or_path"))


def _rebase_paths(data: dict, base: Path) -> None:
    """Make relative local paths relative to the recipe's folder (hub ids are left alone)."""
    sources = data.get("data", {}).get("sources") if isinstance(data.get("data"), dict) else None
    blocks = []
    for *sections, key in _PATH_KEYS:
        block = data
        for section in sections:
            block = block.get(section) if isinstance(block, dict) else None
        blocks.append((block, key))
    blocks += [(item, "path") for item in (sources if isinstance(sources, list) else [])]
    for block, key in blocks:
        if not isinstance(block, dict):
            continue
        value = block.get(key)
        if not isinstance(value, str) or not value or Path(value).is_absolute():
            continue
        if value.startswith(("./", "../")) or _exists(base / value) or key == "hostfile":
            block[key] = _rebased(base, value)


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):  # a name too long to stat is no local file
        return False


def _rebased(base: Path, value: str) -> str:
    joined = str(base / value)
    # Keep a relative result recognisably a path: "./weights", not "weights", which reads as a hub id.
    if not Path(joined).is_absolute() and not joined.startswith(("./", "../")) and joined != "..":
        joined = "./" + joined
    return joined


def _deep_merge(base: dict, top: dict) -> dict:
    """`top` wins key by key; sections (and deepspeed.overrides) merge recursively."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def apply_set(raw: dict, origin: dict, item: str) -> None:
    """`--set deepspeed.stage=3`: the value is read as YAML (numbers, booleans, lists)."""
    where = "--set"
    if "=" not in item:
        raise RecipeProblem([Problem(where, 1, 1, None, f"`--set {item}` needs the form key.path=value", rule="R006")])
    dotted, _, text = item.partition("=")
    keys = [k for k in dotted.strip().split(".")]
    if not all(keys):
        raise RecipeProblem([Problem(where, 1, 1, dotted, f"`--set {item}`: empty key in `{dotted}`", rule="R006")])
    try:
        value = load_yaml(text, where).data if text.strip() else ""
    except DocumentError as exc:
        raise RecipeProblem([Problem(where, 1, 1, dotted, f"cannot read value: {exc.message}", rule="R006")]) from None
    node = raw
    for i, key in enumerate(keys[:-1]):
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise RecipeProblem([Problem(where, 1, 1, dotted, f"`{'.'.join(keys[:i + 1])}` is not a section", rule="R006")])
        node = child
    node[keys[-1]] = value
    origin[tuple(keys)] = (f"--set {item}", 1, 1)


def validate(raw: dict, origin: dict, path: str) -> Recipe:
    """Validate merged data; every pydantic error becomes a Problem with a position."""
    try:
        return Recipe.model_validate(raw)
    except ValidationError as exc:
        problems = [_to_problem(err, raw, origin, path) for err in exc.errors(include_url=False)]
        raise RecipeProblem(_dedupe(problems)) from None


def _dedupe(problems: list[Problem]) -> list[Problem]:
    seen, out = set(), []
    for p in problems:
        k = (p.path, p.line, p.col, p.key, p.message)
        if k not in seen:
            seen.add(k)
            out.append(p)
    return sorted(out, key=lambda p: (p.path, p.line, p.col))


def _to_problem(err: dict, raw: dict, origin: dict, path: str) -> Problem:
    # pydantic inserts union-member and literal names into loc; keep only real keys and indexes.
    loc = tuple(part for part in err["loc"] if _is_real_key(raw, err["loc"], part))
    key = ".".join(str(p) for p in loc)
    file, line, col = _where(origin, loc, path)
    kind = err["type"]
    if kind == "extra_forbidden":
        return Problem(file, line, col, key, "unknown key", unknown_key_fix(loc), rule="R002", loc=loc)
    if kind == "missing":
        return Problem(file, line, col, key, "required key is missing", rule="R005")
    value = err.get("input")
    shown = _short(repr(value), 60) if not isinstance(value, (dict, list)) else type(value).__name__
    message = err["msg"]
    if kind == "literal_error":
        expected = err.get("ctx", {}).get("expected", "")
        message = f"expected one of {expected}"
        guess = difflib.get_close_matches(str(value), re.findall(r"'([^']*)'", expected), n=1, cutoff=0.6)
        if guess:
            return Problem(file, line, col, key, f"{message}, got {shown}", f"did you mean `{guess[0]}`?", rule="R004", loc=loc)
    return Problem(file, line, col, key, f"{message}, got {shown}", rule="R004", loc=loc)


def _is_real_key(raw: Any, full_loc: tuple, part: Any) -> bool:
    node = raw
    for p in full_loc:
        if p is part:
            break
        if isinstance(node, dict) and p in node:
            node = node[p]
        elif isinstance(node, list) and isinstance(p, int) and p < len(node):
            node = node[p]
    if isinstance(part, int):
        return isinstance(node, list)
    return isinstance(node, dict) or node is None or not isinstance(node, (list,))


def _where(origin: dict, loc: tuple, path: str) -> tuple[str, int, int]:
    loc = tuple(loc)
    while loc:
        if loc in origin:
            return origin[loc]
        loc = loc[:-1]
    return origin.get((), (path, 1, 1))


# Names other tools (HF TrainingArguments, axolotl, LLaMA-Factory, PEFT, DeepSpeed) give to recipe keys.
PEER_KEYS = {
    "num_epochs": "training.epochs", "num_train_epochs": "training.epochs", "epoch": "training.epochs",
    "lr": "training.learning_rate", "learning_rate": "training.learning_rate",
    "per_device_train_batch_size": "training.micro_batch_size", "train_micro_batch_size_per_gpu": "training.micro_batch_size",
    "micro_batch_size": "training.micro_batch_size", "batch_size": "training.micro_batch_size",
    "gradient_accumulation": "training.gradient_accumulation_steps",
    "gradient_accumulation_steps": "training.gradient_accumulation_steps",
    "lr_scheduler_type": "training.lr_scheduler", "optim": "training.optimizer", "warmup": "training.warmup_ratio",
    "lora_r": "lora.r", "rank": "lora.r", "lora_rank": "lora.r", "lora_alpha": "lora.alpha",
    "lora_dropout": "lora.dropout", "lora_target_modules": "lora.target_modules", "lora_target": "lora.target_modules",
    "target_modules": "lora.target_modules", "use_rslora": "lora.rslora", "use_dora": "lora.dora",
    "zero_stage": "deepspeed.stage", "zero": "deepspeed.stage", "stage": "deepspeed.stage",
    "base_model": "model.name_or_path", "model_name_or_path": "model.name_or_path", "model_name": "model.name_or_path",
    "torch_dtype": "model.dtype", "dtype": "model.dtype",
    "sequence_len": "data.max_length", "max_seq_length": "data.max_length", "cutoff_len": "data.max_length",
    "max_seq_len": "data.max_length", "max_length": "data.max_length", "sample_packing": "data.packing",
    "dataset": "data.path", "datasets": "data.path", "val_set_size": "data.validation_split",
    "output": "output_dir", "adapter": "method", "finetuning_type": "method",
    "load_in_4bit": "method", "bnb_4bit_quant_type": "quantization.quant_type",
}


def unknown_key_fix(loc: tuple) -> Optional[str]:
    """The suggestion for an unknown key: the same key in another section, a peer tool's name for a
    key, or a close spelling in this section."""
    name = str(loc[-1])
    section = tuple(loc[:-1])
    here = ".".join(str(p) for p in section)
    elsewhere = [f"{s}.{name}" if s else name for s in _sections() if s != here and name in _known_keys(tuple(s.split(".")) if s else ())]
    if elsewhere:
        return f"did you mean `{elsewhere[0]}`? (`{name}` belongs in the {elsewhere[0].rsplit('.', 1)[0] or 'top'} section)"
    peer = PEER_KEYS.get(name.lower())
    if peer is not None and peer != (f"{here}.{name}" if here else name):
        if peer == "method":
            return "the method is one key: `method: lora` or `method: qlora` (4-bit base)"
        return f"did you mean `{peer}`? (`{name}` is what other tools call it)"
    options = _known_keys(section)
    guess = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
    if guess:
        return f"did you mean `{guess[0]}`?"
    return f"known keys: {', '.join(sorted(options))}" if options else None


def _sections() -> list[str]:
    """"" (the top level) and the name of every section of the recipe."""
    return [""] + [name for name, field in Recipe.model_fields.items() if section_model(field.annotation) is not None]


def _known_keys(section_loc: tuple) -> list[str]:
    model: Any = Recipe
    for part in section_loc:
        if isinstance(part, int):
            return []
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = section_model(field.annotation)
        if model is None:
            return []
    return list(getattr(model, "model_fields", {}).keys())


def section_model(annotation: Any) -> Any:
    """The pydantic section class behind a field annotation (`Optional[HardwareSection]` too), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def json_schema() -> dict:
    """JSON Schema of the recipe, for YAML language servers (`# yaml-language-server: $schema=...`)."""
    schema = Recipe.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "finetune recipe"
    return schema
