"""training.loss_kernel: the chunked loss equals transformers' own (value and gradients), the Trainer
still passes num_items_in_batch to it, the planner follows the choice, and liger is refused without
a GPU or the package. The 2-process ZeRO-3 run is in tests/train/test_runner.py (full_zero3_offload).

    python -m pytest tests/train/test_loss_kernel.py
"""

from __future__ import annotations

import copy

import pytest

from finetune.recipe import Recipe

torch = pytest.importorskip("torch")

# Shape of the toy Llama: a vocabulary large enough that chunk borders fall inside rows.
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=97, max_position_embeddings=64)


def tiny_llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides})).float()


def batch():
    """3 sequences of 13 tokens: the second is padded (label -100, attention 0), prompt tokens masked."""
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, TINY["vocab_size"], (3, 13), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 9:] = 0
    labels = input_ids.clone()
    labels[:, :4] = -100  # the prompt
    labels[1, 9:] = -100  # padding
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def loss_and_grads(model, **extra):
    model.train()
    model.zero_grad()
    loss = model(**batch(), **extra).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads


def assert_same(default, chunked):
    (loss_a, grads_a), (loss_b, grads_b) = default, chunked
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-6)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-4, atol=1e-6, msg=name)


def with_lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(2)
    # lm_head adapted too: the chunks go through the LoRA-wrapped head.
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                        target_modules=["q_proj", "v_proj", "down_proj", "lm_head"])
    return get_peft_model(model, config)


@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("num_items", [None, 17])
@pytest.mark.parametrize("chunks", [1, 5])
def test_chunked_loss_equals_the_default_with_gradients(method, num_items, chunks):
    from finetune.loss_kernel import use_chunked_loss

    default = tiny_llama()
    if method == "lora":
        default = with_lora(default)
    chunked = copy.deepcopy(default)
    use_chunked_loss(chunked, chunks)
    extra = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    assert_same(loss_and_grads(default, **extra), loss_and_grads(chunked, **extra))


def test_chunked_loss_with_gradient_checkpointing():
    from finetune.loss_kernel import use_chunked_loss

    default = tiny_llama()
    from finetune.train.model import enable_checkpointing
    enable_checkpointing(default)
    chunked = copy.deepcopy(default)
    use_chunked_loss(chunked, 4)
    assert_same(loss_and_grads(default), loss_and_grads(chunked))


def test_chunked_loss_applies_gemma2_softcapping():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from finetune.loss_kernel import use_chunked_loss

    torch.manual_seed(0)
    config = Gemma2Config(**{**TINY, "head_dim": 8}, final_logit_softcapping=2.0, attn_implementation="eager")
    default = Gemma2ForCausalLM(config).float()
    chunked = copy.deepcopy(default)
    use_chunked_loss(chunked, 3)
    assert_same(loss_and_grads(default), loss_and_grads(chunked))


def test_chunked_forward_drops_the_logits_in_training_only():
    from finetune.loss_kernel import use_chunked_loss

    model = tiny_llama()
    reference = copy.deepcopy(model).eval()
    use_chunked_loss(model, 3)
    model.train()
    assert model(**batch()).logits is None
    model.eval()  # evaluation and generation keep transformers' forward
    with torch.no_grad():
        out = model(**batch())
        torch.testing.assert_close(out.logits, reference(**batch()).logits)


def test_chunked_loss_through_the_trainer_with_gradient_accumulation(tmp_path):
    """Two steps of 2 micro batches: the Trainer passes num_items_in_batch (tokens of the whole
    accumulated batch) to the chunked forward as to the default one; the losses and weights agree."""
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments, default_data_collator

    from finetune.loss_kernel import use_chunked_loss

    rows = [{k: v[i % 3] for k, v in batch().items()} for i in range(8)]
    rows = [{**r, "labels": r["labels"] if i % 2 else torch.where(torch.arange(13) < 8, -100, r["labels"])}
            for i, r in enumerate(rows)]  # micro batches with different numbers of loss tokens
    data = Dataset.from_list([{k: v.tolist() for k, v in r.items()} for r in rows])

    def train(model, name):
        args = TrainingArguments(output_dir=str(tmp_path / name), per_device_train_batch_size=2,
                                 gradient_accumulation_steps=2, max_steps=2, learning_rate=1e-2,
                                 logging_steps=1, report_to="none", use_cpu=True, save_strategy="no",
                                 lr_scheduler_type="constant", seed=0, data_seed=0,
                                 optim="sgd")  # Adam would turn float noise in near-zero gradients into full steps
        trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator)
        assert trainer.model_accepts_loss_kwargs  # so num_items_in_batch reaches the forward
        trainer.train()
        return [e["loss"] for e in trainer.state.log_history if "loss" in e]

    default = tiny_llama()
    chunked = copy.deepcopy(default)
    use_chunked_loss(chunked, 4)
    assert train(chunked, "chunked") == pytest.approx(train(default, "default"), rel=1e-5)
    for (name, a), b in zip(default.named_parameters(), chunked.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6, msg=name)


