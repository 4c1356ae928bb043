"""Mixtures of experts (issue 37): finetune's family table against the installed transformers, DeepSpeed and peft;
the planner's counts and saved tensors of LoRA on the experts; the lint rules, one line each; the rendered leaf
classes; this year's models in the planner's table against their transformers classes (meta device)."""

from __future__ import annotations

import textwrap

import pytest

from finetune.builtin import ZOO
from finetune.models.families import DEEPSPEED_DEFAULT_LEAF_CLASSES, FAMILIES, family, family_by_name
from finetune.models.targets import PARAM_WRAPPER_RULES, LoraChoice, resolve
from finetune.plan import Setup, layer_activation_bytes, param_groups, plan
from finetune.plan.archs import BY_NAME, THIS_YEAR, arch_from_config

ZOO_OF = {c["model_type"]: n for n, c in ZOO.items()}


@pytest.fixture(scope="module")
def zoo_root(tmp_path_factory):
    from tests.train_fixtures import cache_dir

    return cache_dir(tmp_path_factory)


# ------------------------------------------------------------------------------------------------
# The family table is the libraries' truth


def test_deepspeed_default_leaf_classes_are_mirrored():
    from deepspeed.runtime.zero.leaf_module_config import DEFAULT_LEAF_MODULE_CLASSES

    assert list(DEEPSPEED_DEFAULT_LEAF_CLASSES) == DEFAULT_LEAF_MODULE_CLASSES


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_family_row_matches_transformers(model_type, zoo_root):
    """Each row against the real model class: its linears, sdpa support, sparse block class, fused experts (in
    declaration order), router and shared expert, and where save_pretrained puts the experts."""
    import importlib
    import json

    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from finetune.builtin import ensure_builtin_model

    fam = FAMILIES[model_type]
    name = ZOO_OF.get(model_type, "tiny-llama")
    path = ensure_builtin_model(f"builtin:{name}", zoo_root)
    assert json.loads((path / "config.json").read_text())["model_type"] == model_type
    from transformers import AutoConfig

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path)))
    assert type(model)._supports_sdpa == fam.sdpa
    modules = dict(model.named_modules())
    layer = "model.layers.0."
    for linear in fam.attention + (fam.shared_expert if fam.moe else fam.mlp):
        assert isinstance(modules[layer + ("self_attn." if linear in fam.attention else "mlp." * (not fam.moe))
                                  + linear], torch.nn.Linear), linear
    if not fam.moe:
        return
    module_path, _, cls = fam.moe_block.rpartition(".")
    assert type(modules[layer + "mlp"]) is getattr(importlib.import_module(module_path), cls)
    experts = [n for n, _ in modules[layer + fam.experts].named_parameters(recurse=False)]
    assert [n for n in experts if n in fam.expert_params] == list(fam.expert_params)
    assert hasattr(modules[layer + fam.router], "weight")
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    experts_on_disk = fam.checkpoint_path(layer + fam.experts)
    if fam.checkpoint_expert:
        assert {fam.checkpoint_expert.format(experts=experts_on_disk, e=0, proj=p)
                for p in fam.checkpoint_projections} <= keys
    else:
        assert {f"{experts_on_disk}.{p}" for p in fam.expert_params} <= keys
    assert fam.checkpoint_path(layer + fam.router) + ".weight" in keys


def test_param_wrapper_rules_are_peft_s_words(zoo_root):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from finetune.builtin import ensure_builtin_model

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(ensure_builtin_model("builtin:tiny-qwen3-moe", zoo_root)))
    for key, option in (("dropout", {"lora_dropout": 0.1}), ("dora", {"use_dora": True}), ("bias", {"lora_bias": True})):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        with pytest.raises(ValueError, match=PARAM_WRAPPER_RULES[key].replace(".", r"\.")):
            get_peft_model(model, LoraConfig(target_modules=["q_proj"], target_parameters=["mlp.experts.down_proj"],
                                             **option))


@pytest.mark.parametrize("hub_id,model_type", [("Qwen/Qwen3-30B-A3B-Instruct-2507", "qwen3_moe"),
                                               ("mistralai/Mixtral-8x7B-v0.1", "mixtral"),
                                               ("openai/gpt-oss-120b", "gpt_oss"),
                                               ("Qwen/Qwen1.5-MoE-A2.7B", "qwen2_moe"),
                                               ("Qwen/Qwen3-8B", "qwen3"), ("microsoft/phi-4", "phi3")])
def test_a_hub_id_names_its_family(hub_id, model_type):
    assert family_by_name(hub_id).model_type == model_type


def test_the_planner_table_and_the_families_agree():
    """Every mixture of experts in the planner's table is known by name to the families (render and lint, which
    cannot import the planner, find its leaf class and layout the same way)."""
    for arch in BY_NAME.values():
        if arch.experts:
            assert family_by_name(arch.name).model_type == arch.model_type, arch.name


# ------------------------------------------------------------------------------------------------
# The planner: exact counts, the expert stack kept for backward


