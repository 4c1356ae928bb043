"""`finetune convert` without training: PEFT's key names, what is not a checkpoint, an output that exists, a run
directory given instead of a checkpoint, and checkpoints that pickle foreign code (refused, nothing runs). Real
2-process ZeRO checkpoints converted to the adapter or model their run saved: tests/launches/test_convert.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed")
from typer.testing import CliRunner  # noqa: E402

from finetune.cli import app  # noqa: E402
from finetune.weights.convert import ConvertError, convert, peft_key  # noqa: E402

runner = CliRunner()


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
