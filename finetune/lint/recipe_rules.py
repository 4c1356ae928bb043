"""Recipe rules (R1xx): combinations that validate fine but fail, or silently misbehave, at run time.

Each rule is one small function taking the loaded recipe and yielding RawFindings whose `key` is a
recipe key path (the engine turns it into file:line:col).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

from finetune import objectives
from finetune.lint.deepspeed.context import RawFinding  # one finding type for every rule module; key = recipe path here
from finetune.recipe import LoadedRecipe
from finetune.recipe.references import DATA_SUFFIXES, MODEL_CONFIG, is_local, recipe_paths
from finetune.suggest import closest

RULES: dict[str, str] = {
    "R001": "The file is not a readable YAML recipe (syntax, tags, duplicate keys, size, nesting).",
    "R002": "Unknown key (with a did-you-mean suggestion).",
    "R003": "Broken `extends` (missing file, loop, too long a chain).",
    "R004": "Wrong type or value for a key.",
    "R005": "Required key missing.",
    "R006": "Malformed `--set` override.",
    "R101": "QLoRA + ZeRO-3: the 4-bit storage dtype must equal the compute dtype and the model dtype.",
    "R102": "ZeRO-3 without stage3_gather_16bit_weights_on_model_save saves no usable weights.",
    "R103": "bf16 (or FlashAttention) on a declared GPU that lacks it.",
    "R104": "Reentrant checkpointing setting that is not what runs (LoRA under ZeRO-3 is always reentrant) or that is slower for nothing.",
    "R105": "Optimizer offload with an optimizer DeepSpeed cannot offload.",
    "R106": "trust_remote_code runs code from the model repository.",
    "R107": "Offload requested at a ZeRO stage that ignores it.",
    "R108": "NVMe offload without nvme_path.",
    "R109": "Dataset file missing or of an unsupported type.",
    "R110": "Evaluation configured without a validation split.",
    "R111": "A section that the chosen method ignores.",
    "R112": "More processes per node than the declared GPUs.",
    "R113": "Launch settings that cannot work (hostfile missing, multi-node on loopback).",
    "R114": "Packing or padding_free with a model that cannot keep the examples apart (no position_ids; remote code).",
    "R115": "A data mixture that cannot be built: weight and samples on one source, or weights on only some sources.",
    "R116": "A data key the source's format ignores (roles on alpaca/text, an unknown `columns` name, think or chat_template without a chat source).",
    "R117": "The same data source listed twice (its examples would count double in the mixture).",
    "R118": "Objective settings the objective does not read (a `preference` or `grpo` key, a loss of another objective, a reference that cannot exist).",
    "R119": "Data or training keys that TRL's objectives do not use (format, packing, mask_prompt, pad_to_multiple_of, loss_kernel).",
    "R120": "`model.adapter` that cannot be continued from (objective sft, full fine-tune, missing adapter, a `lora` section it overrides, rows in another prompt format than the SFT run's).",
    "R121": "GRPO rewards and batch that cannot work: no reward, a malformed `module:function`, weights, a built-in without its setting, a batch that does not hold whole groups.",
    "R122": "Unknown `builtin:` model (a misspelled name).",
    "R123": "A path the recipe names is a device, FIFO or socket, or a folder holding one (every reader would hang or never end).",
}

# transformers 5.x causal LMs whose forward takes no position_ids: ALiBi (bloom, mpt), recurrent state
# (mamba, rwkv, xlstm) or encoder-decoder heads. Packed examples are kept apart only through restarting
# position_ids (or the cu_seq_lens derived from them); these models attend, or carry state, across the
# whole row, and the Trainer even drops the unused position_ids column. tests/lint/test_lint.py checks the
# list against the installed transformers.
NO_POSITION_IDS_MODEL_TYPES = frozenset({
    "bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "bloom", "cpmant", "falcon_mamba", "mamba",
    "mamba2", "marian", "mbart", "mpt", "mvp", "pegasus", "plbart", "prophetnet", "roformer", "rwkv", "trocr",
    "xlstm",
})

Rule = Callable[[LoadedRecipe], Iterator[RawFinding]]
_RULES: list[Rule] = []


def rule(fn: Rule) -> Rule:
    _RULES.append(fn)
    return fn


def check_recipe(loaded: LoadedRecipe) -> list[RawFinding]:
    return [finding for fn in _RULES for finding in fn(loaded)]


def written(loaded: LoadedRecipe, *key: str) -> bool:
    """Whether the user wrote `key` (in the recipe, an extended one, or --set), not a default."""
    node = loaded.raw
    for part in key:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


@rule
def qlora_zero3_storage(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    r = loaded.recipe
    if r.method != "qlora" or r.deepspeed.stage != 3:
        return
    q = r.quantization
    # ZeRO-3 flattens and partitions every parameter tensor of one dtype; packed 4-bit weights stored as
    # uint8 (or a dtype unlike the rest) fail with "Cannot copy out of meta tensor" / dtype mismatches.
    if q.storage_dtype != q.compute_dtype:
        yield RawFinding("R101", "error", ("quantization", "storage_dtype"),
                         f"QLoRA with ZeRO-3 needs storage_dtype equal to compute_dtype ({q.storage_dtype} != {q.compute_dtype})",
                         f"set quantization.storage_dtype: {q.compute_dtype}")
    if q.storage_dtype != r.model.dtype:
        yield RawFinding("R101", "error", ("quantization", "storage_dtype"),
                         f"QLoRA with ZeRO-3 needs storage_dtype equal to model.dtype ({q.storage_dtype} != {r.model.dtype}): "
                         "ZeRO-3 partitions all parameters as one dtype",
                         f"set quantization.storage_dtype: {r.model.dtype} (and compute_dtype to match)")


@rule
def zero3_gather_on_save(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    from finetune.render import render_deepspeed

    r = loaded.recipe
    # Read the rendered config so that a raw `overrides` value counts as much as the recipe key.
    zero = render_deepspeed(r).get("zero_optimization", {})
    gather = zero.get("stage3_gather_16bit_weights_on_model_save", False) if isinstance(zero, dict) else False
    if r.deepspeed.stage != 3 or gather is True:
        return
    if r.method == "full":
        yield RawFinding("R102", "error", ("deepspeed", "gather_16bit_weights_on_model_save"),
                         "ZeRO-3 without gathering 16-bit weights on save writes no model weights for a full fine-tune "
                         "(only sharded optimizer checkpoints)", "set deepspeed.gather_16bit_weights_on_model_save: true")
    else:
        yield RawFinding("R102", "warning", ("deepspeed", "gather_16bit_weights_on_model_save"),
                         "ZeRO-3 without gathering 16-bit weights on save: older transformers/peft write empty LoRA adapters",
                         "set deepspeed.gather_16bit_weights_on_model_save: true")


@rule
def pre_ampere_features(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    from finetune.plan.planner import pre_ampere

    r = loaded.recipe
    gpu = r.hardware.gpu_type if r.hardware else None
    if not pre_ampere(gpu):
        return
    if r.model.dtype == "bfloat16":
        yield RawFinding("R103", "error", ("model", "dtype"), f"{gpu} has no bf16 support (needs compute capability 8.0+)",
                         "set model.dtype: float16 (or float32)")
    if r.method == "qlora" and r.quantization.compute_dtype == "bfloat16":
        yield RawFinding("R103", "error", ("quantization", "compute_dtype"), f"{gpu} has no bf16 support for the 4-bit matmuls",
                         "set quantization.compute_dtype: float16")
    if r.model.attn_implementation.startswith("flash_attention"):
        yield RawFinding("R103", "error", ("model", "attn_implementation"),
                         f"FlashAttention needs an Ampere or newer GPU; {gpu} is older", "set model.attn_implementation: sdpa")


@rule
def builtin_model(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    from finetune.builtin import BUILTIN_PREFIX, builtin_names, is_builtin

    known = builtin_names()
    for key in (("model", "name_or_path"), ("model", "tokenizer")):
        value = getattr(loaded.recipe.model, key[1])
        name = value[len(BUILTIN_PREFIX):] if value and is_builtin(value) else None
        if name is not None and name not in known:
            close = closest(name, known)
            yield RawFinding("R122", "error", key, f"unknown built-in model `{value}` (known: "
                             f"{', '.join(BUILTIN_PREFIX + n for n in known)})",
                             f"did you mean `{BUILTIN_PREFIX}{close}`?" if close else None)


@rule
def reentrant_checkpointing(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    r = loaded.recipe
    t = r.training
    if r.method == "full" or not t.gradient_checkpointing:
        return
    if r.deepspeed.stage == 3:
        # LoRA under ZeRO-3 always checkpoints reentrant (finetune.render.reentrant_checkpointing says why);
        # a `false` written here is not what runs, and TRL would log that it overrides it.
        if not t.gradient_checkpointing_reentrant and written(loaded, "training", "gradient_checkpointing_reentrant"):
            yield RawFinding("R104", "warning", ("training", "gradient_checkpointing_reentrant"),
                             f"{r.method} under ZeRO-3 checkpoints reentrant whatever this says: non-reentrant "
                             "recompute sees ZeRO-3's partitioned frozen weights (DeepSpeed#4332, crashes before "
                             "DeepSpeed 0.19.3) and TRL forces reentrant for PEFT + ZeRO-3",
                             "remove training.gradient_checkpointing_reentrant")
        return
    if t.gradient_checkpointing_reentrant:
        # Reentrant checkpointing drops gradients when no input of a checkpointed block requires grad (frozen
        # embeddings under LoRA) unless the embedding output is made to require grad (the runner does).
        yield RawFinding("R104", "warning", ("training", "gradient_checkpointing_reentrant"),
                         f"reentrant gradient checkpointing with {r.method} below ZeRO-3: slower, and frozen inputs "
                         "get gradients only through the runner's embedding hook",
                         "set training.gradient_checkpointing_reentrant: false")


@rule
def offload_optimizer_kind(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    from finetune.render import DS_OPTIMIZERS

    r = loaded.recipe
    if r.deepspeed.offload_optimizer == "none" or r.training.optimizer in DS_OPTIMIZERS:
        return
    yield RawFinding("R105", "error", ("training", "optimizer"),
                     f"optimizer offload runs the optimizer step on the CPU with DeepSpeed's own CPU optimizers; "
                     f"`{r.training.optimizer}` is a client optimizer it cannot offload",
                     f"use one of {', '.join(sorted(DS_OPTIMIZERS))}, or deepspeed.offload_optimizer: none")


@rule
def remote_code(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    if loaded.recipe.model.trust_remote_code:
        yield RawFinding("R106", "warning", ("model", "trust_remote_code"),
                         "trust_remote_code runs Python code from the model repository on every rank",
                         "pin model.revision to a reviewed commit")


@rule
def ignored_offload(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    ds = loaded.recipe.deepspeed
    if ds.offload_optimizer != "none" and ds.stage == 0:
        yield RawFinding("R107", "error", ("deepspeed", "offload_optimizer"),
                         "optimizer offload needs ZeRO stage 1, 2 or 3; at stage 0 nothing is offloaded",
                         "set deepspeed.stage: 2 (or remove the offload)")
    if ds.offload_param != "none" and ds.stage != 3:
        yield RawFinding("R107", "error", ("deepspeed", "offload_param"),
                         f"parameter offload needs ZeRO-3; at stage {ds.stage} DeepSpeed ignores it and runs without offloading",
                         "set deepspeed.stage: 3 (or offload_param: none)")


@rule
def nvme_path(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    ds = loaded.recipe.deepspeed
    if "nvme" in (ds.offload_optimizer, ds.offload_param) and not ds.nvme_path:
        key = "offload_optimizer" if ds.offload_optimizer == "nvme" else "offload_param"
        yield RawFinding("R108", "error", ("deepspeed", key), "NVMe offload needs a directory on a local NVMe disk",
                         "set deepspeed.nvme_path: /local_nvme")


def _source_keys(loaded: LoadedRecipe) -> list[tuple]:
    """The recipe key of each source: ("data",) for the shorthand, ("data", "sources", i) in a list."""
    sources = loaded.recipe.data.sources
    return [("data", "sources", i) for i in range(len(sources))] if sources else [("data",)]


@rule
def dataset_file(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    from finetune.data.sources import sources_of

    for key, source in zip(_source_keys(loaded), sources_of(loaded.recipe.data)):
        if not is_local(source.path):
            continue
        p = Path(source.path).expanduser()
        if p.suffix and p.suffix not in DATA_SUFFIXES and not p.is_dir():
            yield RawFinding("R109", "error", (*key, "path"), f"unsupported data file type `{p.suffix}`",
                             f"use one of {', '.join(DATA_SUFFIXES)}, or a folder written by datasets' save_to_disk")
        elif not p.exists():
            # An error when the folder that should hold it is here (a typo: issue 24); a warning when the
            # whole folder is absent: CI often lints recipes whose data lives only on the training box.
            from finetune.data.sources import SourceProblem, data_files

            if p.absolute().parent.is_dir():
                try:
                    data_files(p, source.split)
                except SourceProblem as exc:
                    yield RawFinding("R109", "error", (*key, "path"), str(exc), "fix data.path (it is relative to the recipe)")
            else:
                yield RawFinding("R109", "warning", (*key, "path"),
                                 f"dataset {p} not found here: its folder {p.absolute().parent} does not exist "
                                 "(`finetune train` will refuse to start)")


@rule
def special_paths(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    from finetune.fsutil import SpecialFile, refuse_special

    for key, path in recipe_paths(loaded.recipe):
        try:
            refuse_special(Path(path).expanduser())
        except SpecialFile as exc:
            yield RawFinding("R123", "error", key, str(exc), "give a regular file or a folder")


@rule
def data_mixture(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    from finetune.data.mix import spec_problems

    sources = loaded.recipe.data.sources or []
    for i, problem in spec_problems([s.weight for s in sources], [s.samples for s in sources]):
        key = "samples" if sources[i].samples is not None else "weight" if sources[i].weight is not None else "path"
        yield RawFinding("R115", "error", ("data", "sources", i, key), f"data.sources[{i}] {problem}",
                         "weights are shares of the mixture (README: Mixing sources)")


@rule
def data_keys_ignored(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    from finetune.data.formats import CHAT_FORMATS, DEFAULT_COLUMNS

    from finetune.data.sources import sources_of

    data = loaded.recipe.data
    blocks = data.sources or [data]
    # The format each source is read with: a preference objective's own rows whatever data.format says.
    formats = [source.spec.format for source in sources_of(data, loaded.recipe.objective)]
    for key, block, fmt in zip(_source_keys(loaded), blocks, formats):
        if block.roles and fmt not in CHAT_FORMATS:
            yield RawFinding("R116", "warning", (*key, "roles"), f"roles are ignored by format {fmt}",
                             "remove roles, or set format: messages or sharegpt")
        known = DEFAULT_COLUMNS.get(fmt, {})
        for name in block.columns:
            if known and name not in known:
                yield RawFinding("R116", "error", (*key, "columns", name),
                                 f"format {fmt} reads no column called `{name}` (it reads {', '.join(known)})",
                                 "the keys of columns are the format's names, the values your file's column names")
    chat = any(f in CHAT_FORMATS for f in data.source_formats())
    for name, active in (("think", data.think != "train"), ("chat_template", data.chat_template is not None)):
        if active and not chat:
            yield RawFinding("R116", "warning", ("data", name), f"data.{name} only affects messages/sharegpt sources; none is given")


@rule
def duplicate_sources(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    seen: dict[tuple[str, str], int] = {}
    for i, source in enumerate(loaded.recipe.data.sources or []):
        ident = (str(Path(source.path).expanduser().resolve()) if is_local(source.path) else source.path, source.split)
        if ident in seen:
            yield RawFinding("R117", "warning", ("data", "sources", i, "path"),
                             f"data.sources[{i}] repeats data.sources[{seen[ident]}] ({source.path})",
                             "list a source once and give it a larger weight or samples")
        seen.setdefault(ident, i)


@rule
def eval_without_split(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    r = loaded.recipe
    if r.training.eval_steps is not None and r.data.validation_split == 0:
        yield RawFinding("R110", "warning", ("training", "eval_steps"), "eval_steps is set but there is no validation split",
                         "set data.validation_split, e.g. 0.05")


def written_here(loaded: LoadedRecipe, *key: str) -> bool:
    """Written by this very file (or --set), not inherited through `extends`: a shared base may
    legitimately hold a `lora` section that a full fine-tune extending it does not use."""
    source = loaded.where(key)[0]
    return written(loaded, *key) and (source == str(loaded.path) or source.startswith("--set"))


@rule
def ignored_sections(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    from finetune.recipe.schema import METHOD_SECTIONS

    method = loaded.recipe.method
    for section, methods in METHOD_SECTIONS.items():
        if method not in methods and written_here(loaded, section):
            yield RawFinding("R111", "warning", (section,), f"`{section}` is ignored with method: {method}",
                             f"remove it, or set method: {methods[0]}")


@rule
def procs_vs_gpus(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    r = loaded.recipe
    procs = r.launch.procs_per_node
    if r.hardware and isinstance(procs, int) and procs > r.hardware.gpus:
        yield RawFinding("R112", "error", ("launch", "procs_per_node"),
                         f"{procs} processes per node but hardware.gpus is {r.hardware.gpus}",
                         f"set launch.procs_per_node: {r.hardware.gpus} (or auto)")


@rule
def launch_settings(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    launch = loaded.recipe.launch
    if launch.hostfile and not Path(launch.hostfile).expanduser().exists():
        yield RawFinding("R113", "warning", ("launch", "hostfile"), f"hostfile {launch.hostfile} not found here")
    if launch.node_rank >= launch.nodes:
        yield RawFinding("R113", "error", ("launch", "node_rank"),
                         f"node_rank {launch.node_rank} with only {launch.nodes} node(s)", "node ranks run 0..nodes-1")


def _local_model_type(name_or_path: str) -> str | None:
    """model_type from a local model directory's config.json (lint never reaches the hub)."""
    config = Path(name_or_path).expanduser() / MODEL_CONFIG
    if not is_local(name_or_path) or not config.is_file():
        return None
    from finetune.fsutil import read_json

    try:
        value = read_json(config).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