def test_qwen3_30b_a3b_trainable_count_with_experts():
    """peft on the meta device, two layers of Qwen3-30B-A3B's exact widths (the 48 only repeat them, and peft
    takes ~10 s per 48 on this box): the planner counts each targeting as peft does; at 48 layers, r=16, LoRA on
    the experts and the router trains 996,507,648 parameters (issue 37, counted on the whole meta model)."""
    from dataclasses import replace

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    arch = BY_NAME["qwen3-30b-a3b"]
    two = replace(arch, layers=2)
    cfg = two.hf_config()
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    for experts, router in ((False, False), (True, False), (True, True)):
        targets = resolve(LoraChoice(r=16, alpha=32, target_experts=experts, target_router=router), family("qwen3_moe"))
        with torch.device("meta"):
            model = get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig(
                r=16, lora_alpha=32, lora_dropout=0.0, target_modules=list(targets.modules),
                target_parameters=list(targets.parameters) or None, rank_pattern=targets.rank_pattern,
                alpha_pattern=targets.alpha_pattern))
        counted = sum(p.numel() for p in model.parameters() if p.requires_grad)
        setup = Setup(arch=two, params=two.total_params, lora_r=16, lora_targets=targets.modules,
                      lora_experts=experts, lora_router=router)
        assert plan(setup).trainable == counted
    full = Setup(arch=arch, params=arch.total_params, lora_r=16, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"),
                 lora_experts=True, lora_router=True)
    assert plan(full).trainable == 996_507_648
    assert plan(replace(full, lora_experts=False, lora_router=False)).trainable == 13_369_344  # attention only


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_expert_lora_saved_tensors_match_the_plan(model_type):
    """What LoRA on the experts and the router, and the router logits kept for the auxiliary loss, add to one MoE
    layer's saved-for-backward bytes (2-layer minus 1-layer model, the base in bf16): the parametrized stack of
    expert weights, the experts' routed inputs, the router's, the fp32 logits; within 2% of the plan (measured
    apart, the logits were exact and the rest within 1%)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.plan.test_planner import saved_for_backward_bytes

    shape = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 vocab_size=512, num_experts_per_tok=2)
    shape.update(num_experts=8, moe_intermediate_size=40) if model_type == "qwen3_moe" else \
        shape.update(num_local_experts=8, intermediate_size=40)
    b, s = 2, 48

    def measure(layers: int, experts: bool, logits: bool) -> int:
        config = AutoConfig.for_model(model_type, **shape, num_hidden_layers=layers, output_router_logits=logits)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(torch.bfloat16).train()
        t = resolve(LoraChoice(r=4, alpha=8, target_experts=experts, target_router=experts), family(model_type))
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(t.modules),
                                                 target_parameters=list(t.parameters) or None,
                                                 rank_pattern=t.rank_pattern, alpha_pattern=t.alpha_pattern))
        torch.manual_seed(1)
        return saved_for_backward_bytes(model.to(torch.bfloat16), torch.randint(0, 512, (b, s)))

    arch = arch_from_config({"model_type": model_type, **shape, "num_hidden_layers": 2}, "tiny")
    base = Setup(arch=arch, params=arch.total_params, attn="eager", lora_r=4, lora_dropout=0.0, micro_batch=b,
                 seq_len=s, full_rows=True, gradient_checkpointing=False, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    plain, adapted = (measure(2, on, on) - measure(1, on, on) for on in (False, True))
    from dataclasses import replace

    planned = layer_activation_bytes(replace(base, lora_experts=True, lora_router=True, router_logits=True)) \
        - layer_activation_bytes(base)
    assert planned == pytest.approx(adapted - plain, rel=0.02)
    assert planned > arch.expert_params * 2  # the whole stack, in bf16


def test_zero3_fetches_a_leaf_block_whole():
    """With its sparse block a leaf, ZeRO-3's trace has the block as one unit, LoRA included: every expert, the
    router and their adapters gathered at once; without, the experts and the router are units of their own."""
    from dataclasses import replace

    from finetune.plan.zero3 import _module_trace

    arch = BY_NAME["qwen3-30b-a3b"]
    base = Setup(arch=arch, params=arch.total_params, stage=3, gpus_per_node=8, lora_experts=True, lora_router=True,
                 lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    groups = param_groups(base)
    block = sum(g.storage_numel for g in groups  # what is not persistent (small tensors stay whole on every rank)
                if g.unit.startswith(("router", "experts")) and g.storage_numel > base.param_persistence_threshold)
    leaf = {key: gathered for key, gathered, _, _ in _module_trace(replace(base, moe_leaf=True), groups)}
    assert leaf["0.mlp"] == block and "0.experts" not in leaf
    per_module = {key: gathered for key, gathered, _, _ in _module_trace(base, groups)}
    assert per_module["0.experts"] == arch.expert_params and per_module["0.mlp"] == 0


@pytest.mark.parametrize("arch", THIS_YEAR, ids=lambda a: a.name)
def test_this_year_table_matches_transformers(arch):
    """The named table's shapes build the real model class (meta device) with exactly the planned parameters."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = arch.hf_config()
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert model.num_parameters() == arch.total_params


