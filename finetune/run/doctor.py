"""`finetune doctor`: is this machine's stack able to run a recipe? Checked before renting time on it.

Facts (Python, torch, CUDA, GPUs, NCCL, library versions) are gathered once into `Facts`; checks are
pure functions of facts (and of a recipe, for `finetune train`'s preflight), so tests feed fake
versions and GPUs without owning either. Versions come from importlib.metadata (no import); torch is
imported only for the GPU facts.

Example:

    $ finetune doctor
    python        3.11.9
    torch         2.5.1+cu124 (CUDA 12.4, NCCL 2.21.5)
    GPU 0         NVIDIA GeForce RTX 4070, 12.0 GiB, sm_89, bf16
    ...
    fail  qlora-zero3.bitsandbytes: bitsandbytes 0.43.1 is too old for QLoRA + ZeRO-3 (needs >= 0.43.3)
          fix: pip install -U 'bitsandbytes>=0.43.3'
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from finetune import objectives
from finetune.hints import runnable
from finetune.run.machine import BF16_MIN_CAPABILITY, PACKAGES, Facts, collect_facts, package_version
from finetune.run.requirements import extra_floors, python_requirement, satisfies
from finetune.units import gib_text

if TYPE_CHECKING:
    from finetune.recipe import Recipe

CHECKED_BY_FEATURE = {"tensorboard"}


def train_floors() -> dict[str, str]:
    """The floors of pyproject's `train` extra (finetune.run.requirements): below them the runner itself
    does not work (e.g. transformers 5 reads warmup_steps < 1 as a ratio, see
    dsconfig.render_training_args). Only the libraries the report shows: safetensors and tokenizers
    come with transformers; tensorboard and matplotlib are checked by what uses them."""
    return {name: spec for name, spec in extra_floors("train").items()
            if name in PACKAGES and name not in CHECKED_BY_FEATURE}


def extra_install(extra: str) -> str:
    return f"pip install 'finetune[{extra}]'"


# QLoRA under ZeRO-3 crashes with "Cannot copy out of meta tensor" on older stacks; these are the
# releases that taught each library to shard 4-bit weights (bnb quant_storage, accelerate's
# zero3 init, the HF/PEFT/TRL loaders). `trl` counts only when installed. Not pyproject's floors:
# what the bug reports name for this one combination (transformers and trl are not even floors there).
QLORA_ZERO3_FLOORS = {
    "bitsandbytes": ">=0.43.3",
    "accelerate": ">=1.0.1",
    "transformers": ">4.44.2",
    "peft": ">0.13.0",
    "trl": ">0.11.4",
}
OPTIONAL_FOR_QLORA_ZERO3 = {"trl"}

@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok, info, warn, fail
    message: str
    fix: Optional[str] = None

    def to_dict(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------------------------
# Versions

def pip_fix(package: str, spec: str) -> str:
    return f"pip install -U '{package}{spec}'"


def floor_checks(facts: Facts, floors: dict[str, str], topic: str, why: str,
                 optional: frozenset[str] | set[str] = frozenset(), severity: str = "fail") -> list[Check]:
    """One check per package: missing (unless optional) or below its floor -> `severity`."""
    checks = []
    for package, spec in floors.items():
        version = facts.version(package)
        name = f"{topic}.{package}"
        if version is None:
            if package in optional:
                continue
            checks.append(Check(name, severity, f"{package} is not installed ({why})", pip_fix(package, spec)))
        elif not satisfies(version, spec):
            checks.append(Check(name, severity, f"{package} {version} is too old {why}: needs {spec}", pip_fix(package, spec)))
        else:
            checks.append(Check(name, "ok", f"{package} {version} ({spec})"))
    return checks


# ----------------------------------------------------------------------------------------------
# Checks for the machine (`finetune doctor`)


def machine_checks(facts: Facts) -> list[Check]:
    checks = [python_check(facts)]
    checks += torch_checks(facts)
    checks += floor_checks(facts, {k: v for k, v in train_floors().items() if k != "torch"}, "train",
                           "for `finetune train`")
    # Only QLoRA + ZeRO-3 needs these, so on the machine as a whole they warn; a recipe that uses
    # the combination fails on them in `finetune train` (checks_for_recipe).
    checks += floor_checks(facts, QLORA_ZERO3_FLOORS, "qlora-zero3", "for QLoRA + ZeRO-3",
                           optional=OPTIONAL_FOR_QLORA_ZERO3 | {"bitsandbytes"}, severity="warn")
    checks += build_tool_checks(facts)
    for module, error in sorted(facts.import_errors.items()):
        if module != "torch":
            # Optional libraries (bitsandbytes) only break the recipes that use them: warn here.
            checks.append(Check(f"import.{module}", "warn", f"`import {module}` fails: {error}",
                                f"pip install --force-reinstall '{module}'"))
    return checks + deepspeed_release_checks(facts)


def deepspeed_release_checks(facts: Facts, recipe: Optional["Recipe"] = None) -> list[Check]:
    """The installed DeepSpeed against finetune.run.bad_releases: on the machine, a warning per release that
    breaks a common setup; for a recipe that uses the broken setup, the row's severity."""
    from finetune.run.bad_releases import matching

    version = facts.version("deepspeed")
    return [Check(f"deepspeed.release.{row.issue.split('#')[1].split(',')[0]}", row.severity if recipe else "warn",
                  f"deepspeed {version} {row.what} with {row.setup} ({row.issue})", row.fix)
            for row in matching(version) if (row.uses(recipe) if recipe else row.severity == "fail")]


