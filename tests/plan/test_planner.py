"""`finetune plan`: the memory model against DeepSpeed's own estimators, torch's real activation memory,
bitsandbytes' real quantization state and transformers' real models (DeepSpeed's real allocations, in a probe
process: tests/launches/test_plan_probe.py).

What cannot be measured here (no GPU): the CUDA context, NCCL's buffers and allocator fragmentation;
those are documented estimates in finetune/plan/.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from finetune.plan.archs import BUILTIN, BY_NAME, arch_from_config, match_hub_id
from finetune.plan import (
    DS_ALLGATHER_BUCKET_SIZE, DS_MAX_LIVE_PARAMETERS, DS_MAX_REUSE_DISTANCE, DS_PARAM_PERSISTENCE_THRESHOLD,
    DS_PARAM_SWAP_BUFFER_SIZE, DS_PARAM_SWAP_BUFFERS, DS_OPTIMIZER_SWAP_BUFFERS, DS_PREFETCH_BUCKET_SIZE,
    DS_REDUCE_BUCKET_SIZE, DS_SUB_GROUP_SIZE, GiB, PlanError, Setup, four_bit_bytes, largest_module_numel,
    layer_activation_bytes, param_groups, plan, plan_recipe, quant_constant_bytes, recommend, setup_from_recipe,
)
from finetune.recipe import load_recipe
from tests.conftest import MINIMAL, REPO, run_cli


def full_setup(arch, **kw):
    return Setup(arch=arch, params=arch.total_params if arch else kw.pop("params"), method="full", **kw)


# ----------------------------------------------------------------------------------------------
# Model states: DeepSpeed's estimators and the ZeRO paper


ESTIMATOR_CASES = [
    (name, gpus, nodes, stage, offload)
    for name in ("qwen2.5-0.5b", "llama-3-8b", "gemma-2-9b", "llama-2-70b")
    for gpus, nodes in ((1, 1), (2, 1), (8, 4))
    for stage, offload in ((2, "none"), (2, "cpu"), (3, "none"), (3, "cpu"), (3, "cpu+param"))
]


def test_estimator_cases_cover_twenty_combinations():
    assert len(ESTIMATOR_CASES) >= 20


@pytest.mark.parametrize("name,gpus,nodes,stage,offload", ESTIMATOR_CASES)
def test_model_states_equal_deepspeed_estimators(name, gpus, nodes, stage, offload):
    """model_states = what DeepSpeed's own estimate_zero{2,3}_model_states_mem_needs count (full fine-tune), on one
    GPU too (issue 35: ZeRO-3 there gathers nothing, but the estimator counts the largest module's copy and so
    does the plan). The estimators are plain arithmetic: no GPU needed."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    arch = BY_NAME[name]
    setup = full_setup(arch, stage=stage, gpus_per_node=gpus, nodes=nodes,
                       offload_optimizer="none" if offload == "none" else "cpu",
                       offload_param="cpu" if offload == "cpu+param" else "none",
                       param_persistence_threshold=10 * arch.hidden)
    ours = plan(setup).per_gpu["model_states"]
    if stage == 2:
        _, theirs = estimate_zero2_model_states_mem_needs(
            arch.total_params, num_gpus_per_node=gpus, num_nodes=nodes, cpu_offload=offload != "none")
    else:
        _, theirs, _ = estimate_zero3_model_states_mem_needs(
            arch.total_params, arch.largest_module_params, num_gpus_per_node=gpus, num_nodes=nodes,
            cpu_offload=offload != "none", cpu_offload_params=offload == "cpu+param")
    assert ours == pytest.approx(theirs, rel=0.01)


def test_plan_command_prints_deepspeeds_zero3_offload_figure_for_llama3_8b():
    """The issue-35 regression, as a user runs it: `finetune plan --model llama-3-8b --method full --zero 3
    --gpus 1 --offload-optimizer cpu` shows DeepSpeed's 16.91 GiB of model states, not 15.94."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from typer.testing import CliRunner

    from finetune.cli import app

    out = CliRunner().invoke(app, ["plan", "--model", "llama-3-8b", "--method", "full", "--zero", "3", "--gpus", "1",
                                   "--offload-optimizer", "cpu", "--format", "json"])
    assert out.exit_code == 0, out.output
    arch = BY_NAME["llama-3-8b"]
    _, theirs, _ = estimate_zero3_model_states_mem_needs(arch.total_params, arch.largest_module_params,
                                                         num_gpus_per_node=1, cpu_offload=True, cpu_offload_params=False)
    ours = json.loads(out.output)["per_gpu"]["model_states"]
    # within the norms' 0.5 MB, which stay whole (stage3_param_persistence_threshold) and count as buffers here
    assert ours == pytest.approx(theirs, rel=1e-4) and round(ours / 2**30, 2) == round(theirs / 2**30, 2) == 16.91


def test_zero_paper_figure_relates_to_deepspeeds_accounting():
    """ZeRO paper, 7.5B parameters on 64 GPUs: 120 / 31.4 / 16.6 / 1.9 GB, from 2 + 2 + 12 bytes per
    parameter (16-bit weights, 16-bit gradients, fp32 master + Adam moments).

    DeepSpeed's code (and its estimators) also builds an fp32 copy of the gradient partition for the
    optimizer step: 4 more bytes per parameter, divided like the optimizer states (by 64 with ZeRO, not
    at all without it). Its ZeRO-3 estimator counts 18/N bytes (2 + 4 + 4 + 8) and leaves out the
    16-bit gradient partition (stage3.py grad_partitions_flat_buffer), which the planner lists with the
    buffers. Take those two differences away and the planner reproduces the paper.
    """
    psi = 7_500_000_000
    paper = {0: 120, 1: 31.4, 2: 16.6, 3: 1.9}
    for stage, expected_gb in paper.items():
        result = plan(Setup(arch=None, params=psi, method="full", stage=stage, gpus_per_node=8, nodes=8))
        fp32_grads = sum(t.bytes for t in result.terms if t.field == "gradients" and "fp32" in t.name)
        assert fp32_grads == pytest.approx(4 * psi / (1 if stage == 0 else 64), rel=1e-6)
        grad16_buffer = sum(t.bytes for t in result.terms if t.name.startswith("contiguous gradient partition"))
        assert grad16_buffer == (pytest.approx(2 * psi / 64) if stage == 3 else 0)
        paper_view = result.per_gpu["model_states"] - fp32_grads + grad16_buffer
        assert paper_view / 1e9 == pytest.approx(expected_gb, abs=0.05)
    # ZeRO-2 as DeepSpeed counts it: 2 + 18/64 bytes per parameter = 17.1 GB, not 16.6.
    z2 = plan(Setup(arch=None, params=psi, method="full", stage=2, gpus_per_node=8, nodes=8))
    assert z2.per_gpu["model_states"] / 1e9 == pytest.approx(17.11, abs=0.01)


def test_lora_counts_only_the_adapter_as_trainable():
    """The QLoRA 8B run in CONTEXT.md: 167,772,160 trainable parameters is r=64 on all linear layers."""
    arch = BY_NAME["llama-3-8b"]
    result = plan(Setup(arch=arch, params=arch.total_params, method="qlora", lora_r=64, stage=2, gpus_per_node=2))
    assert result.trainable == 167_772_160
    grads = result.per_gpu["gradients"]
    # ZeRO-2 on 2 GPUs: 16-bit (2) + fp32 (4) gradient partitions of the adapter only.
    assert grads == pytest.approx(6 * 167_772_160 / 2, rel=1e-6)


# ----------------------------------------------------------------------------------------------
# Parameters and shapes against transformers and bitsandbytes


@pytest.mark.parametrize("name", ["llama-2-13b", "llama-3-8b", "qwen2.5-0.5b", "qwen2.5-7b", "mistral-7b-v0.3",
                                  "gemma-2-2b"])
def test_parameter_counts_match_transformers(name):
    """Total and largest-module parameters equal a real transformers model built from the table (meta device)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    arch = BY_NAME[name]
    cfg = arch.hf_config()
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert model.num_parameters() == arch.total_params
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    assert largest == arch.largest_module_params
    assert largest_module_numel(param_groups(full_setup(arch))) == largest


