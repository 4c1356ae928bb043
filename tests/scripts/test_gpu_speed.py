"""scripts/gpu_speed.py's report without a run: a memory row's allocations at its peak (finetune.train.memory_trace)
appear in results.md. The harness end to end on CPU: tests/launches/test_gpu_speed.py."""

from __future__ import annotations

import importlib.util
import sys

from tests.train_fixtures import REPO


def gpu_speed():
    spec = importlib.util.spec_from_file_location("gpu_speed", REPO / "scripts" / "gpu_speed.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_speed"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_a_memory_rows_peak_is_in_the_report():
    peak = {"steps": 2, "baseline_bytes": 3 * 2**30, "peak_bytes": 28 * 2**30, "max_memory_allocated_bytes": 28 * 2**30,
            "truncated": False, "groups": [{"owner": "transformers/loss/loss_utils.py:36 fixed_cross_entropy",
                                            "bytes": 4 * 2**30, "blocks": 2}]}
    results = {"machine": {"cpu": False, "gpus": 1, "gpu_name": "H200", "versions": {}}, "created": "today",
               "commit": "abc", "budget": 500, "elapsed": 100, "ratios": {},
               "runs": [{"name": "memory_lora_8k", "status": "ok", "memory_at_peak": peak}]}
    text = gpu_speed().markdown(results)
    assert "Live at the peak of memory_lora_8k's first 2 steps: 28.00 GiB (3.00 before the first step" in text
    assert "| transformers/loss/loss_utils.py:36 fixed_cross_entropy | 4.00 | 2 |" in text


def test_only_runs_the_named_cases_in_the_order_named(tmp_path):
    module = gpu_speed()
    cases = module.gpu_cases("model", tmp_path / "d.jsonl", tmp_path / "long.jsonl", steps=10)
    names = [c.name for c in module.selected(cases, "memory_lora,memory_qlora,lora_1x2k,8rows")]
    assert names[:2] == ["memory_lora_8k", "memory_qlora_8k"]
    assert names[2:] == [c.name for c in cases if "lora_1x2k" in c.name] + \
        ["lora_8rows_llama_factory_defaults", "lora_8rows_finetune_auto"]
    assert "memory_full_8k" not in names and "full_1x2k_finetune" not in names