def python_check(facts: Facts) -> Check:
    need = str(python_requirement())  # pyproject's requires-python
    if not satisfies(facts.python, need):
        return Check("python", "fail", f"Python {facts.python} is not supported: needs {need}",
                     f"use Python {need} (e.g. uv venv --python 3.11)")
    return Check("python", "ok", f"Python {facts.python}")


# Before pytorch/pytorch#172596 (merged 2026-03-03) torchrun SIGKILLed the ranks 30 s after forwarding
# a stop signal, whatever TORCH_ELASTIC_SHUTDOWN_TIMEOUT said. torch 2.13 has it (read in its source);
# which release first shipped it is not verified here, so the check looks for the feature, not a number.
TORCHRUN_FIXED_GRACE_S = 30
SHUTDOWN_TIMEOUT_TORCH = "2.13"


def stop_timeout_checks(recipe: "Recipe", facts: Facts) -> list[Check]:
    """launch.stop_timeout is torchrun's TORCH_ELASTIC_SHUTDOWN_TIMEOUT; older torchrun ignores it."""
    from finetune.run.launch.commands import choose_launcher

    wanted = recipe.launch.stop_timeout
    if facts.torchrun_shutdown_timeout is not False or choose_launcher(recipe) != "torchrun" \
            or wanted <= TORCHRUN_FIXED_GRACE_S:
        return []
    return [Check("launch.stop_timeout", "warn",
                  f"torch {facts.version('torch')}'s torchrun kills the ranks {TORCHRUN_FIXED_GRACE_S} s after a stop "
                  f"signal (it ignores TORCH_ELASTIC_SHUTDOWN_TIMEOUT): launch.stop_timeout: {wanted} is cut to "
                  f"{TORCHRUN_FIXED_GRACE_S} s, and a checkpoint that takes longer to save after Ctrl-C or a preemption is lost",
                  pip_fix("torch", f">={SHUTDOWN_TIMEOUT_TORCH}"))]


