"""Packing and padding-free batches keep every example to itself, on every attention kernel (issue 9).

The tiny Llama (random weights, float32) runs a collated micro batch and each example alone: the
logits must agree. Flash attention has no CPU kernel: for flash_attention_2/3 the model runs
transformers' own flash path (flash's mask rules, flash_attention_forward choosing the plain or the
varlen kernel from what it receives) over CPU stand-ins for the two kernels, and what reaches the
attention is recorded. The acceptance run on a GPU checks the real kernels.
"""

from __future__ import annotations

import json

import pytest

from finetune.data.spec import DataSpec
from finetune.data.packing import FlatteningCollator, make_collator, pack, split_packed
from finetune.data.tokenize import IGNORE_INDEX, tokenize_examples
from tests.data.test_training_rows import DEMO, _section, tokenizer  # noqa: F401  (a session fixture)
from tests.train_fixtures import trains_the_same

LAYOUTS = {"packing": dict(packing=True, padding_free=False), "padding_free": dict(packing=False, padding_free=True)}


def micro_batch(tokenizer, layout: str, size: int) -> list[dict]:
    """`size` dataset rows as the Trainer would hand them to the collator."""
    examples = [json.loads(line) for line in DEMO.read_text().splitlines()[:24]]
    rows = tokenize_examples(examples, tokenizer, "alpaca", 64)
    if layout == "packing":
        rows = pack(rows, 160)
        assert all(len(split_packed(r)) > 1 for r in rows[:size]), "every block should hold several examples"
    return rows[:size]


def examples_per_batch_row(rows: list[dict], collator) -> list[list[dict]]:
    """The examples each row of the collated batch holds, in order."""
    if isinstance(collator, FlatteningCollator):
        return [[example for row in rows for example in split_packed(row)]]
    return [split_packed(row) for row in rows]


def logits_alone_and_in_batch(model, rows, collator):
    """Pairs (in batch, alone) of logits, one per example."""
    import torch

    batch = collator(rows)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    pairs = []
    with torch.no_grad():
        # use_cache=False as in training: with a KV cache transformers skips the packed-sequence mask.
        together = model(**inputs, use_cache=False).logits
        for index, examples in enumerate(examples_per_batch_row(rows, collator)):
            offset = 0
            for example in examples:
                n = len(example["input_ids"])
                alone = model(input_ids=torch.tensor([example["input_ids"]]), use_cache=False).logits[0]
                pairs.append((together[index, offset:offset + n], alone))
                offset += n
    return batch, pairs


@pytest.fixture(scope="module")
def models(tiny_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return {attn: AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32, attn_implementation=attn).eval()
            for attn in ("eager", "sdpa")}


