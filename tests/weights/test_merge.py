"""`finetune merge`: bit-identical to PEFT's merge_and_unload, and safe with bad inputs.

Every equality test builds a tiny random model and adapter (tests/weights/merge_fixtures.py), merges it with
the streaming merge and with PEFT (from_pretrained -> PeftModel -> merge_and_unload -> save_pretrained),
and compares every saved tensor with torch.equal.
"""

from __future__ import annotations

import glob
import hashlib
import io
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
from safetensors.torch import load_file, save_file  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

import finetune.weights.merge as merge_mod  # noqa: E402
from finetune.cli import app  # noqa: E402
from finetune.weights.merge import merge  # noqa: E402
from finetune.weights.merge_inputs import resolve_inputs  # noqa: E402
from finetune.weights.verify import verify  # noqa: E402
from finetune.weights.errors import MergeError  # noqa: E402
from finetune.weights.safetensors_io import human_size  # noqa: E402
from tests.conftest import REPO  # noqa: E402
from tests.weights.merge_fixtures import (assert_same, build_adapter, build_gpt2, build_llama,  # noqa: E402
                                  peft_merged_state_dict, safetensors_data_bytes)

runner = CliRunner()


def load_dir(path: Path) -> dict:
    tensors: dict = {}
    for file in sorted(glob.glob(str(path / "*.safetensors"))):
        tensors.update(load_file(file))
    return tensors


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Base models shared by the tests of this module (built once: ~1 s each)."""
    root = tmp_path_factory.mktemp("bases")
    return {
        "bf16": build_llama(root / "bf16"),
        "fp32": build_llama(root / "fp32", dtype="float32"),
        "fp16": build_llama(root / "fp16", dtype="float16"),
        "tied": build_llama(root / "tied", tie=True),
        "bias": build_llama(root / "bias", attention_bias=True, tokenizer=False),
        "wide": build_llama(root / "wide", hidden_size=96, tokenizer=False),
        "gpt2": build_gpt2(root / "gpt2"),
    }


@pytest.fixture(scope="module")
def bf16_adapter(models, tmp_path_factory):
    return build_adapter(models["bf16"], tmp_path_factory.mktemp("adapters") / "plain")


CASES = {
    "plain-bf16": ("bf16", {}),
    "plain-fp32": ("fp32", {}),
    "plain-fp16": ("fp16", {}),
    "rslora": ("bf16", {"use_rslora": True, "lora_alpha": 16}),
    # Patterns as PEFT matches them: a suffix at a dot boundary, first match wins, regexes allowed.
    "rank-alpha-patterns": ("bf16", {"rank_pattern": {"q_proj": 2, r"layers\.1\.mlp\.down_proj": 8},
                                     "alpha_pattern": {"layers.1.self_attn.v_proj": 3, "o_proj": 32}}),
    "modules-to-save": ("bf16", {"modules_to_save": ["lm_head", "embed_tokens"]}),
    "tied-embeddings": ("tied", {}),
    "tied-lora-on-embeddings": ("tied", {"target_modules": ["q_proj", "embed_tokens"]}),
    "tied-lora-on-head": ("tied", {"target_modules": ["v_proj", "lm_head"]}),
    "embedding-lora": ("bf16", {"target_modules": ["q_proj", "embed_tokens", "lm_head"]}),
    "dora": ("bf16", {"use_dora": True}),
    "lora-bias": ("bias", {"lora_bias": True, "bias": "lora_only", "target_modules": ["q_proj", "k_proj"]}),
    "bias-all": ("bias", {"bias": "all", "target_modules": ["q_proj", "v_proj"]}),
    "gpt2-fan-in-fan-out": ("gpt2", {"target_modules": ["c_attn", "c_proj", "c_fc"], "fan_in_fan_out": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bit_identical_to_peft(case, models, tmp_path):
    base_kind, lora = CASES[case]
    base = models[base_kind]
    adapter = build_adapter(base, tmp_path / "adapter", **lora)
    merge(base, adapter, tmp_path / "out")
    assert_same(load_dir(tmp_path / "out"), peft_merged_state_dict(base, adapter))


def test_sharded_output_and_index(models, bf16_adapter, tmp_path):
    out = tmp_path / "out"
    result = merge(models["bf16"], bf16_adapter, out, max_shard_size=60_000, fsync=True)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert result.shards == len(files) > 2
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors = load_dir(out)
    assert set(index["weight_map"]) == set(tensors)
    assert set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert_same(tensors, peft_merged_state_dict(models["bf16"], bf16_adapter))
    # The merged directory is a complete model: config, generation config, tokenizer, chat template.
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).is_file(), name


def test_dtype_float32_equals_peft_on_a_float32_base(models, bf16_adapter, tmp_path):
    # --dtype float32 keeps float32(W) + delta unrounded: what PEFT computes on a base loaded in float32.
    merge(models["bf16"], bf16_adapter, tmp_path / "out", dtype="float32")
    assert_same(load_dir(tmp_path / "out"), peft_merged_state_dict(models["bf16"], bf16_adapter, dtype="float32"))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "float32"


def test_base_and_adapter_are_never_written(models, bf16_adapter, tmp_path):
    def digest(folder: Path) -> dict:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}

    before = digest(models["bf16"]), digest(bf16_adapter)
    merge(models["bf16"], bf16_adapter, tmp_path / "out")
    assert (digest(models["bf16"]), digest(bf16_adapter)) == before


def test_merge_path_imports_neither_transformers_nor_peft():
    code = ("import sys, finetune.weights.merge; "
            "print(sorted(m for m in ('transformers', 'peft', 'deepspeed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ------------------------------------------------------------------------------------------------
# Run directories


def make_run(tmp_path: Path, base: Path, adapter: Path, recipe_base: str | None) -> Path:
    import shutil

    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(adapter, run / "adapter")
    if recipe_base is not None:
        (run / "recipe.yaml").write_text(f"model:\n  name_or_path: {recipe_base}\nmethod: lora\ndata:\n  path: d.jsonl\n")
    return run


def test_run_dir_reads_base_from_recipe(models, bf16_adapter, tmp_path):
    run = make_run(tmp_path, models["bf16"], bf16_adapter, str(models["bf16"]))
    config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "/nonexistent"  # the recipe wins
    (run / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    result = runner.invoke(app, ["merge", str(run), "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "merged 14 LoRA layers" in result.output
    assert_same(load_dir(tmp_path / "out"), peft_merged_state_dict(models["bf16"], bf16_adapter))


def test_run_dir_falls_back_to_adapter_config(models, bf16_adapter, tmp_path):
    run = make_run(tmp_path, models["bf16"], bf16_adapter, None)
    inputs = resolve_inputs(run, None, None)
    assert inputs.base == models["bf16"] and inputs.adapter == run / "adapter"


def test_run_dir_with_hub_base_says_download(models, bf16_adapter, tmp_path):
    run = make_run(tmp_path, models["bf16"], bf16_adapter, "meta-llama/Meta-Llama-3-8B")
    config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "meta-llama/Meta-Llama-3-8B"
    (run / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    result = runner.invoke(app, ["merge", str(run), "-o", str(tmp_path / "out")])
    assert result.exit_code == 1
    assert "not found locally" in result.output and "--base" in result.output


# ------------------------------------------------------------------------------------------------
# Bad inputs: a clear one-line reason, exit 1, and no output directory (nor leftovers beside it)


def cli_fails(tmp_path: Path, *args: str, code: int = 1) -> str:
    result = runner.invoke(app, ["merge", *args, "-o", str(tmp_path / "out")])
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.*"))  # no temporary directory left behind
    return result.output


def test_adapter_of_another_architecture(models, tmp_path):
    gpt2_adapter = build_adapter(models["gpt2"], tmp_path / "gpt2-adapter", target_modules=["c_attn"])
    out = cli_fails(tmp_path, "--base", str(models["bf16"]), "--adapter", str(gpt2_adapter))
    assert "matches no base tensor" in out and "GPT2LMHeadModel" in out


def test_adapter_of_another_shape(models, tmp_path):
    wide_adapter = build_adapter(models["wide"], tmp_path / "wide-adapter")
    out = cli_fails(tmp_path, "--base", str(models["bf16"]), "--adapter", str(wide_adapter))
    assert "does not fit" in out and "update but the base" in out


def test_adapter_weights_missing(models, bf16_adapter, tmp_path):
    import shutil

    adapter = tmp_path / "adapter"
    shutil.copytree(bf16_adapter, adapter)
    (adapter / "adapter_model.safetensors").unlink()
    assert "no adapter_model.safetensors" in cli_fails(tmp_path, "--base", str(models["bf16"]), "--adapter", str(adapter))


def test_adapter_config_missing(models, tmp_path):
    (tmp_path / "adapter").mkdir()
    assert "no adapter_config.json" in cli_fails(tmp_path, "--base", str(models["bf16"]), "--adapter", str(tmp_path / "adapter"))


def test_base_shard_missing(models, bf16_adapter, tmp_path):
    import shutil

    base = tmp_path / "base"
    shutil.copytree(models["bf16"], base)
    index = {"metadata": {"total_size": 1}, "weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}}
    (base / "model.safetensors.index.json").write_text(json.dumps(index))
    out = cli_fails(tmp_path, "--base", str(base), "--adapter", str(bf16_adapter))
    assert "model-00002-of-00002.safetensors: listed in model.safetensors.index.json but missing" in out


def test_base_without_safetensors(bf16_adapter, tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    (base / "pytorch_model.bin").write_bytes(b"")
    out = cli_fails(tmp_path, "--base", str(base), "--adapter", str(bf16_adapter))
    assert "no model.safetensors" in out and "pytorch_model.bin" in out


def test_hub_id_base(bf16_adapter, tmp_path):
    out = cli_fails(tmp_path, "--base", "meta-llama/Meta-Llama-3-8B", "--adapter", str(bf16_adapter))
    assert "hub id" in out and "huggingface-cli download" in out and "local files only" in out


def test_not_enough_disk_space(models, bf16_adapter, tmp_path, monkeypatch):
    import shutil

    monkeypatch.setattr(merge_mod.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12 - 1000, 1000))
    out = cli_fails(tmp_path, "--base", str(models["bf16"]), "--adapter", str(bf16_adapter))
    assert "not enough disk space" in out


def test_a_disk_that_fills_during_the_merge_is_one_line_naming_the_mount(models, bf16_adapter, tmp_path, monkeypatch):
    """Issue 34 item 9: ENOSPC, then BufferError, was a traceback; now the mount, the file, and nothing published."""
    import errno
    import os

    from finetune.rundir.checkpoint import mount_point

    real_write = os.write

    def full(fd, data):
        if fd > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full)
    out = tmp_path / "out"
    result = runner.invoke(app, ["merge", "--base", str(models["bf16"]), "--adapter", str(bf16_adapter), "-o", str(out)])
    assert result.exit_code == 1 and result.exception is None or isinstance(result.exception, SystemExit), result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith(f"error: no space left on {mount_point(tmp_path)}: the output disk "
                                                     f"is full (writing {tmp_path}/.out."), result.output
    assert errors[0].endswith(f"model.safetensors); free some space, then run merge again ({out} was not changed)")
    assert not out.exists() and not list(tmp_path.glob(".out.*"))


def test_existing_output_needs_overwrite(models, bf16_adapter, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    args = ["merge", "--base", str(models["bf16"]), "--adapter", str(bf16_adapter), "-o", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 1 and "already exists" in result.output and "--overwrite" in result.output
    assert (out / "keep.txt").exists()
    # Issue 34: --overwrite replaces only a folder merge or convert wrote, never one holding anything else
    result = runner.invoke(app, args + ["--overwrite"])
    assert result.exit_code == 1 and f"{out} holds keep.txt, which merge and convert never write" in result.output
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    (out / "keep.txt").unlink()
    (out / "model.safetensors").write_text("a previous merge")
    (out / "config.json").write_text("{}")
    result = runner.invoke(app, args + ["--overwrite"])
    assert result.exit_code == 0, result.output
    assert (out / "model.safetensors").stat().st_size > 100
    # Issue 34: through a link the output is replaced at the link's target; the link stays, nothing is left beside
    link = tmp_path / "link"
    link.symlink_to(out, target_is_directory=True)
    result = runner.invoke(app, ["merge", "--base", str(models["bf16"]), "--adapter", str(bf16_adapter), "-o", str(link),
                                 "--overwrite"])
    assert result.exit_code == 0, result.output
    assert link.is_symlink() and (out / "model.safetensors").is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["link", "out"]


def test_output_inside_an_input_is_refused(models, bf16_adapter, tmp_path):
    result = runner.invoke(app, ["merge", "--base", str(models["bf16"]), "--adapter", str(bf16_adapter),
                                 "-o", str(bf16_adapter / "merged")])
    assert result.exit_code == 1 and "never writes into its inputs" in result.output
    assert not (bf16_adapter / "merged").exists()


@pytest.mark.parametrize("change, message", [
    ({"peft_type": "IA3"}, "peft_type 'IA3' is not supported"),
    ({"init_lora_weights": "pissa"}, "changes the base weights"),
    ({"use_qalora": True}, "`use_qalora` is set"),
    ({"r": 8}, "has rank 4 but adapter_config.json gives it r=8"),
])
def test_unsupported_or_inconsistent_adapter_config(models, bf16_adapter, tmp_path, change, message):
    import shutil

    adapter = tmp_path / "adapter"
    shutil.copytree(bf16_adapter, adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config.update(change)
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    assert message in cli_fails(tmp_path, "--base", str(models["bf16"]), "--adapter", str(adapter))


def test_non_finite_result_is_refused(models, bf16_adapter, tmp_path):
    import shutil

    adapter = tmp_path / "adapter"
    shutil.copytree(bf16_adapter, adapter)
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
    tensors[key][0, 0] = float("inf")
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    out = cli_fails(tmp_path, "--base", str(models["bf16"]), "--adapter", str(adapter))
    assert "model.layers.1.mlp.up_proj has inf/NaN" in out


def _adapter_with(bf16_adapter, tmp_path, value: float) -> Path:
    import shutil

    adapter = tmp_path / "adapter"
    shutil.copytree(bf16_adapter, adapter)
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    tensors["base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"][0, 0] = value
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    return adapter


def test_result_beyond_the_output_dtype_is_refused(models, bf16_adapter, tmp_path):
    # Finite in float32, past float16's 65504 once stored: the output would hold inf.
    adapter = _adapter_with(bf16_adapter, tmp_path, 1e6)
    out = cli_fails(tmp_path, "--base", str(models["fp16"]), "--adapter", str(adapter))
    assert "model.layers.1.mlp.up_proj has inf/NaN" in out


def test_huge_but_finite_result_is_merged_like_peft(models, bf16_adapter, tmp_path):
    # Squares past float32's range send the merge to its exact finite check, which lets these through.
    adapter = _adapter_with(bf16_adapter, tmp_path, 1e30)
    merge(models["bf16"], adapter, tmp_path / "out")
    merged = load_dir(tmp_path / "out")
    assert merged["model.layers.1.mlp.up_proj.weight"].float().abs().max() > 1e29
    assert_same(merged, peft_merged_state_dict(models["bf16"], adapter))


def test_interrupted_merge_leaves_nothing(models, bf16_adapter, tmp_path, monkeypatch):
    calls = []
    real = merge_mod.output_tensor

    def interrupt_midway(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(merge_mod, "output_tensor", interrupt_midway)
    with pytest.raises(KeyboardInterrupt):
        merge(models["bf16"], bf16_adapter, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_on_write_reports_each_tensor_up_to_the_bytes_on_disk(models, bf16_adapter, tmp_path):
    seen = []
    result = merge(models["bf16"], bf16_adapter, tmp_path / "out", max_shard_size=60_000, on_write=seen.append)
    on_disk = sum(safetensors_data_bytes(p) for p in (tmp_path / "out").glob("*.safetensors"))
    assert result.shards > 2 and len(seen) == len(load_dir(tmp_path / "out"))
    assert [w.tensors for w in seen] == list(range(1, len(seen) + 1))
    assert all(a.bytes < b.bytes for a, b in zip(seen, seen[1:]))
    assert seen[-1].bytes == seen[-1].total_bytes == result.total_bytes == on_disk
    assert {(w.total_bytes, w.total_tensors) for w in seen} == {(on_disk, len(seen))}


def merge_cli(models, adapter, out):
    return runner.invoke(app, ["merge", "--base", str(models["bf16"]), "--adapter", str(adapter), "-o", str(out),
                               "--max-shard-size", "60KB"])


def test_merge_on_a_terminal_draws_a_progress_bar(models, bf16_adapter, tmp_path, monkeypatch):
    from rich.console import Console

    from finetune.run import progress
    from finetune.run.progress import WriteDisplay

    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=150)
    monkeypatch.setattr(progress, "wanted", lambda stream=None: True)
    monkeypatch.setattr(progress, "WriteDisplay", lambda what: WriteDisplay(what, console=console))
    result = merge_cli(models, bf16_adapter, tmp_path / "out")
    assert result.exit_code == 0, result.output
    drawn = screen.getvalue()
    count = len(load_dir(tmp_path / "out"))
    assert "\x1b[" in drawn and "merging" in drawn and "━" in drawn  # a live, redrawn bar
    assert f"{count}/{count} tensors" in drawn and "100%" not in result.output
    assert "wrote model-00001-of-" in drawn  # the log lines above the bar, not on plain stderr
    assert result.stderr == "" and result.stdout.startswith("merged ")


def test_merge_off_a_terminal_prints_the_plain_lines(models, bf16_adapter, tmp_path):
    result = merge_cli(models, bf16_adapter, tmp_path / "out")
    assert result.exit_code == 0, result.output
    files = sorted((tmp_path / "out").glob("*.safetensors"))
    assert result.stderr.splitlines() == [f"wrote {p.name} ({human_size(safetensors_data_bytes(p))})" for p in files]
    assert "\x1b" not in result.output and " tensors" not in result.output  # no bar
    assert result.stdout.startswith(f"merged 14 LoRA layers into {tmp_path / 'out'} ({len(files)} shards, ")


def test_missing_arguments_are_usage_errors(tmp_path):
    result = runner.invoke(app, ["merge", "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and "--base and --adapter" in result.output


# ------------------------------------------------------------------------------------------------
# --verify


def test_verify_passes_for_a_correct_merge(models, bf16_adapter, tmp_path):
    result = runner.invoke(app, ["merge", "--base", str(models["bf16"]), "--adapter", str(bf16_adapter),
                                 "-o", str(tmp_path / "out"), "--verify"])
    assert result.exit_code == 0, result.output
    assert "verify: max |logits merged - logits base+adapter|" in result.output


def test_verify_fails_for_a_wrong_merge(models, bf16_adapter, tmp_path):
    other = build_adapter(models["bf16"], tmp_path / "other", seed=7)
    merge(models["bf16"], other, tmp_path / "out")
    check = verify(tmp_path / "out", models["bf16"], bf16_adapter)
    assert not check.ok and check.max_abs_diff > check.tolerance


def test_merge_error_is_an_exception_with_a_message(models, tmp_path):
    with pytest.raises(MergeError, match="no such adapter directory"):
        merge(models["bf16"], tmp_path / "missing", tmp_path / "out")


def test_merge_of_the_runs_folder_lists_the_run_directories(tmp_path):
    for name in ("b", "a"):
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "recipe.yaml").write_text("name: x\n")
    with pytest.raises(MergeError, match=r"it holds run directories: .*runs/a, .*runs/b; give one of them"):
        resolve_inputs(tmp_path / "runs", None, None)


def small_effect_adapter(base: Path, path: Path) -> Path:
    """An adapter that moves the logits by well under 2% of their size (a short or gentle fine-tune)."""
    adapter = build_adapter(base, path)
    weights = path / "adapter_model.safetensors"
    tensors = {k: (v * 0.005 if "lora_B" in k else v) for k, v in load_file(str(weights)).items()}
    save_file(tensors, str(weights))
    return adapter


def test_verify_fails_a_merge_that_lost_one_lora_layer_of_a_small_adapter(models, tmp_path):
    adapter = small_effect_adapter(models["bf16"], tmp_path / "small")
    # The same adapter without one module's pair of LoRA tensors: the merge silently lacks that layer.
    lossy = tmp_path / "lossy"
    lossy.mkdir()
    (lossy / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    dropped = [k for k in tensors if "layers.1.mlp.down_proj" in k]
    assert len(dropped) == 2
    save_file({k: v for k, v in tensors.items() if k not in dropped}, str(lossy / "adapter_model.safetensors"))
    merge(models["bf16"], lossy, tmp_path / "lossy-out")
    check = verify(tmp_path / "lossy-out", models["bf16"], adapter)
    # A fixed bf16 tolerance of 2% of max(1, largest |logit|) is at least 0.02: it passed this merge.
    assert check.max_abs_diff < 2e-2
    assert not check.ok, check
    # The complete merge of the same small adapter passes, and its rounding is what the tolerance is made of.
    merge(models["bf16"], adapter, tmp_path / "good-out")
    good = verify(tmp_path / "good-out", models["bf16"], adapter)
    assert good.ok, good
    assert good.rounding > 0 and good.max_abs_diff < check.max_abs_diff


def test_verify_fails_a_merge_without_the_adapter(models, tmp_path):
    adapter = small_effect_adapter(models["bf16"], tmp_path / "small")
    check = verify(models["bf16"], models["bf16"], adapter)  # "merged" = the base itself
    assert not check.ok and check.max_abs_diff == pytest.approx(check.adapter_effect, rel=1e-3)


@pytest.mark.parametrize("kind,dtype", [("fp32", None), ("fp16", None), ("bf16", "float32"), ("bf16", "float16")])
def test_verify_passes_correct_merges_in_every_dtype(models, kind, dtype, tmp_path):
    adapter = small_effect_adapter(models[kind], tmp_path / "small")
    merge(models[kind], adapter, tmp_path / "out", dtype=dtype)
    check = verify(tmp_path / "out", models[kind], adapter)
    assert check.ok, check


# ------------------------------------------------------------------------------------------------
# Interrupted merges: SIGKILL leaves a partial directory, the next merge removes it; SIGTERM exits 143

_KILL_INSIDE_ATOMIC_DIR = """
import os, signal, sys
from pathlib import Path
from finetune.fsutil import atomic_dir
with atomic_dir(Path(sys.argv[1])) as tmp:
    (tmp / "model-00001-of-00002.safetensors").write_bytes(b"x" * 1000)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_next_merge_removes_partial_output_of_a_killed_merge(models, bf16_adapter, tmp_path):
    out = tmp_path / "out"
    killed = subprocess.run([sys.executable, "-c", _KILL_INSIDE_ATOMIC_DIR, str(out)], cwd=REPO)
    assert killed.returncode == -9
    [stale] = tmp_path.glob(".out.*.partial")
    # A partial directory whose writer still lives is never touched.
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        busy = tmp_path / ".out.busy.partial"
        busy.mkdir()
        (busy / ".finetune-owner.json").write_text(json.dumps({"pid": alive.pid, "host": socket.gethostname()}))
        result = runner.invoke(app, ["merge", "--base", str(models["bf16"]), "--adapter", str(bf16_adapter), "-o", str(out)])
        assert result.exit_code == 0, result.output
        assert f"removed {stale}" in result.stderr and "which is gone" in result.stderr
        assert not stale.exists() and busy.is_dir()
        assert not list(out.glob(".finetune-owner.json"))  # the owner note never reaches the output
    finally:
        alive.kill()
        alive.wait()