def torch_checks(facts: Facts) -> list[Check]:
    version = facts.version("torch")
    floor = train_floors().get("torch", "")
    if version is None:
        return [Check("torch", "fail", "torch is not installed",
                      f"pip install 'torch{floor}' (see https://pytorch.org/get-started/locally/ for the CUDA build)")]
    if "torch" in facts.import_errors:
        return [Check("torch", "fail", f"`import torch` fails: {facts.import_errors['torch']}",
                      f"pip install --force-reinstall 'torch{floor}'")]
    checks = floor_checks(facts, {"torch": floor}, "train", "for `finetune train`")
    if not facts.cuda_available:
        build = f"CUDA {facts.torch_cuda} build" if facts.torch_cuda else "CPU-only build"
        hint = ("check the NVIDIA driver (nvidia-smi) and CUDA_VISIBLE_DEVICES" if facts.torch_cuda else
                "install a CUDA build: pip install torch --index-url https://download.pytorch.org/whl/cu124")
        checks.append(Check("gpu", "warn", f"no CUDA GPU visible (torch {version}, {build}): training runs on CPU only", hint))
        return checks
    checks.append(Check("gpu", "ok", f"{len(facts.gpus)} GPU(s), CUDA {facts.torch_cuda}"))
    no_bf16 = [g for g in facts.gpus if not g.bf16]
    if no_bf16:
        names = ", ".join(f"GPU {g.index} ({g.name}, sm_{g.capability[0]}{g.capability[1]})" for g in no_bf16)
        checks.append(Check("gpu.bf16", "warn", f"no bf16 on {names}", "use model.dtype: float16 in recipes for these GPUs"))
    if facts.nccl is None:
        checks.append(Check("nccl", "warn", "torch has no NCCL: multi-GPU training will fall back or fail",
                            "install a CUDA build of torch from https://pytorch.org/get-started/locally/"))
    else:
        checks.append(Check("nccl", "ok", f"NCCL {facts.nccl}"))
    return checks


# ----------------------------------------------------------------------------------------------
# Checks for one recipe (`finetune train` preflight)


def recipe_imports(recipe: "Recipe") -> tuple[str, ...]:
    """Modules to really import before training this recipe (the ones that break on import)."""
    return (("bitsandbytes",) if recipe.method == "qlora" else ()) + \
        (("tensorboard",) if "tensorboard" in recipe.training.report_to else ())


def checks_for_recipe(recipe: "Recipe", facts: Optional[Facts] = None, run_dir: Optional[Path] = None) -> list[Check]:
    """The environment checks that concern `recipe`; status `fail` stops `finetune train`. `run_dir`: the run
    directory a resume writes into in place, whose recorded optimizer the run keeps (deepspeed_ops.recipe_ops)."""
    if facts is None:
        facts = collect_facts(recipe_imports(recipe))
    checks = torch_install_checks(facts)
    needed = {k: v for k, v in train_floors().items() if k != "torch" and not (k == "peft" and recipe.method == "full")}
    checks += floor_checks(facts, needed, "train", "for `finetune train`")
    if recipe.method == "qlora":
        checks += qlora_checks(recipe, facts)
    if "tensorboard" in recipe.training.report_to:
        checks += tensorboard_checks(facts)
    if recipe.model.attn_implementation.startswith("flash_attention"):
        checks += flash_attention_checks(recipe, facts)
    if recipe.training.loss_kernel == "liger":
        checks += liger_checks(facts)
        if recipe.deepspeed.stage == 3:
            # Liger's patched forward passes lm_head.weight to its kernel without calling lm_head, so
            # ZeRO-3's gather hook never runs (Liger asserts on the empty weight). Not run here: no GPU.
            checks.append(Check("liger-kernel.zero3", "warn", "training.loss_kernel: liger reads the output head's "
                                "weight directly, which ZeRO-3 keeps partitioned outside the head's own forward",
                                "use training.loss_kernel: chunked with ZeRO-3"))
    checks += nvcc_checks(recipe, facts, run_dir)
    checks += build_tool_checks(facts, recipe, run_dir)
    checks += vllm_checks(recipe.grpo.vllm, facts) if objectives.get(recipe.objective).generates \
        and recipe.grpo.vllm != "off" else []
    checks += parallel_checks(recipe, facts)
    checks += device_checks(recipe, facts)
    checks += stop_timeout_checks(recipe, facts)
    return checks + deepspeed_release_checks(facts, recipe)