def test_lora_trainable_count_matches_peft():
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=300, tie_word_embeddings=True)
    arch = arch_from_config({**cfg, "model_type": "qwen2"}, "tiny")
    for targets in (["q_proj", "v_proj"], "all-linear"):
        torch.manual_seed(0)
        model = get_peft_model(Qwen2ForCausalLM(Qwen2Config(**cfg)),
                               LoraConfig(r=8, target_modules=targets, modules_to_save=["lm_head"]))
        expected = sum(p.numel() for p in model.parameters() if p.requires_grad)
        names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj") \
            if targets == "all-linear" else tuple(targets)
        setup = Setup(arch=arch, params=arch.total_params, method="lora", lora_r=8, lora_targets=names,
                      modules_to_save=("lm_head",))
        assert plan(setup).trainable == expected


def test_quantization_state_bytes_match_bitsandbytes():
    """NF4 storage and quantization constants, with and without double quantization, as bitsandbytes stores them."""
    import bitsandbytes.functional as bnbf
    import torch

    weight = torch.randn(300, 1024, dtype=torch.bfloat16)
    for double in (True, False):
        packed, state = bnbf.quantize_4bit(weight, quant_type="nf4", compress_statistics=double)
        constants = [state.absmax, state.code] + ([state.offset, state.state2.absmax, state.state2.code] if double else [])
        assert packed.numel() * packed.element_size() == four_bit_bytes(weight.numel())
        assert sum(t.numel() * t.element_size() for t in constants) == quant_constant_bytes(weight.numel(), double)


# ----------------------------------------------------------------------------------------------
# Activations and logits against torch on CPU


TINY = dict(hidden_size=64, intermediate_size=176, num_attention_heads=4, num_key_value_heads=2)


def tiny_model(cfg, attn, method, r=8, dropout=0.0, ckpt=False):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**cfg, attn_implementation=attn, max_position_embeddings=512))
    model = model.to(torch.bfloat16).train()
    if ckpt:
        from finetune.train.model import enable_checkpointing
        enable_checkpointing(model)
    if method == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=r, lora_alpha=16, lora_dropout=dropout, target_modules="all-linear"))
        model.to(torch.bfloat16)
    return model


def saved_for_backward_bytes(model, ids) -> int:
    """Bytes of distinct non-parameter storages autograd saves during forward."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    return sum(seen.values())


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("method,dropout", [("full", 0.0), ("lora", 0.0), ("lora", 0.1)])
def test_layer_activations_equal_saved_tensors(attn, method, dropout):
    """One decoder layer's saved-for-backward bytes (difference of a 2- and a 1-layer model) match exactly."""
    import torch

    b, s = 2, 48
    measured = []
    for layers in (1, 2):
        model = tiny_model({**TINY, "vocab_size": 512, "num_hidden_layers": layers}, attn, method, dropout=dropout)
        torch.manual_seed(1)
        measured.append(saved_for_backward_bytes(model, torch.randint(0, 512, (b, s))))
    arch = arch_from_config({**TINY, "vocab_size": 512, "num_hidden_layers": 2, "model_type": "llama"}, "tiny")
    setup = Setup(arch=arch, params=arch.total_params, method=method, attn=attn, lora_r=8, lora_dropout=dropout,
                  micro_batch=b, seq_len=s, full_rows=True, gradient_checkpointing=False)
    predicted = layer_activation_bytes(setup)
    if dropout:
        # CUDA's fused dropout keeps a 1-byte bool mask (what the planner counts); CPU's dropout
        # multiplies by a mask in the activation dtype (2 bytes): one more byte per element.
        widths = 6 * arch.hidden + arch.intermediate  # q, k, v, o, gate, up inputs + down's input
        predicted += b * s * widths
    assert measured[1] - measured[0] == predicted


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_fp32_adapters_under_the_trainers_autocast_save_16_bit_inputs(dropout):
    """Without DeepSpeed peft keeps the adapters in fp32 and the Trainer runs forward under autocast: lora_A's
    F.linear casts peft's fp32 copy of its input back to 16 bits and saves that cast (and its 16-bit output),
    not the fp32 copy. One layer's saved bytes match the plan exactly (dropout as CUDA runs it: a bool mask)."""
    import torch
    from peft import LoraConfig, get_peft_model

    from finetune.plan.trace.step import cuda_paths

    b, s = 2, 48
    measured = []
    for layers in (1, 2):
        model = tiny_model({**TINY, "vocab_size": 512, "num_hidden_layers": layers}, "sdpa", "full")
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=dropout, target_modules="all-linear"))
        assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
        torch.manual_seed(1)
        with cuda_paths(), torch.autocast("cpu", dtype=torch.bfloat16):
            measured.append(saved_for_backward_bytes(model, torch.randint(0, 512, (b, s))))
    arch = arch_from_config({**TINY, "vocab_size": 512, "num_hidden_layers": 2, "model_type": "llama"}, "tiny")
    setup = Setup(arch=arch, params=arch.total_params, method="lora", lora_r=8, lora_dropout=dropout, deepspeed=False,
                  micro_batch=b, seq_len=s, full_rows=True, gradient_checkpointing=False)
    assert setup.trainer_autocast
    assert measured[1] - measured[0] == layer_activation_bytes(setup)