def test_a_head_that_scales_its_logits_is_refused():
    from finetune.loss_kernel import LossKernelError, use_chunked_loss

    model = tiny_llama()
    model.config.logit_scale = 0.5
    with pytest.raises(LossKernelError, match="logit_scale"):
        use_chunked_loss(model, 2)


def test_chunk_count_is_fixed_by_the_largest_batch():
    from finetune.chunks import chunk_count, chunk_tokens

    assert chunk_tokens(128_256) == 523  # 256 MiB of fp32 logits
    assert chunk_count(4096, 128_256) == 8
    assert chunk_count(256, 768, chosen=48) == 6
    assert chunk_count(10, 32_000) == 1


# ------------------------------------------------------------------------------------------------
# Recipe, planner, TrainingArguments, preflight (no torch needed, but cheap here)


def recipe(**training) -> Recipe:
    return Recipe.model_validate({"model": {"name_or_path": "meta-llama/Meta-Llama-3-8B"}, "method": "qlora",
                                  "data": {"path": "x.jsonl", "max_length": 4096},
                                  "training": {"micro_batch_size": 1, **training},
                                  "hardware": {"gpus": 1, "gpu_memory": "24GiB"}})


def test_the_planner_follows_the_loss_kernel():
    from finetune.plan import plan_recipe

    default = plan_recipe(recipe()).per_gpu["logits"]
    chunked = plan_recipe(recipe(loss_kernel="chunked")).per_gpu["logits"]
    liger = plan_recipe(recipe(loss_kernel="liger")).per_gpu["logits"]
    assert default == 4096 * 128_256 * 12  # 6.3 GB: every token's fp32 logits and two gradients
    assert chunked == 512 * 128_256 * 12  # 8 chunks of 512 tokens
    # Liger: chunk = next_pow2(4096 / ceil(128256 / 4096)) = 128 tokens of bf16 logits, + the input's gradient
    assert liger == 128 * 128_256 * 2 + 4096 * (4096 * 2 + 4)
    assert plan_recipe(recipe(loss_kernel="chunked")).per_gpu["total"] < plan_recipe(recipe()).per_gpu["total"]


def test_liger_is_a_training_arguments_switch():
    from finetune.render import render_training_args

    assert render_training_args(recipe(loss_kernel="liger"))["use_liger_kernel"] is True
    assert "use_liger_kernel" not in render_training_args(recipe(loss_kernel="chunked"))


def test_liger_without_a_gpu_or_the_package_fails_preflight():
    from finetune.run.doctor import checks_for_recipe
    from finetune.run.machine import Facts, Gpu

    packages = {"torch": "2.13.0", "deepspeed": "0.19.8", "transformers": "5.23.0", "peft": "0.21.2",
                "bitsandbytes": "0.49.0", "accelerate": "1.12.0", "datasets": "4.0.0"}
    cpu = Facts(python="3.11", platform="linux", packages=packages)
    failed = {c.name: c.message for c in checks_for_recipe(recipe(loss_kernel="liger"), cpu) if c.status == "fail"}
    assert "liger-kernel" in failed and "liger-kernel.gpu" in failed
    gpu = Facts(python="3.11", platform="linux", packages={**packages, "liger-kernel": "0.8.5"}, torch_cuda="12.8",
                cuda_available=True, gpus=[Gpu(index=0, name="NVIDIA H100", memory_bytes=80 * 2**30, capability=(9, 0))])
    failed = [c.name for c in checks_for_recipe(recipe(loss_kernel="liger"), gpu) if c.status == "fail"]
    assert not [n for n in failed if n.startswith("liger")]
    zero3 = recipe(loss_kernel="liger").model_copy(update={"deepspeed": recipe().deepspeed.model_copy(update={"stage": 3})})
    assert {c.name: c.status for c in checks_for_recipe(zero3, gpu)}["liger-kernel.zero3"] == "warn"
    assert not [c for c in checks_for_recipe(recipe(loss_kernel="chunked"), cpu) if c.name.startswith("liger")]