def build_tool_checks(facts: Facts, recipe: Optional["Recipe"] = None, run_dir: Optional[Path] = None) -> list[Check]:
    """The C++ compiler, ninja and Python's headers, when a launch of `recipe` (None: the defaults) here would
    JIT-compile a DeepSpeed op that is not built yet (finetune.run.deepspeed_ops.missing_build_tools)."""
    if facts.version("torch") is None or facts.version("deepspeed") is None or "torch" in facts.import_errors:
        return []
    from finetune.run.deepspeed_ops import is_built, launch_extensions_root, missing_build_tools, recipe_ops

    device = "cuda" if facts.cuda_available and facts.gpus else "cpu"
    root = launch_extensions_root()
    ops = [op for op in recipe_ops(device, recipe, run_dir) if not is_built(root / op)]
    missing = missing_build_tools() if ops else []
    if not missing:
        return []
    return [Check("deepspeed.build-tools", "fail", f"DeepSpeed compiles {', '.join(ops)} on the first run, and this "
                  f"machine lacks {' and '.join(what for what, _ in missing)}",
                  "; ".join(dict.fromkeys(fix for _, fix in missing)))]


def nvcc_checks(recipe: "Recipe", facts: Facts, run_dir: Optional[Path] = None) -> list[Check]:
    """DeepSpeed compiles FusedAdam (FusedLion, FusedLamb) on the first run on a GPU, with the CUDA toolkit's
    nvcc; an image with the CUDA runtime alone fails there, after the model has loaded. Not run on a GPU here."""
    if not (facts.cuda_available and facts.gpus) or facts.nvcc is not None:
        return []
    from finetune.run.deepspeed_ops import CUDA_OPS, FUSED_ADAM_OP, is_built, launch_extensions_root, recipe_ops

    root = launch_extensions_root()
    ops = [op for op in recipe_ops("cuda", recipe, run_dir) if op in CUDA_OPS and not is_built(root / op)]
    if not ops:
        return []
    fix = f"install the CUDA toolkit (nvcc) of torch's CUDA {facts.torch_cuda} and set CUDA_HOME"
    if FUSED_ADAM_OP in ops:
        fix += (", or leave `torch_adam: false` out of deepspeed.overrides (finetune's default for Adam/AdamW, torch's "
                "fused AdamW, compiles nothing)")
    return [Check("deepspeed.nvcc", "fail", f"DeepSpeed compiles {', '.join(ops)} on the first run with the CUDA "
                  "toolkit's nvcc, and there is none where torch looks (CUDA_HOME, PATH, /usr/local/cuda)", fix)]


def vllm_checks(mode: str, facts: Facts) -> list[Check]:
    """grpo.vllm: TRL generates with vLLM, which needs vllm and a CUDA GPU (not run by this project)."""
    checks = []
    if package_version("vllm") is None:
        checks.append(Check("vllm", "fail", f"grpo.vllm: {mode} needs vllm, which is not installed",
                            "pip install vllm on a CUDA machine, or set grpo.vllm: off (transformers' generate)"))
    if not (facts.cuda_available and facts.gpus):
        checks.append(Check("vllm.gpu", "fail", f"grpo.vllm: {mode} needs a CUDA GPU; none is visible here",
                            "set grpo.vllm: off (transformers' generate works on CPU too)"))
    return checks


def parallel_checks(recipe: "Recipe", facts: Facts) -> list[Check]:
    from finetune.lint.parallel_rules import AUTOTP_FLOORS, ULYSSES_FLOORS

    p = recipe.parallel
    return (floor_checks(facts, ULYSSES_FLOORS, "ulysses", "for parallel.sequence (Ulysses)") if p.sequence > 1 else []) \
        + (floor_checks(facts, AUTOTP_FLOORS, "autotp", "for parallel.tensor (AutoTP)") if p.tensor > 1 else [])


def liger_checks(facts: Facts) -> list[Check]:
    """Liger's kernels are Triton, so CUDA only; transformers wants liger-kernel >= 0.3.0."""
    checks = []
    if facts.version("liger-kernel") is None:
        checks.append(Check("liger-kernel", "fail", "training.loss_kernel: liger needs the liger-kernel package",
                            f"{extra_install('liger')}, or set training.loss_kernel: chunked"))
    else:
        checks += floor_checks(facts, {"liger-kernel": extra_floors("liger")["liger-kernel"]}, "liger",
                               "for training.loss_kernel: liger")
    if not (facts.cuda_available and facts.gpus):
        checks.append(Check("liger-kernel.gpu", "fail", "training.loss_kernel: liger runs Triton kernels on a CUDA GPU; "
                            "none is visible here", "set training.loss_kernel: chunked, which works on CPU too"))
    return checks


