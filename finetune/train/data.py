"""Training data: load (local file or hub), format, tokenize with the prompt masked, pack, cache.

Formats (`data.format`):
- alpaca: `instruction`, optional `input`, `output`. The prompt is the Alpaca template below; the
  loss covers the output and the EOS token that ends it.
- messages: `messages`, a list of {role, content}, rendered with the chat template. The loss covers
  the assistant turns (found through the character offsets of the rendered text).
- text: `text`; every token is trained. Long documents are split into max_length pieces.

Labels are -100 where a token is not trained (Hugging Face's ignore index), so the prompt never
enters the loss when `data.mask_prompt` is true. `tokenize_for_training` runs once per data section
and tokenizer: the result is saved under the cache (keyed by a hash of both) and later runs, and the
other ranks of this run, load it from there.

Batching (`make_collator`): padded rows, packed rows, or one flattened row per micro batch
(`data.padding_free`, and packing under flash attention), so that examples never attend to each other.

This module imports `datasets` and torch only inside functions (finetune.tiny imports format_alpaca).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable

IGNORE_INDEX = -100  # transformers' CrossEntropyLoss ignore_index
LOCAL_SUFFIXES = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
# Bump when tokenization changes, so caches written by an older version are never reused.
TOKENIZE_VERSION = 1

# The Alpaca template without its one-sentence preamble (which only costs tokens on every example).
ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
ALPACA_PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"


class DataError(ValueError):
    """Bad training data: the message names the file and what is wrong."""


def format_alpaca(example: dict[str, Any]) -> tuple[str, str]:
    """(prompt, response) text of one alpaca example."""
    instruction = example.get("instruction")
    output = example.get("output")
    if not isinstance(instruction, str) or not isinstance(output, str):
        raise DataError("alpaca examples need string `instruction` and `output` fields")
    extra = example.get("input") or ""
    if extra:
        return ALPACA_PROMPT_WITH_INPUT.format(instruction=instruction, input=extra), output
    return ALPACA_PROMPT.format(instruction=instruction), output


# ------------------------------------------------------------------------------------------------
# Loading


def load_raw(path: str, split: str = "train"):
    """A `datasets.Dataset` from a local .json/.jsonl/.parquet/.csv file, a local folder or a hub id."""
    import datasets

    local = Path(path).expanduser()
    try:
        if local.is_file():
            builder = LOCAL_SUFFIXES.get(local.suffix.lower())
            if builder is None:
                raise DataError(f"{path}: unsupported data file type `{local.suffix}` (use .json, .jsonl, .parquet or .csv)")
            return datasets.load_dataset(builder, data_files=str(local), split="train")
        if local.is_dir():
            if (local / "dataset_info.json").is_file():  # written by Dataset.save_to_disk
                return datasets.load_from_disk(str(local))
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
                      mask_prompt: bool = True, on_example: Callable[[int], None] | None = None) -> list[dict[str, list[int]]]:
    """input_ids + labels for each example (a text may give several rows, an empty one none).
    on_example gets the number of examples done after each one."""
    encode = _ENCODERS[fmt]
    rows: list[dict[str, list[int]]] = []
    for index, example in enumerate(examples):
        try:
            rows.extend(encode(example, tokenizer, max_length, mask_prompt))
        except DataError as exc:
            raise DataError(f"example {index}: {exc}") from None
        if on_example is not None:
            on_example(index + 1)
    return rows


def _keep(ids: list[int], labels: list[int], max_length: int) -> list[dict[str, list[int]]]:
    ids, labels = ids[:max_length], labels[:max_length]
    # An example whose response was cut off entirely trains nothing: drop it.
    if all(label == IGNORE_INDEX for label in labels[1:]):
        return []
    return [{"input_ids": ids, "labels": labels}]


def _eos(tokenizer) -> list[int]:
    return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []


def _encode_alpaca(example, tokenizer, max_length: int, mask_prompt: bool) -> list[dict[str, list[int]]]:
    prompt, response = format_alpaca(example)
    # Prompt and response are tokenized apart, so the boundary is exact; the tokenizer's own special
    # tokens (BOS for Llama, none for Qwen) go in front of the prompt.
    prompt_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + _eos(tokenizer)
    prompt_labels = [IGNORE_INDEX] * len(prompt_ids) if mask_prompt else list(prompt_ids)
    return _keep(prompt_ids + response_ids, prompt_labels + response_ids, max_length)


def _encode_text(example, tokenizer, max_length: int, mask_prompt: bool) -> list[dict[str, list[int]]]:
    text = example.get("text")
    if not isinstance(text, str):
        raise DataError("text examples need a string `text` field")
    ids = tokenizer(text, add_special_tokens=True)["input_ids"] + _eos(tokenizer)
    # Continued pre-training: a long document is split, not truncated, so no text is thrown away.
    return [{"input_ids": ids[i:i + max_length], "labels": ids[i:i + max_length]}
            for i in range(0, len(ids), max_length) if len(ids[i:i + max_length]) > 1]


def _encode_messages(example, tokenizer, max_length: int, mask_prompt: bool) -> list[dict[str, list[int]]]:
    messages = example.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise DataError("messages examples need a `messages` list of {role, content}")
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = _assistant_spans(messages, tokenizer, text) if mask_prompt else [(0, len(text))]
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = encoded["input_ids"]
    labels = [tok if any(start < end_ and end > start_ for start_, end_ in spans) else IGNORE_INDEX
              for tok, (start, end) in zip(ids, encoded["offset_mapping"])]
    return _keep(ids, labels, max_length)


def _assistant_spans(messages: list[dict], tokenizer, text: str) -> list[tuple[int, int]]:
    """Character spans of the assistant turns in `text` (the whole conversation, rendered).

    Turn i spans from the end of the conversation up to it with the generation prompt to the end of
    the conversation up to and including it. That needs a template whose rendering of a shorter
    conversation is a prefix of the longer one, which holds for the common templates.
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


