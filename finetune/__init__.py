"""finetune: one YAML recipe -> linted DeepSpeed config -> multi-GPU training -> streaming merge."""

__version__ = "0.1.0"
