"""Run directories written by earlier versions of finetune still load (issue 39).

Each folder of tests/fixtures/rundirs/ is a run directory as `finetune train` wrote it then, byte for byte
(tests/fixtures/rundirs/README.md: the command, the commit). A copy of it goes through the real commands, in this
process: `finetune chat`, `eval`, `merge`, `convert`, `export` (with the export extra) and `publish --dry-run`, and
the check `finetune train` makes before resuming (finetune.run.preflight.resume_step). A change that breaks one of
them for an old run directory needs a migration (finetune/recipe/migrations.py, finetune/rundir/format.py), which
the synthetic rename below exercises.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from finetune.rundir import format as run_format
from finetune.recipe import migrations

REPO = Path(__file__).resolve().parents[2]
FIXTURES = sorted(p for p in (REPO / "tests" / "fixtures" / "rundirs").iterdir() if p.is_dir())
DEMO_DATA = "/recipes/tiny/../data/demo_instructions.jsonl"  # how the fixtures' recipes name the demo data


def relocated_copy(fixture: Path, folder: Path) -> Path:
    """The fixture copied to folder/run, the absolute paths it recorded mapped as a user upgrading in place keeps
    theirs: its run directory to the copy, the checkout it trained in to this one (only .json and .yaml files
    hold paths; the adapter's base_model_name_or_path, a cache of that machine, is left as it is)."""
    from finetune.rundir.run_dir import read_recipe_data

    run = folder / "run"
    shutil.copytree(fixture, run)
    recorded = read_recipe_data(run / "recipe.yaml")
    checkout = recorded["data"]["path"].removesuffix(DEMO_DATA)
    for path in [*run.rglob("*.json"), *run.rglob("*.yaml")]:
        text = path.read_text(encoding="utf-8")
        moved = text.replace(recorded["output_dir"], str(run)).replace(checkout, str(REPO))
        if moved != text:
            path.write_text(moved, encoding="utf-8")
    return run


def assert_merged_is_base_plus_adapter(merged: Path, base: Path, adapter: Path) -> None:
    """Every merged weight is the base's, plus (alpha / r) B A where the adapter has a pair (float32 throughout)."""
    from safetensors.torch import load_file

    config = json.loads((adapter / "adapter_config.json").read_text())
    lora = load_file(adapter / "adapter_model.safetensors")
    got = {k: v for f in sorted(merged.glob("*.safetensors")) for k, v in load_file(f).items()}
    want = {k: v for f in sorted(base.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert got.keys() == want.keys()
    pairs = 0
    for name, weight in want.items():
        a = lora.get(f"base_model.model.{name.removesuffix('.weight')}.lora_A.weight")
        if a is not None:
            b = lora[f"base_model.model.{name.removesuffix('.weight')}.lora_B.weight"]
            weight, pairs = weight + (config["lora_alpha"] / config["r"]) * (b @ a), pairs + 1
        assert (got[name] - weight).abs().max() <= 1e-6, name
    assert pairs == 4 * 7  # every linear layer of the 4 decoder layers


@pytest.fixture(params=[p.name for p in FIXTURES])
def old_run(request, tmp_path) -> Path:
    return relocated_copy(REPO / "tests" / "fixtures" / "rundirs" / request.param, tmp_path)


def test_an_old_run_directory_is_format_1_and_chats_evaluates_merges_converts_exports_publishes(old_run, tmp_path, tiny_dir, cli):
    from safetensors.torch import load_file

    assert run_format.recorded_version(old_run / "recipe.yaml") == run_format.UNVERSIONED == 1
    chat = cli("chat", old_run, "--prompt", "Name a primary colour.", "--max-new-tokens", 4)
    assert chat.returncode == 0 and "prompt format: alpaca (as the run trained)" in chat.stderr, chat.stderr[-2000:]

    # Eight of the rows it trained on (scoring all 307 twice costs 15 s of CPU): the adapter scores below the base.
    sample = tmp_path / "eight.jsonl"
    sample.write_text("".join((REPO / "recipes" / "data" / "demo_instructions.jsonl").open().readlines()[:8]))
    scored = cli("eval", old_run, "--data", sample)
    assert scored.returncode == 0, scored.stderr[-2000:]
    scores = json.loads((old_run / "eval-eight.json").read_text())
    assert scores["tuned"]["loss"] < scores["base"]["loss"] and scores["sequences"] == 8, scores

    merged = tmp_path / "merged"
    done = cli("merge", old_run, "-o", merged)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (merged / "finetune_recipe.yaml").is_file() and not (merged / "finetune_format.json").exists()
    assert_merged_is_base_plus_adapter(merged, tiny_dir, old_run / "adapter")
    if importlib.util.find_spec("conversion") is not None:  # llama.cpp's converter: the export extra
        exported = cli("export", merged, "--gguf", "f16", "-o", tmp_path / "gguf", "--no-verify")
        assert exported.returncode == 0, exported.stderr[-2000:]
        assert "the Alpaca prompt the run trained with" in exported.stderr + exported.stdout
    if importlib.util.find_spec("huggingface_hub") is not None:  # the publish extra
        published = cli("publish", old_run, "--repo", "me/old-run", "--dry-run")
        assert published.returncode == 0 and "(adapter, " in published.stdout, published.stderr[-2000:]
        assert "finetune_format.json" in published.stdout  # its recipe goes out in this finetune's format

    converted = cli("convert", old_run / "checkpoint-4", "-o", tmp_path / "adapter-4")
    assert converted.returncode == 0, converted.stderr[-2000:]
    saved = load_file(old_run / "adapter" / "adapter_model.safetensors")
    again = load_file(tmp_path / "adapter-4" / "adapter_model.safetensors")
    assert saved.keys() == again.keys() and all((saved[k] == again[k]).all() for k in saved)  # step 4 both


def test_an_old_run_directory_resumes_with_its_own_recipe(old_run):
    """What `finetune train RUN/recipe.yaml --output-dir RUN` checks: the recorded recipe read back gives the
    recorded resume key (nothing changed), and the newest checkpoint passes inspection."""
    from finetune.rundir.run_dir import RunDir
    from finetune.run.preflight import Preflight, resume_step

    recipe = RunDir(old_run).recipe()
    forced = Preflight()
    resume_step(old_run, recipe, world_size=2, resume=True, force=True, result=forced)
    assert not forced.run_dir_errors and forced.resume_from.name == "checkpoint-4", forced.run_dir_errors
    assert not [w for w in forced.warnings if "changed" in w], forced.warnings
    plain = Preflight()
    resume_step(old_run, recipe, world_size=2, resume=True, force=False, result=plain)
    assert "holds a finished run (summary.json)" in plain.run_dir_errors[0]
    moved = Preflight()
    resume_step(old_run, recipe.model_copy(update={"training": recipe.training.model_copy(update={"learning_rate": 0.02})}),
                world_size=2, resume=True, force=True, result=moved)
    assert any("although the recipe changed (--force-resume): training.learning_rate: 0.01 -> 0.02" in w
               for w in moved.warnings), moved.warnings


def test_an_old_run_directory_resumes_with_the_optimizer_that_wrote_its_checkpoints(old_run):
    """The run files `finetune train` writes in place before resuming keep the recorded Adam implementation
    (DeepSpeed's FusedAdam up to 2026-11-28, a block without torch_adam), where a fresh run of the same recipe steps
    torch's fused AdamW (finetune.render.with_torch_adam)."""
    from finetune.recipe import load_recipe
    from finetune.render import render_deepspeed
    from finetune.rundir.layout import write_run_dir

    recorded = json.loads((old_run / "deepspeed.json").read_text())
    assert "torch_adam" not in recorded["optimizer"]["params"]
    loaded = load_recipe(old_run / "recipe.yaml", [])
    assert render_deepspeed(loaded.recipe, 2)["optimizer"]["params"]["torch_adam"] is True
    write_run_dir(loaded, old_run, 2, in_place=True)
    again = json.loads((old_run / "deepspeed.json").read_text())
    assert again["optimizer"] == recorded["optimizer"]
    assert (old_run / "checkpoint-4").is_dir()  # in place: the checkpoints stay


# ------------------------------------------------------------------------------------------------
# The format version and the migrations table


def test_a_new_run_directory_records_todays_format(write_recipe, tmp_path):
    from finetune.recipe import load_recipe
    from finetune.rundir.layout import write_run_dir

    run = write_run_dir(load_recipe(write_recipe()), tmp_path / "run", world_size=1)
    assert json.loads((run / "format.json").read_text()) == {"format_version": run_format.FORMAT_VERSION}
    assert run_format.recorded_version(run / "recipe.yaml") == run_format.FORMAT_VERSION


def test_a_renamed_key_is_migrated_when_an_older_run_directory_is_read(tmp_path, monkeypatch):
    """A synthetic rename (format 2 calls training.learning_rate what format 1 called training.lr)."""
    from finetune.rundir.errors import RunDirError
    from finetune.rundir.run_dir import RunDir

    run = tmp_path / "run"
    run.mkdir()
    recorded = (FIXTURES[0] / "recipe.yaml").read_text()
    (run / "recipe.yaml").write_text(recorded.replace("  learning_rate: 0.01\n", "  lr: 0.02\n"))  # format 1, "old"
    monkeypatch.setattr(run_format, "FORMAT_VERSION", 2)
    with pytest.raises(RunDirError, match=r"recipe.yaml: cannot read the run's recipe: .*training.lr"):
        RunDir(run).recipe()  # no migration registered: the old key is unknown to today's schema
    monkeypatch.setattr(migrations, "MIGRATIONS", {1: (migrations.Rename("training.lr", "training.learning_rate"),)})
    assert RunDir(run).recipe().training.learning_rate == 0.02
    (run / "format.json").write_text('{"format_version": 2}\n')  # already today's: nothing to migrate
    with pytest.raises(RunDirError, match="training.lr"):
        RunDir(run).recipe()


def test_a_newer_format_is_one_line_from_every_reader(old_run, tmp_path, cli):
    from finetune.rundir.checkpoint import plan_resume
    from finetune.rundir.run_dir import read_recipe_data

    (old_run / "format.json").write_text('{"format_version": 1}\n')
    merged = tmp_path / "merged"
    assert cli("merge", old_run, "-o", merged).returncode == 0
    assert json.loads((merged / "finetune_format.json").read_text()) == {"format_version": 1}  # travels with the recipe

    newer = f"written by a newer finetune (run directory format 7; this one reads formats up to {run_format.FORMAT_VERSION})"
    (old_run / "format.json").write_text('{"format_version": 7}\n')
    (merged / "finetune_format.json").write_text('{"format_version": 7}\n')
    for args in (("chat", old_run, "--prompt", "x"), ("eval", old_run), ("merge", old_run, "-o", tmp_path / "m2"),
                 ("chat", merged, "--prompt", "x")):
        done = cli(*args)
        assert done.returncode == 1 and newer in done.stderr and "Traceback" not in done.stderr, (args, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    plan = plan_resume(old_run, read_recipe_data(FIXTURES[0] / "recipe.yaml"), 2, 1, resume=True, force=True)
    assert newer in plan.error and plan.checkpoint is None
    (old_run / "format.json").write_text('{"version": 1}\n')
    with pytest.raises(Exception, match=r"format.json: cannot read the run directory's format: expected"):
        read_recipe_data(old_run / "recipe.yaml")