class LiveBytes:
    """Peak bytes of live tensor storages created by torch ops (forward and backward), parameters excluded."""

    def __init__(self, exclude):
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                outer.sweep()
                out = func(*args, **(kwargs or {}))
                outer.track(out)
                return out

        self.mode = Mode()
        self.exclude = exclude
        self.refs: dict[int, tuple] = {}
        self.current = 0
        self.peak = 0

    def sweep(self):
        for key in [k for k, (ref, _) in self.refs.items() if ref.expired()]:
            self.current -= self.refs.pop(key)[1]

    def track(self, out):
        import torch
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._pytree import tree_flatten

        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key in self.exclude or key in self.refs or storage.nbytes() == 0:
                    continue
                self.refs[key] = (StorageWeakRef(storage), storage.nbytes())
                self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.parametrize("dims", [
    (dict(TINY, vocab_size=512), 2, 48),  # loss buffers dominate
    (dict(hidden_size=128, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2, vocab_size=64), 2, 64),
    (dict(TINY, vocab_size=4096), 1, 128),  # a large vocabulary
])
def test_activation_and_logit_peak_matches_torch(attn, ckpt, dims):
    """activations + logits = the peak of memory torch allocates in forward + backward (LoRA, 3 layers)."""
    import torch

    cfg, b, s = dims
    cfg = {**cfg, "num_hidden_layers": 3}
    model = tiny_model(cfg, attn, "lora", ckpt=ckpt)
    torch.manual_seed(1)
    ids = torch.randint(0, cfg["vocab_size"], (b, s))
    live = LiveBytes({p.untyped_storage().data_ptr() for p in model.parameters()})
    with live.mode:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    arch = arch_from_config({**cfg, "model_type": "llama"}, "tiny")
    result = plan(Setup(arch=arch, params=arch.total_params, method="lora", attn=attn, lora_r=8, lora_dropout=0.0,
                        micro_batch=b, seq_len=s, full_rows=True, gradient_checkpointing=ckpt))
    predicted = result.per_gpu["activations"] + result.per_gpu["logits"]
    assert predicted == pytest.approx(live.peak, rel=0.03)


def test_one_row_with_the_collators_all_ones_mask_is_planned_as_no_mask():
    """What Setup.full_rows stands on: transformers drops an all-ones mask for sdpa (is_causal, key/value heads not
    repeated), so the collator's mask of one unpadded row costs nothing; one padded position brings the 4D mask,
    sdpa's copy of it per layer and the repeated heads back, and the plan of a padded batch counts them."""
    import torch

    cfg = {**TINY, "vocab_size": 128, "num_hidden_layers": 3}
    s = 64

    def peak(mask):
        model = tiny_model(cfg, "sdpa", "lora")
        ids = torch.randint(0, cfg["vocab_size"], (1, s), generator=torch.Generator().manual_seed(1))
        live = LiveBytes({p.untyped_storage().data_ptr() for p in model.parameters()})
        with live.mode:
            model(input_ids=ids, labels=ids, attention_mask=mask).loss.backward()
        return live.peak

    padded = torch.ones((1, s), dtype=torch.long)
    padded[0, -1] = 0
    unmasked, ones, one_pad = peak(None), peak(torch.ones((1, s), dtype=torch.long)), peak(padded)
    assert ones == unmasked < one_pad
    arch = arch_from_config({**cfg, "model_type": "llama"}, "tiny")
    planned = {full: plan(Setup(arch=arch, params=arch.total_params, method="lora", attn="sdpa", lora_r=8,
                                lora_dropout=0.0, seq_len=s, full_rows=full, gradient_checkpointing=False))
               for full in (True, False)}
    # The mask, its per-layer copy and the repeated heads: 52 KiB here; the CPU kernels keep 12 KiB more.
    assert 0.75 * (one_pad - unmasked) <= planned[False].per_gpu["activations"] - planned[True].per_gpu["activations"] \
        <= one_pad - unmasked


def test_logits_dominate_for_large_vocabularies():
    """Llama-3's 128k vocabulary: the loss buffers of 2 x 1024 tokens are 2.9 GiB, more than the
    checkpointed activations of all 32 layers."""
    arch = BY_NAME["llama-3-8b"]
    result = plan(Setup(arch=arch, params=arch.total_params, method="qlora", micro_batch=2, seq_len=1024))
    assert result.per_gpu["logits"] == 2 * 1024 * 128256 * 12
    assert result.per_gpu["logits"] > 5 * result.per_gpu["activations"]


# ----------------------------------------------------------------------------------------------
# DeepSpeed: config defaults (what it really allocates: tests/launches/test_plan_probe.py)


def test_deepspeed_defaults_are_the_planners():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig, DeepSpeedZeroOffloadParamConfig

    zero = DeepSpeedZeroConfig()
    assert zero.reduce_bucket_size == DS_REDUCE_BUCKET_SIZE
    assert zero.allgather_bucket_size == DS_ALLGATHER_BUCKET_SIZE
    assert zero.prefetch_bucket_size == DS_PREFETCH_BUCKET_SIZE
    assert zero.param_persistence_threshold == DS_PARAM_PERSISTENCE_THRESHOLD
    assert zero.max_live_parameters == DS_MAX_LIVE_PARAMETERS
    assert zero.max_reuse_distance == DS_MAX_REUSE_DISTANCE
    assert zero.sub_group_size == DS_SUB_GROUP_SIZE
    assert zero.contiguous_gradients is True
    # overlap_comm defaults to True for ZeRO-3 only (the planner's Setup.overlap).
    assert DeepSpeedZeroConfig(stage=3).overlap_comm is True and DeepSpeedZeroConfig(stage=2).overlap_comm is False
    assert Setup(arch=None, params=1, stage=3).overlap and not Setup(arch=None, params=1, stage=2).overlap
    param = DeepSpeedZeroOffloadParamConfig()
    assert (param.buffer_count, param.buffer_size) == (DS_PARAM_SWAP_BUFFERS, DS_PARAM_SWAP_BUFFER_SIZE)
    assert DeepSpeedZeroOffloadOptimizerConfig().buffer_count == DS_OPTIMIZER_SWAP_BUFFERS


