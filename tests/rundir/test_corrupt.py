"""A fuzz of corrupt and foreign run directories through chat, eval, merge, convert and resume (issue 25
items 4 and 6): every one ends in one `error:` line (or works), never a traceback, and nothing pickled runs.

Chat (the command that loads the most), eval and merge run on every corruption, in this process; convert and
resume (`finetune train --dry-run`) on corrupt checkpoints.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

from finetune.cli import app
from tests.weights.merge_fixtures import build_adapter, build_llama

runner = CliRunner()


class _RunsAShellCommand:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _truncate(path: Path, keep: int = 100) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def _huge_header(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 2**40) + data[8:])


def _pickle_bin(run: Path) -> None:
    import torch

    (run / "adapter" / "adapter_model.safetensors").unlink()
    torch.save({"x": _RunsAShellCommand(run / "PWNED")}, run / "adapter" / "adapter_model.bin")


def _own_base(run: Path, change) -> None:
    """Point the run at its own copy of the base model, then corrupt the copy."""
    recipe = run / "recipe.yaml"
    base = Path(recipe.read_text().split("name_or_path: ")[1].split(",")[0])
    copy = run.parent / f"{run.name}-base"
    shutil.copytree(base, copy)
    change(copy)
    recipe.write_text(recipe.read_text().replace(str(base), str(copy)))


def _nested_config(base: Path) -> None:
    config = json.loads((base / "config.json").read_text())
    config.update(hidden_size={"a": [1]}, num_hidden_layers="x")
    (base / "config.json").write_text(json.dumps(config))


CORRUPTIONS = {
    "recipe-garbage": lambda r: (r / "recipe.yaml").write_bytes(b"\x00\xff garbage: ["),
    "recipe-a-list": lambda r: (r / "recipe.yaml").write_text("- 1\n- 2\n"),
    "recipe-invalid": lambda r: (r / "recipe.yaml").write_text("model: {name_or_path: 3}\nmethod: nope\n"),
    "adapter-config-garbage": lambda r: (r / "adapter/adapter_config.json").write_bytes(b"{not json"),
    "adapter-config-a-list": lambda r: (r / "adapter/adapter_config.json").write_text("[1, 2]"),
    "adapter-config-nested": lambda r: (r / "adapter/adapter_config.json").write_text(
        json.dumps({"peft_type": {"a": [1]}, "r": "x"})),
    "adapter-weights-truncated": lambda r: _truncate(r / "adapter/adapter_model.safetensors"),
    "adapter-weights-huge-header": lambda r: _huge_header(r / "adapter/adapter_model.safetensors"),
    "adapter-weights-pickle": _pickle_bin,
    "base-config-garbage": lambda r: _own_base(r, lambda b: (b / "config.json").write_text("{oops")),
    "base-config-nested": lambda r: _own_base(r, _nested_config),
    "base-weights-truncated": lambda r: _own_base(r, lambda b: _truncate(b / "model.safetensors", 1000)),
    "tokenizer-config-garbage": lambda r: (r / "tokenizer/tokenizer_config.json").write_text("{x"),
    "empty": lambda r: [shutil.rmtree(p) if p.is_dir() else p.unlink() for p in list(r.iterdir())],
}


@pytest.fixture(scope="module")
def good_run(tmp_path_factory) -> Path:
    """A LoRA run directory as `finetune train` leaves it (tiny Llama base, adapter, tokenizer, recipe)."""
    root = tmp_path_factory.mktemp("corrupt")
    base = build_llama(root / "base", dtype="float32")
    run = root / "good"
    run.mkdir()
    build_adapter(base, run / "adapter")
    (root / "d.jsonl").write_text("".join(json.dumps({"instruction": f"q{i}", "output": f"a{i}"}) + "\n" for i in range(8)))
    (run / "recipe.yaml").write_text(f"model: {{name_or_path: {base}, dtype: float32}}\nmethod: lora\n"
                                     f"data: {{path: {root / 'd.jsonl'}}}\n")
    shutil.copytree(base, run / "tokenizer", ignore=shutil.ignore_patterns("*.safetensors", "config.json",
                                                                         "generation_config.json"))
    return run


COMMANDS = {
    "chat": lambda run: ["chat", str(run), "--prompt", "hi", "--max-new-tokens", "2", "--device", "cpu"],
    "eval": lambda run: ["eval", str(run), "--device", "cpu"],
    "merge": lambda run: ["merge", str(run), "-o", str(run.parent / f"{run.name}-merged")],
}


def run_corrupted(good_run: Path, corruption: str, command: str):
    run = good_run.parent / f"{corruption}-{command}"
    shutil.copytree(good_run, run)
    CORRUPTIONS[corruption](run)
    result = runner.invoke(app, COMMANDS[command](run))
    return run, result


def assert_one_line_or_works(run: Path, result) -> None:
    crashed = result.exception is not None and not isinstance(result.exception, SystemExit)
    assert not crashed, f"traceback: {result.exception!r}"
    errors = [line for line in result.output.splitlines() if line.startswith("error")]
    assert result.exit_code == 0 or (result.exit_code == 1 and len(errors) == 1), result.output
    assert not (run / "PWNED").exists(), "a pickled command ran"


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_chat_on_a_corrupt_run_directory_says_one_line(good_run, corruption):
    run, result = run_corrupted(good_run, corruption, "chat")
    assert_one_line_or_works(run, result)
    assert result.exit_code == 1


@pytest.mark.parametrize("command", ["eval", "merge"])
@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_eval_and_merge_on_a_corrupt_run_directory_say_one_line(good_run, corruption, command):
    assert_one_line_or_works(*run_corrupted(good_run, corruption, command))


# ------------------------------------------------------------------------------------------------
# Checkpoints: convert and resume


def _checkpoint(run: Path, step: int) -> Path:
    """A checkpoint-N laid out as the Trainer and DeepSpeed write it (small stand-in tensors), published."""
    import torch

    from finetune.rundir import checkpoint as ckpt

    path = run / f"checkpoint-{step}"
    shards = path / f"global_step{step}"
    shards.mkdir(parents=True)
    shutil.copy2(run / "adapter" / "adapter_model.safetensors", path / "adapter_model.safetensors")
    shutil.copy2(run / "adapter" / "adapter_config.json", path / "adapter_config.json")
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
    (path / "latest").write_text(f"global_step{step}")
    torch.save({"param_shapes": [{}], "module": {}}, shards / "mp_rank_00_model_states.pt")
    torch.save({"optimizer_state_dict": {}}, shards / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    ckpt.publish(path, step)
    return path


def _poison_shard(path: Path) -> None:
    import torch

    torch.save({"x": _RunsAShellCommand(path.parent.parent / "PWNED")}, path)


def _poisoned_copy_outside(checkpoint: Path) -> Path:
    """A copy of the checkpoint's step folder outside the run directory, every shard pickling a command."""
    outside = checkpoint.parent.parent / f"{checkpoint.parent.name}-elsewhere" / "global_step4"
    shutil.copytree(checkpoint / "global_step4", outside)
    for shard in outside.iterdir():
        _poison_shard(shard)
    return outside


