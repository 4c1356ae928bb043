"""Training data: load (local file or hub), format, tokenize with the prompt masked, mix, pack, cache.

Rows become examples in finetune.data.formats (alpaca, messages, sharegpt, text; role maps, per-turn
train flags); this module turns them into input_ids and labels:
- alpaca: the Alpaca prompt, masked; the loss covers the output and the EOS token that ends it.
- messages / sharegpt: rendered with the chat template. The loss covers every assistant turn whose
  train flag is on, including the template's end-of-turn token (EOS for most templates), so the model
  learns to stop after each turn. The turns are located by the template's `{% generation %}` blocks
  when it has one per assistant turn (transformers' render_jinja_template reports them), else by
  rendering each prefix of the conversation. With `data.think: mask` the `<think>...</think>` spans
  inside assistant turns stay in the input but leave the loss.
- text: every token is trained. Long documents are split into max_length pieces.

Labels are -100 where a token is not trained (Hugging Face's ignore index). `tokenize_for_training`
tokenizes every source, drops (and counts, per source) examples with nothing left to train after
truncation, mixes them (finetune.data.mix) and saves the result under the cache, keyed by a hash of
the data section, the source files and the tokenizer; later runs, resumed runs and the other ranks
of this run load it from there. The per-source report is saved beside it (mix.json).

Batching (`make_collator`): padded rows, packed rows, or one flattened row per micro batch
(`data.padding_free`, and packing under flash attention), so that examples never attend to each other.

This module imports `datasets` and torch only inside functions.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from finetune.data.formats import (
    ALPACA_PROMPT, ALPACA_PROMPT_WITH_INPUT, Chat, Prompted, RowProblem, RowSpec, Text, to_example,
)
from finetune.data.mix import MixError, Share, mixture, targets
from finetune.data.sources import ARROW_MARKER, DATA_SUFFIXES, Source, data_files, is_arrow_dir, is_local, sources_of
from finetune.errors import FinetuneError
from finetune.fsutil import publish_once

__all__ = ["ALPACA_PROMPT", "ALPACA_PROMPT_WITH_INPUT"]

IGNORE_INDEX = -100  # transformers' CrossEntropyLoss ignore_index
# datasets' builder for each data file type (.jsonl files are read by the json builder)
LOCAL_SUFFIXES = {suffix: "json" if suffix == ".jsonl" else suffix[1:] for suffix in DATA_SUFFIXES}
# Bump when tokenization changes, so caches written by an older version are never reused.
TOKENIZE_VERSION = 2
MIX_REPORT = "mix.json"
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)


class DataError(FinetuneError, ValueError):
    """Bad training data: the message names the file and what is wrong."""


# ------------------------------------------------------------------------------------------------
# Loading


def load_raw(path: str, split: str = "train"):
    """A `datasets.Dataset` from a local .json/.jsonl/.parquet/.csv file, a local folder or a hub id.

    Local files go through datasets' builders, which write Arrow files and memory-map them: a source
    larger than RAM is read, never held. A save_to_disk folder is memory-mapped as it is."""
    import datasets

    local = Path(path).expanduser()
    try:
        if local.is_file():
            builder = LOCAL_SUFFIXES.get(local.suffix.lower())
            if builder is None:
                raise DataError(f"{path}: unsupported data file type `{local.suffix}` "
                                f"(use {', '.join(DATA_SUFFIXES[:-1])} or {DATA_SUFFIXES[-1]})")
            return datasets.load_dataset(builder, data_files=str(local), split="train")
        if local.is_dir():
            if is_arrow_dir(local):
                loaded = datasets.load_from_disk(str(local))
                return loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded
            return datasets.load_dataset(str(local), split=split)
        if path.startswith(("/", "./", "../", "~")) or Path(path).suffix.lower() in LOCAL_SUFFIXES:
            raise DataError(f"{path}: no such file")
        return datasets.load_dataset(path, split=split)
    except DataError:
        raise
    except Exception as exc:  # datasets raises many types (FileNotFound, DatasetNotFound, ArrowInvalid...)
        raise DataError(f"{path}: cannot load the dataset: {exc}") from None


# ------------------------------------------------------------------------------------------------
# Tokenizing


def tokenize_examples(examples: Iterable[dict[str, Any]], tokenizer, fmt: str, max_length: int,
                      mask_prompt: bool = True, on_example: Callable[[int], None] | None = None,
                      spec: Optional[RowSpec] = None, think: str = "train",
                      dropped: Optional[list[int]] = None) -> list[dict[str, list[int]]]:
    """input_ids + labels for each example (a text may give several rows, an empty one none).
    on_example gets the number of examples done after each one; `dropped` collects the indices of
    examples that truncation left with nothing to train."""
    spec = spec or RowSpec(fmt)
    rows: list[dict[str, list[int]]] = []
    for index, row in enumerate(examples):
        try:
            encoded = encode(to_example(row, spec), tokenizer, max_length, mask_prompt, think)
        except (DataError, RowProblem) as exc:
            raise DataError(f"example {index}: {exc}") from None
        if not encoded and dropped is not None:
            dropped.append(index)
        rows.extend(encoded)
        if on_example is not None:
            on_example(index + 1)
    return rows


def encode(example, tokenizer, max_length: int, mask_prompt: bool = True, think: str = "train") -> list[dict[str, list[int]]]:
    if isinstance(example, Prompted):
        return _encode_prompted(example, tokenizer, max_length, mask_prompt)
    if isinstance(example, Text):
        return _encode_text(example, tokenizer, max_length)
    if isinstance(example, Chat):
        return _encode_chat(example, tokenizer, max_length, mask_prompt, think)
    raise DataError(f"no tokenization for {type(example).__name__} examples")


def _keep(ids: list[int], labels: list[int], max_length: int) -> list[dict[str, list[int]]]:
    ids, labels = ids[:max_length], labels[:max_length]
    # An example whose response was cut off entirely trains nothing: drop it (the caller counts it).
    if all(label == IGNORE_INDEX for label in labels[1:]):
        return []
    return [{"input_ids": ids, "labels": labels}]


def _eos(tokenizer) -> list[int]:
    return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []


def _encode_prompted(example: Prompted, tokenizer, max_length: int, mask_prompt: bool) -> list[dict[str, list[int]]]:
    # Prompt and response are tokenized apart, so the boundary is exact; the tokenizer's own special
    # tokens (BOS for Llama, none for Qwen) go in front of the prompt.
    prompt_ids = tokenizer(example.prompt, add_special_tokens=True)["input_ids"]
    response_ids = tokenizer(example.response, add_special_tokens=False)["input_ids"] + _eos(tokenizer)
    prompt_labels = [IGNORE_INDEX] * len(prompt_ids) if mask_prompt else list(prompt_ids)
    return _keep(prompt_ids + response_ids, prompt_labels + response_ids, max_length)


def _encode_text(example: Text, tokenizer, max_length: int) -> list[dict[str, list[int]]]:
    ids = tokenizer(example.text, add_special_tokens=True)["input_ids"] + _eos(tokenizer)
    # Continued pre-training: a long document is split, not truncated, so no text is thrown away.
    return [{"input_ids": ids[i:i + max_length], "labels": ids[i:i + max_length]}
            for i in range(0, len(ids), max_length) if len(ids[i:i + max_length]) > 1]


def _encode_chat(example: Chat, tokenizer, max_length: int, mask_prompt: bool, think: str) -> list[dict[str, list[int]]]:
    text = tokenizer.apply_chat_template(example.messages, tokenize=False)
    if mask_prompt:
        turns = _assistant_turn_spans(example.messages, tokenizer, text)
        flags = [flag for message, flag in zip(example.messages, example.train) if message["role"] == "assistant"]
        spans = [span for span, flag in zip(turns, flags) if flag]
    else:
        spans = [(0, len(text))]
    if think == "mask":
        spans = _without_think(spans, text)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = encoded["input_ids"]
    labels = [tok if any(start < end_ and end > start_ for start_, end_ in spans) else IGNORE_INDEX
              for tok, (start, end) in zip(ids, encoded["offset_mapping"])]
    return _keep(ids, labels, max_length)


def _assistant_turn_spans(messages: list[dict], tokenizer, text: str) -> list[tuple[int, int]]:
    """Character spans of the assistant turns in `text`, one per assistant message, in order."""
    template = tokenizer.get_chat_template()
    wanted = sum(m["role"] == "assistant" for m in messages)
    if _GENERATION_TAG.search(template):
        from transformers.utils.chat_template_utils import render_jinja_template

        # What apply_chat_template(return_assistant_tokens_mask=True) uses, at character level, so
        # the per-turn flags and <think> masking can cut inside the turns.
        rendered, indices = render_jinja_template([messages], chat_template=template, return_assistant_tokens_mask=True,
                                                  **tokenizer.special_tokens_map)
        if rendered[0] == text and len(indices[0]) == wanted:
            return [tuple(span) for span in indices[0]]
    return _assistant_spans(messages, tokenizer, text)


def _assistant_spans(messages: list[dict], tokenizer, text: str) -> list[tuple[int, int]]:
    """Character spans of the assistant turns in `text` (the whole conversation, rendered).

    Turn i spans from the end of the conversation up to it with the generation prompt to the end of
    the conversation up to and including it (so the template's end-of-turn token is in it). That
    needs a template whose rendering of a shorter conversation is a prefix of the longer one, which
    holds for the common templates.
    """
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        through = tokenizer.apply_chat_template(messages[:i + 1], tokenize=False)
        if not (text.startswith(through) and through.startswith(before)):
            raise DataError("the chat template renders earlier turns differently in longer conversations, so the "
                            "assistant turns cannot be located; set data.mask_prompt: false or a data.chat_template")
        spans.append((len(before), len(through)))
    return spans


def _without_think(spans: list[tuple[int, int]], text: str) -> list[tuple[int, int]]:
    """`spans` minus the <think>...</think> ranges inside them."""
    out = []
    for start, end in spans:
        cursor = start
        for match in _THINK.finditer(text, start, end):
            if match.start() > cursor:
                out.append((cursor, match.start()))
            cursor = match.end()
        if cursor < end:
            out.append((cursor, end))
    return out


def pack(rows: list[dict[str, list[int]]], max_length: int) -> list[dict[str, list[int]]]:
    """Greedy in-order packing of whole examples into blocks of at most max_length tokens.

    Each block carries position_ids that restart at 0 for every example: the collators below turn
    them into the boundaries each attention kernel honours (see `make_collator`). The first token of
    every example is not a label: it would be predicted from the previous example's last token.
    """
    blocks: list[dict[str, list[int]]] = []
    current: dict[str, list[int]] = {"input_ids": [], "labels": [], "position_ids": []}
    for row in rows:
        if current["input_ids"] and len(current["input_ids"]) + len(row["input_ids"]) > max_length:
            blocks.append(current)
            current = {"input_ids": [], "labels": [], "position_ids": []}
        current["input_ids"] += row["input_ids"]
        current["labels"] += [IGNORE_INDEX] + row["labels"][1:]
        current["position_ids"] += list(range(len(row["input_ids"])))
    if current["input_ids"]:
        blocks.append(current)
    return blocks


# ------------------------------------------------------------------------------------------------
# The cached, tokenized dataset


def cache_key(data: dict[str, Any], tokenizer) -> str:
    """Hash of the data section, every source file's identity and the tokenizer (vocabulary + template)."""
    # padding_free is left out on purpose: it changes how rows are batched, not the rows themselves.
    section = {k: data.get(k) for k in ("path", "format", "split", "columns", "roles", "sources", "seed", "think",
                                        "chat_template", "max_length", "packing", "mask_prompt")}
    files = [_identity(source.path) for source in sources_of(data)]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    blob = json.dumps({"v": TOKENIZE_VERSION, "data": section, "source": files,
                       "template": tokenizer.chat_template, "bos": tokenizer.bos_token_id,
                       "eos": tokenizer.eos_token_id, "class": type(tokenizer).__name__}, sort_keys=True, default=str)
    digest = hashlib.sha256(blob.encode())
    digest.update(vocab.encode())
    return digest.hexdigest()[:16]


def _identity(path: str) -> Any:
    """(path, size, mtime) of each local file of a source: other rows under the same name change the key."""
    local = Path(path).expanduser()
    if not is_local(path) or not local.exists():
        return None
    try:
        files = data_files(local) if local.is_dir() else [local]
    except Exception:  # noqa: BLE001 - an unreadable folder has no identity; loading it will say why
        return None
    return [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]


@dataclass
class SourceReport:
    """One source's line of the mixture report."""
    path: str
    format: str
    rows: int  # read from the source
    dropped: int  # examples truncation left with nothing to train
    examples: int  # tokenized sequences after dropping (a text document may give several)
    mixed: int  # sequences of this source in the training set
    how: str

    def line(self, max_length: int) -> str:
        drop = f", {self.dropped} dropped (nothing left to train within max_length {max_length})" if self.dropped else ""
        return (f"data: {self.path} ({self.format}): {self.rows} rows -> {self.examples} examples{drop}; "
                f"{self.mixed} in the mixture ({self.how})")


def tokenize_for_training(data: dict[str, Any], tokenizer, cache_dir: Path, log: Callable[[str], None] = print):
    """The tokenized `datasets.Dataset` for `data` (a recipe's data section as a dict), cached.

    Call it on one process first (the runner uses TrainingArguments.main_process_first); the others
    then find the cache. The cache directory is written under a temporary name and renamed.
    """
    import datasets

    target = Path(cache_dir) / cache_key(data, tokenizer)
    max_length = int(data["max_length"])
    if (target / ARROW_MARKER).is_file():
        log(f"tokenized data: cached in {target}")
        for report in _read_reports(target):
            log(report.line(max_length))
        return datasets.load_from_disk(str(target))
    sources = sources_of(data)
    per_source, reports = [], []
    for source in sources:
        rows, report = _tokenize_source(source, data, tokenizer, log)
        per_source.append(rows)
        reports.append(report)
    rows = _mix(sources, per_source, reports, int(data.get("seed") or 0))
    if not rows:
        raise DataError(f"{', '.join(s.path for s in sources)}: no example has a trainable token after truncation "
                        f"to max_length {max_length}")
    for report in reports:
        log(report.line(max_length))
    if data.get("packing"):
        rows = pack(rows, max_length)
    dataset = datasets.Dataset.from_list(rows)
    _save_atomic(dataset, target, {MIX_REPORT: json.dumps([asdict(r) for r in reports], indent=2)})
    log(f"tokenized data: {len(dataset)} sequences, {sum(len(r['input_ids']) for r in rows)} tokens -> {target}")
    return datasets.load_from_disk(str(target))


def _tokenize_source(source: Source, data: dict[str, Any], tokenizer, log: Callable[[str], None]):
    raw = load_raw(source.path, source.split)
    dropped: list[int] = []
    try:
        rows = tokenize_examples(raw, tokenizer, source.format, int(data["max_length"]), bool(data.get("mask_prompt", True)),
                                 on_example=_every_interval(lambda done: log(f"tokenizing: {done}/{len(raw)} rows")),
                                 spec=source.spec, think=data.get("think") or "train", dropped=dropped)
    except DataError as exc:
        raise DataError(f"{source.path}: {exc}") from None
    report = SourceReport(source.path, source.format, len(raw), len(dropped), len(rows), len(rows), "all")
    return rows, report


def _mix(sources: list[Source], per_source: list[list], reports: list[SourceReport], seed: int) -> list:
    """The training rows: one source without weight/samples keeps its order (the Trainer shuffles)."""
    if len(sources) == 1 and sources[0].weight is None and sources[0].samples is None:
        return per_source[0]
    try:
        shares: list[Share] = targets([len(rows) for rows in per_source], [s.weight for s in sources],
                                      [s.samples for s in sources], [s.path for s in sources])
    except MixError as exc:
        raise DataError(str(exc)) from None
    for report, share in zip(reports, shares):
        report.mixed, report.how = share.target, share.describe()
    return [per_source[s][i] for s, i in mixture(shares, seed)]


def mix_report(data: dict[str, Any], tokenizer, cache_dir: Path) -> list[dict[str, Any]]:
    """The per-source report of the cached tokenization of `data` (after tokenize_for_training)."""
    return [asdict(r) for r in _read_reports(Path(cache_dir) / cache_key(data, tokenizer))]


def _read_reports(target: Path) -> list[SourceReport]:
    try:
        return [SourceReport(**item) for item in json.loads((target / MIX_REPORT).read_text(encoding="utf-8"))]
    except (OSError, ValueError, TypeError):
        return []


def _every_interval(report: Callable[[int], None]) -> Callable[[int], None]:
    """report(done), at most once per progress interval (the live display asks for 1 s, logs get 15 s)."""
    from finetune.progress_env import progress_interval

    interval = progress_interval()
    last = time.monotonic()

    def maybe_report(done: int) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last >= interval:
            last = now
            report(done)

    return maybe_report


def _save_atomic(dataset, target: Path, extra: Optional[dict[str, str]] = None) -> None:
    # another node's main process may win the race with the same content
    with publish_once(target, ARROW_MARKER) as tmp:
        dataset.save_to_disk(str(tmp))
        for name, text in (extra or {}).items():
            (tmp / name).write_text(text, encoding="utf-8")


def split_eval(dataset, fraction: float, seed: int):
    """(train, eval or None): a seeded random hold-out of `fraction` of the sequences."""
    if fraction <= 0:
        return dataset, None
    if len(dataset) < 2:
        raise DataError(f"validation_split {fraction} needs at least 2 sequences, the data has {len(dataset)}")
    parts = dataset.train_test_split(test_size=fraction, seed=seed, shuffle=True)
    return parts["train"], parts["test"]


# ------------------------------------------------------------------------------------------------
# Batching


class Collator:
    """Pads a list of rows to the longest (rounded up to a multiple of 8 for tensor-core shapes).

    Unpacked rows get an attention mask. Packed rows (with position_ids) get none, so the model builds
    the block-diagonal mask from the position ids (sdpa/eager only: see `make_collator`); padding
    continues the positions of a separate trailing sequence with labels -100.
    """

    def __init__(self, pad_token_id: int, multiple_of: int = 8):
        self.pad_token_id = pad_token_id
        self.multiple_of = multiple_of

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        longest = max(len(r["input_ids"]) for r in rows)
        width = -(-longest // self.multiple_of) * self.multiple_of
        packed = "position_ids" in rows[0]
        batch: dict[str, list[list[int]]] = {"input_ids": [], "labels": []}
        batch["position_ids" if packed else "attention_mask"] = []
        for r in rows:
            n, pad = len(r["input_ids"]), width - len(r["input_ids"])
            batch["input_ids"].append(list(r["input_ids"]) + [self.pad_token_id] * pad)
            batch["labels"].append(list(r["labels"]) + [IGNORE_INDEX] * pad)
            if packed:
                batch["position_ids"].append(list(r["position_ids"]) + list(range(pad)))
            else:
                batch["attention_mask"].append([1] * n + [0] * pad)
        return {k: torch.tensor(v, dtype=torch.long) for k, v in batch.items()}


def split_packed(row: dict[str, Any]) -> list[dict[str, list[int]]]:
    """The examples of a packed block (cut where position_ids restart at 0); an unpacked row as is."""
    if "position_ids" not in row:
        return [{"input_ids": list(row["input_ids"]), "labels": list(row["labels"])}]
    starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["input_ids"])]
    return [{"input_ids": list(row["input_ids"][a:b]), "labels": list(row["labels"][a:b])}
            for a, b in zip(starts, starts[1:])]


