"""Talk to a trained model: `finetune chat RUN_DIR | MERGED_DIR | --base BASE --adapter ADAPTER`.

The prompt is built the way the run trained, with the functions the trainer used
(finetune.data.tokenize), so sampling and training cannot drift apart:
- alpaca: BOS + the Alpaca prompt of finetune.data.formats.alpaca_prompt; the reply ends at EOS.
  Earlier turns go in front as whole training examples (prompt + reply + EOS), as packing lays them out.
- messages: the tokenizer's chat template (the run's tokenizer/, which holds the recipe's template)
  with the generation prompt, tokenized without extra special tokens, as in training.
- text: the conversation so far is one text the model continues.

A run directory names its format, dtype and quantization in recipe.yaml; a merged directory written
by `finetune merge RUN_DIR` carries that recipe as finetune_recipe.yaml. torch and transformers are
imported inside the functions: `finetune --help` stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional

from finetune import objectives
from finetune.errors import FinetuneError
from finetune.recipe import Recipe
from finetune.data.show import trained_format
from finetune.recipe.references import MODEL_CONFIG, is_model_dir, is_model_path, require_model_dir
from finetune.rundir.names import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from finetune.rundir.adapter import adapter_weights, find_adapter
from finetune.rundir.run_dir import RunDir, merged_recipe, no_model_yet, not_a_run_dir_message, resolve_base
from finetune.units import gib_text
from finetune.use.conversation import Conversation

FORMATS = ("alpaca", "messages", "text")


class ChatError(FinetuneError, ValueError):
    """A model that cannot be loaded or talked to: the message says why and what to do."""


@dataclass
class Source:
    """Where the weights, the tokenizer and the training format come from."""

    model: str  # base model (with an adapter) or the full / merged model: a local dir or a hub id
    adapter: Optional[Path] = None
    tokenizer: Optional[str] = None
    recipe: Optional[Recipe] = None
    fmt: str = "messages"
    label: str = ""


# ------------------------------------------------------------------------------------------------
# Finding the model


def resolve_source(path: Optional[Path], base: Optional[str] = None, adapter: Optional[Path] = None,
                   fmt: Optional[str] = None) -> Source:
    """A run directory, a merged/full model directory, or --base + --adapter (which override the run's).
    The folder checks' errors (finetune.rundir.run_dir, finetune.recipe.references) come out as ChatError,
    worded by their owners: eval and benchmark catch ChatError."""
    try:
        return _resolve_source(path, base, adapter, fmt)
    except ChatError:
        raise
    except FinetuneError as exc:
        raise ChatError(str(exc)) from None


def _resolve_source(path: Optional[Path], base: Optional[str], adapter: Optional[Path], fmt: Optional[str]) -> Source:
    if fmt == "sharegpt":  # trained through the chat template, like messages (finetune.data.formats)
        fmt = "messages"
    if fmt is not None and fmt not in FORMATS:
        raise ChatError(f"--format must be one of {', '.join(FORMATS)} or sharegpt, got {fmt!r}")
    from finetune.fsutil import SpecialFile, refuse_special

    try:
        for what, value in (("PATH", path), ("--base", base), ("--adapter", adapter)):
            if value is not None:
                refuse_special(Path(value).expanduser(), what)
    except SpecialFile as exc:
        raise ChatError(str(exc)) from None
    if path is None:
        if base is None:
            raise ChatError("give a run directory, a model directory, or --base (with --adapter for a LoRA adapter)")
        source = Source(model=_local_or_hub(base), adapter=_checked_adapter(adapter) if adapter else None,
                        label=f"{base}" + (f" + {adapter}" if adapter else ""))
        source.fmt = fmt or "messages"  # no recipe: the chat template, or plain text without one (load time)
        return source
    path = Path(path)
    if not path.is_dir():
        raise ChatError(f"{path}: no such directory")
    if RunDir(path).is_run():
        source = _run_source(RunDir(path), base, adapter)
    elif is_model_dir(path):
        source = Source(model=str(path), adapter=_checked_adapter(adapter) if adapter else None, label=str(path),
                        recipe=merged_recipe(path))
    elif find_adapter(path) is not None:
        source = _adapter_source(find_adapter(path), base)
    else:
        raise ChatError(f"{not_a_run_dir_message(path)}, a model directory (no {MODEL_CONFIG}) "
                        f"or an adapter (no {ADAPTER_CONFIG})")
    source.fmt = fmt or (trained_format(source.recipe) if source.recipe is not None else "messages")
    return source


def format_why(recipe) -> str:
    """Why chat prompts this run's model the way trained_format says (printed beside the format)."""
    from finetune.data.show import prompt_kind

    if objectives.get(recipe.objective).reads_data_format:
        return "as the run trained"
    kind = prompt_kind(recipe)
    if kind is None:
        return (f"the {recipe.objective} run's rows are not readable here, so the chat template; "
                "--format text if its prompts were plain text")
    return "as the run trained: " + {"messages": "its rows were chat messages", "alpaca": "its text prompts were "
                                     "Alpaca prompts", "text": "its text prompts as written"}[kind]


def _run_source(run: RunDir, base: Optional[str], adapter: Optional[Path]) -> Source:
    run_dir = run.path
    recipe = run.recipe()
    tokenizer = str(run.tokenizer()) if run.tokenizer() else None
    if adapter is None and run.has_model():
        return Source(model=str(run.model_path), tokenizer=tokenizer, recipe=recipe, label=f"{run.model_path}")
    adapter = adapter or run.adapter()
    if adapter is None:
        raise ChatError(no_model_yet(run_dir))
    model = base or resolve_base(recipe)
    return Source(model=_local_or_hub(model), adapter=_checked_adapter(adapter), tokenizer=tokenizer, recipe=recipe,
                  label=f"{run_dir} ({recipe.method} adapter on {recipe.model.name_or_path})")


def _adapter_source(adapter: Path, base: Optional[str]) -> Source:
    model = base or resolve_base(adapter)
    return Source(model=_local_or_hub(model), adapter=_checked_adapter(adapter), label=f"{model} + {adapter}")


def _local_or_hub(model: str) -> str:
    """A local directory must hold a model; anything else is a hub id (from_pretrained reports it)."""
    from finetune.builtin import is_builtin, resolve_model_path

    if is_builtin(model):
        return resolve_model_path(model)  # built on first use
    if is_model_path(model):
        return str(require_model_dir(model, "base model", "pass --base DIR with the base model"))
    return model


def _checked_adapter(adapter: Path) -> Path:
    adapter_weights(adapter)
    return Path(adapter)


# ------------------------------------------------------------------------------------------------
# Loading


@dataclass
class ChatModel:
    model: Any
    tokenizer: Any
    fmt: str
    device: str
    label: str
    vision: Optional[Any] = None  # a vision-language model's finetune.use.images.Vision


def pick_device(requested: str = "auto") -> str:
    import torch

    if requested not in ("auto", "cpu", "cuda"):
        raise ChatError(f"--device must be auto, cpu or cuda, got {requested!r}")
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ChatError("--device cuda: no CUDA GPU is visible (torch.cuda.is_available() is false)")
    return requested


def weights_estimate(source: Source) -> tuple[Optional[int], str]:
    """(bytes, how it was estimated) of the weights on the GPU: the planner's for a recipe's model."""
    if source.recipe is not None:
        from finetune import plan as planner

        try:
            setup = planner.setup_from_recipe(source.recipe, gpus=1, nodes=1)
        except planner.PlanError:
            setup = None
        if setup is not None:
            setup = replace(setup, deepspeed=False, stage=0, offload_optimizer="none", offload_param="none")
            return planner.plan(setup).per_gpu["weights"], "the planner's weight estimate (finetune plan)"
    local = Path(source.model)
    if local.is_dir():
        files = list(local.glob("*.safetensors")) or list(local.glob("*.bin"))
        if files:
            return sum(f.stat().st_size for f in files), "the size of its weight files"
    return None, ""


def check_gpu_fits(source: Source, free_bytes: int, device_name: str) -> None:
    need, how = weights_estimate(source)
    # The weights plus a tenth for the KV cache, activations and the CUDA context of a short chat.
    if need is not None and need * 1.1 > free_bytes:
        raise ChatError(f"the model needs about {gib_text(need, 1)} for its weights ({how}); {device_name} has "
                        f"{gib_text(free_bytes, 1)} free. Chat on the CPU with --device cpu")


def load_chat_model(source: Source, device: str = "auto") -> ChatModel:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from finetune.use.images import load_vision

    _quiet_loading()
    device = pick_device(device)
    if device == "cuda":
        free, _ = torch.cuda.mem_get_info()
        check_gpu_fits(source, free, torch.cuda.get_device_name(0))
    kwargs: dict[str, Any] = {"dtype": "auto"}
    recipe = source.recipe
    if recipe is not None:
        from finetune.train.model import quantization_config, torch_dtype

        kwargs["attn_implementation"] = recipe.model.attn_implementation
        kwargs["trust_remote_code"] = recipe.model.trust_remote_code
        if source.adapter is not None:  # the base as it trained; a merged or full model keeps its saved dtype
            kwargs["dtype"] = torch_dtype(recipe.model.dtype)
            if recipe.model.revision:
                kwargs["revision"] = recipe.model.revision
            quant = quantization_config(recipe)  # QLoRA: the base in 4-bit, as it trained
            if quant is not None:
                kwargs["quantization_config"] = quant
                kwargs["device_map"] = {"": 0 if device == "cuda" else "cpu"}
    from finetune.use.files import check_adapter_dir, check_model_dir, loading

    try:
        if Path(source.model).is_dir():
            check_model_dir(Path(source.model))
        if source.adapter is not None:
            check_adapter_dir(source.adapter)
    except FinetuneError as exc:  # FileProblem, or the folder checks of finetune.rundir and finetune.recipe
        raise ChatError(str(exc)) from None
    vision = load_vision(source.model, [source.tokenizer, str(source.adapter) if source.adapter else None])
    auto = AutoModelForImageTextToText if vision is not None else AutoModelForCausalLM  # a VLM: its tower too
    model = loading(f"the model {source.model}", lambda: auto.from_pretrained(source.model, **kwargs), ChatError)
    if "device_map" not in kwargs:
        model.to(device)
    if source.adapter is not None:
        from peft import PeftModel

        import warnings

        with warnings.catch_warnings():  # "Found missing adapter keys": check_adapter_loaded says it as an error
            warnings.filterwarnings("ignore", message="Found missing adapter keys")
            model = loading(f"the adapter {source.adapter}", lambda: PeftModel.from_pretrained(model, str(source.adapter)),
                            ChatError)
        check_adapter_loaded(model, source.adapter)
    model.eval()
    tokenizer = _load_tokenizer(source)
    fmt = source.fmt
    if fmt == "messages" and not tokenizer.chat_template:
        if recipe is not None:
            raise ChatError(f"{source.label}: trained with format: messages but the tokenizer has no chat template")
        fmt = "text"  # a model without a recipe and without a template: continue plain text
    return ChatModel(model=model, tokenizer=tokenizer, fmt=fmt, device=device, label=source.label, vision=vision)


def check_adapter_loaded(model, adapter: Path) -> None:
    """Every weight of the adapter's file went into one of the model's LoRA modules. PEFT only warns when they do
    not, and an adapter whose names match nothing leaves every LoRA B at zero: the "fine-tuned" model is the base
    (issue 34). One line naming the adapter and the module names expected against those found."""
    from peft.utils import get_peft_model_state_dict
    from safetensors import safe_open

    file = adapter / ADAPTER_WEIGHTS[0]
    if not file.is_file():
        return  # a pickled adapter: its keys are not read without unpickling (finetune.use.files checked it)
    with safe_open(str(file), framework="pt") as handle:
        found = set(handle.keys())
    expected = set(get_peft_model_state_dict(model).keys())
    unmatched = sorted(found - expected)
    if not unmatched:
        return
    def modules(keys):
        names = sorted({k.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] if ".lora_" in k else k for k in keys})
        return ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
    example_found, example_expected = unmatched[0], (sorted(expected)[0] if expected else "none")
    raise ChatError(f"{adapter}: {len(unmatched)} of its {len(found)} weights match no LoRA module of the model "
                    f"(the model would run as if not fine-tuned): expected names like {example_expected} "
                    f"(modules {modules(expected) or 'none'}), found {example_found} (modules {modules(unmatched)}); "
                    "is it the adapter of another base model?")