@pytest.mark.parametrize("size", [1, 4])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_every_example_in_a_batch_has_its_logits_alone(models, tokenizer, attn, layout, size):  # noqa: F811
    import torch

    rows = micro_batch(tokenizer, layout, size)
    collator = make_collator(tokenizer.pad_token_id, attn, **LAYOUTS[layout])
    batch, pairs = logits_alone_and_in_batch(models[attn], rows, collator)
    assert "attention_mask" not in batch  # boundaries come from the position ids
    assert len(pairs) == sum(len(split_packed(r)) for r in rows)
    for together, alone in pairs:
        torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_rows_of_one_length_go_unpadded_without_a_mask_and_train_the_same(models, tokenizer, attn):  # noqa: F811
    """Issue 35: a mask over rows that need no padding made transformers read it on the host every forward (a
    GPU sync) and, padding one row to a multiple of 8, kept SDPA off its flash kernel. Rows of one length now
    go as they are, without a mask; the loss and the gradients are those of the masked batch."""
    from finetune.data.packing import Collator

    rows = [r for r in micro_batch(tokenizer, "padding_free", 24) if len(r["input_ids"]) % 8][:1]
    assert rows, "a row whose length is not a multiple of 8"
    n = len(rows[0]["input_ids"])
    plain, masked = Collator(tokenizer.pad_token_id)(rows), Collator(tokenizer.pad_token_id, always_mask=True)(rows)
    assert "attention_mask" not in plain and plain["input_ids"].shape == (1, n)
    assert masked["input_ids"].shape[1] == -(-n // 8) * 8 and int(masked["attention_mask"].sum()) == n
    uneven = Collator(tokenizer.pad_token_id)(micro_batch(tokenizer, "padding_free", 3))
    assert "attention_mask" in uneven and uneven["input_ids"].shape[1] % 8 == 0

    trains_the_same(models[attn], plain, masked)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_rows_padded_to_a_multiple_for_the_gpu_train_the_same_without_a_mask(models, tokenizer, attn):  # noqa: F811
    """data.pad_to_multiple_of (auto: 64 on a GPU, finetune.plan.auto.pad_choice): a row of one length padded at
    its end to the multiple gets no mask, since no real token of a causal model attends to a later position, and
    its padding's labels are -100: the loss and the gradients are the unpadded row's. Rows of different lengths are
    padded to the multiple too, masked; the width never passes data.max_length rounded up to 8; a mixture of
    experts' padded row is masked."""
    from finetune.data.packing import Collator

    rows = [r for r in micro_batch(tokenizer, "padding_free", 24) if len(r["input_ids"]) % 16][:1]
    n = len(rows[0]["input_ids"])
    width = -(-n // 16) * 16
    plain = Collator(tokenizer.pad_token_id)(rows)
    bucketed = Collator(tokenizer.pad_token_id, bucket=16)(rows)
    assert "attention_mask" not in bucketed and bucketed["input_ids"].shape == (1, width) > plain["input_ids"].shape
    assert (bucketed["labels"][0, n:] == IGNORE_INDEX).all()
    assert (bucketed["input_ids"][0, n:] == tokenizer.pad_token_id).all()
    capped = Collator(tokenizer.pad_token_id, bucket=4096, limit=width)(rows)
    assert capped["input_ids"].shape[1] == width
    moe = Collator(tokenizer.pad_token_id, bucket=16, mask_padding=True)(rows)
    assert int(moe["attention_mask"].sum()) == n and moe["input_ids"].shape[1] == width
    uneven = Collator(tokenizer.pad_token_id, bucket=16)(micro_batch(tokenizer, "padding_free", 3))
    assert "attention_mask" in uneven and uneven["input_ids"].shape[1] % 16 == 0

    trains_the_same(models[attn], plain, bucketed)


# ------------------------------------------------------------------------------------------------
# Flash attention: what reaches the kernel


def _cpu_flash_kernels():
    """CPU stand-ins for flash_attn_func / flash_attn_varlen_func (same signatures and layouts: rows x
    seq x heads x dim, and total tokens x heads x dim cut at cu_seqlens), causal within each segment."""
    import torch

    def attend(q, k, v, softmax_scale):  # (seq, heads, dim) each, key/value heads grouped
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=softmax_scale, enable_gqa=True)
        return out.transpose(0, 1)

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
        assert causal
        return torch.stack([attend(q[i], k[i], v[i], softmax_scale) for i in range(q.shape[0])])

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False):
        assert causal and torch.equal(cu_seqlens_q, cu_seqlens_k)
        bounds = cu_seqlens_q.tolist()
        assert max_seqlen_q == max(b - a for a, b in zip(bounds, bounds[1:]))
        return torch.cat([attend(q[a:b], k[a:b], v[a:b], softmax_scale) for a, b in zip(bounds, bounds[1:])])

    return flash_attn_func, flash_attn_varlen_func


@pytest.fixture(scope="module")
def varlen_model(tiny_dir):
    """The tiny Llama running transformers' own flash attention path (flash_attention_forward, which picks
    the varlen kernel from the kwargs it gets), with CPU stand-ins for the kernels; every call's inputs
    are recorded."""
    import torch
    import transformers.modeling_flash_attention_utils as fa_utils
    import transformers.modeling_utils as modeling_utils
    from transformers import AttentionInterface, AttentionMaskInterface, AutoModelForCausalLM
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.masking_utils import flash_attention_mask

    flash_fn, varlen_fn = _cpu_flash_kernels()
    process_kwargs = fa_utils._lazy_define_process_function(varlen_fn)
    calls: list[dict] = []

    def recorded_flash_attention(module, query, key, value, attention_mask, **kwargs):
        calls.append({"attention_mask": attention_mask, "batch": query.shape[0],
                      **{k: kwargs.get(k) for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
                                                    "position_ids")}})
        return flash_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("test_flash", recorded_flash_attention)
    AttentionMaskInterface.register("test_flash", flash_attention_mask)
    kernels = lambda *a, **k: ((flash_fn, varlen_fn, None, None, None), (process_kwargs, dict))  # noqa: E731
    with pytest.MonkeyPatch.context() as patch:
        for where in (fa_utils, modeling_utils):  # from_pretrained checks that a flash kernel loads
            patch.setattr(where, "lazy_import_flash_attention", kernels)
        model = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32, attn_implementation="test_flash")
        yield model.eval(), calls