def _link(path: Path, target: Path) -> None:
    shutil.rmtree(path) if path.is_dir() else path.unlink()
    path.symlink_to(target)


# Issue 34 item 1: DeepSpeed's loader and the universal conversion open CHECKPOINT/<tag from latest>/<name>.
LINKS_OUT = {
    "step-folder-links-out": lambda c: _link(c / "global_step4", _poisoned_copy_outside(c)),
    "shard-links-out": lambda c: _link(c / "global_step4" / "mp_rank_00_model_states.pt",
                                       _poisoned_copy_outside(c) / "mp_rank_00_model_states.pt"),
    "latest-absolute": lambda c: (c / "latest").write_text(str(_poisoned_copy_outside(c))),
    "latest-dot-dot": lambda c: (c / "latest").write_text(
        f"../../{_poisoned_copy_outside(c).parent.name}/global_step4"),
    "universal-links-out": lambda c: ((c / "global_step4_universal").symlink_to(_poisoned_copy_outside(c)),
                                      (c / "latest_universal").write_text("global_step4_universal")),
}

CHECKPOINT_CORRUPTIONS = {
    **LINKS_OUT,
    "trainer-state-garbage": lambda c: (c / "trainer_state.json").write_bytes(
        b"\x00" * (c / "trainer_state.json").stat().st_size),
    "weights-truncated": lambda c: _truncate(c / "adapter_model.safetensors"),
    "weights-huge-header": lambda c: _huge_header(c / "adapter_model.safetensors"),
    "shard-not-a-zip": lambda c: (c / "global_step4" / "mp_rank_00_model_states.pt").write_bytes(b"junk" * 10),
    "shard-pickles-code": lambda c: _poison_shard(c / "global_step4" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
    "latest-names-nothing": lambda c: (c / "latest").write_text("global_step99"),
    "marker-garbage": lambda c: (c / "COMPLETE").write_text("{"),
    "no-shards": lambda c: shutil.rmtree(c / "global_step4"),
}


@pytest.mark.parametrize("corruption", sorted(CHECKPOINT_CORRUPTIONS))
def test_convert_and_resume_on_a_corrupt_checkpoint_say_one_line(good_run, corruption, monkeypatch):
    from finetune.rundir import checkpoint as ckpt

    run = good_run.parent / f"ckpt-{corruption}"
    shutil.copytree(good_run, run)
    _checkpoint(run, 2)
    newest = _checkpoint(run, 4)
    before = {name: size for name, size in ckpt.manifest(newest).items()}
    CHECKPOINT_CORRUPTIONS[corruption](newest)
    if corruption not in ("marker-garbage", "no-shards"):  # sizes that still agree: only a look inside finds it
        ckpt.publish(newest, 4) if ckpt.manifest(newest) != before else None
    converted = runner.invoke(app, ["convert", str(newest), "-o", str(run.parent / f"{run.name}-out")])
    assert_one_line_or_works(run, converted)
    assert converted.exit_code == 1
    monkeypatch.chdir(run.parent)
    (run.parent / f"{run.name}.yaml").write_text((run / "recipe.yaml").read_text() + "launch: {procs_per_node: 1}\n")
    from finetune.recipe import load_recipe
    from finetune.rundir.layout import write_run_dir

    # the run inputs `finetune train` wrote (only a run directory is resumed, issue 34)
    write_run_dir(load_recipe(run.parent / f"{run.name}.yaml"), run, world_size=1, in_place=True)
    resumed = runner.invoke(app, ["train", f"{run.name}.yaml", "--output-dir", str(run), "--dry-run"])
    assert_one_line_or_works(run, resumed)
    if corruption == "shard-pickles-code":
        assert resumed.exit_code == 1 and "refused to load: it pickles posix.system" in resumed.stderr
    elif corruption in LINKS_OUT:
        assert resumed.exit_code == 1 and "cannot be resumed from" in resumed.stderr, resumed.output
        assert "outside" in resumed.stderr and "outside" in converted.stderr, (resumed.stderr, converted.stderr)
    else:  # checkpoint-4 is passed over (damaged, or not complete) for checkpoint-2
        assert "resuming from checkpoint-2 (step 2)" in resumed.stderr, resumed.output
