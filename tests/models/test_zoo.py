"""The zoo (issue 37): every family's tiny built-in model through the default recipe, in this process.

For each: the recipe lints and plans; finetune's loader and LoRA targets (finetune.models.targets) wrap the real
model; one forward and backward train every adapter; the planner's parameter and trainable counts equal the
model's and peft's; and the trained adapter, saved as peft saves it, merges (`finetune merge`) to exactly what
peft's merge_and_unload() gives. The mixtures of experts do it again with LoRA on their experts and router.
2-process runs of a few families (ZeRO-2 and 3, LoRA and full, convert, merge, chat) are the `full` tier:
tests/launches/test_zoo.py.
"""

from __future__ import annotations

import textwrap

import pytest

from finetune.builtin import ZOO

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

MOE = sorted(n for n, c in ZOO.items() if c["model_type"] in ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss"))
EXPERTS = "{target_experts: true, target_router: true, dropout: 0}"
NO_SDPA = ("gemma2", "gpt_oss")


@pytest.fixture(scope="module")
def zoo_root(tmp_path_factory):
    from tests.train_fixtures import cache_dir

    return cache_dir(tmp_path_factory)


def write_recipe(folder, name: str, lora: str = "{}", attn: str = "sdpa", dtype: str = "float32"):
    """The default recipe for the built-in `name` (float32, as recipes/tiny: bf16 matmuls are slow on a CPU)."""
    (folder / "rows.jsonl").write_text('{"instruction": "Add 2 and 3.", "output": "5"}\n')
    path = folder / f"{name}.yaml"
    path.write_text(textwrap.dedent(f"""\
        model: {{name_or_path: "builtin:{name}", attn_implementation: {attn}, dtype: {dtype}}}
        data: {{path: rows.jsonl, max_length: 64}}
        lora: {lora}
        """))
    return path


def lint_errors(path) -> list:
    from finetune.lint import LintOptions, lint_paths

    return [f for f in lint_paths([path], LintOptions()).findings if f.severity == "error"]


def default_attention(name: str, path) -> str:
    """sdpa, the recipe's default; Gemma 2 and gpt-oss are refused with it (R168, one line) and run eager."""
    errors = lint_errors(path)
    if ZOO[name]["model_type"] not in NO_SDPA:
        assert errors == []
        return "sdpa"
    assert [(f.rule, f.key) for f in errors] == [("R168", "model.attn_implementation")]
    return "eager"


def train_one_step(recipe, model_dir):
    """finetune's loader and LoRA, one forward and backward on a batch, one SGD step on the adapter."""
    from finetune.train.model import load_model, prepare_model

    model = prepare_model(load_model(recipe, str(model_dir)), recipe)
    torch.manual_seed(0)
    ids = torch.randint(7, 700, (2, 40))  # 40 tokens: past the zoo's 16-token sliding windows
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    trained = [p for p in model.parameters() if p.requires_grad]
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in trained)
    with torch.no_grad():
        for p in trained:
            p -= 0.5 * p.grad  # lora_B leaves zero: the merge below adds a real update
    return model, out


def check_merge(model, model_dir, tmp_path, dtype=None):
    """`finetune merge` of the saved adapter equals peft's merge_and_unload, tensor for tensor."""
    from finetune.weights.merge import merge
    from tests.weights.merge_fixtures import assert_same, peft_merged_state_dict
    from tests.weights.test_merge import load_dir

    adapter = tmp_path / "adapter"
    model.save_pretrained(str(adapter))
    merge(model_dir, adapter, tmp_path / "merged")
    assert_same(load_dir(tmp_path / "merged"), peft_merged_state_dict(model_dir, adapter, dtype))


@pytest.mark.parametrize("name", sorted(ZOO))
def test_default_recipe_lints_plans_trains_and_merges(name, zoo_root, tmp_path):
    from finetune.builtin import ensure_builtin_model
    from finetune.plan import plan_recipe
    from finetune.recipe import load_recipe

    model_dir = ensure_builtin_model(f"builtin:{name}", zoo_root)
    attn = default_attention(name, write_recipe(tmp_path, name))
    recipe = load_recipe(write_recipe(tmp_path, name, attn=attn)).recipe
    plan = plan_recipe(recipe, gpus=1)
    model, out = train_one_step(recipe, model_dir)
    base = model.get_base_model()
    assert sum(p.numel() for n, p in base.named_parameters() if "lora_" not in n) == plan.setup.arch.total_params
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == plan.trainable
    if name in MOE:
        # The router's auxiliary loss, on by default for every objective (finetune.train.moe): loss = LM + coef x aux.
        assert out.aux_loss is not None and base.config.output_router_logits  # identity: test_router_loss_...
    check_merge(model, model_dir, tmp_path)


