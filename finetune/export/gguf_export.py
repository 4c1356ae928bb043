"""`finetune export RUN_OR_MODEL --gguf TYPE -o OUT`: one folder with the GGUF, an Ollama Modelfile and export.json.

    OUT/NAME-TYPE.gguf   llama.cpp / Ollama / LM Studio
    OUT/Modelfile        `ollama create NAME -f OUT/Modelfile`
    OUT/export.json      what was exported from what, and the verification's numbers (what makes OUT finetune's)

Order: every check that needs no weights first (input, output, converter, architecture, pre-tokenizer, quantizer),
then the merge of a run's adapter (finetune's streaming merge, into a temporary folder beside OUT), the conversion,
the quantization, the verification; OUT appears only at the end, by rename (finetune.fsutil.atomic_dir). An existing
OUT is replaced only with --overwrite and only when it holds export.json (an export finetune wrote).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from finetune.export import llama_cpp
from finetune.export.modelfile import MODELFILE, modelfile
from finetune.export.prompt import TrainedPrompt, trained_prompt
from finetune.recipe.references import MODEL_CONFIG
from finetune.export.source import ExportError, ExportSource, base_hub_id, context_length, prompt_format, resolve

EXPORT_RECORD = "export.json"


@dataclass
class ExportResult:
    name: str
    output: Path
    gguf: Path
    seconds: float
    prompt: TrainedPrompt
    notes: list[str] = field(default_factory=list)
    verify: Optional[dict] = None


def check_output(output: Path, overwrite: bool, inputs: list[Path]) -> None:
    out = output.resolve()
    for path in inputs:
        src = path.resolve()
        if out == src or src in out.parents or out in src.parents:
            raise ExportError(f"-o {output} overlaps the input {path}; export never writes into or over its input")
    if not output.exists() and not output.is_symlink():
        return
    if not overwrite:
        raise ExportError(f"{output} already exists (use --overwrite to replace an earlier export)")
    if not output.is_dir() or output.is_symlink() or not (output / EXPORT_RECORD).is_file():
        raise ExportError(f"{output} exists and is not an export finetune wrote (no {EXPORT_RECORD}); "
                          "--overwrite replaces only those: choose another -o")


def export_gguf(path: Path, out_type: str, output: Optional[Path] = None, *, overwrite: bool = False,
                verify: Optional[bool] = None, log: Callable[[str], None] = lambda s: None) -> ExportResult:
    """Export a run or model directory to GGUF (see the module docstring). verify None: on for models under 2B."""
    start = time.perf_counter()
    if out_type not in llama_cpp.TYPES:
        raise ExportError(f"--gguf must be one of {', '.join(llama_cpp.TYPES)}, got {out_type!r}")
    source = resolve(path)
    output = Path(output) if output is not None else Path("exports") / f"{source.name}-{out_type}"
    check_output(output, overwrite, [source.path])
    quantize = None
    if out_type in llama_cpp.K_QUANTS:
        quantize = llama_cpp.quantizer()
        if quantize is None:
            raise ExportError(llama_cpp.NO_QUANTIZER)
    config_dir = source.model_dir or _adapter_base(source)
    cls = llama_cpp.model_class(config_dir)
    tokenizer_dir = source.tokenizer_dir or config_dir
    pre = llama_cpp.pre_tokenizer(cls, tokenizer_dir)
    prompt = _prompt(source, tokenizer_dir)
    gguf_name = f"{_file_stem(source.name)}-{out_type}.gguf"
    from finetune.fsutil import atomic_dir

    output.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{output.name}.work-", dir=output.parent))
    try:
        model_dir = source.model_dir or _merge(source, work / "merged", log)
        with atomic_dir(output, overwrite=overwrite) as tmp:
            target = tmp / gguf_name
            fallback = None
            if quantize is None:
                log(f"converting {model_dir} to {out_type} with llama.cpp's converter ...")
                llama_cpp.convert(model_dir, pre, out_type, target, source.name, prompt, base_hub_id(source), work)
            else:
                middle = work / f"{_file_stem(source.name)}-{_float_type(model_dir)}.gguf"
                log(f"converting {model_dir} to {_float_type(model_dir)} with llama.cpp's converter ...")
                llama_cpp.convert(model_dir, pre, _float_type(model_dir), middle, source.name, prompt,
                                  base_hub_id(source), work)
                log(f"quantizing to {llama_cpp.K_QUANTS[out_type]} with llama.cpp's quantizer ...")
                quantize(middle, target, llama_cpp.K_QUANTS[out_type])
                middle.unlink()
                fallback = llama_cpp.fallback_note(target, out_type)
            adds_bos = _adds_bos(target)
            text, notes = modelfile(gguf_name, prompt, adds_bos, context_length(source))
            if fallback:
                notes.append(fallback)
            (tmp / MODELFILE).write_text(text, encoding="utf-8")
            record = {"source": source.name, "type": out_type, "gguf": gguf_name, "prompt": prompt.fmt,
                      "stops": prompt.stops, "context_length": context_length(source), "base_model": base_hub_id(source)}
            check = None
            if _should_verify(verify, model_dir):
                from finetune.export.readback import verify_export

                log("verifying: the GGUF read back against the model it came from ...")
                check = verify_export(target, model_dir, source, prompt,
                                      _float_type(model_dir) if quantize is not None else None)
                record["verify"] = check
                if not check["ok"]:
                    raise ExportError(f"verify: the GGUF does not compute what {model_dir} computes "
                                      f"({check['why']}); nothing was written to {output}")
            (tmp / EXPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return ExportResult(source.name, output, output / gguf_name, time.perf_counter() - start, prompt, notes, check)


def _adapter_base(source: ExportSource) -> Path:
    from finetune.weights.merge_inputs import resolve_inputs
    from finetune.weights.errors import MergeError

    try:
        return resolve_inputs(source.path, None, None).base
    except MergeError as exc:
        raise ExportError(str(exc)) from None


def _merge(source: ExportSource, into: Path, log: Callable[[str], None]) -> Path:
    """The run's adapter merged into its base with `finetune merge`'s streaming merge (one tensor in RAM)."""
    from finetune.weights.merge import merge
    from finetune.weights.merge_inputs import resolve_inputs
    from finetune.weights.errors import MergeError

    try:
        inputs = resolve_inputs(source.path, None, None)
        log(f"merging {inputs.adapter} into {inputs.base} first ...")
        merge(inputs.base, inputs.adapter, into, source_dirs=inputs.tokenizer_dirs)
    except MergeError as exc:
        raise ExportError(str(exc)) from None
    return into


def _prompt(source: ExportSource, tokenizer_dir: Path) -> TrainedPrompt:
    from transformers import AutoTokenizer, GenerationConfig

    trust = bool(source.recipe and source.recipe.model.trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), trust_remote_code=trust)
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
    if source.recipe is not None and source.recipe.data.chat_template:
        template = source.recipe.data.chat_template
    ends: list[str] = []
    try:
        generation = GenerationConfig.from_pretrained(str(source.model_dir or tokenizer_dir))
        ids = generation.eos_token_id
        for token_id in ids if isinstance(ids, list) else [ids] if ids is not None else []:
            ends.append(tokenizer.convert_ids_to_tokens(int(token_id)))
    except (OSError, ValueError):
        pass
    try:
        return trained_prompt(prompt_format(source), template, tokenizer.bos_token or "", tokenizer.eos_token or "",
                              tuple(ends))
    except ValueError as exc:
        raise ExportError(f"{source.path}: {exc}") from None


def _float_type(model_dir: Path) -> str:
    """The 16-bit type a K-quant starts from: bf16 for a bf16 model (f16 could overflow it), else f16."""
    try:
        config = json.loads((model_dir / MODEL_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "f16"
    return "bf16" if (config.get("dtype") or config.get("torch_dtype")) == "bfloat16" else "f16"


def _adds_bos(gguf_file: Path) -> bool:
    from gguf import GGUFReader

    field_ = GGUFReader(str(gguf_file)).fields.get("tokenizer.ggml.add_bos_token")
    return bool(field_.contents()) if field_ is not None else False


def _should_verify(verify: Optional[bool], model_dir: Path) -> bool:
    if verify is not None:
        return verify
    total = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    return total < 2e9 * 2  # under 2B parameters at 16 bits (4 GB): a read-back fits in RAM


def _file_stem(name: str) -> str:
    import re

    return re.sub(r"[^\w.-]+", "-", name).strip("-.") or "model"
