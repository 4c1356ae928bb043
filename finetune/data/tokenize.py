"""Training data: load (local file or hub), format, tokenize with the prompt masked.

Rows become examples in finetune.data.formats (alpaca, messages, sharegpt, text; role maps, per-turn
train flags); this module turns a batch of them into input_ids and labels (`encode_rows`), with one call
to the fast tokenizer per batch:
- alpaca: the Alpaca prompt, masked; the loss covers the output and the EOS token that ends it.
- messages / sharegpt: rendered with the chat template. The loss covers every assistant turn whose
  train flag is on, including the template's end-of-turn token (EOS for most templates), so the model
  learns to stop after each turn. The turns are located by the template's `{% generation %}` blocks
  when it has one per assistant turn (transformers' render_jinja_template reports them), else by
  rendering each prefix of the conversation (finetune.data.chat_template). With `data.think: mask` the
  `<think>...</think>` spans inside assistant turns stay in the input but leave the loss.
- text: every token is trained. Long documents are split into max_length pieces.

Labels are -100 where a token is not trained (Hugging Face's ignore index). finetune.data.prepare runs
`encode_rows` on every core, mixes, packs (finetune.data.packing) and caches the result before the
ranks start.

This module imports `datasets`, pyarrow and torch only inside functions.
"""

from __future__ import annotations

from itertools import chain
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from finetune.data.formats import Chat, Prompted, RowProblem, RowSpec, Text, to_example
from finetune.data.sources import is_arrow_dir
from finetune.recipe.references import DATA_SUFFIXES
from finetune.errors import FinetuneError

IGNORE_INDEX = -100  # transformers' CrossEntropyLoss ignore_index
# datasets' builder for each data file type (.jsonl files are read by the json builder)
LOCAL_SUFFIXES = {suffix: "json" if suffix == ".jsonl" else suffix[1:] for suffix in DATA_SUFFIXES}


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
                      mask_prompt: bool = True, spec: Optional[RowSpec] = None, think: str = "train",
                      dropped: Optional[list[int]] = None) -> list[dict[str, list[int]]]:
    """input_ids + labels for each example (a text may give several rows, an empty one none), in memory:
    for a handful of rows (eval, tests). Training data goes through finetune.data.prepare, which calls
    `encode_rows` on batches in every core. `dropped` collects the indices of examples that truncation left
    with nothing to train."""
    spec = spec or RowSpec(fmt)
    rows: list[dict[str, list[int]]] = []
    batch = list(examples)
    for index, encoded in enumerate(encode_rows(batch, spec, tokenizer, max_length, mask_prompt, think)):
        if not encoded and dropped is not None:
            dropped.append(index)
        rows.extend({name: list(map(int, values)) if name in ("input_ids", "labels") else values
                     for name, values in sequence.items()} for sequence in encoded)
    return rows


class RowError(DataError):
    """A row that cannot be tokenized: `index` is its position in the batch (the caller names file and line)."""

    def __init__(self, index: int, message: str):
        super().__init__(message)
        self.index = index

    def __reduce__(self):  # raised in a datasets.map worker, re-raised in the launcher
        return (type(self), (self.index, str(self)))


def encode_rows(rows: list[Any], spec: RowSpec, tokenizer, max_length: int, mask_prompt: bool = True,
                think: str = "train") -> list[list[dict[str, list[int]]]]:
    """The sequences of each row (converted by its format), with one batched call to the fast tokenizer per
    kind of example: input_ids and labels as lists of ints, or numpy int64 arrays (chat rows). Raises RowError
    naming the row of the batch that is wrong."""
    examples = []
    for index, row in enumerate(rows):
        try:
            examples.append(to_example(row, spec))
        except RowProblem as exc:
            raise RowError(index, f"example {index}: {exc}") from None
    try:
        return encode_batch(examples, tokenizer, max_length, mask_prompt, think, spec)
    except RowError:
        raise
    except DataError as exc:
        raise RowError(0, str(exc)) from None


def encode(example, tokenizer, max_length: int, mask_prompt: bool = True, think: str = "train") -> list[dict[str, list[int]]]:
    return encode_batch([example], tokenizer, max_length, mask_prompt, think)[0]


def encode_batch(examples: list[Any], tokenizer, max_length: int, mask_prompt: bool = True,
                 think: str = "train", spec: Optional[RowSpec] = None) -> list[list[dict[str, list[int]]]]:
    """encode() of each example; the examples of one kind share one batched tokenizer call (a fast
    tokenizer gives the same ids for a text alone or in a batch, without padding). An encoder added with
    register_encoder also gets the rows' `spec`."""
    out: list[list[dict[str, list[int]]]] = [[] for _ in examples]
    kinds: dict[type, list[int]] = {}
    for index, example in enumerate(examples):
        kinds.setdefault(type(example), []).append(index)
    for kind, indices in kinds.items():
        encoder = _ENCODERS.get(kind)
        if encoder is None:
            raise RowError(indices[0], f"no tokenization for {kind.__name__} examples")
        extra = {"spec": spec} if kind in _REGISTERED else {}
        for index, encoded in zip(indices, encoder([examples[i] for i in indices], indices, tokenizer, max_length,
                                                   mask_prompt, think, **extra)):
            out[index] = encoded
    return out


