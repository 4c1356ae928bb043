"""Packing and batching: whole examples end to end in blocks of at most max_length tokens, and the
collator that keeps every example to itself on each attention kernel.

- `pack_starts` / `pack_table`: greedy in-order packing on Arrow columns (finetune.data.prepare packs the
  tokenized data with them on every core); each block carries position_ids that restart at 0 for every
  example, and the first token of each example is not a label.
- `make_collator`: padded rows, packed rows, or one flattened row per micro batch (`data.padding_free`,
  and packing under flash attention), so that examples never attend to each other.

This module imports numpy, pyarrow, torch and transformers only inside functions.
"""

from __future__ import annotations

from typing import Any

from finetune.data.tokenize import IGNORE_INDEX


def pack(rows: list[dict[str, list[int]]], max_length: int) -> list[dict[str, list[int]]]:
    """`pack_table` of a list of rows, as lists (a handful of rows: tests, the GPU acceptance script)."""
    import pyarrow as pa

    table = pa.table({name: pa.array([row[name] for row in rows], pa.list_(pa.int32())) for name in ("input_ids", "labels")})
    return pack_table(table, pack_starts(pa.compute.list_value_length(table["input_ids"]).to_numpy(), max_length)).to_pylist()


def pack_starts(lengths, max_length: int):
    """Greedy in-order packing of whole examples into blocks of at most max_length tokens: the index of
    each block's first example, then len(lengths) (a numpy int64 array; the lengths are a numpy array too).

    Each block carries position_ids that restart at 0 for every example (`pack_table`): the collators below
    turn them into the boundaries each attention kernel honours (see `make_collator`)."""
    import numpy as np

    starts = [0] if len(lengths) else []
    used = 0
    for index, length in enumerate(lengths.tolist()):  # sequential by nature; ~0.3 s per million examples
        if used and used + length > max_length:
            starts.append(index)
            used = 0
        used += length
    return np.array(starts + [len(lengths)], dtype=np.int64)