def torch_install_checks(facts: Facts) -> list[Check]:
    return [c for c in torch_checks(facts) if c.name in ("torch", "train.torch")]


def qlora_checks(recipe: "Recipe", facts: Facts) -> list[Check]:
    checks = []
    if facts.version("bitsandbytes") is None:
        checks.append(Check("qlora.bitsandbytes", "fail", "method: qlora needs bitsandbytes, which is not installed",
                            extra_install("qlora")))
    elif "bitsandbytes" in facts.import_errors:
        floor = extra_floors("qlora").get("bitsandbytes", "")
        checks.append(Check("qlora.bitsandbytes", "fail",
                            f"method: qlora needs bitsandbytes, but `import bitsandbytes` fails: {facts.import_errors['bitsandbytes']}",
                            f"pip install --force-reinstall 'bitsandbytes{floor}'"))
    if recipe.deepspeed.stage == 3:
        checks += floor_checks(facts, QLORA_ZERO3_FLOORS, "qlora-zero3", "for QLoRA + ZeRO-3",
                               optional=OPTIONAL_FOR_QLORA_ZERO3)
    return checks


def tensorboard_checks(facts: Facts) -> list[Check]:
    """The Trainer's TensorBoardCallback raises on every rank, after the model is loaded, when neither
    tensorboard nor tensorboardX is installed (transformers.integrations.is_tensorboard_available)."""
    floor = extra_floors("train").get("tensorboard", "")
    instead = "or set training.report_to: [none]"
    if facts.version("tensorboard") is None and facts.version("tensorboardX") is None:
        return [Check("tensorboard", "fail", "training.report_to: tensorboard needs the tensorboard package, "
                      "which is not installed", f"pip install 'tensorboard{floor}' (part of finetune[train]), {instead}")]
    if "tensorboard" in facts.import_errors and facts.version("tensorboardX") is None:
        return [Check("tensorboard", "fail", f"training.report_to: tensorboard, but `import tensorboard` fails: "
                      f"{facts.import_errors['tensorboard']}", f"pip install --force-reinstall 'tensorboard{floor}', {instead}")]
    return []


def flash_attention_checks(recipe: "Recipe", facts: Facts) -> list[Check]:
    kind = recipe.model.attn_implementation
    package = "flash-attn" if kind == "flash_attention_2" else "flash-attn-3"
    checks = []
    if kind == "flash_attention_2" and facts.version("flash-attn") is None:
        checks.append(Check("flash-attn", "fail", f"model.attn_implementation: {kind} needs the {package} package",
                            "pip install flash-attn --no-build-isolation (or set model.attn_implementation: sdpa)"))
    old = [g for g in facts.gpus if tuple(g.capability) < BF16_MIN_CAPABILITY]
    if old:
        checks.append(Check("flash-attn.gpu", "fail", f"{kind} needs an Ampere or newer GPU; GPU {old[0].index} is {old[0].name}",
                            "set model.attn_implementation: sdpa"))
    return checks


def device_checks(recipe: "Recipe", facts: Facts) -> list[Check]:
    """GPU count against launch.procs_per_node, and bf16 on the GPUs that will be used."""
    procs = recipe.launch.procs_per_node
    gpus = facts.gpus if facts.cuda_available else []
    checks = []
    if recipe.hardware is not None and recipe.hardware.gpus != len(gpus):
        # Not an error (a recipe may run on other boxes), but usually the wrong machine or CUDA_VISIBLE_DEVICES.
        checks.append(Check("device.hardware", "warn", f"the recipe is meant for {recipe.hardware.gpus} GPU(s) per node "
                            f"(hardware.gpus) but {len(gpus)} are visible here"))
    if not gpus:
        n = procs if isinstance(procs, int) else recipe.launch.cpu_procs
        return checks + [Check("device", "info", f"no GPU: {n} CPU process{'es' if n != 1 else ''} on DeepSpeed's CPU accelerator (slow; meant for tests)")]
    if isinstance(procs, int) and procs > len(gpus):
        return checks + [Check("device", "fail", f"launch.procs_per_node is {procs} but only {len(gpus)} GPU(s) are visible",
                      f"set launch.procs_per_node: {len(gpus)} (or auto), or check CUDA_VISIBLE_DEVICES")]
    used = gpus[:procs] if isinstance(procs, int) else gpus
    checks.append(Check("device", "ok", f"{len(used)} process(es) on {len(used)} of {len(gpus)} GPU(s)"))
    bf16_dtypes = {recipe.model.dtype} | ({recipe.quantization.compute_dtype} if recipe.method == "qlora" else set())
    no_bf16 = [g for g in used if not g.bf16]
    if "bfloat16" in bf16_dtypes and no_bf16:
        g = no_bf16[0]
        checks.append(Check("device.bf16", "fail",
                            f"the recipe trains in bfloat16 but GPU {g.index} ({g.name}, sm_{g.capability[0]}{g.capability[1]}) has no bf16",
                            "set model.dtype: float16 (and quantization.compute_dtype / storage_dtype: float16 for qlora)"))
    return checks


