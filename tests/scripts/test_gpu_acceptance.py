"""scripts/gpu_acceptance.py's pure parts: peak FLOPs, FLOPs per token, the GPU matrix. The harness end to end on
CPU: tests/launches/test_gpu_acceptance.py.

    python -m pytest tests/scripts/test_gpu_acceptance.py
"""

from __future__ import annotations

import importlib.util
import json
import sys

from tests.train_fixtures import REPO

SCRIPT = REPO / "scripts" / "gpu_acceptance.py"


def harness():
    spec = importlib.util.spec_from_file_location("gpu_acceptance", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_acceptance"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_peak_flops_come_from_the_table():
    h = harness()
    assert h.peak_bf16_flops("NVIDIA H100 80GB HBM3")[0] == 989e12
    assert h.peak_bf16_flops("NVIDIA H100 PCIe")[0] == 756e12
    assert h.peak_bf16_flops("NVIDIA A100-SXM4-80GB")[0] == 312e12
    assert h.peak_bf16_flops("NVIDIA A10G")[0] is None  # no datasheet figure: no MFU rather than a guess
    assert h.peak_bf16_flops("Tesla P40") == (None, None)


def test_flops_per_token_is_the_anchors_basis_for_every_method(tmp_path):
    h = harness()
    config = {**h.MODELS["llama3-8b"], "model_type": "llama"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    flops, basis = h.flops_per_token(tmp_path, 2048)
    matmul_params = 8_030_261_248 - 128_256 * 4096 - 65 * 4096  # every weight but the embedding and the norms
    attention = 12 * 32 * 4096 * 2048
    assert flops == 6 * matmul_params + attention and "LoRA/QLoRA counted as full" in basis


def test_gpu_matrix_covers_every_combination_once():
    h = harness()
    machine = h.Machine(cpu=False, gpus=8, gpu_name="NVIDIA H100 80GB HBM3", gpu_memory=80 * 2**30,
                        peak_flops=989e12, peak_source="", flash=True, bitsandbytes=True, versions={})

    class Args:
        models, methods, stages = ["llama-1b", "llama3-8b"], ["lora", "qlora", "full"], [0, 2, 3]

    cases = h.gpu_matrix(machine, Args)
    # 2 models x 3 methods x (z0 + z2 x offload 2 + z3 x offload 2 = 5) x packing 2 x attention 2 x gpus {1, 8}
    assert len(cases) == 2 * 3 * 5 * 2 * 2 * 2 == len({c.name for c in cases})
    assert not [c for c in cases if c.stage == 0 and c.offload]
    one_gpu = h.Machine(**{**machine.__dict__, "gpus": 1, "flash": False})
    assert {c.gpus for c in h.gpu_matrix(one_gpu, Args)} == {1}
    assert {c.attn for c in h.gpu_matrix(one_gpu, Args)} == {"sdpa"}