_SIGTERM_WHILE_WRITING = """
import os, signal, sys
import finetune.weights.merge as m
from finetune.cli import main
real = m.write_shards
def write_then_terminate(*args, **kwargs):
    real(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGTERM)
m.write_shards = write_then_terminate
sys.argv = ["finetune", "merge", "--base", sys.argv[1], "--adapter", sys.argv[2], "-o", sys.argv[3]]
main()
"""


def test_sigterm_exits_143_in_one_line_and_leaves_nothing(models, bf16_adapter, tmp_path):
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-c", _SIGTERM_WHILE_WRITING, str(models["bf16"]), str(bf16_adapter), str(out)],
                            capture_output=True, text=True, cwd=REPO, timeout=300)
    assert result.returncode == 143, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: merge stopped by SIGTERM; the partial output was removed and {out} was not touched"]
    assert "Traceback" not in result.stderr
    assert not out.exists() and not list(tmp_path.glob(".out.*"))


# ------------------------------------------------------------------------------------------------
# Issue 25 item 5: publish only what --verify passed; the debris of a killed merge is cleaned by the next


def test_a_merge_that_fails_verify_is_not_published(models, tmp_path, monkeypatch):
    import finetune.weights.merge as merge_module

    adapter = small_effect_adapter(models["bf16"], tmp_path / "small")
    real_plan = merge_module.plan_merge

    def lossy_plan(*args, **kwargs):  # a merge that silently lacks one LoRA layer
        plan = real_plan(*args, **kwargs)
        next(t for t in plan.tensors if t.update is not None).update = None
        return plan

    monkeypatch.setattr(merge_module, "plan_merge", lossy_plan)
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_text("the previous output")
    result = runner.invoke(app, ["merge", "--base", str(models["bf16"]), "--adapter", str(adapter), "-o", str(out),
                                 "--verify", "--overwrite"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "error: verify: the merged model does not reproduce base + adapter; it was not published" in result.output
    assert (out / "model.safetensors").read_text() == "the previous output"  # the old output is still there
    assert not list(tmp_path.glob(".out.*"))


def test_the_next_merge_removes_what_a_killed_merge_left(models, bf16_adapter, tmp_path):
    import os
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a PID of this host whose process is gone
    old = tmp_path / f".out.old-{gone.pid}"  # killed while deleting the output it replaced
    partial = tmp_path / f".out.{gone.pid}.x1y2.partial"  # killed between the swap's renames (no owner file)
    live = tmp_path / f".out.{os.getpid()}.a1b2.partial"  # a writer still alive: left alone
    for folder in (old, partial, live):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"\0" * 1000)
    result = runner.invoke(app, ["merge", "--base", str(models["bf16"]), "--adapter", str(bf16_adapter),
                                 "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert not old.exists() and not partial.exists() and live.exists()
    assert f"removed {old} (1.0 kB), left by process {gone.pid} which is gone" in result.output