@pytest.mark.parametrize("size", [1, 4])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("attn", ["flash_attention_2", "flash_attention_3"])
def test_flash_receives_the_example_boundaries(varlen_model, tokenizer, attn, layout, size):  # noqa: F811
    import torch

    model, calls = varlen_model
    calls.clear()
    rows = micro_batch(tokenizer, layout, size)
    collator = make_collator(tokenizer.pad_token_id, attn, **LAYOUTS[layout])
    examples = [example for row in rows for example in split_packed(row)]
    lengths = [len(e["input_ids"]) for e in examples]
    bounds = [sum(lengths[:i]) for i in range(len(lengths) + 1)]

    batch, pairs = logits_alone_and_in_batch(model, rows, collator)
    assert batch["input_ids"].shape == (1, sum(lengths))  # one flattened row, no padding
    assert batch["position_ids"][0].tolist() == [p for n in lengths for p in range(n)]
    together_calls = calls[:model.config.num_hidden_layers]
    for call in together_calls:  # every layer's attention got the boundaries and no mask
        assert call["batch"] == 1 and call["attention_mask"] is None
        assert call["cu_seq_lens_q"].tolist() == bounds and call["cu_seq_lens_k"].tolist() == bounds
        assert call["cu_seq_lens_q"].dtype == torch.int32  # what flash_attn_varlen_func takes
        assert call["max_length_q"] == call["max_length_k"] == max(lengths)
        assert call["position_ids"][0].tolist() == batch["position_ids"][0].tolist()
    for together, alone in pairs:
        torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# Labels


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("attn", ["eager", "sdpa", "flash_attention_2"])
def test_no_label_is_predicted_across_examples(tokenizer, attn, layout):  # noqa: F811
    """After the model's one-token shift, every trained label is predicted from a token of its own example."""
    rows = micro_batch(tokenizer, layout, 4)
    batch = make_collator(tokenizer.pad_token_id, attn, **LAYOUTS[layout])(rows)
    labels, positions = batch["labels"].tolist(), batch["position_ids"].tolist()
    for row_labels, row_positions in zip(labels, positions):
        for t in range(1, len(row_labels)):
            if row_labels[t] != IGNORE_INDEX:  # predicted from token t - 1
                assert row_positions[t] == row_positions[t - 1] + 1, f"label at {t} is predicted from another example"
        assert all(l == IGNORE_INDEX for l, p in zip(row_labels, row_positions) if p == 0)
    examples = [example for row in rows for example in split_packed(row)]
    trained = sorted(l for row in labels for l in row if l != IGNORE_INDEX)
    assert trained == sorted(l for e in examples for l in e["labels"][1:] if l != IGNORE_INDEX)


def test_padding_free_batches_the_same_tokenized_rows(tokenizer):  # noqa: F811
    """padding_free changes the batching only, so the tokenization cache is shared."""
    section = _section(DEMO)
    assert DataSpec.from_section({**section, "padding_free": True}).cache_key(tokenizer) == \
        DataSpec.from_section(section).cache_key(tokenizer)


def test_packed_rows_without_boundaries_mix_examples_under_flash(varlen_model, tokenizer):  # noqa: F811
    """Why flash needs the flattened batch: the padded packed rows that sdpa/eager get reach a flash
    kernel with no per-example boundaries (several rows: transformers derives none from position_ids),
    and the examples attend to each other. Also shows the logits check above can see mixing."""
    import torch

    from finetune.data.packing import Collator

    model, calls = varlen_model
    calls.clear()
    rows = micro_batch(tokenizer, "packing", 4)
    batch, pairs = logits_alone_and_in_batch(model, rows, Collator(tokenizer.pad_token_id))
    assert batch["input_ids"].shape[0] == 4 and calls[0]["cu_seq_lens_q"] is None
    assert not all(torch.allclose(together, alone, rtol=1e-5, atol=1e-5) for together, alone in pairs)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_runner_refuses_a_model_without_position_ids(layout, tiny_dir):
    """Lint R114 sees only local configs; the runner checks the loaded model itself."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM, BloomConfig, BloomForCausalLM

    from finetune.data.tokenize import DataError
    from finetune.train.runner import check_packing_support

    recipe = SimpleNamespace(data=SimpleNamespace(**LAYOUTS[layout]))
    bloom = BloomForCausalLM(BloomConfig(n_layer=1, hidden_size=16, n_head=2, vocab_size=64))
    with pytest.raises(DataError, match=f"data.{layout}: BloomForCausalLM takes no position_ids"):
        check_packing_support(bloom, recipe)
    check_packing_support(AutoModelForCausalLM.from_pretrained(str(tiny_dir)), recipe)
    check_packing_support(bloom, SimpleNamespace(data=SimpleNamespace(packing=False, padding_free=False)))


# The real 2-process runs: recipes/tiny/lora_zero2_offload.yaml packs and lora_zero3.yaml is padding-free
# (tests/train/test_runner.py::test_two_process_run_learns_and_saves_what_it_trained).