def _quiet_loading() -> None:
    """The conversation is the output: no weight-loading bar, no deprecation raised between libraries."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing. is deprecated", category=FutureWarning)


def _load_tokenizer(source: Source):
    from transformers import AutoTokenizer

    candidates = [source.tokenizer] if source.tokenizer else []
    if source.adapter is not None and ((source.adapter / "tokenizer_config.json").is_file()
                                       or (source.adapter / "tokenizer.json").is_file()):
        candidates.append(str(source.adapter))
    candidates.append(source.model)
    from finetune.use.files import check_tokenizer_dir, loading

    trust = bool(source.recipe and source.recipe.model.trust_remote_code)
    if Path(candidates[0]).expanduser().is_dir():
        check_tokenizer_dir(Path(candidates[0]).expanduser(), ChatError)
    tokenizer = loading(f"the tokenizer from {candidates[0]}",
                        lambda: AutoTokenizer.from_pretrained(candidates[0], trust_remote_code=trust), ChatError)
    if source.recipe is not None and source.recipe.data.chat_template and not source.tokenizer:
        tokenizer.chat_template = source.recipe.data.chat_template
    return tokenizer


@dataclass
class Reply:
    text: str
    ids: list[int]
    prompt_tokens: int
    dropped_turns: int = 0


def context_limit(model) -> Optional[int]:
    config = getattr(model, "config", None)
    # a VLM's language model keeps it in text_config
    return getattr(config, "max_position_embeddings", None) or getattr(getattr(config, "text_config", None),
                                                                      "max_position_embeddings", None)


def answer(chat: ChatModel, conversation: Conversation, user: str, *, max_new_tokens: int = 256,
           temperature: float = 0.0, seed: Optional[int] = None,
           on_text: Callable[[str], None] = lambda s: None, images: tuple[str, ...] = ()) -> Reply:
    """Generate the reply to `user` (shown with `images`, a VLM's), streaming its text to `on_text`; the turn is
    added to the conversation."""
    import torch
    from transformers import TextStreamer, set_seed

    from jinja2 import TemplateError

    limit = context_limit(chat.model)
    vision = chat.vision

    def prompt(first: int) -> tuple[list[int], dict[str, Any]]:
        shown = conversation.images(first, images)
        counts, pixels = vision.inputs(shown, chat.model.device) if vision is not None else ([], {})
        return conversation.prompt_ids(user, first, images, tuple(counts)), pixels

    try:
        first, (ids, pixels) = 0, prompt(0)
        # The oldest turns leave when the conversation outgrows the model's context.
        while limit is not None and len(ids) + 1 > limit - min(max_new_tokens, limit // 4) and first < len(conversation.turns):
            first += 1
            ids, pixels = prompt(first)
    except TemplateError as exc:  # a template error, or one the sandbox refuses (SecurityError)
        raise ChatError(f"the chat template cannot render this conversation: {type(exc).__name__}: "
                        f"{' '.join(str(exc).split())[:300]}") from None
    if limit is not None and len(ids) >= limit:
        raise ChatError(f"the prompt is {len(ids)} tokens; the model's context is {limit}")
    new_tokens = max_new_tokens if limit is None else min(max_new_tokens, limit - len(ids))

    class Stream(TextStreamer):  # TextStreamer prints to stdout; this hands the text to the caller
        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            if text:
                on_text(text)

    if seed is not None:
        set_seed(seed)
    tokenizer = chat.tokenizer
    input_ids = torch.tensor([ids], dtype=torch.long, device=chat.model.device)
    if vision is not None:
        pixels = {**pixels, **vision.token_types(input_ids)}
    sampling: dict[str, Any] = {"do_sample": True, "temperature": temperature} if temperature > 0 else \
        {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    with torch.no_grad():
        output = chat.model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
            streamer=Stream(tokenizer, skip_prompt=True, skip_special_tokens=True), **sampling, **pixels)
    reply_ids = output[0, len(ids):].tolist()
    if reply_ids and reply_ids[-1] == tokenizer.eos_token_id:
        reply_ids = reply_ids[:-1]
    text = tokenizer.decode(reply_ids, skip_special_tokens=True)
    conversation.add(user, text, reply_ids, images)
    return Reply(text=text, ids=reply_ids, prompt_tokens=len(ids), dropped_turns=first)