_ENCODERS: dict[str, Callable] = {"alpaca": _encode_alpaca, "messages": _encode_messages, "text": _encode_text}


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
    """Hash of the data section, the data file's identity and the tokenizer (vocabulary + template)."""
    # padding_free is left out on purpose: it changes how rows are batched, not the rows themselves.
    section = {k: data.get(k) for k in ("path", "format", "split", "chat_template", "max_length", "packing", "mask_prompt")}
    local = Path(str(data.get("path", ""))).expanduser()
    source: Any = None
    if local.is_file():
        stat = local.stat()
        source = [str(local.resolve()), stat.st_size, stat.st_mtime_ns]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    blob = json.dumps({"v": TOKENIZE_VERSION, "data": section, "source": source,
                       "template": tokenizer.chat_template, "bos": tokenizer.bos_token_id,
                       "eos": tokenizer.eos_token_id, "class": type(tokenizer).__name__}, sort_keys=True, default=str)
    digest = hashlib.sha256(blob.encode())
    digest.update(vocab.encode())
    return digest.hexdigest()[:16]


def tokenize_for_training(data: dict[str, Any], tokenizer, cache_dir: Path, log: Callable[[str], None] = print):
    """The tokenized `datasets.Dataset` for `data` (a recipe's data section as a dict), cached.

    Call it on one process first (the runner uses TrainingArguments.main_process_first); the others
    then find the cache. The cache directory is written under a temporary name and renamed.
    """
    import datasets

    target = Path(cache_dir) / cache_key(data, tokenizer)
    if (target / "dataset_info.json").is_file():
        log(f"tokenized data: cached in {target}")
        return datasets.load_from_disk(str(target))
    raw = load_raw(str(data["path"]), data.get("split", "train"))
    _check_columns(raw, data["format"], str(data["path"]))
    rows = tokenize_examples(raw, tokenizer, data["format"], int(data["max_length"]), bool(data.get("mask_prompt", True)),
                             on_example=_every_interval(lambda done: log(f"tokenizing: {done}/{len(raw)} rows")))
    if not rows:
        raise DataError(f"{data['path']}: no example has a trainable token after truncation to max_length {data['max_length']}")
    dropped = len(raw) - len(rows) if data["format"] != "text" else 0
    if dropped > 0:
        log(f"tokenized data: dropped {dropped} of {len(raw)} examples whose response did not fit in max_length")
    if data.get("packing"):
        rows = pack(rows, int(data["max_length"]))
    dataset = datasets.Dataset.from_list(rows)
    _save_atomic(dataset, target)
    log(f"tokenized data: {len(dataset)} sequences, {sum(len(r['input_ids']) for r in rows)} tokens -> {target}")
    return datasets.load_from_disk(str(target))


def _every_interval(report: Callable[[int], None]) -> Callable[[int], None]:
    """report(done), at most once per progress interval (the live display asks for 1 s, logs get 15 s)."""
    from finetune.progress import PROGRESS_ENV

    interval = float(os.environ.get(PROGRESS_ENV) or 15)
    last = time.monotonic()

    def maybe_report(done: int) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last >= interval:
            last = now
            report(done)

    return maybe_report


def _check_columns(raw, fmt: str, path: str) -> None:
    needed = {"alpaca": ["instruction", "output"], "messages": ["messages"], "text": ["text"]}[fmt]
    missing = [c for c in needed if c not in raw.column_names]
    if missing:
        raise DataError(f"{path}: format `{fmt}` needs column(s) {', '.join(missing)}; found {', '.join(raw.column_names) or 'none'}"
                        " (set data.format to match the file)")


def _save_atomic(dataset, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    try:
        dataset.save_to_disk(str(tmp))
        try:
            os.rename(tmp, target)
        except OSError:  # another node's main process won the race with the same content
            if not (target / "dataset_info.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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