def _keep(ids: list[int], labels: list[int], max_length: int) -> list[dict[str, list[int]]]:
    ids, labels = ids[:max_length], labels[:max_length]
    # An example whose response was cut off entirely trains nothing: drop it (the caller counts it).
    if all(label == IGNORE_INDEX for label in labels[1:]):
        return []
    return [{"input_ids": ids, "labels": labels}]


def _eos(tokenizer) -> list[int]:
    return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []


def _backend(tokenizer):
    """The fast tokenizer's Rust `tokenizers.Tokenizer`, when calling it directly gives what tokenizer(texts)
    gives: no truncation or padding set on it (transformers switches them off on every call without
    them) and the same special-token splitting. None otherwise: then the transformers call."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch_fast"):
        return None
    if backend.truncation is not None or backend.padding is not None:
        return None
    if backend.encode_special_tokens != bool(getattr(tokenizer, "split_special_tokens", False)):
        return None
    return backend


def _ids(tokenizer, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """tokenizer(texts)["input_ids"]; through the Rust tokenizer without offsets when that is the same
    (encode_batch_fast: a third less work, and no BatchEncoding of attention masks to build)."""
    backend = _backend(tokenizer)
    if backend is None:
        return tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]
    return [encoding.ids for encoding in backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)]


def _ids_and_offsets(tokenizer, texts: list[str], max_length: int) -> tuple[list[Any], list[Any]]:
    """tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True): ids (numpy int64) and character
    offsets (numpy, (n, 2)) of the first max_length tokens. Through the Rust tokenizer, a long text only as far
    as max_length needs (finetune.data.prefix), the rest of the batch cut where its first texts say."""
    backend = _backend(tokenizer)
    if backend is None:
        encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        return ([_tokens(ids[:max_length]) for ids in encoded["input_ids"]],
                [_array(o[:max_length]) for o in encoded["offset_mapping"]])
    from finetune.data.prefix import PROBE, Prefixes, chars_per_token

    cuts = Prefixes.of(tokenizer)
    ids, offsets = _encoded(tokenizer, backend, texts[:PROBE], [None] * len(texts[:PROBE]), max_length)
    rest = texts[PROBE:]
    ratio = chars_per_token(offsets, max_length) if cuts is not None and rest else None
    if ratio is None:
        more = _encoded(tokenizer, backend, rest, [None] * len(rest), max_length)
        return ids + more[0], offsets + more[1]
    ends = cuts.ends(rest, ratio, max_length)
    more = _encoded(tokenizer, backend, [text[:end] for text, (end, _) in zip(rest, ends)], [last for _, last in ends],
                    max_length, cuts.lengths)
    redo = [i for i, found in enumerate(more[0]) if found is None]  # a cut that did not hold: the whole text
    again = _encoded(tokenizer, backend, [rest[i] for i in redo], [None] * len(redo), max_length)
    for i, found_ids, found_offsets in zip(redo, *again):
        more[0][i], more[1][i] = found_ids, found_offsets
    return ids + more[0], offsets + more[1]


def _encoded(tokenizer, backend, texts: list[str], lasts: list[Optional[int]], max_length: int,
             lengths: Optional[dict[int, int]] = None) -> tuple[list[Any], list[Any]]:
    """ids and offsets of the first max_length tokens of each text: without offsets (encode_batch_fast) where
    finetune.data.offsets computes them from the ids, with them for the other texts; sliced in Python
    (Encoding.truncate builds the overflowing tail as new encodings: 2-4x converting it). A text cut after the
    added token `lasts[i]` (of `lengths[lasts[i]]` characters) gives (None, None) unless its tokens number at
    least max_length and end with that token, on the text's last characters (finetune.data.prefix)."""
    from finetune.data.offsets import ByteOffsets

    ids: list[Any] = [None] * len(texts)
    offsets: list[Any] = [None] * len(texts)
    failed = [False] * len(texts)
    spelled = ByteOffsets.of(tokenizer)
    if spelled is not None and texts:
        for i, encoding in enumerate(backend.encode_batch_fast(texts, add_special_tokens=False)):
            if lasts[i] is None:
                ids[i] = _tokens(encoding.ids[:max_length])
            else:
                tokens = _tokens(encoding.ids)
                if not (len(tokens) >= max_length and tokens[-1] == lasts[i] and spelled.spells_all(texts[i], tokens)):
                    failed[i] = True
                    continue
                ids[i] = tokens[:max_length]
            offsets[i] = spelled.offsets(texts[i], ids[i])
    rest = [i for i, found in enumerate(offsets) if found is None and not failed[i]]
    for i, encoding in zip(rest, backend.encode_batch([texts[i] for i in rest], add_special_tokens=False)):
        if lasts[i] is not None and not (len(encoding.ids) >= max_length and encoding.ids[-1] == lasts[i]
                                         and encoding.offsets[-1] == (len(texts[i]) - lengths[lasts[i]], len(texts[i]))):
            continue
        ids[i], offsets[i] = _tokens(encoding.ids[:max_length]), _array(encoding.offsets[:max_length])
    return ids, offsets


