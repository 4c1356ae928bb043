"""What this machine has: Python, torch, CUDA, GPUs, NCCL and library versions, gathered once.

`finetune doctor` and `finetune train`'s preflight check these facts (finetune.run.doctor); tests build
their own. Versions come from importlib.metadata (no import); torch is imported only for the GPU facts.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform
from dataclasses import dataclass, field
from typing import Optional

# Libraries whose versions the report shows (trl only matters when installed: some users mix it in).
PACKAGES = ("torch", "deepspeed", "transformers", "peft", "bitsandbytes", "accelerate", "datasets", "trl", "flash-attn",
            "liger-kernel", "tensorboard", "tensorboardX")
# Checked only for the recipes that use them (training.report_to), though `train` installs them.
BF16_MIN_CAPABILITY = (8, 0)  # Ampere: the first GPUs with bf16 tensor cores


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    memory_bytes: int
    capability: tuple[int, int]

    @property
    def bf16(self) -> bool:
        return tuple(self.capability) >= BF16_MIN_CAPABILITY

    def to_dict(self) -> dict:
        return {"index": self.index, "name": self.name, "memory_bytes": self.memory_bytes,
                "memory_gib": round(self.memory_bytes / 2**30, 1),
                "compute_capability": f"{self.capability[0]}.{self.capability[1]}", "bf16": self.bf16}


@dataclass
class Facts:
    """What the machine has. Built by collect_facts(); tests build their own."""

    python: str
    platform: str
    packages: dict[str, Optional[str]]
    torch_cuda: Optional[str] = None  # CUDA version torch was built with (None: CPU build)
    cuda_available: bool = False
    nccl: Optional[str] = None
    # The CUDA toolkit's compiler where torch's extension builder finds it (torch.utils.cpp_extension.CUDA_HOME,
    # then bin/nvcc), for DeepSpeed's CUDA ops compiled on the first run. Read only when a GPU is usable.
    nvcc: Optional[str] = None
    gpus: list[Gpu] = field(default_factory=list)
    import_errors: dict[str, str] = field(default_factory=dict)
    # Whether torchrun honours TORCH_ELASTIC_SHUTDOWN_TIMEOUT (None: unknown, torch not imported).
    torchrun_shutdown_timeout: Optional[bool] = None

    def version(self, package: str) -> Optional[str]:
        return self.packages.get(package)

    def to_dict(self) -> dict:
        return {
            "python": self.python,
            "platform": self.platform,
            "torch": {"version": self.version("torch"), "cuda": self.torch_cuda,
                      "cuda_available": self.cuda_available, "nccl": self.nccl, "nvcc": self.nvcc},
            "gpus": [g.to_dict() for g in self.gpus],
            "packages": dict(self.packages),
            "import_errors": dict(self.import_errors),
        }


def package_version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def collect_facts(try_imports: tuple[str, ...] = ()) -> Facts:
    """Versions without importing; torch imported for GPU facts; `try_imports` really imported."""
    facts = Facts(python=platform.python_version(), platform=platform.platform(),
                  packages={name: package_version(name) for name in PACKAGES})
    if facts.version("torch") is not None:
        _torch_facts(facts)
    for module in try_imports:
        error = import_error(module)
        if error is not None:
            facts.import_errors[module] = error
    return facts


def _torch_facts(facts: Facts) -> None:
    try:
        import torch
    except Exception as exc:  # a broken install (missing CUDA libraries) is a finding, not a crash
        facts.import_errors["torch"] = _one_line(exc)
        return
    facts.torch_cuda = torch.version.cuda
    facts.torchrun_shutdown_timeout = _torchrun_has_shutdown_timeout()
    facts.cuda_available = bool(torch.cuda.is_available())
    if not facts.cuda_available:
        return
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        facts.gpus.append(Gpu(index, props.name, int(props.total_memory), (props.major, props.minor)))
    facts.nvcc = _nvcc()
    try:
        version = torch.cuda.nccl.version()
        facts.nccl = ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)
    except Exception:  # CPU or ROCm builds without NCCL bindings
        facts.nccl = None


def _nvcc() -> Optional[str]:
    """DeepSpeed's JIT builder compiles CUDA ops with CUDA_HOME/bin/nvcc, CUDA_HOME as torch finds it (the
    environment variable, nvcc on PATH, /usr/local/cuda): None when there is no compiler there."""
    import os

    try:
        from torch.utils.cpp_extension import CUDA_HOME
    except Exception:  # a torch without its extension builder
        return None
    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else None
    return nvcc if nvcc and os.access(nvcc, os.X_OK) else None


def import_error(module: str) -> Optional[str]:
    """None when `module` imports; otherwise the error, on one line."""
    if importlib.util.find_spec(module) is None:
        return f"No module named {module!r}"
    try:
        __import__(module)
    except Exception as exc:
        return _one_line(exc)
    return None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _torchrun_has_shutdown_timeout() -> Optional[bool]:
    import dataclasses

    try:
        from torch.distributed.launcher.api import LaunchConfig
    except Exception:  # torch without distributed support
        return None
    return "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}
