"""Mixture-of-experts models in the planner: shapes against transformers' real models, activations
against torch's saved tensors (CPU), LoRA counts against peft, and the memory model (every expert
resident, activations for the top-k experts only)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from finetune.plan.archs import BY_NAME, ArchError, arch_from_config
from finetune.plan import GiB, Setup, largest_module_numel, layer_activation_bytes, param_groups, plan

TINY_MOE = {
    "mixtral": dict(model_type="mixtral", hidden_size=64, intermediate_size=96, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=512, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(model_type="qwen2_moe", hidden_size=64, intermediate_size=160, moe_intermediate_size=48,
                      num_experts=6, num_experts_per_tok=2, shared_expert_intermediate_size=80,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512, decoder_sparse_step=1,
                      mlp_only_layers=[]),
}


def hf_model(cfg: dict, layers: int, method: str = "full", meta: bool = False):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(cfg, num_hidden_layers=layers)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg, attn_implementation="sdpa")
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).train()
    if method == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                 target_modules="all-linear")).to(torch.bfloat16)
    return model


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen1.5-moe-a2.7b"])
def test_moe_table_matches_transformers(name):
    """Total parameters and DeepSpeed's largest_layer_params (the experts module) of the real model."""
    arch = BY_NAME[name]
    model = hf_model(arch.hf_config(), arch.layers, meta=True)
    assert model.num_parameters() == arch.total_params
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    assert largest == arch.largest_module_params == arch.expert_params
    setup = Setup(arch=arch, params=arch.total_params, method="full")
    assert largest_module_numel(param_groups(setup)) == largest


@pytest.mark.parametrize("kind", sorted(TINY_MOE))
def test_moe_config_json_matches_transformers(kind):
    cfg = dict(TINY_MOE[kind], num_hidden_layers=3)
    arch = arch_from_config(cfg, "tiny")
    assert arch.experts and arch.moe_layers == 3
    assert hf_model(TINY_MOE[kind], 3, meta=True).num_parameters() == arch.total_params


def test_deepseek_style_dense_first_layers_and_shared_experts():
    arch = arch_from_config({"model_type": "deepseek", "hidden_size": 64, "intermediate_size": 160,
                             "moe_intermediate_size": 32, "n_routed_experts": 8, "n_shared_experts": 2,
                             "num_experts_per_tok": 3, "first_k_dense_replace": 1, "num_hidden_layers": 4,
                             "num_attention_heads": 4, "vocab_size": 100}, "deepseek")
    assert (arch.dense_layers, arch.moe_layers, arch.shared_intermediate) == (1, 3, 64)
    assert arch.active_mlp_width == 3 * 32 + 64
    with pytest.raises(ArchError, match="latent attention"):
        arch_from_config({"model_type": "deepseek_v3", "hidden_size": 64, "intermediate_size": 160,
                          "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100,
                          "kv_lora_rank": 16, "n_routed_experts": 8}, "v3")


def saved_bytes(model, ids) -> int:
    from tests.plan.test_planner import saved_for_backward_bytes

    return saved_for_backward_bytes(model, ids)


@pytest.mark.parametrize("kind,method", [("mixtral", "full"), ("qwen2_moe", "full"), ("qwen2_moe", "lora")])
def test_moe_layer_activations_match_saved_tensors(kind, method):
    """One MoE layer's saved-for-backward bytes (2-layer minus 1-layer model) within 2% of the plan:
    the top-k experts' activations, the router's fp32 softmax, the shared expert."""
    import torch

    b, s = 2, 48
    measured = []
    for layers in (1, 2):
        model = hf_model(TINY_MOE[kind], layers, method)
        torch.manual_seed(1)
        measured.append(saved_bytes(model, torch.randint(0, 512, (b, s))))
    arch = arch_from_config(dict(TINY_MOE[kind], num_hidden_layers=2), "tiny")
    setup = Setup(arch=arch, params=arch.total_params, method=method, attn="sdpa", lora_r=8, lora_dropout=0.0,
                  micro_batch=b, seq_len=s, full_rows=True, gradient_checkpointing=False)
    assert layer_activation_bytes(setup) == pytest.approx(measured[1] - measured[0], rel=0.02)


def test_moe_lora_trainable_count_matches_peft():
    """Qwen2-MoE with "all-linear": attention, the shared expert and its gate (the routed experts and
    the router are plain parameters, which peft leaves alone for this model)."""
    model = hf_model(TINY_MOE["qwen2_moe"], 2, "lora")
    expected = sum(p.numel() for p in model.parameters() if p.requires_grad)
    arch = arch_from_config(dict(TINY_MOE["qwen2_moe"], num_hidden_layers=2), "tiny")
    assert plan(Setup(arch=arch, params=arch.total_params, method="lora", lora_r=8)).trainable == expected


def test_every_expert_is_resident_but_activations_follow_top_k():
    arch = BY_NAME["mixtral-8x7b"]
    base = Setup(arch=arch, params=arch.total_params, method="lora", deepspeed=False, seq_len=2048,
                 gradient_checkpointing=False)
    result = plan(base)
    frozen = next(t.bytes for t in result.terms if t.name == "frozen base 16-bit")
    assert frozen >= (arch.total_params - result.trainable) * 2 * 0.999  # all 8 experts, 46.7B parameters
    # Twice the experts: twice the expert (and router) weights, but per token only the router's softmax grows.
    wide = replace(arch, experts=16)
    wider = plan(replace(base, arch=wide, params=wide.total_params))
    assert wider.per_gpu["weights"] - result.per_gpu["weights"] == \
        arch.layers * (arch.expert_params + arch.router_params) * 2
    per_token = (layer_activation_bytes(replace(base, arch=wide)) - layer_activation_bytes(base)) / 2048
    assert per_token == 4 * 8  # fp32 router probabilities of 8 more experts
    # Top-4 instead of top-2: activations grow by two experts' MLP per token.
    top4 = replace(arch, experts_per_token=4)
    assert layer_activation_bytes(replace(base, arch=top4)) > layer_activation_bytes(base) * 1.3


def test_qlora_of_moe_keeps_experts_16_bit_and_says_so():
    arch = BY_NAME["mixtral-8x7b"]
    result = plan(Setup(arch=arch, params=arch.total_params, method="qlora", stage=2, seq_len=1024))
    assert result.per_gpu["weights"] > arch.layers * arch.expert_params * 2
    assert result.per_gpu["weights"] < 100 * GiB
    assert any("experts stay in bfloat16" in n for n in result.notes)
