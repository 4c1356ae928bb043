"""The recipe's schema: every section and key with its default, type, bounds and documentation
(pydantic), and the JSON Schema derived from it. Loading a YAML file into it is in `loading`."""

from __future__ import annotations

import re
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from finetune import objectives
from finetune.objectives import DPO_LOSSES, GRPO_LOSSES, KTO_LOSSES
from finetune.recipe.auto import AUTO_WITHOUT_MACHINE, auto_in_range, auto_or
from finetune.suggest import closest

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


class RopeScalingSection(_Section):
    rope_type: Literal["linear", "dynamic", "yarn", "llama3"] = Field(description="transformers' RoPE scaling (modeling_rope_utils.ROPE_INIT_FUNCTIONS): linear (position interpolation), dynamic (NTK), yarn, llama3.")
    factor: float = Field(gt=1, le=1024, description="How many times the model's trained positions the scaled context covers.")
    original_max_position_embeddings: Optional[int] = Field(None, ge=1, le=1 << 24, description="Positions the model was trained with (default: its config's max_position_embeddings).")
    low_freq_factor: Optional[float] = Field(None, gt=0, description="llama3 only (Llama 3.1 uses 1).")
    high_freq_factor: Optional[float] = Field(None, gt=0, description="llama3 only (Llama 3.1 uses 4).")
    beta_fast: Optional[float] = Field(None, gt=0, description="yarn only (default 32).")
    beta_slow: Optional[float] = Field(None, gt=0, description="yarn only (default 1).")

    @model_validator(mode="after")
    def _keys_of_the_type(self) -> "RopeScalingSection":
        llama3 = ("low_freq_factor", "high_freq_factor")
        yarn = ("beta_fast", "beta_slow")
        if self.rope_type == "llama3" and any(getattr(self, k) is None for k in llama3):
            raise ValueError("rope_type llama3 needs low_freq_factor and high_freq_factor (Llama 3.1: 1 and 4)")
        stray = [k for k in llama3 if self.rope_type != "llama3" and getattr(self, k) is not None]
        stray += [k for k in yarn if self.rope_type != "yarn" and getattr(self, k) is not None]
        if stray:
            raise ValueError(f"{', '.join(stray)} do not apply to rope_type {self.rope_type}")
        return self


class ModelSection(_Section):
    name_or_path: str = Field(min_length=1, description="Hub id or local directory of the base model.")
    revision: Optional[str] = Field(None, description="Git revision (branch, tag or commit) of a hub model.")
    dtype: Dtype = Field("bfloat16", description="Dtype the weights are loaded and trained in (mixed precision follows it).")
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2", "flash_attention_3"] = Field(
        "sdpa", description="Attention kernel passed to from_pretrained. Left out: sdpa, or eager for the families whose transformers class refuses sdpa (Gemma 2, gpt-oss).")
    trust_remote_code: bool = Field(False, description="Run modelling code shipped with the checkpoint. Off by default: it executes code from the hub.")
    tokenizer: Optional[str] = Field(None, description="Tokenizer location when it differs from the model's.")
    rope_scaling: Optional[RopeScalingSection] = Field(None, description="Stretch the model's RoPE positions to a longer context (written into the config's rope_parameters before loading). README: Long context.")
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
    target_experts: bool = Field(False, description="Mixture of experts: LoRA on every routed expert too (the fused gate_up_proj at rank 2r, down_proj; peft's target_parameters). Needs dropout 0, no DoRA, bias none (peft's ParamWrapper). README: Mixture of experts.")
    target_router: bool = Field(False, description="Mixture of experts: LoRA on the router's weight too (peft's target_parameters; dropout 0, no DoRA, bias none).")


class MoeSection(_Section):
    experts_implementation: Optional[Literal["eager", "grouped_mm", "batched_mm"]] = Field(
        None, description="How the experts run (transformers' experts_implementation): null keeps transformers' default (grouped_mm, eager where grouped_mm cannot run); eager loops over the experts.")
    router_aux_loss_coef: Optional[float] = Field(
        None, ge=0, le=100, description="Weight of the router's load-balancing loss, added to every objective's loss alike (SFT and TRL's): null: the model config's router_aux_loss_coef; 0: off.")


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


