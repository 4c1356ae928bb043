"""`finetune convert` on real 2-process ZeRO checkpoints: they become the adapter (or model) the run saved.

The LoRA cases read the session's runs of the product's runner (tests/conftest.py `tiny_run`: recipes/tiny/
lora_zero3.yaml, and lora_zero2_offload.yaml whose head is trained whole, `modules_to_save`): their final
checkpoint's float32 master weights, cast to the training dtype, must equal the adapter/ the run saved, bit for
bit. A full fine-tune with a frozen parameter has no recipe key, so that case trains with its own Trainer harness
(tests/weights/merge_fixtures.py, torchrun, 2 processes, 3 steps, bfloat16, a frozen embedding): DeepSpeed keeps frozen
parameters apart (frozen_param_fragments), and convert must take them from there. Bad inputs and PEFT's key names
are checked without training in tests/weights/test_convert.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed")
from safetensors.torch import load_file  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from finetune.cli import app  # noqa: E402
from finetune.weights.convert import convert, peft_key  # noqa: E402
from finetune.weights.merge import merge  # noqa: E402
from finetune.weights.safetensors_io import Written  # noqa: E402
from tests.weights.merge_fixtures import assert_same, build_llama, peft_merged_state_dict, safetensors_data_bytes  # noqa: E402

FIXTURES = Path(__file__).parents[1] / "weights" / "merge_fixtures.py"
runner = CliRunner()


def train(base: Path, out: Path, stage: int, method: str) -> Path:
    """torchrun --nproc_per_node 2: Trainer + DeepSpeed on CPU, 3 steps, checkpoint-3/ and final/."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(FIXTURES.parents[2])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(FIXTURES),
           "train", "--base", str(base), "--out", str(out), "--stage", str(stage), "--method", method]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out


class Trained:
    """A run's final checkpoint, what it saved, the base it trained and its dtype."""

    def __init__(self, run_dir: Path, recipe, base: Path):
        self.checkpoint = run_dir / f"checkpoint-{recipe.training.max_steps}"
        self.saved = run_dir / ("adapter" if recipe.method != "full" else "model")
        self.base, self.dtype = base, recipe.model.dtype
        self.head_trained_whole = "lm_head" in (recipe.lora.modules_to_save or [])


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_run, tiny_dir):
    def product(name: str) -> Trained:
        run_dir, result, recipe = tiny_run(name)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
        return Trained(run_dir, recipe, tiny_dir)

    root = tmp_path_factory.mktemp("zero")
    base = build_llama(root / "base")
    full = train(base, root / "full-zero3", 3, "full")
    return {"lora-zero3": product("lora_zero3"), "lora-zero2": product("lora_zero2_offload"),
            "full-zero3": SimpleNamespace(checkpoint=full / "checkpoint-3", saved=full / "final", base=base)}


@pytest.mark.parametrize("run", ["lora-zero3", "lora-zero2"])
def test_lora_checkpoint_becomes_the_saved_adapter(runs, run, tmp_path):
    trained = runs[run]
    result = runner.invoke(app, ["convert", str(trained.checkpoint), "-o", str(tmp_path / "adapter")])
    assert result.exit_code == 0, result.output
    assert f"LoRA adapter, {trained.dtype}" in result.output
    ours = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    saved = load_file(str(trained.saved / "adapter_model.safetensors"))
    assert_same(ours, saved)
    # Training happened: B started at zero; a head trained whole (modules_to_save) is there under PEFT's name.
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in ours.items())
    assert ("base_model.model.lm_head.weight" in ours) == trained.head_trained_whole
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["peft_type"] == "LORA"


def test_global_step_dir_and_float32(runs, tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    checkpoint = runs["lora-zero3"].checkpoint
    step = checkpoint / f"global_step{checkpoint.name.split('-')[1]}"
    seen = []
    convert(step, tmp_path / "adapter", dtype="float32", on_write=seen.append)
    ours = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    size = safetensors_data_bytes(tmp_path / "adapter" / "adapter_model.safetensors")
    assert seen == [Written(size, len(ours), size, len(ours))]  # one file, written by one call
    masters = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), exclude_frozen_parameters=True)
    assert_same(ours, {peft_key(k, "default"): v for k, v in masters.items()})


def test_full_checkpoint_becomes_the_saved_model(runs, tmp_path):
    out = tmp_path / "model"
    seen = []
    result = convert(runs["full-zero3"].checkpoint, out, max_shard_size=100_000, on_write=seen.append)
    assert result.kind == "full" and result.shards > 1
    # on_write: once per tensor, bytes growing to exactly the tensor bytes in the shards
    on_disk = sum(safetensors_data_bytes(p) for p in out.glob("*.safetensors"))
    assert [w.tensors for w in seen] == list(range(1, result.tensors + 1))
    assert all(a.bytes < b.bytes for a, b in zip(seen, seen[1:]))
    assert seen[-1].bytes == seen[-1].total_bytes == result.total_bytes == on_disk
    ours = {}
    for shard in sorted(out.glob("*.safetensors")):
        ours.update(load_file(str(shard)))
    assert_same(ours, load_file(str(runs["full-zero3"].saved / "model.safetensors")))
    assert (out / "config.json").is_file() and (out / "model.safetensors.index.json").is_file()
    # The frozen embedding came from DeepSpeed's frozen_param_fragments, untouched by training.
    base = load_file(str(runs["full-zero3"].base / "model.safetensors"))
    assert torch.equal(ours["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    assert not torch.equal(ours["model.layers.0.mlp.up_proj.weight"], base["model.layers.0.mlp.up_proj.weight"])


def test_convert_then_merge_equals_peft_merge_of_the_saved_adapter(runs, tmp_path):
    trained = runs["lora-zero3"]
    convert(trained.checkpoint, tmp_path / "adapter")
    merge(trained.base, tmp_path / "adapter", tmp_path / "merged")
    reference = peft_merged_state_dict(trained.base, trained.saved)
    assert_same(load_file(str(tmp_path / "merged" / "model.safetensors")), reference)


def test_lora_checkpoint_without_adapter_config(runs, tmp_path):
    trained = runs["lora-zero2"]
    ckpt = tmp_path / trained.checkpoint.name
    shutil.copytree(trained.checkpoint, ckpt)
    (ckpt / "adapter_config.json").unlink()
    result = runner.invoke(app, ["convert", str(ckpt), "-o", str(tmp_path / "out")])
    assert result.exit_code == 1 and "no adapter_config.json" in result.output and "--adapter-config" in result.output
    assert not (tmp_path / "out").exists()
    result = runner.invoke(app, ["convert", str(ckpt), "-o", str(tmp_path / "out"),
                                 "--adapter-config", str(trained.saved)])
    assert result.exit_code == 0, result.output