@rule
def packing_isolation(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    r = loaded.recipe
    if not (r.data.packing or r.data.padding_free):
        return
    key = ("data", "packing" if r.data.packing else "padding_free")
    mode = "packing" if r.data.packing else "padding_free"
    model_type = _local_model_type(r.model.name_or_path)
    if model_type in NO_POSITION_IDS_MODEL_TYPES:
        yield RawFinding("R114", "error", key,
                         f"{mode} keeps examples apart through restarting position_ids, which a `{model_type}` model "
                         "does not take: its examples would attend to each other",
                         f"set data.{mode}: false")
    elif r.model.trust_remote_code:
        yield RawFinding("R114", "warning", key,
                         f"{mode} with trust_remote_code: the repository's own attention code decides whether packed "
                         "examples stay apart (they do only if it honours position_ids / cu_seq_lens like transformers)",
                         f"check the model's attention code, or set data.{mode}: false")


@rule
def continued_adapter(loaded: LoadedRecipe) -> Iterator[RawFinding]:
    r = loaded.recipe
    adapter = r.model.adapter
    if adapter is None:
        return
    if not objectives.get(r.objective).uses_trl:
        # The SFT runner builds a fresh adapter (finetune.train.model.prepare_model) and would ignore it.
        yield RawFinding("R120", "error", ("model", "adapter"),
                         "model.adapter is continued by the preference objectives (dpo, orpo, kto, simpo) only",
                         "remove it, or set objective: dpo (or orpo, kto, simpo)")
        return
    if r.method == "full":
        yield RawFinding("R120", "error", ("model", "adapter"),
                         "a full fine-tune continues from full weights, not an adapter",
                         "set model.name_or_path to the SFT run's model/ directory and remove model.adapter")
        return
    from finetune.rundir.adapter import find_adapter, no_adapter_message

    if find_adapter(adapter) is None:
        # Info, not a warning: the SFT run a DPO recipe continues from usually exists only on the training box
        # (and later than the recipe); `finetune train`'s preflight refuses to start without it.
        yield RawFinding("R120", "info", ("model", "adapter"),
                         f"{no_adapter_message(adapter)} here (`finetune train` will refuse to start)")
    if written_here(loaded, "lora"):
        yield RawFinding("R120", "warning", ("lora",), "`lora` is ignored with model.adapter: the adapter keeps the "
                         "rank, alpha and target modules it was trained with", "remove the lora section")