def _tokens(ids: list[int]):
    import numpy as np

    return np.fromiter(ids, dtype=np.int64, count=len(ids))


def _array(offsets: list[tuple[int, int]]):
    """(n, 2) int64 from a list of (start, end) (fromiter: half the time of asarray on a list of tuples)."""
    import numpy as np

    return np.fromiter(chain.from_iterable(offsets), dtype=np.int64, count=2 * len(offsets)).reshape(-1, 2)


def _encode_prompted(examples: list[Prompted], indices: list[int], tokenizer, max_length: int, mask_prompt: bool,
                     think: str) -> list[list[dict[str, list[int]]]]:
    # Prompt and response are tokenized apart, so the boundary is exact; the tokenizer's own special
    # tokens (BOS for Llama, none for Qwen) go in front of the prompt.
    prompts = _ids(tokenizer, [e.prompt for e in examples], add_special_tokens=True)
    responses = _ids(tokenizer, [e.response for e in examples], add_special_tokens=False)
    eos = _eos(tokenizer)
    out = []
    for prompt_ids, response_ids in zip(prompts, responses):
        ids = (prompt_ids + response_ids + eos)[:max_length]
        # What _keep checks, without walking the labels: a response token left at a position >= 1.
        first_trained = max(len(prompt_ids), 1) if mask_prompt else 1
        if len(ids) <= first_trained:
            out.append([])
            continue
        labels = [IGNORE_INDEX] * len(prompt_ids) + ids[len(prompt_ids):] if mask_prompt else list(ids)
        out.append([{"input_ids": ids, "labels": labels[:max_length]}])
    return out


def _encode_text(examples: list[Text], indices: list[int], tokenizer, max_length: int, mask_prompt: bool,
                 think: str) -> list[list[dict[str, list[int]]]]:
    eos = _eos(tokenizer)
    out = []
    for ids in _ids(tokenizer, [e.text for e in examples], add_special_tokens=True):
        ids = ids + eos
        # Continued pre-training: a long document is split, not truncated, so no text is thrown away.
        out.append([{"input_ids": ids[i:i + max_length], "labels": ids[i:i + max_length]}
                    for i in range(0, len(ids), max_length) if len(ids[i:i + max_length]) > 1])
    return out


def _encode_chat(examples: list[Chat], indices: list[int], tokenizer, max_length: int, mask_prompt: bool,
                 think: str) -> list[list[dict[str, list[int]]]]:
    import numpy as np

    from finetune.data.chat_template import ChatRenderer, chat_text
    from finetune.data.template_budget import alarm_handler

    render = ChatRenderer(tokenizer, examples[0].messages if examples else None)
    texts, all_spans = [], []
    with alarm_handler():  # each render within the template budget's time (finetune.data.template_budget)
        for index, example in zip(indices, examples):
            try:
                text, spans = chat_text(example, render, mask_prompt, think)
            except RowProblem as exc:
                raise RowError(index, f"example {index}: {exc}") from None
            texts.append(text)
            all_spans.append(spans)
    out = []
    for ids, offsets, spans in zip(*_ids_and_offsets(tokenizer, texts, max_length), all_spans):
        # A token is trained when its characters overlap a trained span (numpy: ~10x a Python loop per token).
        trained = np.zeros(len(ids), dtype=bool)
        for start, end in spans:
            trained |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
        if not trained[1:].any():  # _keep: nothing left to train
            out.append([])
            continue
        # Numpy columns: finetune.data.prepare hands them to Arrow as they are (tokenize_examples makes lists).
        out.append([{"input_ids": ids, "labels": np.where(trained, ids, IGNORE_INDEX)}])
    return out


_ENCODERS: dict[type, Callable[..., list[list[dict[str, list[int]]]]]] = {
    Prompted: _encode_prompted, Text: _encode_text, Chat: _encode_chat,
}
_REGISTERED: set[type] = set()


def register_encoder(kind: type, encode: Callable[..., list[list[dict[str, Any]]]]) -> None:
    """Tokenize examples of `kind` with `encode(examples, indices, tokenizer, max_length, mask_prompt, think, spec)`
    (a row format's own sequences: finetune.data.vision_encode's rows with images)."""
    _ENCODERS[kind] = encode
    _REGISTERED.add(kind)


def split_eval(dataset, fraction: float, seed: int):
    """(train, eval or None): a seeded random hold-out of `fraction` of the sequences."""
    if fraction <= 0:
        return dataset, None
    if len(dataset) < 2:
        raise DataError(f"validation_split {fraction} needs at least 2 sequences, the data has {len(dataset)}")
    parts = dataset.train_test_split(test_size=fraction, seed=seed, shuffle=True)
    return parts["train"], parts["test"]