def test_auto_buckets_are_what_transformers_fills_in(write_recipe):
    """reduce_bucket_size "auto" = hidden^2, stage3 prefetch 0.9 x hidden^2, persistence 10 x hidden:
    the values transformers' DeepSpeed integration writes into the rendered config."""
    from types import SimpleNamespace

    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    from finetune.render import render_deepspeed

    recipe = load_recipe(write_recipe(MINIMAL.replace("org/some-model", "Qwen/Qwen2.5-7B-Instruct")
                                      + "deepspeed:\n  stage: 3\n"), []).recipe
    hf = HfTrainerDeepSpeedConfig(render_deepspeed(recipe, 2))
    model = SimpleNamespace(config=SimpleNamespace(hidden_size=BY_NAME["qwen2.5-7b"].hidden))
    hf.trainer_config_finalize(SimpleNamespace(get_warmup_steps=lambda steps: 0), model, 100)
    zero = hf.config["zero_optimization"]
    setup = setup_from_recipe(recipe, gpus=2)
    assert setup.reduce_bucket_size == zero["reduce_bucket_size"] == 3584 ** 2
    assert setup.prefetch_bucket_size == zero["stage3_prefetch_bucket_size"]
    assert setup.param_persistence_threshold == zero["stage3_param_persistence_threshold"]


# ----------------------------------------------------------------------------------------------
# Model resolution, recipes, the command line


@pytest.mark.parametrize("hub_id,name", [
    ("meta-llama/Meta-Llama-3-8B-Instruct", "llama-3-8b"),
    ("meta-llama/Llama-3.1-70B-Instruct", "llama-3.1-70b"),
    ("meta-llama/Llama-2-7b-chat-hf", "llama-2-7b"),
    ("meta-llama/Llama-2-70b-hf", "llama-2-70b"),
    ("Qwen/Qwen2.5-0.5B-Instruct", "qwen2.5-0.5b"),
    ("Qwen/Qwen2.5-32B", "qwen2.5-32b"),
    ("Qwen/Qwen2.5-3B", "qwen2.5-3b"),
    ("mistralai/Mistral-7B-Instruct-v0.2", "mistral-7b"),
    ("mistralai/Mistral-7B-v0.3", "mistral-7b-v0.3"),
    ("google/gemma-2-27b-it", "gemma-2-27b"),
    ("google/gemma-2-2b", "gemma-2-2b"),
    ("llama-3-8b", "llama-3-8b"),
])
def test_hub_ids_match_the_table(hub_id, name):
    assert match_hub_id(hub_id).name == name


@pytest.mark.parametrize("hub_id", ["org/some-model", "meta-llama/Llama-4-Scout", "Qwen/Qwen2.5-70B"])
def test_unknown_hub_ids_do_not_match(hub_id):
    assert match_hub_id(hub_id) is None


def test_table_is_complete():
    wanted = {"llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3-8b", "llama-3-70b", "llama-3.1-8b",
              "llama-3.1-70b", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "qwen2.5-14b",
              "qwen2.5-32b", "qwen2.5-72b", "mistral-7b", "gemma-2-2b", "gemma-2-9b", "gemma-2-27b"}
    assert wanted <= {a.name for a in BUILTIN}


def test_plan_recipe_interface_for_the_linter(write_recipe):
    recipe = load_recipe(write_recipe(MINIMAL.replace("org/some-model", "meta-llama/Meta-Llama-3-8B-Instruct")
                                      + "method: qlora\ndeepspeed:\n  stage: 2\n"), []).recipe
    roomy = plan_recipe(recipe, gpus=2, gpu_memory_bytes=80 * GiB)
    tight = plan_recipe(recipe, gpus=2, gpu_memory_bytes=6 * GiB)
    unknown = plan_recipe(recipe, gpus=2, gpu_memory_bytes=None)
    assert (roomy.fits, tight.fits, unknown.fits) == (True, False, None)
    assert set(roomy.per_gpu) == {"weights", "gradients", "optimizer", "model_states", "buffers", "activations",
                                  "logits", "overhead", "total"}
    assert all(isinstance(v, int) for v in roomy.per_gpu.values())
    assert "\n" not in tight.summary() and "over" in tight.summary() and "weights" in tight.summary()
    with pytest.raises(PlanError, match="--model"):
        plan_recipe(load_recipe(write_recipe(MINIMAL), []).recipe, gpus=1, gpu_memory_bytes=GiB)


def test_recipe_hardware_and_local_config(write_recipe, tmp_path):
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({**BY_NAME["qwen2.5-1.5b"].hf_config(), "model_type": "qwen2"}))
    recipe = load_recipe(write_recipe("""\
        model: {name_or_path: ./my-model}
        method: lora
        data: {path: data.jsonl}
        hardware: {gpus: 2, gpu_memory: 12GiB, cpu_memory: 64GiB}
        """), []).recipe
    result = plan_recipe(recipe)
    assert result.setup.world == 2 and result.setup.gpu_memory == 12 * GiB and result.setup.cpu_memory == 64 * GiB
    assert result.setup.params == BY_NAME["qwen2.5-1.5b"].total_params
    assert result.fits is True


def test_every_shipped_recipe_plans():
    for path in sorted((REPO / "recipes").rglob("*.yaml")):
        recipe = load_recipe(path, []).recipe
        result = plan_recipe(recipe)
        assert result.per_gpu["total"] > 0, path
        assert result.fits is not False, (path, result.summary())


def test_cli_recipe_text_and_json():
    text = run_cli("plan", "recipes/llama3/8b_qlora_2x12gb.yaml")
    assert text.returncode == 0, text.stderr
    assert "per GPU" in text.stdout and "fits" in text.stdout and "loss working set" in text.stdout
    out = run_cli("plan", "recipes/llama3/8b_qlora_2x12gb.yaml", "--format", "json", "--set", "deepspeed.stage=2")
    data = json.loads(out.stdout)
    assert set(data["per_gpu"]) >= {"weights", "gradients", "optimizer", "model_states", "buffers", "activations",
                                     "logits", "overhead", "total"}
    assert data["setup"]["zero"] == 2 and data["fits"] in (True, False) and "total" in data["cpu"]