DataFormat = Literal["alpaca", "messages", "sharegpt", "text", "prompt"]
_FORMAT_DOC = ("alpaca: instruction/input/output columns; messages: OpenAI-style list of {role, content} (system/user/assistant/tool); "
               "sharegpt: `conversations` of {from, value} (human/gpt/system/function_call/observation); text: one `text` column; "
               "prompt (objective grpo): a `prompt` column, text or messages. Preference objectives read their own rows "
               "(prompt/chosen/rejected; kto: prompt/completion/label) and ignore format.")


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
    pad_to_multiple_of: Union[Literal["auto"], int] = Field(
        "auto", description="Each micro batch is padded at the end to a multiple of this many tokens (never past max_length rounded up to 8; not with padding_free), so that the GPU's attention kernel sees few shapes: cuDNN's attention (torch's SDPA on H100/H200) builds a plan on the host for every new length. Rows of one length need no attention mask for it (a causal model never attends to later tokens; a mixture of experts gets one). auto: 64 on a GPU for sft with a text model, else 1. Rows of different lengths are padded to at least a multiple of 8 and masked. sft only (TRL's collators pad the other objectives).")
    validation_split: float = Field(0.0, ge=0, lt=1, description="Fraction of examples held out for evaluation (0 = no eval).")
    mask_prompt: bool = Field(True, description="Exclude prompt tokens from the loss (train on responses only).")
    num_proc: Union[Literal["auto"], int] = Field(
        "auto", description="Processes that tokenize before launch (`finetune prepare`, or `finetune train` before the ranks start): auto = the cores this machine lets the command use. The rows are the same for any value.")

    _paths = field_validator("path")(plain_path)
    _roles = field_validator("roles")(known_roles)

    @field_validator("num_proc")
    @classmethod
    def _at_least_one_process(cls, value: Union[str, int]) -> Union[str, int]:
        if isinstance(value, int) and not 1 <= value <= 4096:
            raise ValueError("num_proc must be `auto` or a number of processes from 1 to 4096")
        return value

    _pad_multiple = field_validator("pad_to_multiple_of", mode="before")(
        lambda value: auto_in_range(value, 4096, "a number of tokens"))

    @model_validator(mode="after")
    def _one_way_to_name_the_data(self) -> "DataSection":
        if self.sources and self.path:
            raise ValueError("give either data.path (one source) or data.sources, not both")
        if not self.sources and not self.path:
            raise ValueError("data needs `path` (one source) or `sources` (a list of them)")
        return self

    def source_formats(self) -> list[str]:
        return [s.format for s in self.sources] if self.sources else [self.format]


class VisionSection(_Section):
    freeze_tower: bool = Field(True, description="Keep the vision tower frozen (no gradients, no saved activations); false trains it (LoRA: adapters on its linear layers; full: its weights). README: Vision-language models.")
    freeze_projector: bool = Field(True, description="Keep the projector between the tower and the language model frozen (Qwen2.5-VL's merger, LLaVA's multi_modal_projector).")
    max_pixels: Optional[int] = Field(None, ge=784, le=1 << 32, description="Qwen2.5-VL: images larger than this many pixels are shrunk (aspect kept) before the tower; caps the tokens an image costs at max_pixels / 784 (default: the model's preprocessor_config.json).")
    min_pixels: Optional[int] = Field(None, ge=784, le=1 << 32, description="Qwen2.5-VL: images smaller than this many pixels are enlarged (default: the model's preprocessor_config.json).")
    max_image_tokens: Optional[int] = Field(None, ge=1, le=1 << 22, description="Qwen2.5-VL: the same limit as max_pixels, in tokens per image (max_pixels = tokens x 28 x 28).")
    tower_guard: Literal["auto", "always", "off"] = Field("auto", description="A micro batch without images still runs the vision tower (a zero-weighted dummy image after the embeddings), so every rank gathers the same ZeRO-3 parameters in the same order: auto = with more than one process.")

    @model_validator(mode="after")
    def _one_size_limit(self) -> "VisionSection":
        if self.max_pixels is not None and self.max_image_tokens is not None:
            raise ValueError("give max_pixels or max_image_tokens, not both (they are the same limit)")
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            raise ValueError("min_pixels is larger than max_pixels")
        return self


PREFERENCE_OBJECTIVES = objectives.PREFERENCE


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
            guess = closest(value, known)
            raise ValueError(f"unknown loss_type {value!r}" + (f", did you mean {guess!r}?" if guess else "")
                             + f" (dpo: {', '.join(DPO_LOSSES)}; kto: {', '.join(KTO_LOSSES)})")
        return value