class FlatteningCollator:
    """One row per micro batch: every example of every row, end to end, without padding.

    transformers' DataCollatorWithFlattening does the work: position_ids restart per example, the
    first label of each example is -100, and with `flash_kwargs` it adds cu_seq_lens_q/k and
    max_length_q/k, which flash attention turns into a varlen call (one causal segment per example).
    Without them (sdpa, eager) the model builds a block-diagonal mask from the position ids.
    """

    def __init__(self, flash_kwargs: bool):
        from transformers import DataCollatorWithFlattening

        self.flatten = DataCollatorWithFlattening(return_position_ids=True, separator_id=IGNORE_INDEX,
                                                  return_flash_attn_kwargs=flash_kwargs)

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        return self.flatten([example for row in rows for example in split_packed(row)])


def make_collator(pad_token_id: int, attn_implementation: str, packing: bool, padding_free: bool):
    """The collator that keeps every example to itself on `attn_implementation`.

    - padding_free (any kernel), or packing with flash attention: one flattened row per micro batch.
      Flash needs it: transformers passes flash only per-example boundaries it is given
      (cu_seq_lens) or, from position ids, when the batch has a single row
      (modeling_flash_attention_utils._is_packed_sequence); several packed rows would attend across
      examples.
    - packing with sdpa/eager: the packed rows, padded; masking_utils.find_packed_sequence_indices
      turns the restarting position ids of each row into a (rows, 1, seq, seq) block-diagonal mask,
      which is smaller than one flattened row's (1, 1, rows x seq, rows x seq).
    - otherwise: padded rows with an attention mask.
    """
    flash = attn_implementation.startswith("flash_attention")
    if padding_free or (packing and flash):
        return FlatteningCollator(flash_kwargs=flash)
    return Collator(pad_token_id)