def test_cli_what_ifs():
    out = run_cli("plan", "--model", "llama-3-8b", "--method", "qlora", "--lora-r", "64", "--zero", "2",
                  "--gpus", "2", "--gpu-memory", "12GiB", "--micro-batch", "1", "--seq-len", "512",
                  "--no-gradient-checkpointing", "--lora-targets", "q_proj,v_proj", "--format", "json")
    data = json.loads(out.stdout)
    assert data["setup"]["gradient_checkpointing"] is False and data["setup"]["seq_len"] == 512
    assert data["trainable_params"] == 32 * 64 * (4096 + 4096 + 4096 + 1024)
    count = json.loads(run_cli("plan", "--model", "7.5B", "--method", "full", "--zero", "3", "--gpus", "8",
                               "--nodes", "8", "--format", "json").stdout)
    assert count["complete"] is False and count["per_gpu"]["activations"] == 0 and count["fits"] is None
    none = json.loads(run_cli("plan", "--model", "qwen2.5-0.5b", "--zero", "none", "--format", "json").stdout)
    assert none["setup"]["deepspeed"] is False and none["per_gpu"]["buffers"] == 0


@pytest.mark.parametrize("args,code,message", [
    (["--model", "org/unknown-model"], 1, "--model"),
    (["--model", "llama-3-8b", "--gpu-memory", "lots"], 2, "--gpu-memory"),
    (["--model", "llama-3-8b", "--zero", "4"], 1, "--zero"),
    (["--model", "llama-3-8b", "--method", "dora"], 1, "method"),
    (["--model", "llama-3-8b", "--recommend"], 1, "--gpu-memory"),
    ([], 1, "--model is required"),
    (["--model", "llama-3-8b", "--format", "yaml"], 2, "--format"),
])
def test_cli_errors_are_one_line(args, code, message):
    out = run_cli("plan", *args)
    assert out.returncode == code
    assert message in out.stderr and "Traceback" not in out.stderr


def test_cli_never_imports_torch_and_is_fast():
    cmd = [sys.executable, "-X", "importtime", "-m", "finetune.cli", "plan", "recipes/llama3/8b_qlora_2x12gb.yaml",
           "--recommend"]
    start = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=60)
    elapsed = time.perf_counter() - start
    assert out.returncode == 0, out.stderr[-2000:]
    heavy = [line for line in out.stderr.splitlines()
             if line.rstrip().split("|")[-1].strip().split(".")[0] in ("torch", "deepspeed", "transformers")]
    assert heavy == []
    assert elapsed < 2.0  # well under a second on a quiet machine; headroom for a busy CI box


# ----------------------------------------------------------------------------------------------
# The puzzles of CONTEXT.md (the numbers docs/plan.md shows)


def qlora_setup(name, **kw):
    arch = BY_NAME[name]
    base = dict(arch=arch, params=arch.total_params, method="qlora", lora_r=64, micro_batch=1, seq_len=512)
    base.update(kw)
    return Setup(**base)


def test_zero2_gradient_partition_is_made_after_the_loss_buffers():
    """DeepSpeed allocates ZeRO-2's 16-bit gradient partition at the first gradient and frees it with the step
    (states.backward_gradients): with one micro batch per step the loss buffers at backward's start never
    meet it (the allocated counter), its cached block does (the reserved one), and backward's own peak, once the
    loss buffers are gone, has it. With accumulation it stays alive across the micro batches. The H200's full
    fine-tune at 8,192 tokens, ZeRO-2 on one GPU, measured 41.31 GiB allocated; planned 41.33 (docs/plan.md)."""
    arch = BY_NAME["llama-3.2-1b"]
    base = dict(deepspeed=True, stage=2, seq_len=8192, gradient_checkpointing=False, full_rows=True, attn="sdpa",
                reduce_bucket_size=arch.hidden ** 2, gpu_type="NVIDIA H200")
    one, accumulated = (plan(full_setup(arch, gradient_accumulation=n, **base)) for n in (1, 2))
    partition = {t.name: t for t in one.terms}["16-bit gradient partition 1/1"]
    assert partition.phase == "step" and partition.remade and partition.bytes == arch.total_params * 2
    assert {t.name: t for t in accumulated.terms}["16-bit gradient partition 1/1"].phase == "both"
    assert one.peak_phase == "backward"
    assert one.memory_views["allocated"] / GiB == pytest.approx(41.31, rel=0.01)
    cached = {t.name: t for t in one.terms}["cached gradient blocks"]
    assert cached.bytes == partition.bytes and cached.counter == "reserved" and cached.phase == "backward"
    # Where the loss is chunked, backward's own peak (the gradients made so far beside a layer's backward) holds
    # the partition: it is not lost from the backward phase.
    chunked = plan(full_setup(arch, loss_kernel="chunked", gradient_checkpointing=True,
                              **{k: v for k, v in base.items() if k != "gradient_checkpointing"}))
    raised = {t.name: t for t in chunked.terms}["gradients at backward's own peak"]
    assert raised.bytes > 0 and raised.field == "buffers"


def test_zero0_gradients_are_made_after_the_loss_buffers():
    """Without ZeRO, DeepSpeed's step ends with the wrapper's zero_grad(set_to_none=True) (engine._take_model_step):
    with one micro batch per step the 16-bit gradients are not alive beside the loss at backward's start. The H200's
    full fine-tune of the Llama-3.2-1B shape at 4 x 2,048 tokens (torch's fused AdamW, checkpointing) measured
    28.56 GiB allocated, its 16-bit gradients (2.30 GiB) below the plan that counted them there (docs/plan.md,
    "Tenth pass"); at 1 x 2,048 the step, which has them, is the peak (23.08 measured)."""
    arch = BY_NAME["llama-3.2-1b"]
    kw = dict(deepspeed=True, stage=0, seq_len=2048, full_rows=True, ds_fused_adam=False, gpu_type="NVIDIA H200")
    four, one, accumulated = (plan(full_setup(arch, micro_batch=m, gradient_accumulation=g, **kw))
                              for m, g in ((4, 1), (1, 1), (4, 2)))
    grads = {t.name: t for t in four.terms}["16-bit gradients"]
    assert grads.phase == "step" and grads.remade and grads.bytes == arch.total_params * 2
    assert {t.name: t for t in accumulated.terms}["16-bit gradients"].phase == "both"
    assert four.peak_phase == "backward" and one.peak_phase == "step"
    assert four.memory_views["allocated"] / GiB == pytest.approx(28.56, rel=0.01)
    assert one.memory_views["allocated"] / GiB == pytest.approx(23.08, rel=0.01)
    assert {t.name: t for t in four.terms}["cached gradient blocks"].bytes == grads.bytes


