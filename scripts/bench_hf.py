"""The baseline finetune's speed is measured against: a plain Hugging Face Trainer (+ DeepSpeed) run of the same
recipe, driven the way LLaMA-Factory and axolotl drive it (issue 35).

    python scripts/bench_hf.py RECIPE --out DIR                      # every process the recipe asks for
    python scripts/bench_hf.py runs/my-run --out DIR                 # exactly as that finetune run trained
    python scripts/bench_hf.py RECIPE --out DIR --no-deepspeed --profile
    python scripts/bench_hf.py runs/my-run --out DIR --deepspeed-config runs/my-run/deepspeed.json

The same as finetune: the model, the rows (finetune's tokenized cache of the recipe's data, in the Trainer's own
seeded order), the LoRA / QLoRA configuration, micro batch, accumulation, sequence length, dtype, attention
kernel, gradient checkpointing (and its use_reentrant), learning rate, schedule and steps: a recipe's `auto`
values resolved as `finetune train` resolves them on this machine, a run directory's as that run resolved them.
What a user of those tools gets instead of finetune's:
- the DeepSpeed config: LLaMA-Factory's examples/deepspeed/ds_z0_config.json (ZeRO stage 0) or
  ds_z2_config.json (stages 1-3), every batch and precision value "auto"; `--deepspeed-config FILE` runs another
  (finetune's own, for the overhead benchmark: scripts/bench_overhead.py), `--no-deepspeed` none;
- the optimizer: the Trainer's default, torch's fused AdamW (those templates name no optimizer, so DeepSpeed
  wraps the Trainer's);
- transformers' DataCollatorForSeq2Seq (padding to a multiple of 8), the Trainer's defaults otherwise.
Nothing is added to the step: a callback stamps the host clock at each step's end (synchronising the device
where the steady window opens and closes, as finetune does), and the tokens of each step are read afterwards
from what the collator built, in order.

Writes DIR/summary.json: `steady` in finetune's shape (finetune.speed.steady: tokens/s, step p50/p90, MFU),
the peak memory per rank, and with --profile a torch.profiler window over the PROFILE_STEPS steps after the warm-up:
GPU-busy time over wall time and the kernels (CPU: operators) that took the most time, also in DIR/profile.json
(the steady window then starts after the profiled steps); with --syncs the host syncs and collectives per step
over the same steps, by the line that makes them (finetune.train.syncs), also in DIR/syncs.json.
Runs its processes under torchrun, like `finetune train` (one process without DeepSpeed: in this process).
Packing and padding-free recipes are not supported.

Not run by the tests: directly; tests/launches/test_gpu_speed.py runs it (its --profile mode too) through
scripts/gpu_speed.py --cpu, which is how the GPU check uses it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# LLaMA-Factory's examples/deepspeed/ds_z0_config.json and ds_z2_config.json (hiyouga/LLaMA-Factory at 1d6e8b2), as
# data: the templates its README points DeepSpeed users to; axolotl's deepspeed_configs/zero2.json sets the same
# batch and precision values to "auto".
LLAMA_FACTORY_ZERO = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_allow_untested_optimizer": True,
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 0, "allgather_partitions": True, "allgather_bucket_size": 5e8,
                          "overlap_comm": False, "reduce_scatter": True, "reduce_bucket_size": 5e8,
                          "contiguous_gradients": True, "round_robin_gradients": True},
}


def llama_factory_config(stage: int) -> dict[str, Any]:
    config = json.loads(json.dumps(LLAMA_FACTORY_ZERO))
    config["zero_optimization"]["stage"] = 0 if stage == 0 else 2
    return config


# ------------------------------------------------------------------------------------------------
# The recipe, as finetune would train it


def load(source: Path, sets: list[str]):
    """(recipe with every value resolved, run directory or None): a run directory's recipe as that run trained
    (finetune.rundir.layout.read_run_dir), or a recipe file resolved as `finetune train` resolves it here."""
    from finetune.recipe import load_recipe
    from finetune.rundir.layout import read_run_dir

    if source.is_dir():
        recipe, _, _ = read_run_dir(source)
        return recipe, source
    loaded = load_recipe(source, sets)
    from finetune.run.start import resolve_auto

    return resolve_auto(loaded.recipe).recipe, None


def check_supported(recipe) -> Optional[str]:
    if recipe.objective != "sft":
        return f"objective {recipe.objective}: bench_hf trains SFT recipes only"
    if recipe.data.packing or recipe.data.padding_free:
        return "data.packing / data.padding_free: bench_hf pads rows (DataCollatorForSeq2Seq) only"
    if recipe.parallel.model_parallel > 1:
        return "parallel.sequence / parallel.tensor: not part of the baseline"
    return None


# ------------------------------------------------------------------------------------------------
# The launcher: tokenize once, then torchrun


def launch(args: argparse.Namespace) -> int:
    from finetune.recipe import load_recipe
    from finetune.data.prepare_recipe import prepare_recipe
    from finetune.tokenizer import load_for_launch
    from finetune.run.launch.commands import free_port

    recipe, run_dir = load(args.source, args.set)
    problem = check_supported(recipe)
    if problem:
        print(f"bench_hf: {problem}", file=sys.stderr)
        return 2
    recipe_file = run_dir / "recipe.yaml" if run_dir else args.source
    launched = load_recipe(recipe_file, [] if run_dir else args.set).recipe
    prepare_recipe(launched, load_for_launch(launched), log=lambda line: print(f"[bench_hf] {line}"))
    procs = args.procs or (recipe.world_size or 1)
    args.out.mkdir(parents=True, exist_ok=True)
    if procs == 1 and args.no_deepspeed:  # one process, no DeepSpeed: the Trainer needs no process group
        return rank_main(args)
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(procs), "--master-port",
            str(free_port()), str(Path(__file__).resolve()), *sys.argv[1:]]
    return subprocess.run(argv, check=False).returncode


# ------------------------------------------------------------------------------------------------
# A rank


class StepStamps:
    """A TrainerCallback (built lazily: transformers is imported in the ranks only) that stamps the host clock at
    each optimizer step's end, synchronising the device where the steady window opens and closes, and runs the
    profiler window (finetune.train.profile.Window, when given) over the PROFILE_STEPS steps after the warm-up,
    stopped before that step's stamp, so that the profiler's own processing stays out of the steady window."""

    def __new__(cls, window=None):
        from transformers import TrainerCallback

        from finetune.speed import WARMUP_STEPS
        from finetune.train.profile import synchronize

        class _Stamps(TrainerCallback):
            def __init__(self):
                self.stamps: list[float] = []

            def on_train_begin(self, args, state, control, **kwargs):
                self.stamps = [time.perf_counter()]

            def on_step_end(self, args, state, control, **kwargs):
                step = len(self.stamps)
                last = bool(state.max_steps and state.global_step >= state.max_steps)
                if window is not None:
                    window.at_step_end(step, last)
                if step == WARMUP_STEPS or last:
                    synchronize()
                self.stamps.append(time.perf_counter())

        return _Stamps()


class RecordingCollator:
    """DataCollatorForSeq2Seq, and the (tokens, sum of squared lengths) of each batch it built, in order."""

    def __init__(self, tokenizer):
        from transformers import DataCollatorForSeq2Seq

        self.collate = DataCollatorForSeq2Seq(tokenizer, pad_to_multiple_of=8, label_pad_token_id=-100)
        self.counts: list[tuple[int, int]] = []

    def __call__(self, rows):
        lengths = [len(r["input_ids"]) for r in rows]
        self.counts.append((sum(lengths), sum(n * n for n in lengths)))
        return self.collate([{"input_ids": r["input_ids"], "labels": r["labels"],
                              "attention_mask": [1] * len(r["input_ids"])} for r in rows])


def build_model(recipe, model_path: str):
    """The model as a LLaMA-Factory user gets it: from_pretrained (4-bit for QLoRA), then peft's LoRA."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[recipe.model.dtype]
    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": recipe.model.attn_implementation}
    if recipe.method == "qlora":
        q = recipe.quantization
        compute = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=q.quant_type, bnb_4bit_use_double_quant=q.double_quant,
            bnb_4bit_compute_dtype=compute[q.compute_dtype], bnb_4bit_quant_storage=compute[q.storage_dtype])
    model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs)
    model.config.use_cache = False
    if recipe.method == "full":
        return model
    from peft import LoraConfig, get_peft_model

    lora = recipe.lora
    return get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=lora.r, lora_alpha=lora.alpha,
                                            lora_dropout=lora.dropout, target_modules=lora.target_modules,
                                            use_rslora=lora.rslora, use_dora=lora.dora, bias=lora.bias))


