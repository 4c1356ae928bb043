"""Every finding of the DeepSpeed config checker on ~30,000 generated configs plus tests/ds_corpus, as JSON:
a refactor of finetune/lint/deepspeed/ must leave the file byte-identical (same ids, messages, order).

    git stash; python scripts/lint_ds_snapshot.py /tmp/before.json; git stash pop
    python scripts/lint_ds_snapshot.py /tmp/after.json && cmp /tmp/before.json /tmp/after.json
    python scripts/lint_ds_snapshot.py /tmp/few.json --count 50     # the first 50 configs (tests/test_entry_points.py)

The configs come from a fixed seed (same list on every machine): keys from DeepSpeed's schema tables, values
chosen to hit every rule (the script prints how many of the rules fired). About 20 s on a busy 2-core box.
"""
import argparse
import copy
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from finetune.lint.deepspeed import DSContext, check_config, schema  # noqa: E402
from finetune.recipe.yamlio import load_json  # noqa: E402
from finetune.render import render_training_args  # noqa: E402
from finetune.recipe import Recipe  # noqa: E402

TA = render_training_args(Recipe(model={"name_or_path": "org/tiny"}, data={"path": "data.jsonl"},
                    training={"micro_batch_size": 2, "gradient_accumulation_steps": 4, "max_steps": 100}), output_dir="runs/t")
TA2 = dict(TA, optim="adafactor", gradient_accumulation_steps=1)
keys = sorted(set(schema.TOP) | set(schema.REMOVED_TOP) | {k for s in schema.SECTIONS.values() for k in s}
              | {k for s in schema.LENIENT.values() for k in s} | set(schema.REMOVED_ZERO) | set(schema.COMMON_MISNAMES)
              | {"stage", "device", "nvme_path", "type", "params", "lr", "betas", "eps", "warmup_num_steps",
                 "total_num_steps", "warmup_type", "max_grad_norm", "torch_adam", "_c", "overlap_com", "bfloat16",
                 "comms_config", "warmup_min_lr", "warmup_max_lr", "cycle_min_lr", "loss_scale"})
scalars = [None, True, False, 0, 1, 2, 3, -1, 4, 0.5, 1.0, 1e9, float("inf"), float("nan"), 7, 16, 10, "auto", "3", "cpu",
           "nvme", "none", "AdamW", "adam", "Lamb", "lion", "SGD", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR",
           "OneCycle", "cosine", "fp16", "bf16", "fp32", "float16", "true", "false", "1e5", "12", "", "SUM", "mean",
           "warn", "FAIL", "linear", "x", "/nvme", 500000001, 2**66]
def value(r, depth):
    c = r.random()
    if depth > 3 or c < 0.55:
        return r.choice(scalars)
    if c < 0.65:
        return [value(r, depth + 1) for _ in range(r.randint(0, 3))]
    return {r.choice(keys): value(r, depth + 1) for _ in range(r.randint(0, 5))}
def doc(r):
    d = {r.choice(keys): value(r, 1) for _ in range(r.randint(0, 8))}
    if r.random() < 0.5:
        d["zero_optimization"] = {"stage": r.choice([0, 1, 2, 3, "auto", "3", True]),
                                  **{r.choice(list(schema.SECTIONS["zero_optimization"]) + ["cpu_offload"]): value(r, 2) for _ in range(r.randint(0, 4))}}
        if r.random() < 0.5:
            d["zero_optimization"]["offload_optimizer"] = {"device": r.choice(["cpu", "nvme", "auto", "none"]),
                                                           **({"nvme_path": r.choice(["auto", "none", "/x", None])} if r.random() < .5 else {})}
        if r.random() < 0.4:
            d["zero_optimization"]["offload_param"] = {"device": r.choice(["cpu", "nvme", "auto"])}
    for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if r.random() < 0.4:
            d[k] = r.choice([1, 2, 4, 8, 16, 10, 32, "auto", 0, "2", 3])
    if r.random() < 0.3:
        d["optimizer"] = {"type": r.choice(["AdamW", "Adam", "Lamb", "Lion", "adagrad", "SGD", "Adamw8bit", "auto", 3]),
                          **({"params": {r.choice(keys): value(r, 3) for _ in range(r.randint(0, 4))}} if r.random() < .8 else {})}
    if r.random() < 0.3:
        d["scheduler"] = {"type": r.choice(["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "StepLR", "cos"]),
                          **({"params": {r.choice(keys): value(r, 3) for _ in range(r.randint(0, 4))}} if r.random() < .8 else {None: 1} if False else {})}
    for s in ("fp16", "bf16"):
        if r.random() < 0.3:
            d[s] = {"enabled": r.choice([True, False, "auto", "true", 1]), **({"loss_scale": r.choice([0, 128, -1, "2"])} if s == "fp16" and r.random() < .5 else {})}
    if r.random() < 0.15:
        d.setdefault("bf16", {})
        if isinstance(d["bf16"], dict):
            d["bf16"][r.choice(["bf16_optimizer_states", "bf16_master_weights_and_grads"])] = r.choice([True, "true", 1])
    if r.random() < 0.15:
        d["data_types"] = {r.choice(["grad_accum_dtype", "param_dtype", "keep_in_fp32_modules"]): r.choice(["fp32", "bf16", "fp16", "auto", ["a"], 3])}
    return d
ctxs = [lambda: DSContext(world_size=2, training_args=TA), lambda: DSContext(world_size=2),
        lambda: DSContext(world_size=2, hf_integration=False), lambda: DSContext(), lambda: DSContext(hf_integration=False),
        lambda: DSContext(world_size=3, training_args=TA2, from_recipe=True), lambda: DSContext(world_size=1, training_args=TA)]
def fnd(fs):
    return [[f.rule, f.severity, [str(k) for k in f.key], f.message, f.fix] for f in fs]
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path, help="the JSON file to write")
    parser.add_argument("--count", type=int, default=30000, help="generated configs (the first COUNT of the fixed list)")
    args = parser.parse_args()
    out = []
    r = random.Random(19)
    for i in range(args.count):
        d = doc(r)
        ci = r.randrange(len(ctxs))
        ctx = ctxs[ci]()
        if r.random() < 0.1:
            ctx.duplicates = [((r.choice(keys),), 1, 1), (("zero_optimization", "stage"), 2, 2)]
        out.append(fnd(check_config(copy.deepcopy(d), ctx)))
    for p in sorted((Path(__file__).resolve().parent.parent / "tests" / "ds_corpus").glob("*.json")):
        dd = load_json(p.read_text(), str(p))
        for c in ctxs:
            ctx = c(); ctx.duplicates = list(dd.duplicates)
            out.append(fnd(check_config(copy.deepcopy(dd.data), ctx)))
    for c in ctxs:
        for bad in ([1], None, "x", 3):
            out.append(fnd(check_config(bad, c())))
    args.output.write_text(json.dumps(out))
    print(f"{len(out)} configs, {sum(len(o) for o in out)} findings, {len({f[0] for o in out for f in o})} rule ids fired")


if __name__ == "__main__":
    main()