def test_the_dequantized_4bit_weight_is_held_by_a_running_layer_not_beside_the_loss():
    """bitsandbytes dequantizes a 4-bit weight while its layer runs; no quantized layer runs beside the loss's buffers
    (the output head is not quantized), so the copy counts at backward's own peak, in a layer. The H200's Q-LoRA
    rows (Llama-3.2-1B shape, 1 x 2,048 with ZeRO-0 and 8,192 without DeepSpeed) were each 0.03 GiB, its gate_proj,
    under the plan that counted it beside the loss (docs/plan.md, "Tenth pass")."""
    from dataclasses import replace

    from finetune.plan.params import param_groups
    from finetune.plan.states import dequantized_weight_bytes

    arch = BY_NAME["llama-3.2-1b"]
    setup = Setup(arch=arch, params=arch.total_params, method="qlora", lora_r=16, lora_dropout=0.0, micro_batch=1,
                  seq_len=2048, deepspeed=True, stage=0, ds_fused_adam=False, full_rows=True, attn="sdpa",
                  gpu_type="NVIDIA H200")
    copy = dequantized_weight_bytes(setup, param_groups(setup))
    assert copy >= arch.hidden * arch.intermediate * 2  # gate_proj, 16-bit (+ its fp32 absmax)
    default = plan(setup)
    assert {t.name: t for t in default.terms}["dequantized 4-bit weight"].bytes == 0  # the loss's moment is higher
    assert default.memory_views["allocated"] / GiB == pytest.approx(4.243, rel=0.005)
    # With the chunked loss, backward's own peak (a layer's recompute and its gradients) is the higher one: there
    # the copy adds its bytes.
    chunked = plan(replace(setup, loss_kernel="chunked", seq_len=8192))
    terms = {t.name: t for t in chunked.terms}
    assert terms["layer recompute + gradients"].bytes > 0 and terms["dequantized 4-bit weight"].bytes == copy


def test_backward_own_peak_sums_its_parts_once_with_a_tiled_mlp():
    """Backward's own peak beyond the loss buffers is the recomputed layer (less what TiledMLP slices away), the
    gradients made so far and the running layer's dequantized weight, together: the three terms that carry it add
    up to that, whatever shrinks one of them."""
    from finetune.plan.activations import backward_working_bytes, layer_activation_bytes
    from finetune.plan.loss import loss_working_set
    from finetune.plan.params import param_groups
    from finetune.plan.parallel import tiled_mlp_saving
    from finetune.plan.states import backward_gradients, dequantized_weight_bytes

    arch = BY_NAME["llama-3-8b"]
    for shards in (1, 16):
        setup = Setup(arch=arch, params=arch.total_params, method="qlora", micro_batch=1, seq_len=16384,
                      deepspeed=True, stage=2, loss_kernel="chunked", tiled_mlp_shards=shards)
        terms = {t.name: t.bytes for t in plan(setup).terms}
        groups = param_groups(setup)
        trainable = sum(g.total for g in groups if g.trainable)
        beyond = max(0, backward_working_bytes(setup, layer_activation_bytes(setup)) - tiled_mlp_saving(setup)
                     + backward_gradients(setup, trainable) + dequantized_weight_bytes(setup, groups)
                     - loss_working_set(setup)[0])
        parts = (terms["layer recompute + gradients"] + terms["gradients at backward's own peak"]
                 + terms["dequantized 4-bit weight"])
        assert beyond > 0 and parts == beyond, shards
        assert (tiled_mlp_saving(setup) > 0) == (shards > 1)


def test_zero0_over_a_non_deepspeed_optimizer_flattens_nothing(tmp_path):
    """ZeRO-0 over 16-bit weights wraps DeepSpeed's own FusedAdam in FP16_Optimizer (the fp32 gradients flattened: a
    second fp32 copy in the step) and any other optimizer in FP16_UnfusedOptimizer (one fp32 gradient per tensor).
    The H200's full fine-tune of the Llama-3.2-1B shape with torch's fused AdamW (torch_adam) at 2,048 tokens measured
    23.08 GiB; the H100's with FusedAdam 27.68 (both in tests/data/plan_corpus.json)."""
    arch = BY_NAME["llama-3.2-1b"]
    kw = dict(deepspeed=True, stage=0, seq_len=2048, full_rows=True, gpu_type="NVIDIA H200")
    fused, unfused = (plan(full_setup(arch, ds_fused_adam=f, **kw)) for f in (True, False))
    names = {t.name for t in unfused.terms}
    assert "fp32 grad copies (flatten)" in {t.name for t in fused.terms} and "fp32 grad copies (flatten)" not in names
    assert fused.memory_views["allocated"] - unfused.memory_views["allocated"] == arch.total_params * 4
    assert unfused.memory_views["allocated"] / GiB == pytest.approx(23.08, rel=0.01)
    # What the recipe says: torch's fused AdamW (finetune.render.with_torch_adam) unless the overrides write
    # `torch_adam: false` (or the Trainer's optimizer, with no block)
    def setup(extra: str):
        path = tmp_path / "r.yaml"
        path.write_text("model: {name_or_path: meta-llama/Llama-3.2-1B}\ndata: {path: x.jsonl}\nmethod: full\n" + extra)
        return setup_from_recipe(load_recipe(path).recipe)
    assert not setup("deepspeed: {stage: 0}\n").ds_fused_adam
    assert setup("deepspeed: {stage: 0, overrides: {optimizer: {params: {torch_adam: false}}}}\n").ds_fused_adam
    assert not setup("deepspeed: {stage: 0, overrides: {optimizer: {params: {torch_adam: true}}}}\n").ds_fused_adam
    assert not setup("deepspeed: {stage: 0}\ntraining: {optimizer: adamw_bnb_8bit}\n").ds_fused_adam


