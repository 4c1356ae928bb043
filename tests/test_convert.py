"""`finetune convert`: real 2-process ZeRO checkpoints become the adapter (or model) the run saved.

The LoRA cases read the session's runs of the product's runner (tests/conftest.py `tiny_run`: recipes/tiny/
lora_zero3.yaml, and lora_zero2_offload.yaml whose head is trained whole, `modules_to_save`): their final
checkpoint's float32 master weights, cast to the training dtype, must equal the adapter/ the run saved, bit for
bit. A full fine-tune with a frozen parameter has no recipe key, so that case trains with its own Trainer harness
(tests/merge_fixtures.py, torchrun, 2 processes, 3 steps, bfloat16, a frozen embedding): DeepSpeed keeps frozen
parameters apart (frozen_param_fragments), and convert must take them from there.
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
from finetune.weights.convert import ConvertError, convert, peft_key  # noqa: E402
from finetune.weights.merge import merge  # noqa: E402
from finetune.weights.safetensors_io import Written  # noqa: E402
from tests.merge_fixtures import assert_same, build_llama, peft_merged_state_dict, safetensors_data_bytes  # noqa: E402

FIXTURES = Path(__file__).with_name("merge_fixtures.py")
runner = CliRunner()


def train(base: Path, out: Path, stage: int, method: str) -> Path:
    """torchrun --nproc_per_node 2: Trainer + DeepSpeed on CPU, 3 steps, checkpoint-3/ and final/."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(FIXTURES.parent.parent)}
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_convert_then_merge_equals_peft_merge_of_the_saved_adapter(runs, tmp_path):
    trained = runs["lora-zero3"]
    convert(trained.checkpoint, tmp_path / "adapter")
    merge(trained.base, tmp_path / "adapter", tmp_path / "merged")
    reference = peft_merged_state_dict(trained.base, trained.saved)
    assert_same(load_file(str(tmp_path / "merged" / "model.safetensors")), reference)


@pytest.mark.slow
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


# ------------------------------------------------------------------------------------------------
# Fast: bad inputs and PEFT's key names


def test_peft_key_names():
    p = "base_model.model.model.layers.0.self_attn.q_proj"
    assert peft_key(f"{p}.lora_A.default.weight", "default") == f"{p}.lora_A.weight"
    assert peft_key(f"{p}.lora_magnitude_vector.default.weight", "default") == f"{p}.lora_magnitude_vector"
    assert peft_key("base_model.model.lm_head.modules_to_save.default.weight", "default") == "base_model.model.lm_head.weight"
    assert peft_key(f"{p}.base_layer.bias", "default") == f"{p}.base_layer.bias"
    assert peft_key("base_model.model.model.embed_tokens.lora_embedding_A.default", "default") == \
        "base_model.model.model.embed_tokens.lora_embedding_A"
    # An adapter named like a module is only stripped where PEFT strips it.
    assert peft_key("base_model.model.default.lora_A.default.weight", "default") == "base_model.model.default.lora_A.weight"


@pytest.mark.parametrize("layout, message", [
    ("empty", "not a DeepSpeed checkpoint"),
    ("dangling-latest", "names global_step7, but"),
    ("no-states", "no *_model_states.pt"),
    ("missing", "no such checkpoint directory"),
])
def test_not_a_checkpoint(tmp_path, layout, message):
    ckpt = tmp_path / "checkpoint-7"
    if layout != "missing":
        ckpt.mkdir()
    if layout == "dangling-latest":
        (ckpt / "latest").write_text("global_step7")
    if layout == "no-states":
        (ckpt / "global_step7").mkdir()
        (ckpt / "latest").write_text("global_step7")
    result = runner.invoke(app, ["convert", str(ckpt), "-o", str(tmp_path / "out")])
    assert result.exit_code == 1, result.output
    assert message in result.output and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConvertError):
        convert(ckpt, tmp_path / "out")