# ------------------------------------------------------------------------------------------------
# Lint (torch-free) and render


def lint(tmp_path, text: str, name: str = "r.yaml"):
    from finetune.lint import LintOptions, lint_paths

    (tmp_path / "rows.jsonl").write_text('{"instruction": "a", "output": "b"}\n')
    (tmp_path / name).write_text(textwrap.dedent(text))
    return [(f.rule, f.severity, f.key) for f in lint_paths([tmp_path / name], LintOptions()).findings
            if f.rule.startswith("R16")]


@pytest.mark.parametrize("text,expected", [
    ("lora: {target_experts: true}", [("R160", "error", "lora.dropout")]),
    ("lora: {target_router: true, dropout: 0, dora: true, bias: all}",
     [("R160", "error", "lora.dora"), ("R160", "error", "lora.bias")]),
    ("lora: {target_modules: [q_proj, gate_proj]}", [("R162", "error", "lora.target_modules")]),
    ("lora: {target_experts: true, dropout: 0}\ndeepspeed: {stage: 3, overrides: {zero_optimization: "
     "{leaf_module: {classes: [Foo]}}}}",
     [("R164", "warning", "deepspeed.overrides.zero_optimization.leaf_module.classes"),
      ("R165", "warning", "deepspeed.overrides.zero_optimization.leaf_module.classes"),
      ("R166", "info", "deepspeed.stage")]),
    ("lora: {target_experts: true, dropout: 0}\ndeepspeed: {stage: 3}", [("R166", "info", "deepspeed.stage")]),
])
def test_moe_rules_fire_one_line_each(tmp_path, text, expected):
    base = 'model: {name_or_path: "builtin:tiny-qwen3-moe"}\ndata: {path: rows.jsonl, max_length: 64}\n'
    assert sorted(lint(tmp_path, base + text)) == sorted(expected)


def test_rules_on_dense_and_unknown_models(tmp_path):
    dense = 'model: {name_or_path: "builtin:tiny-llama"}\ndata: {path: rows.jsonl, max_length: 64}\n'
    assert lint(tmp_path, dense + "lora: {target_experts: true, dropout: 0}\nmoe: {experts_implementation: eager}") \
        == [("R161", "error", "lora.target_experts"), ("R167", "warning", "moe")]
    (tmp_path / "olmoe").mkdir()
    (tmp_path / "olmoe" / "config.json").write_text('{"model_type": "olmoe", "num_experts": 64}')
    unknown = "model: {name_or_path: ./olmoe}\ndata: {path: rows.jsonl}\n"
    assert lint(tmp_path, unknown, "u.yaml") == [("R163", "error", "lora.target_modules")]
    gpt_oss = 'data: {path: rows.jsonl, max_length: 64}\nmodel: {name_or_path: "builtin:tiny-gpt-oss"'
    assert lint(tmp_path, gpt_oss + "}\n", "g.yaml") == []  # left out: eager (finetune.models.attention)
    assert lint(tmp_path, gpt_oss + ", attn_implementation: sdpa}\n", "g.yaml") == \
        [("R168", "error", "model.attn_implementation")]


def test_zero3_renders_the_leaf_classes_of_a_moe_only():
    from finetune.recipe import Recipe
    from finetune.render import render_deepspeed

    def leaf(name: str, stage: int = 3):
        recipe = Recipe.model_validate({"model": {"name_or_path": name}, "data": {"path": "x"},
                                        "deepspeed": {"stage": stage}})
        return render_deepspeed(recipe)["zero_optimization"].get("leaf_module")

    assert leaf("builtin:tiny-gpt-oss") == {"classes": [*DEEPSPEED_DEFAULT_LEAF_CLASSES, FAMILIES["gpt_oss"].moe_block]}
    assert leaf("Qwen/Qwen3-30B-A3B") == {"classes": list(DEEPSPEED_DEFAULT_LEAF_CLASSES)}
    assert leaf("builtin:tiny-llama") is None and leaf("builtin:tiny-gpt-oss", stage=2) is None


def test_the_runner_refuses_what_lint_could_not_see():
    """A hub model lint could not read (R161, R163) is refused by the runner in one line when loaded."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.recipe import Recipe
    from finetune.train.moe import MoeError, peft_targets

    config = AutoConfig.for_model("olmoe", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=4, num_experts=4, num_experts_per_tok=2,
                                  vocab_size=64)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)

    def recipe(**lora):
        return Recipe.model_validate({"model": {"name_or_path": "org/m"}, "data": {"path": "x"}, "lora": lora})

    with pytest.raises(MoeError, match="`olmoe` is a mixture of experts finetune has no layout for"):
        peft_targets(recipe(), model)
    with pytest.raises(MoeError, match="no expert layout for model type `olmoe`"):
        peft_targets(recipe(target_experts=True, dropout=0), model)
    assert peft_targets(recipe(target_modules=["q_proj", "v_proj"]), model) == {"target_modules": ["q_proj", "v_proj"]}