def pack_table(table, starts):
    """The blocks of an Arrow table of examples (input_ids, labels): block k holds examples starts[k] to
    starts[k+1] - 1, end to end, with position_ids restarting at 0 for each. The first token of every
    example is not a label: it would be predicted from the previous example's last token. Columns in,
    columns out: no Python list of tokens."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    ids, labels = table.column("input_ids").combine_chunks(), table.column("labels").combine_chunks()
    lengths = pc.list_value_length(ids).to_numpy()
    row_start = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=row_start[1:])
    flat_labels = pc.list_flatten(labels).to_numpy(zero_copy_only=False).astype(np.int32, copy=True)
    flat_labels[row_start[:-1]] = IGNORE_INDEX
    positions = (np.arange(row_start[-1], dtype=np.int64) - np.repeat(row_start[:-1], lengths)).astype(np.int32)
    offsets = pa.array(row_start[np.asarray(starts)].astype(np.int32))
    return pa.table({"input_ids": pa.ListArray.from_arrays(offsets, pc.list_flatten(ids).cast(pa.int32())),
                     "labels": pa.ListArray.from_arrays(offsets, pa.array(flat_labels)),
                     "position_ids": pa.ListArray.from_arrays(offsets, pa.array(positions))})


# ------------------------------------------------------------------------------------------------
# Batching


# The host-side counts of a training batch, (trained tokens, sum of squared sequence lengths), under this key when
# the collator is made with counts=True: the runner takes them off before the batch reaches the model
# (finetune.train.counting), so counting tokens needs no device tensor and no synchronisation (issue 35).
COUNTS_KEY = "finetune_counts"


def _squares(lengths) -> int:
    return int((lengths.astype("int64") ** 2).sum())


def _segment_lengths(positions):
    """Lengths of the examples in one packed row: where its position ids restart at 0 (numpy in, numpy out)."""
    import numpy as np

    starts = np.flatnonzero(positions == 0)
    if not len(starts) or starts[0] != 0:
        starts = np.concatenate([[0], starts])
    return np.diff(np.append(starts, len(positions)))


# What `data.pad_to_multiple_of: auto` is on a GPU (finetune.plan.auto.pad_choice): the widths a micro batch can
# take are the multiples of it, so that the attention kernel sees few shapes. torch's SDPA on Hopper runs cuDNN's
# attention, whose plan cache (aten/src/ATen/native/cudnn/MHA.cpp) is keyed on the exact sizes: every new sequence
# length builds a forward and a backward plan on the host (reported at hundreds of ms each: pytorch/pytorch#155958
# and its opt-in TORCH_CUDNN_SDPA_AVOID_RECOMPILE; sgl-project/sglang#4650). With rows of every length from 1 to
# 2,048 that is a build on nearly every step; in multiples of 64 at most 32 shapes a micro batch size, each built
# once, for at most 63 padded tokens a row (3% of 2,048). Measured on an H200 (2026-11-28, LoRA on the Llama-3.2-1B
# shape, micro batch 1, 55 steps of rows of 1,024-2,048 tokens, the same rows both ways): median step 0.205 s
# padded to 64 against 0.402 s unpadded, 6,585 against 4,026 tokens/s (docs/gpu_acceptance/2026-11-28_h200_speed_fourth.md).
GPU_PAD_MULTIPLE = 64


def gpu_pad_multiple(recipe: Any) -> tuple[int, str]:
    """(data.pad_to_multiple_of, why) that `auto` is for `recipe` on a GPU (finetune.plan.auto.pad_choice decides the
    key; `finetune plan` sizes the activations with it, finetune.plan.data_lengths)."""
    from finetune import objectives

    data = recipe.data
    if objectives.get(recipe.objective).uses_trl:
        return 1, f"objective {recipe.objective}: TRL's collator pads its rows"
    if data.padding_free:
        return 1, "padding_free: one row of the micro batch's examples end to end, not padded"
    from finetune.vision_models import recipe_vision

    if recipe_vision(recipe) is not None:
        return 1, "a vision-language model: its collator pads each batch with its images (finetune.train.vlm_collator)"
    widths = -(-data.max_length // GPU_PAD_MULTIPLE)
    lengths = f"{widths} length{'s' if widths != 1 else ''}"
    return GPU_PAD_MULTIPLE, (f"a GPU: each micro batch padded at its end to a multiple of {GPU_PAD_MULTIPLE} tokens, "
                              f"so the attention kernel sees at most {lengths} up to max_length {data.max_length}; "
                              "cuDNN's attention (torch's SDPA on H100/H200) builds a plan on the host for every new "
                              f"length. At most {GPU_PAD_MULTIPLE - 1} padded tokens a row, without an attention mask "
                              "where the rows are of one length (on an H200, LoRA on a 1B model, rows of 1,024-2,048 "
                              "tokens: median step 0.205 s against 0.402 s unpadded)")


def planned_pad_multiple(recipe: Any) -> int:
    """data.pad_to_multiple_of as the plan sizes a GPU's batches with it: as written, else as a GPU decides `auto`;
    1 for the objectives TRL collates (their collators pad)."""
    from finetune import objectives

    if objectives.get(recipe.objective).uses_trl:
        return 1
    if "data.pad_to_multiple_of" in recipe.auto_keys:
        return gpu_pad_multiple(recipe)[0]
    return recipe.data.pad_to_multiple_of


def width_limit(max_length: int) -> int:
    """The widest a micro batch is padded to: data.max_length rounded up to 8, as wide as rows cut to max_length
    made it before data.pad_to_multiple_of (what the plan sizes a step for)."""
    return -(-max_length // 8) * 8


def padded_width(longest: int, multiple: int, limit: int) -> int:
    """The width a micro batch whose longest row has `longest` tokens is padded to: a multiple of `multiple`,
    but never past `limit` (width_limit), nor below the row itself."""
    return max(longest, min(-(-longest // multiple) * multiple, limit))


class Collator:
    """Pads a list of rows to the longest (rounded up to a multiple of 8 for tensor-core shapes).

    Unpacked rows of different lengths get an attention mask. Rows of one length (micro batch 1, always) are
    not padded and get none (unless `always_mask`): with a mask, transformers reads it on the host to see that it
    masks nothing (masking_utils._ignore_causal_mask_sdpa: a host sync every forward, issue 35), and a mask that
    does pad a single row to the multiple of 8 keeps SDPA off its flash kernel; without one the model is causal
    through SDPA's is_causal. Packed rows (with position_ids) get none either, so the model builds
    the block-diagonal mask from the position ids (sdpa/eager only: see `make_collator`); padding
    continues the positions of a separate trailing sequence with labels -100. The rows are copied into
    preallocated numpy arrays and handed to torch without a copy: no Python list of tokens is built
    (nested lists through torch.tensor cost ~1 ms a 4 x 2,048 batch on the step's own thread).

    `bucket` (data.pad_to_multiple_of, as finetune.plan.auto decided it): every batch's width is a multiple of it,
    up to `limit` (padded_width). Rows of one length padded that way get no mask either: their padding comes after
    every real token, where a causal model's tokens never look, and its labels are -100; a mixture of experts'
    router would still see it (its load-balancing loss counts every token it is not told to skip), so with
    `mask_padding` such a batch gets a mask.
    """

    def __init__(self, pad_token_id: int, multiple_of: int = 8, counts: bool = False, always_mask: bool = False,
                 bucket: int = 1, limit: int = 2**31, mask_padding: bool = False):
        self.pad_token_id = pad_token_id
        self.multiple_of = multiple_of
        self.counts = counts
        self.always_mask = always_mask
        self.bucket = bucket
        self.limit = limit
        self.mask_padding = mask_padding

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        import numpy as np
        import torch

        lengths = np.fromiter((len(r["input_ids"]) for r in rows), dtype=np.int64, count=len(rows))
        packed = "position_ids" in rows[0]
        longest = int(lengths.max())
        even = not packed and not self.always_mask and int(lengths.min()) == longest
        width = padded_width(longest, self.bucket if even else max(self.multiple_of, self.bucket), self.limit)
        maskless = even and (width == longest or not self.mask_padding)
        ids = np.full((len(rows), width), self.pad_token_id, dtype=np.int64)
        labels = np.full((len(rows), width), IGNORE_INDEX, dtype=np.int64)
        positions = np.zeros((len(rows), width), dtype=np.int64) if packed else None
        for i, (r, n) in enumerate(zip(rows, lengths.tolist())):
            ids[i, :n] = r["input_ids"]
            labels[i, :n] = r["labels"]
            if packed:
                positions[i, :n] = r["position_ids"]
                positions[i, n:] = np.arange(width - n)
        batch = {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels)}
        if packed:
            batch["position_ids"] = torch.from_numpy(positions)
        elif not maskless:
            batch["attention_mask"] = torch.from_numpy((np.arange(width) < lengths[:, None]).astype(np.int64))
        if self.counts:
            squares = sum(_squares(_segment_lengths(positions[i, :n])) for i, n in enumerate(lengths.tolist())) \
                if packed else _squares(lengths)
            batch[COUNTS_KEY] = (int(lengths.sum()), squares)
        return batch


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

    def __init__(self, flash_kwargs: bool, counts: bool = False):
        from transformers import DataCollatorWithFlattening

        self.flatten = DataCollatorWithFlattening(return_position_ids=True, separator_id=IGNORE_INDEX,
                                                  return_flash_attn_kwargs=flash_kwargs)
        self.counts = counts

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        examples = [example for row in rows for example in split_packed(row)]
        batch = self.flatten(examples)
        if self.counts:
            lengths = [len(e["input_ids"]) for e in examples]
            batch[COUNTS_KEY] = (sum(lengths), sum(n * n for n in lengths))
        return batch


def make_collator(pad_token_id: int, attn_implementation: str, packing: bool, padding_free: bool,
                  counts: bool = False, bucket: int = 1, limit: int = 2**31, mask_padding: bool = False):
    """The collator that keeps every example to itself on `attn_implementation`.

    - padding_free (any kernel), or packing with flash attention: one flattened row per micro batch.
      Flash needs it: transformers passes flash only per-example boundaries it is given
      (cu_seq_lens) or, from position ids, when the batch has a single row
      (modeling_flash_attention_utils._is_packed_sequence); several packed rows would attend across
      examples.
    - packing with sdpa/eager: the packed rows, padded; masking_utils.find_packed_sequence_indices
      turns the restarting position ids of each row into a (rows, 1, seq, seq) block-diagonal mask,
      which is smaller than one flattened row's (1, 1, rows x seq, rows x seq).
    - otherwise: padded rows with an attention mask (rows of one length: none; see `Collator`).
    `counts`: each batch carries its host-side counts under COUNTS_KEY (training batches; see above).
    `bucket`, `limit`, `mask_padding`: the padded rows' widths (`Collator`).
    """
    flash = attn_implementation.startswith("flash_attention")
    if padding_free or (packing and flash):
        return FlatteningCollator(flash_kwargs=flash, counts=counts)
    return Collator(pad_token_id, counts=counts, bucket=bucket, limit=limit, mask_padding=mask_padding)