def test_existing_output_is_refused(tmp_path):
    (tmp_path / "out").mkdir()
    result = runner.invoke(app, ["convert", str(tmp_path), "-o", str(tmp_path / "out")])
    assert result.exit_code == 1 and "already exists" in result.output


def test_a_run_directory_given_to_convert_names_its_checkpoints(tmp_path):
    run = tmp_path / "run"
    for step in (10, 5):
        (run / f"checkpoint-{step}").mkdir(parents=True)
    (run / "recipe.yaml").write_text("name: x\n")
    with pytest.raises(ConvertError, match=rf"its checkpoints: {run}/checkpoint-5, {run}/checkpoint-10$"):
        convert(run, tmp_path / "out")


class _RunsAShellCommand:
    """Unpickling this runs `touch MARKER`: what a checkpoint from an untrusted source can hold."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("poisoned", ["mp_rank_00_model_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"])
def test_checkpoint_pickling_a_foreign_global_is_refused_and_nothing_runs(tmp_path, poisoned):
    step = tmp_path / "checkpoint-1" / "global_step1"
    step.mkdir(parents=True)
    (step.parent / "latest").write_text("global_step1")
    marker = tmp_path / "executed"
    model = {"param_shapes": [{"w": torch.Size([2])}], "module": {}, "ds_config": {}}
    optim = {"optimizer_state_dict": {"zero_stage": 2}}
    for name, states in (("mp_rank_00_model_states.pt", model), ("bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", optim)):
        torch.save({**states, "payload": _RunsAShellCommand(marker)} if name == poisoned else states, step / name)
    result = runner.invoke(app, ["convert", str(step.parent), "-o", str(tmp_path / "out")])
    assert result.exit_code == 1, result.output
    assert f"{step / poisoned}: refused to load: it pickles posix.system" in result.output
    assert "Traceback" not in result.output
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_weights_only_loads_refuse_what_the_scan_cannot_see(tmp_path):
    from finetune.weights.convert import weights_only_loads

    path = tmp_path / "x.pt"
    torch.save({"payload": _RunsAShellCommand(tmp_path / "executed")}, path)
    with weights_only_loads(), pytest.raises(Exception, match="posix.system"):
        torch.load(str(path), weights_only=False)  # what zero_to_fp32 asks for
    assert not (tmp_path / "executed").exists()
    assert torch.load.__module__ == "torch.serialization"  # restored afterwards


def test_convert_opens_the_checkpoint_type_resume_judges(tmp_path):
    """One Checkpoint type: convert reads the step, DeepSpeed's tag and the COMPLETE marker of the folder
    the same way `finetune train` does when it resumes (finetune.rundir.checkpoint)."""
    from finetune.rundir import checkpoint as ckpt
    from finetune.weights.convert import find_checkpoint

    folder = tmp_path / "checkpoint-4"
    (folder / "global_step4").mkdir(parents=True)
    (folder / "latest").write_text("global_step4")
    torch.save({"param_shapes": [{"w": torch.Size([2])}], "module": {}, "ds_config": {}},
               folder / "global_step4" / "mp_rank_00_model_states.pt")
    torch.save({"optimizer_state_dict": {"zero_stage": 2}}, folder / "global_step4" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
    found = find_checkpoint(folder)
    assert isinstance(found, ckpt.Checkpoint)
    assert (found.step, found.path, found.tag, found.step_dir) == (4, folder, "global_step4", folder / "global_step4")
    assert not found.complete and "no COMPLETE marker" in found.problem
    assert found.model_states["param_shapes"] == [{"w": torch.Size([2])}]
    ckpt.publish(folder, 4)
    assert find_checkpoint(folder / "global_step4").complete  # the step folder itself names the same checkpoint
    [listed] = ckpt.list_checkpoints(tmp_path)
    assert (listed.step, listed.path, listed.complete) == (found.step, found.path, True)