@pytest.mark.parametrize("name", MOE)
def test_lora_on_experts_and_router_counts_and_merges(name, zoo_root, tmp_path):
    """LoRA on the fused experts and the router (peft's ParamWrapper), counted by the planner as peft counts it,
    and merged onto the checkpoint's per-expert tensors of a bf16 base as merge_and_unload rounds them."""
    from transformers import AutoModelForCausalLM

    from finetune.builtin import ensure_builtin_model
    from finetune.plan import plan_recipe
    from finetune.recipe import load_recipe

    model_dir = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(str(ensure_builtin_model(f"builtin:{name}", zoo_root)),
                                         dtype=torch.bfloat16).save_pretrained(str(model_dir))
    attn = "eager" if ZOO[name]["model_type"] in NO_SDPA else "sdpa"
    path = write_recipe(tmp_path, name, EXPERTS, attn)
    assert lint_errors(path) == []
    recipe = load_recipe(path).recipe
    plan = plan_recipe(recipe, gpus=1)
    model, _ = train_one_step(recipe, model_dir)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == plan.trainable
    config = model.peft_config["default"]
    assert set(config.target_parameters) >= {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    check_merge(model, model_dir, tmp_path, "bfloat16")


def test_router_loss_is_added_to_the_lm_loss(zoo_root):
    """output_router_logits and router_aux_loss_coef reach the model (`moe.router_aux_loss_coef`; null: the
    config's 0.001): its loss is the cross-entropy plus the weighted auxiliary loss, chunked or not."""
    from transformers import AutoModelForCausalLM

    from finetune.builtin import ensure_builtin_model
    from finetune.loss_kernel import use_chunked_loss
    from finetune.recipe import Recipe
    from finetune.train.moe import config_overrides

    model_dir = str(ensure_builtin_model("builtin:tiny-qwen3-moe", zoo_root))
    recipe = Recipe.model_validate({"model": {"name_or_path": "builtin:tiny-qwen3-moe"}, "data": {"path": "x"},
                                    "moe": {"router_aux_loss_coef": 0.5}})
    assert config_overrides(recipe, model_dir) == {"output_router_logits": True, "router_aux_loss_coef": 0.5}
    off = Recipe.model_validate({"model": {"name_or_path": "builtin:tiny-qwen3-moe"}, "data": {"path": "x"},
                                 "moe": {"router_aux_loss_coef": 0}})
    assert config_overrides(off, model_dir)["output_router_logits"] is False
    model = AutoModelForCausalLM.from_pretrained(model_dir, **config_overrides(recipe, model_dir)).train()
    ids = torch.randint(7, 700, (2, 24))
    out = model(input_ids=ids, labels=ids)
    lm = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert float(out.loss.detach()) == pytest.approx(float(lm.detach() + 0.5 * out.aux_loss.detach()), rel=1e-6)
    use_chunked_loss(model, 3)
    chunked = model(input_ids=ids, labels=ids)
    assert float(chunked.loss.detach()) == pytest.approx(float(out.loss.detach()), rel=1e-6)
    assert float(chunked.aux_loss.detach()) == float(out.aux_loss.detach())


@pytest.mark.parametrize("name_or_path, attn", [("builtin:tiny-gemma2", "eager"), ("builtin:tiny-gpt-oss", "eager"),
                                                ("google/gemma-2-9b", "eager"), ("openai/gpt-oss-20b", "eager"),
                                                ("builtin:tiny-gemma3", "sdpa"), ("builtin:tiny-llama", "sdpa")])
def test_the_default_attention_is_one_the_family_runs(tmp_path, name_or_path, attn):
    """Left out, model.attn_implementation is sdpa, or eager where transformers refuses sdpa (the default recipe
    trains every family); written out, sdpa stays and is R168's one line. Torch-free, as lint."""
    from finetune.cli.common import load_or_exit

    (tmp_path / "rows.jsonl").write_text('{"instruction": "Add 2 and 3.", "output": "5"}\n')
    path = tmp_path / "r.yaml"
    path.write_text(f'model: {{name_or_path: "{name_or_path}"}}\ndata: {{path: rows.jsonl, max_length: 64}}\n')
    assert load_or_exit(path, []).recipe.model.attn_implementation == attn  # what train, plan, render load
    assert [f.rule for f in lint_errors(path)] == []
    written = load_or_exit(path, ["model.attn_implementation=sdpa"])
    assert written.recipe.model.attn_implementation == "sdpa"
    from finetune.lint import LintOptions, lint_paths

    options = LintOptions(overrides=["model.attn_implementation=sdpa"])
    errors = [f.rule for f in lint_paths([path], options).findings if f.severity == "error"]
    assert errors == ([] if attn == "sdpa" else ["R168"])


@pytest.mark.parametrize("name", sorted(ZOO))
def test_a_row_padded_to_the_gpus_multiple_trains_the_same_in_every_family(name, zoo_root):
    """data.pad_to_multiple_of (auto: 64 on a GPU): a row padded at its end, unmasked for a dense model (no real
    token of a causal model attends to a later one, sliding windows and attention sinks included) and masked for
    a mixture of experts (the router's load-balancing loss counts the tokens it is given: unmasked, the four
    mixtures' losses differ), gives the family's model the loss and the gradients of the row as it is."""
    from transformers import AutoModelForCausalLM

    from finetune.builtin import ensure_builtin_model
    from finetune.data.packing import Collator
    from finetune.train.moe import moe_identity
    from tests.train_fixtures import trains_the_same

    model_dir = str(ensure_builtin_model(f"builtin:{name}", zoo_root))
    moe = moe_identity(model_dir) is not None
    extra = {"output_router_logits": True, "router_aux_loss_coef": 0.5} if moe else {}  # the router loss counted too
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **extra,
                                                 attn_implementation="eager" if ZOO[name]["model_type"] in NO_SDPA
                                                 else "sdpa").train()
    torch.manual_seed(0)
    ids = torch.randint(7, 700, (37,)).tolist()  # 37 tokens: past the zoo's 16-token sliding windows
    rows = [{"input_ids": ids, "labels": ids}]
    exact = Collator(0)(rows)
    padded = Collator(0, bucket=16, mask_padding=moe)(rows)
    assert padded["input_ids"].shape == (1, 48) and ("attention_mask" in padded) == moe
    trains_the_same(model, exact, padded)