class RewardSection(_Section):
    function: str = Field(min_length=1, max_length=1000, description="A built-in reward (exact_match, number_match, regex, length, think_format) or your own `package.module:function` / `file.py:function` (relative to the recipe). README: GRPO.")
    weight: float = Field(1.0, ge=-1000, le=1000, description="Weight of this reward in the sum GRPO scores a completion by.")
    column: str = Field("answer", min_length=1, description="exact_match, number_match: the dataset column holding the reference answer.")
    pattern: Optional[str] = Field(None, description="regex: 1.0 when the pattern matches the completion (re.search), else 0.0.")
    target: Optional[int] = Field(None, ge=1, le=1_048_576, description="length: the completion length in tokens that scores 0; each token further away costs 1/target.")


class GrpoSection(_Section):
    num_generations: int = Field(8, ge=2, le=4096, description="Completions sampled per prompt (the group). micro_batch_size x gradient_accumulation_steps x processes must be a multiple of it.")
    max_completion_length: int = Field(256, ge=1, le=1_048_576, description="Tokens generated per completion at most.")
    temperature: float = Field(1.0, gt=0, le=100, description="Sampling temperature of the generations.")
    beta: float = Field(0.0, ge=0, le=100, description="KL coefficient against the reference (the starting model); 0 (TRL's default) keeps no reference.")
    loss_type: Literal[GRPO_LOSSES] = Field("dapo", description="TRL's GRPO loss: " + ", ".join(GRPO_LOSSES) + " (default dapo).")
    scale_rewards: Literal["group", "batch", "none"] = Field("group", description="Advantages divided by the reward std of the group, of the batch, or not at all (Dr. GRPO).")
    num_iterations: int = Field(1, ge=1, le=1000, description="Optimisation passes over each generated batch (mu).")
    epsilon: float = Field(0.2, gt=0, lt=1, description="Clipping range of the policy ratio.")
    rewards: list[RewardSection] = Field(default_factory=list, description="Reward functions, summed with their weights.")
    vllm: Literal["off", "colocate", "server"] = Field("off", description="Generate with vLLM (needs vllm installed and a GPU); off: transformers' generate.")


class TrainingSection(_Section):
    epochs: float = Field(1.0, gt=0, le=1_000_000, description="Passes over the data (ignored when max_steps is set).")
    max_steps: Optional[int] = Field(None, ge=1, le=MAX_COUNT, description="Stop after this many optimizer steps.")
    micro_batch_size: Union[int, Literal["auto"]] = Field(
        "auto", description="Sequences per GPU per forward pass (train_micro_batch_size_per_gpu). auto: as many of a step's rows as fit in one forward under the plan's bound, the rows per optimizer step staying what micro batch 1 x gradient_accumulation_steps x data-parallel processes gives (accumulation shrinks to match); 1 without GPU memory to judge by, and for objectives other than sft (README: Speed).")
    gradient_accumulation_steps: int = Field(1, ge=1, le=MAX_BATCH, description="Micro batches per optimizer step (with micro_batch_size: auto, the rows per GPU per step).")
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
    loss_kernel: Literal["auto", "default", "chunked", "liger"] = Field(
        "auto", description="default: full fp32 logits (12 B per token and vocabulary entry); chunked: head + cross-entropy over ~256 MiB token chunks, recomputed in backward (any device); liger: Liger-Kernel's fused linear cross-entropy (CUDA, `pip install liger-kernel`). auto: chunked where the logits stand between this GPU and a faster setup (no checkpointing, a larger micro batch) under the plan's bound, else default (sft; default without GPU memory to judge by).")
    loss_chunk_tokens: Optional[int] = Field(
        None, ge=1, description="Tokens per chunk with loss_kernel: chunked (default: as many as fit 256 MiB of fp32 logits, 523 at a 128k vocabulary).")
    tiled_mlp: bool = Field(False, description="DeepSpeed ALST's TiledMLP: each MLP runs over slices of the sequence, recomputed in backward, so its intermediate activations (3 x intermediate_size per token) exist for one slice at a time. For very long sequences; one more MLP forward per step. README: Long context.")
    tiled_mlp_shards: Optional[int] = Field(None, ge=1, le=MAX_BATCH, description="Slices per MLP call with tiled_mlp (default: ceil(tokens per process / hidden_size), DeepSpeed's choice).")
    gradient_checkpointing: Union[bool, Literal["auto"]] = Field("auto", description="Recompute activations in backward (less memory, ~30% more compute). auto: off when the plan's bound says the activations fit this GPU without it, on otherwise (on without GPU memory to judge by, and with activation_offload).")
    activation_offload: bool = Field(False, description="With gradient_checkpointing: hold the checkpointed layer inputs (layers x tokens x hidden) in pinned host memory instead of the GPU (transformers' activation_checkpointing_enable(offload=True), ALST's activation-checkpoint offload); a copy each way per layer slows the step. README: Long context.")
    gradient_checkpointing_reentrant: bool = Field(False, description="Reentrant checkpointing (PyTorch recommends false). LoRA/QLoRA under ZeRO-3 is always reentrant: non-reentrant recompute sees ZeRO-3's partitioned frozen weights (DeepSpeed#4332; TRL forces it too).")
    seed: int = Field(42, ge=0, le=2**32 - 1, description="Seed for init, data order and dropout.")
    logging_steps: int = Field(10, ge=1, le=MAX_COUNT, description="Log loss and learning rate every N steps.")
    eval_steps: Optional[int] = Field(None, ge=1, le=MAX_COUNT, description="Evaluate every N steps (needs data.validation_split).")
    save_steps: Optional[int] = Field(None, ge=1, le=MAX_COUNT, description="Checkpoint every N steps (default: at the end only).")
    save_total_limit: Optional[int] = Field(2, ge=1, le=MAX_COUNT, description="Keep the newest N complete checkpoints (older ones are removed once a newer one is complete; null keeps all).")
    resume: bool = Field(True, description="When the run directory holds a complete checkpoint, continue from the newest one (--resume/--no-resume override).")
    report_to: list[Literal["tensorboard", "wandb", "mlflow", "none"]] = Field(
        ["tensorboard"], description="Where metrics go.")
    dataloader_num_workers: int = Field(0, ge=0, le=MAX_PROCS, description="Data loader worker processes per rank.")


    _micro_batch_in_range = field_validator("micro_batch_size", mode="before")(
        lambda value: auto_in_range(value, MAX_BATCH, "a number of sequences"))

    _auto_bools = field_validator("gradient_checkpointing", mode="before")(
        lambda value: auto_or(bool, value, "true, false or `auto`"))

    @model_validator(mode="after")
    def _offload_needs_checkpointing(self) -> "TrainingSection":
        if self.activation_offload and not self.gradient_checkpointing:
            raise ValueError("activation_offload moves the checkpointed layer inputs: it needs gradient_checkpointing: true")
        return self