def training_arguments(recipe, out: Path, deepspeed: Optional[dict[str, Any]], on_cpu: bool, steps: Optional[int]):
    from transformers import TrainingArguments

    from finetune.render import reentrant_checkpointing

    t = recipe.training
    kwargs: dict[str, Any] = dict(
        output_dir=str(out / "trainer"), per_device_train_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=t.gradient_accumulation_steps, max_steps=steps or t.max_steps or -1,
        num_train_epochs=t.epochs, learning_rate=t.learning_rate, lr_scheduler_type=t.lr_scheduler,
        warmup_steps=t.warmup_steps if t.warmup_steps > 0 else t.warmup_ratio, weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm, bf16=recipe.model.dtype == "bfloat16", fp16=recipe.model.dtype == "float16",
        gradient_checkpointing=t.gradient_checkpointing, seed=t.seed, data_seed=t.seed,
        logging_steps=t.logging_steps, logging_first_step=True, save_strategy="no", report_to="none",
        dataloader_num_workers=t.dataloader_num_workers, remove_unused_columns=False, deepspeed=deepspeed,
        use_cpu=on_cpu, disable_tqdm=True)
    if t.gradient_checkpointing:
        kwargs["gradient_checkpointing_kwargs"] = {"use_reentrant": reentrant_checkpointing(recipe)}
    return TrainingArguments(**kwargs)


