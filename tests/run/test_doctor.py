"""finetune.run.doctor: version floors and recipe checks on fake machines, and the real `finetune doctor`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from finetune.cli import app

from finetune.run.doctor import checks_for_recipe, failed, machine_checks, report, run_doctor, satisfies
from finetune.run.machine import Facts, Gpu
from tests.conftest import hub_recipe as recipe
from tests.conftest import run_cli

GOOD = {"torch": "2.5.1+cu124", "deepspeed": "0.16.2", "transformers": "4.46.3", "peft": "0.14.0",
        "bitsandbytes": "0.45.0", "accelerate": "1.2.1", "datasets": "3.2.0", "trl": "1.16.0", "flash-attn": None,
        "tensorboard": "2.18.0"}
# transformers 5 is the runner's floor; 4.46 is fine for QLoRA + ZeRO-3 but not for `finetune train`.
GOOD["transformers"] = "5.0.0"
RTX_4070 = Gpu(0, "NVIDIA GeForce RTX 4070", 12 * 2**30, (8, 9))
P40 = Gpu(0, "Tesla P40", 24 * 2**30, (6, 1))


def facts(gpus=(RTX_4070, RTX_4070), **versions) -> Facts:
    packages = dict(GOOD)
    packages.update({k.replace("_", "-"): v for k, v in versions.items()})
    gpus = [Gpu(i, g.name, g.memory_bytes, g.capability) for i, g in enumerate(gpus)]
    return Facts(python="3.11.9", platform="Linux", packages=packages, torch_cuda="12.4" if gpus else None,
                 cuda_available=bool(gpus), nccl="2.21.5" if gpus else None, gpus=gpus,
                 nvcc="/usr/local/cuda/bin/nvcc" if gpus else None)


def by_name(checks):
    return {c.name: c for c in checks}


QLORA_Z3 = dict(method="qlora", deepspeed={"stage": 3})


@pytest.mark.parametrize("version,spec,ok", [
    ("0.43.3", ">=0.43.3", True), ("0.43.2", ">=0.43.3", False), ("0.44.0", ">=0.43.3", True),
    ("4.44.2", ">4.44.2", False), ("4.45.0.dev0", ">4.44.2", True),
    # PEP 440: `>V` excludes V's post-releases (pip reads it so; the hand-written parser let it through)
    ("4.44.2.post1", ">4.44.2", False), ("4.44.3", ">4.44.2", True),
    ("2.5.1+cu124", ">=2.3", True), ("1.0.1", ">=1.0.1", True), ("1.0.1rc1", ">=1.0.1", False),
    ("0.13.0", ">0.13.0", False), ("0.13.1", ">0.13.0", True),
    # local builds and pre-releases as pip installs them
    ("2.13.0+cpu", ">=2.13", True), ("2.13.0+cpu", ">=2.3", True), ("2.12.1+cu124", ">=2.13", False),
    ("0.19.8.dev0", ">=0.15.4", True), ("0.19.8.dev0", ">=0.19.8", False), ("0.19.8", ">=0.19.8.dev0", True),
    ("2.6.0", ">=2.6,<3", True), ("3.0.0", ">=2.6,<3", False),
    ("not a version", ">=1.0", False),  # unparseable: reported as too old, so it is looked at
])
def test_version_floors(version, spec, ok):
    assert satisfies(version, spec) is ok


def test_qlora_zero3_floors_fail_with_the_pip_command():
    checks = by_name(checks_for_recipe(recipe(**QLORA_Z3), facts(bitsandbytes="0.43.1", peft="0.13.0", trl=None)))
    bnb, peft = checks["qlora-zero3.bitsandbytes"], checks["qlora-zero3.peft"]
    assert bnb.status == "fail" and "0.43.1" in bnb.message and bnb.fix == "pip install -U 'bitsandbytes>=0.43.3'"
    assert peft.status == "fail" and peft.fix == "pip install -U 'peft>0.13.0'"
    assert checks["qlora-zero3.accelerate"].status == "ok"
    assert "qlora-zero3.trl" not in checks  # trl is not installed: not needed


def test_trl_counts_only_when_installed():
    assert by_name(checks_for_recipe(recipe(**QLORA_Z3), facts(trl="0.11.4")))["qlora-zero3.trl"].status == "fail"
    assert by_name(checks_for_recipe(recipe(**QLORA_Z3), facts(trl="0.12.0")))["qlora-zero3.trl"].status == "ok"


def test_old_bitsandbytes_is_fine_without_zero3():
    checks = checks_for_recipe(recipe(method="qlora", deepspeed={"stage": 2}), facts(bitsandbytes="0.43.1"))
    assert not failed(checks)


def test_qlora_needs_an_importable_bitsandbytes():
    missing = by_name(checks_for_recipe(recipe(method="qlora"), facts(bitsandbytes=None)))
    assert missing["qlora.bitsandbytes"].status == "fail"
    broken_facts = facts()
    broken_facts.import_errors["bitsandbytes"] = "OSError: libcudart.so.12: cannot open shared object file"
    broken = by_name(checks_for_recipe(recipe(method="qlora"), broken_facts))["qlora.bitsandbytes"]
    assert broken.status == "fail" and "libcudart" in broken.message
    assert not failed(checks_for_recipe(recipe(method="lora"), facts(bitsandbytes=None)))


def test_missing_deepspeed_fails_the_recipe():
    check = by_name(checks_for_recipe(recipe(), facts(deepspeed=None)))["train.deepspeed"]
    assert check.status == "fail" and check.fix.startswith("pip install")


def test_qlora_without_bitsandbytes_names_the_extra_to_install(tmp_path):
    check = by_name(checks_for_recipe(recipe(method="qlora"), facts(bitsandbytes=None)))["qlora.bitsandbytes"]
    assert check.fix == "pip install 'finetune[qlora]'"
    # ... and `finetune train`'s preflight says it in one line
    from finetune.run.preflight import run_preflight
    from finetune.recipe import load_recipe

    path = tmp_path / "r.yaml"
    path.write_text("model: {name_or_path: org/m}\nmethod: qlora\ndata: {path: org/d}\n")
    errors = run_preflight(load_recipe(path), tmp_path / "run", facts=facts(bitsandbytes=None)).errors
    assert [e for e in errors if "bitsandbytes" in e] == [
        "environment: method: qlora needs bitsandbytes, which is not installed (fix: pip install 'finetune[qlora]')"]


def test_reporting_to_tensorboard_needs_it_installed():
    missing = by_name(checks_for_recipe(recipe(), facts(tensorboard=None)))["tensorboard"]
    assert missing.status == "fail" and "training.report_to: tensorboard" in missing.message
    assert missing.fix.startswith("pip install 'tensorboard>=2.15'") and "report_to: [none]" in missing.fix
    assert "tensorboard" not in by_name(checks_for_recipe(recipe(training={"report_to": ["none"]}), facts(tensorboard=None)))
    # the Trainer's callback falls back to tensorboardX
    assert "tensorboard" not in by_name(checks_for_recipe(recipe(), facts(tensorboard=None, tensorboardX="2.6.2")))
    broken_facts = facts()
    broken_facts.import_errors["tensorboard"] = "ImportError: cannot import name 'builder' from 'google.protobuf.internal'"
    broken = by_name(checks_for_recipe(recipe(), broken_facts))["tensorboard"]
    assert broken.status == "fail" and "protobuf" in broken.message and "--force-reinstall" in broken.fix


def test_more_processes_than_gpus():
    check = by_name(checks_for_recipe(recipe(launch={"procs_per_node": 4}), facts()))["device"]
    assert check.status == "fail" and "4" in check.message and "2 GPU" in check.message


def test_bf16_on_a_gpu_without_it():
    checks = by_name(checks_for_recipe(recipe(), facts(gpus=(P40, P40))))
    assert checks["device.bf16"].status == "fail" and "Tesla P40" in checks["device.bf16"].message
    assert "float16" in checks["device.bf16"].fix
    assert "device.bf16" not in by_name(checks_for_recipe(recipe(model={"name_or_path": "m", "dtype": "float16"}),
                                                          facts(gpus=(P40,))))


def test_a_recipe_for_other_hardware_warns():
    check = by_name(checks_for_recipe(recipe(hardware={"gpus": 2}), facts(gpus=())))["device.hardware"]
    assert check.status == "warn" and "meant for 2 GPU(s)" in check.message and "0 are visible" in check.message
    assert "device.hardware" not in by_name(checks_for_recipe(recipe(hardware={"gpus": 2}), facts()))


def test_no_gpu_means_cpu_processes():
    auto = by_name(checks_for_recipe(recipe(), facts(gpus=())))["device"]
    assert auto.status == "info" and "1 CPU process " in auto.message
    two = by_name(checks_for_recipe(recipe(launch={"procs_per_node": 2}), facts(gpus=())))["device"]
    assert "2 CPU processes" in two.message
    # procs_per_node: auto launches launch.cpu_procs processes, and says so
    cpu_procs = by_name(checks_for_recipe(recipe(launch={"cpu_procs": 2}), facts(gpus=())))["device"]
    assert "no GPU: 2 CPU processes" in cpu_procs.message


def test_a_torchrun_without_a_configurable_grace_period_is_named():
    old = facts()
    old.torchrun_shutdown_timeout = False  # torchrun kills the ranks 30 s after a signal
    check = by_name(checks_for_recipe(recipe(), old))["launch.stop_timeout"]
    assert check.status == "warn" and "launch.stop_timeout: 300 is cut to 30 s" in check.message
    assert check.fix == "pip install -U 'torch>=2.13'"
    short = recipe(launch={"stop_timeout": 30})
    assert "launch.stop_timeout" not in by_name(checks_for_recipe(short, old))
    new = facts()
    new.torchrun_shutdown_timeout = True
    assert "launch.stop_timeout" not in by_name(checks_for_recipe(recipe(), new))


def test_the_installed_torchrun_is_probed_for_its_grace_period():
    pytest.importorskip("torch")
    from finetune.run.machine import collect_facts

    assert collect_facts().torchrun_shutdown_timeout is True  # torch 2.13 reads TORCH_ELASTIC_SHUTDOWN_TIMEOUT


def test_flash_attention_needs_the_package_and_ampere():
    r = recipe(model={"name_or_path": "m", "attn_implementation": "flash_attention_2", "dtype": "float16"})
    checks = by_name(checks_for_recipe(r, facts(gpus=(P40,))))
    assert checks["flash-attn"].status == "fail" and checks["flash-attn.gpu"].status == "fail"
    assert not failed(checks_for_recipe(r.model_copy(update={"model": r.model.model_copy(update={"dtype": "bfloat16"})}),
                                        facts(flash_attn="2.7.0")))


def test_machine_checks_warn_on_qlora_zero3_floors_and_fail_on_missing_libraries():
    checks = by_name(machine_checks(facts(bitsandbytes="0.42.0")))
    assert checks["qlora-zero3.bitsandbytes"].status == "warn"
    assert not failed(list(checks.values()))
    assert by_name(machine_checks(facts(transformers=None)))["train.transformers"].status == "fail"
    assert by_name(machine_checks(facts(torch=None)))["torch"].status == "fail"
    no_gpu = by_name(machine_checks(facts(gpus=())))["gpu"]
    assert no_gpu.status == "warn" and no_gpu.fix


def test_a_recipe_turns_the_machine_warning_into_a_failure():
    _, checks = run_doctor(facts(bitsandbytes="0.42.0"), recipe=recipe(**QLORA_Z3))
    names = [c.name for c in checks]
    assert names.count("qlora-zero3.bitsandbytes") == 1
    assert by_name(checks)["qlora-zero3.bitsandbytes"].status == "fail"


def test_report_shape():
    f = facts()
    data = report(f, machine_checks(f))
    assert data["ok"] is True
    assert data["gpus"][0] == {"index": 0, "name": "NVIDIA GeForce RTX 4070", "memory_bytes": 12 * 2**30,
                               "memory_gib": 12.0, "compute_capability": "8.9", "bf16": True}
    assert data["torch"] == {"version": "2.5.1+cu124", "cuda": "12.4", "cuda_available": True, "nccl": "2.21.5",
                             "nvcc": "/usr/local/cuda/bin/nvcc"}


def test_a_gpu_box_without_nvcc_is_refused_before_deepspeed_compiles_fusedadam(tmp_path, monkeypatch):
    """An image with the CUDA runtime and no toolkit: DeepSpeed's JIT build of FusedAdam (`torch_adam: false`
    written) or FusedLion fails on the first run, after the model loaded. The default AdamW (torch's fused AdamW),
    CPU Adam (offload) or a built op need no nvcc."""
    import dataclasses

    import torch

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    bare = dataclasses.replace(facts(), nvcc=None)
    fused_adam = recipe(method="lora", deepspeed={"overrides": {"optimizer": {"params": {"torch_adam": False}}}})
    [check] = [c for c in checks_for_recipe(fused_adam, bare) if c.name == "deepspeed.nvcc"]
    assert check.status == "fail" and "fused_adam" in check.message and "torch_adam: false" in check.fix
    [check] = [c for c in checks_for_recipe(recipe(method="lora", training={"optimizer": "lion"}), bare)
               if c.name == "deepspeed.nvcc"]
    assert check.status == "fail" and "fused_lion" in check.message and "torch_adam" not in check.fix
    torch_adam = recipe(method="lora", deepspeed={"overrides": {"optimizer": {"params": {"torch_adam": True}}}})
    offload = recipe(method="lora", deepspeed={"stage": 2, "offload_optimizer": "cpu"})
    for fine in (recipe(method="lora"), recipe(method="full", deepspeed={"stage": 3}), torch_adam, offload):
        assert "deepspeed.nvcc" not in by_name(checks_for_recipe(fine, bare))
    assert "deepspeed.nvcc" not in by_name(checks_for_recipe(fused_adam, facts()))  # nvcc found
    built = tmp_path / "fused_adam"  # compiled before (finetune doctor --build-ops on a box with the toolkit)
    built.mkdir()
    (built / "fused_adam.so").write_bytes(b"")
    (built / "build.ninja").write_text(f"cflags = -isystem {Path(torch.__file__).parent / 'include'}\n")
    assert "deepspeed.nvcc" not in by_name(checks_for_recipe(fused_adam, bare))


def test_a_resumed_run_that_recorded_fusedadam_is_refused_without_nvcc(tmp_path, monkeypatch):
    """A run started before 2026-11-28 recorded DeepSpeed's FusedAdam, and its resume keeps it
    (finetune.rundir.layout.with_recorded_optimizer): the ops a launch into that run directory compiles, and so the
    nvcc check, read the record. Replacing the directory (--overwrite: no run_dir) renders torch's fused AdamW."""
    import dataclasses
    import shutil

    from finetune.run.deepspeed_ops import FUSED_ADAM_OP, recipe_ops

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ops"))  # nothing built
    run_dir = tmp_path / "run"
    shutil.copytree(Path(__file__).parents[1] / "fixtures" / "rundirs" / "2026-11-27", run_dir)
    bare = dataclasses.replace(facts(), nvcc=None)
    lora = recipe(method="lora", deepspeed={"enabled": True})
    assert recipe_ops("cuda", lora) == [] and recipe_ops("cuda", lora, run_dir) == [FUSED_ADAM_OP]
    assert "deepspeed.nvcc" not in by_name(checks_for_recipe(lora, bare))
    check = by_name(checks_for_recipe(lora, bare, run_dir))["deepspeed.nvcc"]
    assert check.status == "fail" and FUSED_ADAM_OP in check.message
    assert recipe_ops("cuda", lora, tmp_path / "empty") == []  # nothing recorded there


def test_a_lora_recipe_on_one_gpu_needs_no_nvcc_where_auto_trains_it_without_deepspeed(tmp_path, monkeypatch):
    """`deepspeed.enabled: auto` trains LoRA on one GPU with transformers' Trainer alone (finetune.plan.auto), which
    compiles no DeepSpeed op: an image without the CUDA toolkit may train it. `finetune doctor --recipe` judges the
    recipe train would run there (its auto keys decided for the machine), as train's preflight does; the same
    recipe through DeepSpeed's engine (two GPUs, or enabled: true) with DeepSpeed's FusedAdam (`torch_adam: false`)
    still needs nvcc."""
    import dataclasses

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # nothing built
    one = dataclasses.replace(facts(gpus=(RTX_4070,)), nvcc=None)
    two = dataclasses.replace(facts(), nvcc=None)
    lora = recipe(method="lora")
    fused_adam = {"overrides": {"optimizer": {"params": {"torch_adam": False}}}}
    assert "deepspeed.enabled" in lora.auto_keys
    assert "deepspeed.nvcc" not in by_name(run_doctor(one, lora)[1])
    assert "deepspeed.nvcc" not in by_name(run_doctor(two, lora)[1])  # ZeRO-2 with torch's fused AdamW
    assert by_name(run_doctor(two, recipe(method="lora", deepspeed=fused_adam))[1])["deepspeed.nvcc"].status == "fail"
    assert by_name(run_doctor(one, recipe(method="lora", deepspeed={"enabled": True, **fused_adam}))[1])[
        "deepspeed.nvcc"].status == "fail"
    # `finetune train`'s preflight on that box (a dry run): no refusal for the toolkit either
    from finetune.recipe import load_recipe
    from finetune.run.start import prepare
    from tests.conftest import write_local_inputs

    write_local_inputs(tmp_path)
    (tmp_path / "r.yaml").write_text("model: {name_or_path: ./model}\ndata: {path: data.jsonl}\nmethod: lora\n")
    prepared = prepare(load_recipe(tmp_path / "r.yaml", []), tmp_path / "run", facts=one, dry_run=True)
    try:
        assert prepared.loaded.recipe.deepspeed.enabled is False and prepared.builds is None
        assert not [e for e in prepared.preflight.errors if "nvcc" in e], prepared.preflight.errors
    finally:
        prepared.release()
    from finetune.run.deepspeed_ops import CPU_COMM_OP, recipe_ops

    plain = recipe(method="lora", deepspeed={"enabled": False})
    # the ranks still join the process group through deepspeed.init_distributed: on a CPU, its shared-memory op
    assert recipe_ops("cuda", plain) == [] and recipe_ops("cpu", plain) == [CPU_COMM_OP]
    from finetune.run.deepspeed_ops import build_ahead

    said: list[str] = []
    import os

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")  # build_ahead sets these as the launch would: put back after
    monkeypatch.setenv("PATH", os.environ["PATH"])
    assert build_ahead("cuda", plain, said.append) == []  # `doctor --build-ops --recipe` on that box
    assert said == ["no DeepSpeed op to compile: the recipe trains without DeepSpeed's engine here (deepspeed.enabled)"]


def test_cli_doctor_json():
    done = CliRunner().invoke(app, ["doctor", "--format", "json"])  # in-process: torch is imported once per session
    data = json.loads(done.stdout)
    assert set(data) >= {"python", "platform", "torch", "gpus", "packages", "checks", "ok"}
    assert set(data["packages"]) >= {"torch", "deepspeed", "transformers", "peft", "bitsandbytes", "accelerate", "datasets"}
    for check in data["checks"]:
        assert set(check) == {"name", "status", "message", "fix"}
        assert check["status"] in ("ok", "info", "warn", "fail")
    assert done.exit_code == (0 if data["ok"] else 1)
    assert done.exit_code == int(any(c["status"] == "fail" for c in data["checks"]))


def test_cli_doctor_rejects_unknown_format():
    done = run_cli("doctor", "--format", "xml")
    assert done.returncode == 2 and "--format" in done.stderr


# ----------------------------------------------------------------------------------------------
# The floors are pyproject's, read back from the installed package (finetune.run.requirements)


def _metadata_with(monkeypatch, **changed):
    """The installed package's Requires-Dist lines with some `train` floors replaced."""
    import importlib.metadata

    real = importlib.metadata.requires

    def requires(name):
        lines = real(name)
        if name != "finetune":
            return lines
        for package, spec in changed.items():
            lines = [f'{package}{spec}; extra == "train"' if line.startswith(package) and 'extra == "train"' in line
                     else line for line in lines]
        return lines

    monkeypatch.setattr(importlib.metadata, "requires", requires)


def test_a_floor_raised_in_the_package_metadata_changes_the_verdict(monkeypatch):
    assert by_name(checks_for_recipe(recipe(), facts(peft="0.14.0")))["train.peft"].status == "ok"
    _metadata_with(monkeypatch, peft=">=0.15")
    check = by_name(checks_for_recipe(recipe(), facts(peft="0.14.0")))["train.peft"]
    assert check.status == "fail" and check.fix == "pip install -U 'peft>=0.15'"
    _metadata_with(monkeypatch, torch=">=2.13")
    assert by_name(checks_for_recipe(recipe(), facts(torch="2.13.0+cpu")))["train.torch"].status == "ok"
    old = by_name(machine_checks(facts(torch="2.12.1+cu124")))["train.torch"]
    assert old.status == "fail" and old.fix == "pip install -U 'torch>=2.13'"


def test_markers_and_extras_decide_which_requirements_count():
    from packaging.requirements import Requirement

    from finetune.run.requirements import floors

    lines = ['typer>=0.12', 'peft>=0.14; extra == "train"', 'bitsandbytes>=0.43.3; extra == "qlora"',
             'old-lib>=1; extra == "train" and python_version < "3"', 'torch>=2.3; extra == "train"',
             'torch<3; extra == "train"']
    train = floors("train", [Requirement(line) for line in lines])
    assert {name: str(spec) for name, spec in train.items()} == {"peft": ">=0.14", "torch": "<3,>=2.3"}
    assert list(floors("qlora", [Requirement(line) for line in lines])) == ["bitsandbytes"]


def test_a_source_checkout_reads_the_same_floors_from_pyproject(monkeypatch):
    import importlib.metadata

    from finetune.run import requirements
    installed = {extra: requirements.extra_floors(extra) for extra in ("train", "qlora", "liger", "merge")}
    python = requirements.python_requirement()

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "requires", not_installed)
    monkeypatch.setattr(importlib.metadata, "metadata", not_installed)
    assert {extra: requirements.extra_floors(extra) for extra in installed} == installed
    assert requirements.python_requirement() == python
    # bitsandbytes is QLoRA's alone: a LoRA-only GPU box does not install it
    assert "bitsandbytes" not in installed["train"] and installed["qlora"] == {"bitsandbytes": ">=0.43.3"}


def test_python_older_than_requires_python_fails():
    old = facts()
    old.python = "3.9.18"
    check = by_name(machine_checks(old))["python"]
    assert check.status == "fail" and "needs >=3.10" in check.message
    assert by_name(machine_checks(facts()))["python"].status == "ok"
