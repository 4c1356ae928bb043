"""After training: convert DeepSpeed checkpoints, merge adapters, LoRA math, verify, safetensors I/O."""