def deepspeed_config(args: argparse.Namespace, recipe, on_cpu: bool) -> Optional[dict[str, Any]]:
    if args.no_deepspeed:
        return None
    if args.deepspeed_config is not None:
        config = json.loads(args.deepspeed_config.read_text(encoding="utf-8"))
    else:
        config = llama_factory_config(recipe.deepspeed.stage)
    from finetune.train.runner import adapt_deepspeed_config

    return adapt_deepspeed_config(config, on_cpu)  # on a CPU: torch's Adam for DeepSpeed's, as finetune does


def rank_main(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    import transformers
    from transformers import Trainer

    from finetune.builtin import ensure_builtin_model, is_builtin
    from finetune.data.cache_root import tokenized_root
    from finetune.data.prepare import load_prepared
    from finetune.data.spec import DataSpec
    from finetune.data.tokenize import split_eval
    from finetune.plan.archs import ArchError, arch_from_config
    from finetune.speed import WARMUP_STEPS, peak_bf16_flops, steady
    from finetune.tokenizer import load_tokenizer
    from finetune.train.profile import PROFILE_STEPS, Window
    from finetune.train.dist import all_gather

    recipe, _ = load(args.source, args.set)
    on_gpu = torch.cuda.is_available()
    model_path = str(ensure_builtin_model(recipe.model.name_or_path)) if is_builtin(recipe.model.name_or_path) \
        else recipe.model.name_or_path
    ds = deepspeed_config(args, recipe, not on_gpu)
    training_args = training_arguments(recipe, args.out, ds, not on_gpu, args.steps)
    _ = training_args.device  # the process group and this rank's GPU, before the model
    tokenizer = load_tokenizer(recipe, model_path)
    train_set, _ = split_eval(load_prepared(DataSpec.of(recipe), tokenizer, tokenized_root()),
                              recipe.data.validation_split, recipe.training.seed)
    transformers.set_seed(recipe.training.seed)  # the adapter's initial weights as finetune's (it seeds before loading)
    model = build_model(recipe, model_path)
    collator = RecordingCollator(tokenizer)
    window = Window(on_gpu, WARMUP_STEPS, profile=args.profile, census=args.syncs) \
        if args.profile or args.syncs else None
    stamps = StepStamps(window)
    trainer = Trainer(model=model, args=training_args, train_dataset=train_set, data_collator=collator,
                      processing_class=tokenizer, callbacks=[stamps])
    trainer.train()
    profile = window.result if window is not None else None
    census = window.syncs if window is not None else None
    accumulation = recipe.training.gradient_accumulation_steps
    counts = collator.counts
    per_step = [tuple(map(sum, zip(*counts[i * accumulation:(i + 1) * accumulation])))
                for i in range(len(stamps.stamps) - 1)]
    ranks = all_gather(per_step)
    summed = [(sum(r[i][0] for r in ranks), sum(r[i][1] for r in ranks)) for i in range(len(per_step))]
    world = dist.get_world_size() if dist.is_initialized() else 1
    try:
        arch = arch_from_config(model.config.to_dict(), "bench")
    except (ArchError, KeyError, TypeError, ValueError):
        arch = None
    gpu = torch.cuda.get_device_name(0) if on_gpu else None
    peak, source = peak_bf16_flops(gpu) if gpu else (None, None)
    # with --profile the steady window starts after the profiled steps (the profiler slows them down)
    warmup = WARMUP_STEPS + (PROFILE_STEPS if window is not None else 0)
    result = steady(stamps.stamps, [c[0] for c in summed], [c[1] for c in summed], world, arch, peak, warmup=warmup)
    result.update(gpu=gpu, peak_flops=peak, peak_source=source)
    memory = all_gather(int(torch.cuda.max_memory_allocated()) if on_gpu else None)
    reserved = all_gather(int(torch.cuda.max_memory_reserved()) if on_gpu else None)
    if int(os.environ.get("RANK", "0")) == 0:
        summary = {"tool": "bench_hf", "steps": trainer.state.global_step, "world_size": world, "method": recipe.method,
                   "deepspeed": ds is not None, "deepspeed_config": ds,
                   "micro_batch_size": recipe.training.micro_batch_size,
                   "gradient_accumulation_steps": accumulation, "max_length": recipe.data.max_length,
                   "gradient_checkpointing": recipe.training.gradient_checkpointing,
                   "optimizer": training_args.optim if ds is None or "optimizer" not in ds else ds["optimizer"],
                   "steady": result, "peak_memory_bytes": memory, "peak_memory_reserved_bytes": reserved,
                   "loss_history": [e for e in trainer.state.log_history if "loss" in e], "profile": profile,
                   "syncs": census}
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n", encoding="utf-8")
        if profile is not None:
            (args.out / "profile.json").write_text(json.dumps(profile, indent=2) + "\n", encoding="utf-8")
        if census is not None:
            (args.out / "syncs.json").write_text(json.dumps(census, indent=2) + "\n", encoding="utf-8")
        from finetune.speed import steady_text

        print(f"[bench_hf] {steady_text(result)}; {args.out / 'summary.json'}", flush=True)
    return 0


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    from finetune.train.profile import PROFILE_STEPS  # light: the standard library only
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a finetune recipe, or a finetune run directory")
    parser.add_argument("--out", type=Path, required=True, help="where summary.json (and profile.json) go")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the recipe's)")
    parser.add_argument("--procs", type=int, default=None, help="processes (default: the recipe's world size)")
    parser.add_argument("--no-deepspeed", action="store_true", help="the plain Trainer: no DeepSpeed at all")
    parser.add_argument("--deepspeed-config", type=Path, default=None,
                        help="a DeepSpeed JSON instead of LLaMA-Factory's template (e.g. a finetune run's deepspeed.json)")
    parser.add_argument("--profile", action="store_true", help=f"torch.profiler over {PROFILE_STEPS} steady steps")
    parser.add_argument("--syncs", action="store_true", help=f"count host syncs and collectives over {PROFILE_STEPS} "
                        "steady steps")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="as `finetune train --set`")
    args = parser.parse_args(argv)
    args.out = args.out.resolve()
    args.source = args.source.resolve()
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if "LOCAL_RANK" not in os.environ:
        return launch(args)
    code = rank_main(args)
    from finetune.train.shutdown import close_process_group

    close_process_group()
    return code


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:
        from finetune.train.shutdown import run_as_rank

        # a rank ends as finetune's do: an orderly shutdown, then os._exit, skipping the interpreter's finalization
        # in which a gloo thread can abort the process (finetune/train/shutdown.py)
        run_as_rank(main)
    sys.exit(main())