def test_the_plan_names_who_steps_the_adam_states(tmp_path):
    """Before renting: whether DeepSpeed will compile FusedAdam (nvcc on the box) or torch's fused AdamW steps."""
    def note(extra: str) -> str:
        path = tmp_path / "r.yaml"
        path.write_text("model: {name_or_path: meta-llama/Llama-3.2-1B}\ndata: {path: x.jsonl}\nmethod: full\n" + extra)
        terms = plan(setup_from_recipe(load_recipe(path).recipe)).terms
        [term] = [t for t in terms if t.name.startswith("adamw states")]
        return term.note

    fused_adam = "overrides: {optimizer: {params: {torch_adam: false}}}"
    for stage in (0, 2, 3):
        assert "torch's fused AdamW" in note(f"deepspeed: {{stage: {stage}}}\n")
        assert "FusedAdam" in note(f"deepspeed: {{stage: {stage}, {fused_adam}}}\n")


def test_qlora_adapters_take_the_4bit_layers_own_input_under_autocast():
    """peft's LoRA over a bitsandbytes 4-bit layer casts its input to the fp32 adapters only outside autocast
    (lora/bnb.py: `requires_conversion = not torch.is_autocast_enabled()`, which asks about CUDA's autocast): under
    the Trainer's, lora_A saves the layer's own 16-bit input, not a copy (activations.bnb_uncast). The H200's Q-LoRA
    row at 8,192 tokens kept 16 KiB per token and layer less than LoRA over bf16 weights (2.0 GiB)."""
    bnb = pytest.importorskip("bitsandbytes")
    import torch
    from unittest import mock
    from peft import LoraConfig
    from peft.tuners.lora.bnb import Linear4bit

    base = bnb.nn.Linear4bit(64, 64, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
    base.weight = bnb.nn.Params4bit(torch.randn(64, 64, dtype=torch.bfloat16), requires_grad=False,
                                    quant_type="nf4").to("cpu")
    layer = Linear4bit(base, "default", config=LoraConfig(r=4, lora_alpha=8), r=4, lora_alpha=8, lora_dropout=0.0)
    layer.lora_A.float(), layer.lora_B.float()  # peft's autocast_adapter_dtype
    x = torch.randn(1, 8, 64, dtype=torch.bfloat16, requires_grad=True)

    def saves_the_input_itself(cuda_autocast: bool) -> bool:
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t), \
                mock.patch("torch.is_autocast_enabled", return_value=cuda_autocast), \
                torch.autocast("cpu", dtype=torch.bfloat16):
            layer(x).sum()
        return any(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for t in saved)

    assert saves_the_input_itself(True) and not saves_the_input_itself(False)
    arch = BY_NAME["llama-3.2-1b"]
    kw = dict(arch=arch, params=arch.total_params, deepspeed=False, lora_dropout=0.0, seq_len=1024, full_rows=True,
              gradient_checkpointing=False)
    lora, qlora = layer_activation_bytes(Setup(method="lora", **kw)), layer_activation_bytes(Setup(method="qlora", **kw))
    # LoRA: a private 16-bit copy per target (q, k, v, o, gate, up, down); Q-LoRA: q/k/v share one input, gate/up
    # another, o_proj's is sdpa's saved output, down_proj's its own: 3 x hidden + q_dim fewer per token.
    assert lora - qlora == 1024 * 2 * (3 * arch.hidden + arch.q_dim)


def test_puzzle_zero2_saving_on_two_gpus_is_less_than_theory():
    """QLoRA 8B, 167,772,160 trainable: theory says ZeRO-2 on 2 GPUs saves (2 + 12) x 167.8M / 2 bytes
    = 1.09 GiB; the planner charges NCCL's buffers to the 2-GPU run, so it predicts less (measured: 934 MB)."""
    one = plan(qlora_setup("llama-3-8b", stage=2, gpus_per_node=1))
    two = plan(qlora_setup("llama-3-8b", stage=2, gpus_per_node=2))
    theory = (2 + 12) * 167_772_160 / 2
    saving = one.per_gpu["total"] - two.per_gpu["total"]
    assert saving < theory
    assert 0.8 * GiB < saving < 1.0 * GiB


def test_puzzle_small_model_zero2_buckets_cost_more_than_they_save():
    """0.5B QLoRA on 2 x 12 GB with DeepSpeed's default 5e8-element buckets and overlap_comm: ZeRO-2
    uses more than plain data parallel, and --recommend says why."""
    setup = qlora_setup("qwen2.5-0.5b", stage=2, gpus_per_node=2, micro_batch=8, seq_len=1024, gpu_memory=12 * GiB,
                        reduce_bucket_size=500_000_000, overlap_comm=True)
    zero2 = plan(setup)
    zero0 = plan(Setup(**{**setup.__dict__, "stage": 0}))
    single = plan(Setup(**{**setup.__dict__, "deepspeed": False, "gpus_per_node": 1}))
    assert zero2.per_gpu["total"] > zero0.per_gpu["total"] > single.per_gpu["total"]
    advice = recommend(setup)
    assert advice.chosen.setup.stage == 0
    assert any("adds" in r and "gradient buckets" in r and "saves" in r for r in advice.reasons)


def test_puzzle_zero3_can_need_more_than_zero2():
    """At the same batch, ZeRO-3 keeps up to stage3_max_live_parameters gathered (1e9 by default):
    for a 4-bit 8B on 2 GPUs that is more than partitioning saves."""
    zero2 = plan(qlora_setup("llama-3-8b", stage=2, gpus_per_node=2))
    zero3 = plan(qlora_setup("llama-3-8b", stage=3, gpus_per_node=2))
    assert zero3.per_gpu["total"] > zero2.per_gpu["total"]
    fewer_live = plan(qlora_setup("llama-3-8b", stage=3, gpus_per_node=2, max_live_parameters=100_000_000))
    assert fewer_live.per_gpu["total"] < zero2.per_gpu["total"]


