"""scripts/gpu_acceptance.py end to end on CPU (full tier): its results record measured speed, memory and the plan.
Its pure parts: tests/scripts/test_gpu_acceptance.py.

    python -m pytest -m full tests/launches/test_gpu_acceptance.py
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.scripts.test_gpu_acceptance import SCRIPT
from tests.train_fixtures import REPO, cache_dir, runner_env


@pytest.mark.full  # the harness ran on an H100 (docs/gpu_acceptance/2026-11-24_*)
def test_cpu_run_records_measured_speed_memory_and_the_plan(tmp_path_factory, tmp_path):
    out = tmp_path / "acceptance"
    env = runner_env(cache_dir(tmp_path_factory))
    result = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--out", str(out)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["machine"]["cpu"] is True and len(results["runs"]) == 1
    for run in results["runs"]:
        assert run["status"] == "ok", run
        assert run["tokens_per_second"] > 0
        assert run["peak_memory_bytes"] > 50 * 2**20 and run["peak_memory_kind"] == "cpu_peak_rss"
        assert len(run["peak_memory_bytes_per_rank"]) == 2
        assert run["predicted_bytes"] > 2**20  # `finetune plan --format json` for the same recipe
        assert run["predicted_allocated_bytes"] > 2**20
        assert run["steps"] == 3 and run["loss_last"] is not None
        assert run["mfu"] is None  # no GPU, no peak FLOPs
        summary = json.loads((out / "runs" / run["name"] / "summary.json").read_text())
        assert summary["tokens_per_second"] == run["tokens_per_second"]  # read from the run, not made up
        assert run["steady"] == summary["steady"] and run["startup"] == summary["startup"]  # copied, both
        assert not (out / "runs" / run["name"] / "adapter").exists()  # weights deleted after each run
    [check] = results["packing_checks"]
    assert check["attn"] == "sdpa" and check["equal"]
    # The check can fail: the same tokens without boundaries give other logits.
    assert check["max_abs_diff_without_boundaries"] > 100 * check["tolerance"]
    table = (out / "results.md").read_text()
    assert "| tiny-llama_lora_z2_pack_sdpa_2gpu | ok |" in table