# ----------------------------------------------------------------------------------------------
# Report


def failed(checks: list[Check]) -> list[Check]:
    return [c for c in checks if c.status == "fail"]


def report(facts: Facts, checks: list[Check]) -> dict:
    data = facts.to_dict()
    data["checks"] = [c.to_dict() for c in checks]
    data["ok"] = not failed(checks)
    return data


def render_text(facts: Facts, checks: list[Check]) -> str:
    lines = [f"{'python':<14}{facts.python} ({facts.platform})"]
    torch_version = facts.version("torch")
    if torch_version is None:
        lines.append(f"{'torch':<14}not installed")
    else:
        cuda = f"CUDA {facts.torch_cuda}" if facts.torch_cuda else "CPU build"
        nccl = f", NCCL {facts.nccl}" if facts.nccl else ""
        lines.append(f"{'torch':<14}{torch_version} ({cuda}{nccl}; GPU available: {'yes' if facts.cuda_available else 'no'})")
    for g in facts.gpus:
        lines.append(f"{f'GPU {g.index}':<14}{g.name}, {gib_text(g.memory_bytes, 1)}, "
                     f"sm_{g.capability[0]}{g.capability[1]}, {'bf16' if g.bf16 else 'no bf16'}")
    for package in PACKAGES:
        if package != "torch":
            lines.append(f"{package:<14}{facts.version(package) or '-'}")
    lines.append("")
    for check in checks:
        lines.append(f"{check.status:<5} {check.name}: {check.message}")
        if check.fix and check.status in ("warn", "fail"):
            lines.append(f"      fix: {runnable(check.fix)}")
    bad = failed(checks)
    lines.append(f"{len(bad)} check{'s' if len(bad) != 1 else ''} failed" if bad else "all checks passed")
    return "\n".join(lines) + "\n"


def run_doctor(facts: Optional[Facts] = None, recipe: Optional["Recipe"] = None) -> tuple[Facts, list[Check]]:
    """The machine's checks, plus the recipe's when one is given: the recipe `finetune train` would run here, its
    auto keys decided for this machine (decided_here), as train's preflight checks it."""
    if facts is None:
        facts = collect_facts(("bitsandbytes",) if package_version("bitsandbytes") else ())
    checks = machine_checks(facts)
    if recipe is not None:
        # A recipe's verdict replaces the machine-wide one of the same name (warn -> fail for QLoRA + ZeRO-3).
        by_name = {c.name: c for c in checks}
        for check in checks_for_recipe(decided_here(recipe, facts), facts):
            by_name[check.name] = check
        checks = list(by_name.values())
    return facts, checks


def decided_here(recipe: "Recipe", facts: Facts) -> "Recipe":
    """`recipe` with its auto keys decided for the machine `facts` describe, as `finetune train` decides them
    there: on one GPU a LoRA recipe left `deepspeed.enabled: auto` trains without DeepSpeed, and needs none of its
    compiled ops (nor the CUDA toolkit that builds them)."""
    from finetune.run.decide import resolve_on

    return resolve_on(recipe, facts).recipe


if __name__ == "__main__":  # python -m finetune.run.doctor
    facts, checks = run_doctor()
    sys.stdout.write(render_text(facts, checks))
    sys.exit(1 if failed(checks) else 0)