@pytest.mark.parametrize("attn", ["eager", "sdpa", "flash_attention_2"])
@pytest.mark.parametrize("layout", ["padded", "packing", "padding_free"])
def test_attention_mask_term_equals_the_mask_transformers_builds(attn, layout):
    """The planner's mask = the bytes of the 4D mask masking_utils makes for the collated batch (issue 9):
    (b,1,s,s) for padded and packed rows, (1,1,b*s,b*s) for a padding-free row at its max_length bound,
    none under flash (boundaries travel as cu_seq_lens)."""
    import torch
    from transformers import LlamaConfig
    from transformers.masking_utils import create_causal_mask

    from finetune.plan import attention_mask_bytes
    from finetune.data.packing import make_collator

    b, s = 4, 64
    if layout == "packing":  # full blocks of two examples each
        rows = [{"input_ids": [5] * s, "labels": [5] * s, "position_ids": list(range(20)) + list(range(s - 20))}] * b
    else:  # padded: one short row forces padding; padding_free: examples at the max_length bound
        rows = [{"input_ids": [5] * n, "labels": [5] * n} for n in [s - 4] + [s] * (b - 1)]
        if layout == "padding_free":
            rows[0] = {"input_ids": [5] * s, "labels": [5] * s}
    batch = make_collator(0, attn, packing=layout == "packing", padding_free=layout == "padding_free")(rows)
    config = LlamaConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1, vocab_size=32)
    config._attn_implementation = attn
    embeds = torch.zeros(*batch["input_ids"].shape, 16, dtype=torch.bfloat16)
    positions = batch.get("position_ids", torch.arange(embeds.shape[1])[None])
    mask = create_causal_mask(config, embeds, batch.get("attention_mask"), None, position_ids=positions)
    built = 0 if mask is None or mask.dim() < 4 else mask.untyped_storage().nbytes()
    setup = Setup(arch=None, params=1, attn=attn, dtype="bfloat16", micro_batch=b, seq_len=s,
                  packing=layout == "packing", padding_free=layout == "padding_free")
    assert attention_mask_bytes(setup) == built
    assert (built > 0) == (attn != "flash_attention_2")


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("layout", ["padded", "packing", "padding_free"])
def test_layer_activations_of_packed_and_flattened_batches(attn, layout):
    """One decoder layer's saved tensors for the batches the collator makes: padded and packed rows (sdpa
    gets a mask, so key/value heads are repeated) and one padding-free row of b x s tokens (eager's
    scores span it)."""
    import torch

    from finetune.data.packing import make_collator

    b, s = 2, 48
    rows = [{"input_ids": [7] * s, "labels": [7] * s, "position_ids": list(range(16)) + list(range(s - 16))}] * b
    if layout != "packing":
        rows = [{"input_ids": [7] * s, "labels": [7] * s}] * b
    measured = []
    for layers in (1, 2):
        model = tiny_model({**TINY, "vocab_size": 512, "num_hidden_layers": layers}, attn, "lora")
        torch.manual_seed(1)
        ids = torch.randint(0, 512, (b, s))
        batch = make_collator(0, attn, packing=layout == "packing", padding_free=layout == "padding_free")(
            [{**row, "input_ids": ids[i, :n].tolist(), "labels": ids[i, :n].tolist()}
             for i, (row, n) in enumerate(zip(rows, [s - 4] + [s] * (b - 1) if layout == "padded" else [s] * b))])
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen: dict[int, int] = {}

        def pack(tensor):
            if tensor.untyped_storage().data_ptr() not in params:
                seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(**batch, use_cache=False)
        measured.append(sum(seen.values()))
    arch = arch_from_config({**TINY, "vocab_size": 512, "num_hidden_layers": 2, "model_type": "llama"}, "tiny")
    setup = Setup(arch=arch, params=arch.total_params, method="lora", attn=attn, lora_r=8, lora_dropout=0.0,
                  micro_batch=b, seq_len=s, packing=layout == "packing", padding_free=layout == "padding_free",
                  gradient_checkpointing=False)
    assert measured[1] - measured[0] == layer_activation_bytes(setup)


def test_recommend_never_trains_bf16_on_a_card_without_it():
    """Issue 34: `plan --set hardware.gpu_type=P40 --recommend` recommended the recipe's bf16; the plan says so
    and every setup --recommend tries is float16 (the same bytes), with the keys to set. An A100 keeps bf16."""
    from finetune.plan.recommendation import recommendation_overrides

    setup = qlora_setup("llama-3-8b", stage=2, gpus_per_node=2, gpu_memory=24 * GiB, gpu_type="Tesla P40")
    assert any("P40 has no bf16" in note for note in plan(setup).notes)
    advice = recommend(setup)
    assert {r.setup.dtype for r in advice.tried} == {"float16"}
    assert recommendation_overrides(advice)[:3] == ["model.dtype=float16", "quantization.compute_dtype=float16",
                                                    "quantization.storage_dtype=float16"]
    ampere = recommend(Setup(**{**setup.__dict__, "gpu_type": "A100"}))
    assert {r.setup.dtype for r in ampere.tried} == {"bfloat16"} and not any("bf16" in n for n in plan(ampere.current.setup).notes)
    from typer.testing import CliRunner
    from finetune.cli import app

    out = CliRunner().invoke(app, ["plan", "--model", "llama-3-8b", "--method", "lora", "--gpu-memory", "24GiB",
                                   "--gpu-type", "T4", "--recommend", "--format", "json"])
    data = json.loads(out.stdout)
    assert data["recommendation"]["chosen"]["dtype"] == "float16" and "T4 has no bf16" in data["notes"][-1]


def test_recommend_quotes_its_table_shows_its_choice_and_offers_a_larger_micro_batch():
    """Issue 34: a why line quoted ZeRO-3 and ZeRO-2 totals of the chunked-loss variants (9.21 against 8.17 GiB)
    while the table showed the recipe's loss (12.07, 11.03); the recommended setup was missing from the table when
    its micro batch differed; GiBs to spare never suggested a larger micro batch."""
    import re

    setup = qlora_setup("llama-3-8b", stage=2, gpus_per_node=2, gpu_memory=48 * GiB, gradient_accumulation=2)
    advice = recommend(setup)
    text = advice.render_text()
    table = text.split("tried (")[1]
    zero3 = next(r for r in advice.reasons if r.startswith("ZeRO-3 needs more than ZeRO-2"))
    for number in re.findall(r"\((\d+\.\d\d) against (\d+\.\d\d) GiB\)", zero3)[0]:
        assert f" {number} " in table, (number, table)
    assert advice.chosen.setup.micro_batch == 2  # accumulation 2 absorbs it: the rows per step stay
    assert "<- recommended" in next(line for line in table.splitlines() if "micro batch 2" in line)
    assert advice.larger is not None and advice.larger.setup.micro_batch > 2 and advice.larger.fits
    assert f"micro batch {advice.larger.setup.micro_batch} fits too" in text
    assert "<- fits too" in next(line for line in table.splitlines() if f"micro batch {advice.larger.setup.micro_batch}" in line)
