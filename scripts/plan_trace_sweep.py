"""The analytic plan against `finetune plan --trace` over random setups without DeepSpeed, where the trace runs
the whole step (docs/plan.md, "The trace"): built-in shapes x method x attention x length x micro batch x
checkpointing x dropout x rank x dtype x accumulation x loss kernel x packing. Prints each setup's error,
(analytic allocated peak - traced peak) / traced peak, then how many are within 2% and the worst ones.

    python scripts/plan_trace_sweep.py --seed 11 --count 40      # about 3 minutes on 2 cores

The tests plan its random setups (tests/test_entry_points.py) but trace none of them: one trace takes seconds
(tests/plan/trace/test_trace.py traces small ones).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from finetune.plan import Setup, plan  # noqa: E402
from finetune.plan.archs import BY_NAME  # noqa: E402

MODELS = ("llama-3-8b", "qwen2.5-7b", "mistral-7b-v0.3", "qwen2.5-0.5b", "qwen2.5-1.5b", "llama-2-7b", "gemma-2-2b",
          "qwen2.5-14b")


def random_setup(rng: random.Random) -> Setup:
    name = rng.choice(MODELS)
    arch = BY_NAME[name]
    kw = dict(deepspeed=False, method=rng.choice(["lora", "lora", "qlora", "full"]),
              attn="eager" if name.startswith("gemma") else rng.choice(["sdpa", "flash_attention_2", "eager"]),
              seq_len=rng.choice([256, 1024, 2048, 4096]), micro_batch=rng.choice([1, 2, 4]),
              gradient_checkpointing=rng.random() < 0.7, lora_dropout=rng.choice([0.0, 0.05]),
              lora_r=rng.choice([8, 16, 64]), dtype=rng.choice(["bfloat16", "bfloat16", "float16"]),
              gradient_accumulation=rng.choice([1, 1, 2]), loss_kernel=rng.choice(["default", "default", "chunked"]))
    if kw["attn"] == "eager" and kw["seq_len"] * kw["micro_batch"] > 4096:
        kw["seq_len"] = 1024  # eager's seq^2 scores: keep the trace in seconds
    if kw["method"] == "full" and arch.total_params > 2e9:
        kw["method"] = "lora"  # without DeepSpeed a full fine-tune of 7B and more needs more than one GPU holds
    layout = rng.random()
    if layout < 0.15:
        kw["packing"] = True
    elif layout < 0.25 and kw["attn"].startswith("flash"):
        kw["padding_free"] = True
    elif layout < 0.45:
        kw["full_rows"] = True
    if kw["method"] == "qlora" and rng.random() < 0.3:
        kw["kbit_prepared"] = True
    if kw["method"] == "lora" and rng.random() < 0.2:
        kw["adapter_dtype"] = "model"
    return Setup(arch=arch, params=arch.total_params, model_label=name, **kw)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--count", type=int, default=40)
    args = parser.parse_args(argv)
    from finetune.plan.trace.step import trace

    rng = random.Random(args.seed)
    errors = []
    for _ in range(args.count):
        setup = random_setup(rng)
        traced = trace(setup)
        error = plan(setup).memory_views["allocated"] / traced.peak - 1
        errors.append((error, setup))
        print(f"{error:+7.2%}  {traced.phase:8}  {setup.model_label:16} {setup.method:5} {setup.describe()}", flush=True)
    within = sum(1 for e, _ in errors if abs(e) <= 0.02)
    print(f"\n{within} of {len(errors)} within 2% of the trace; worst: "
          + ", ".join(f"{e:+.1%} ({s.model_label} {s.method})" for e, s in sorted(errors, key=lambda x: x[0])[:3]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