class DeepSpeedSection(_Section):
    enabled: Union[bool, Literal["auto"]] = Field("auto", description="Train through DeepSpeed's engine. false: transformers' Trainer alone with torch's fused AdamW (one process, no offload, no ZeRO). auto: false for LoRA/QLoRA SFT on one GPU with nothing to offload, where DeepSpeed partitions nothing and its bf16 optimizer wrapper adds host syncs every step; true otherwise (more processes, offload, full fine-tunes for their fp32 master weights, no GPU).")
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
    _auto_bool = field_validator("enabled", mode="before")(lambda value: auto_or(bool, value, "true, false or `auto`"))

    @field_validator("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
    @classmethod
    def _bucket_bound(cls, value: Any) -> Any:
        if isinstance(value, int) and value > MAX_ELEMENTS:
            raise ValueError(f"must be at most {MAX_ELEMENTS:,} elements or 'auto'")
        return value


class ParallelSection(_Section):
    sequence: int = Field(1, ge=1, le=MAX_PROCS, description="Ulysses sequence parallelism (DeepSpeed ALST, through accelerate's ParallelismConfig): each sequence is split across this many processes, which exchange attention heads (all-to-all); activations and logits per process shrink by this factor. Needs heads and kv-heads divisible by it, sdpa or flash attention. README: Long context.")
    tensor: int = Field(1, ge=1, le=MAX_PROCS, description="DeepSpeed AutoTP (tensor_parallel.autotp_size): linear layers are split across this many processes, which see the same rows. Full fine-tunes at ZeRO stage 0-2 (lint R143, R148). README: Long context.")

    @property
    def model_parallel(self) -> int:
        """Processes that share one stream of rows (sequence x tensor)."""
        return self.sequence * self.tensor


LOOPBACK = "127.0.0.1"  # node 0 of a single-node run: nothing leaves the machine


class LaunchSection(_Section):
    procs_per_node: Union[int, Literal["auto"]] = Field("auto", description="Processes per machine (auto: one per visible GPU, or cpu_procs without a GPU).")
    cpu_procs: int = Field(1, ge=1, le=MAX_PROCS, description="With procs_per_node: auto and no GPU visible: CPU processes on DeepSpeed's CPU accelerator (CI, demos).")
    nodes: int = Field(1, ge=1, le=MAX_PROCS, description="Number of machines.")
    node_rank: int = Field(0, ge=0, le=MAX_PROCS - 1, description="Rank of this machine (torchrun rendezvous).")
    hostfile: Optional[str] = Field(None, description="DeepSpeed hostfile (`host slots=N` lines); launches through the deepspeed launcher.")
    master_addr: str = Field(LOOPBACK, description="Address of node 0.")
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


# The sections only some methods read (lint R111 warns when another method's recipe writes one).
METHOD_SECTIONS: dict[str, tuple[str, ...]] = {"lora": ("lora", "qlora"), "quantization": ("qlora",)}


class Recipe(_Section):
    """A fine-tuning recipe."""

    extends: Optional[str] = Field(None, description="Path of a recipe this one starts from (relative to this file); keys here win.")
    name: Optional[str] = Field(None, description="Run name (default: the recipe's file name).")
    model: ModelSection = Field(description="The base model.")
    method: Literal["full", "lora", "qlora"] = Field("lora", description="full: every weight; lora: adapters on a frozen 16-bit base; qlora: adapters on a frozen 4-bit base.")
    objective: Literal[objectives.NAMES] = Field("sft", description=objectives.doc() + ".")
    preference: PreferenceSection = Field(default_factory=PreferenceSection, description=f"Preference objectives' settings ({', '.join(objectives.PREFERENCE)}).")
    grpo: GrpoSection = Field(default_factory=GrpoSection, description="objective grpo: generation, the GRPO loss and the reward functions (README: GRPO).")
    lora: LoraSection = Field(default_factory=LoraSection, description="LoRA adapter settings (lora and qlora).")
    moe: MoeSection = Field(default_factory=MoeSection, description="Mixture-of-experts models: how the experts run and the router's auxiliary loss (README: Mixture of experts).")
    quantization: QuantizationSection = Field(default_factory=QuantizationSection, description="4-bit quantization of the frozen base (qlora).")
    data: DataSection = Field(description="The training data.")
    vision: VisionSection = Field(default_factory=VisionSection, description="Vision-language models (recognised from config.json): what trains, image sizes (README: Vision-language models).")
    training: TrainingSection = Field(default_factory=TrainingSection, description="Optimisation hyper-parameters (HF TrainingArguments).")
    deepspeed: DeepSpeedSection = Field(default_factory=DeepSpeedSection, description="ZeRO stage, offload and buckets (rendered to DeepSpeed JSON).")
    parallel: ParallelSection = Field(default_factory=ParallelSection, description="Model parallelism beside ZeRO's data parallelism: sequence (Ulysses) and tensor (AutoTP) degrees.")
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

    # The keys left `auto` (so written, or not written at all): finetune.plan.auto resolves them for a machine (GPU
    # memory, process count). Until then they hold what a run without GPU facts gets (AUTO_WITHOUT_MACHINE), so that
    # every reader of a recipe sees concrete values; a run directory's recipe.yaml writes `auto` back (with_auto).
    _auto: frozenset = PrivateAttr(default_factory=frozenset)

    @model_validator(mode="after")
    def _auto_without_a_machine(self) -> "Recipe":
        keys = set()
        for key, value in AUTO_WITHOUT_MACHINE.items():
            section, name = key.split(".")
            if getattr(getattr(self, section), name) == "auto":
                keys.add(key)
                setattr(getattr(self, section), name, value)
        self._auto = frozenset(keys)
        return self

    @property
    def auto_keys(self) -> frozenset:
        """Dotted keys the recipe leaves `auto` (their values now: AUTO_WITHOUT_MACHINE, or a machine's choice)."""
        return self._auto

    @property
    def world_size(self) -> Optional[int]:
        """Total processes, or None when it depends on the GPUs found at launch."""
        if isinstance(self.launch.procs_per_node, int):
            return self.launch.procs_per_node * self.launch.nodes
        if self.hardware is not None:
            return self.hardware.gpus * self.launch.nodes
        return None


    @property
    def data_parallel_size(self) -> Optional[int]:
        """Processes that see different rows: world / (sequence x tensor), or None when the world is known only
        at launch (or does not divide; lint says so)."""
        world = self.world_size
        if world is None or world % self.parallel.model_parallel:
            return None
        return world // self.parallel.model_parallel


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
