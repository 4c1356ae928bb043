"""The per-rank training process: one per GPU (or CPU process), started by `finetune train`.

    torchrun --nproc-per-node 2 -m finetune.train.runner --run-dir runs/demo
    deepspeed --num_gpus 2 --no_local_rank --module finetune.train.runner --run-dir runs/demo

The run directory is written before launch (finetune.rundir.layout) and holds:
    recipe.yaml          the resolved recipe (absolute paths)
    deepspeed.json       finetune.render.render_deepspeed(recipe, world_size)
    training_args.json   finetune.render.render_training_args(recipe, output_dir=run_dir)
The runner adds (rank 0 writes; every final output appears under its name only once complete):
    env.json                  library versions, devices, world size
    deepspeed.effective.json  the DeepSpeed config as run ("auto" filled, CPU adjustments)
    adapter/ or model/        PEFT adapter (lora, qlora) or full weights (safetensors)
    tokenizer/                the tokenizer, with the chat template used
    final_logits.safetensors  logits of a fixed batch at the end of training (for verification)
    summary.json              steps, losses, tokens/s, wall time, peak memory per rank, loss history
    loss.png, report.html     the loss plot (redrawn while training) and the run's report (finetune.train.report)
    tensorboard/              loss and learning rate (report_to: tensorboard)

The order below is DeepSpeed's: distributed init, then TrainingArguments(deepspeed=...) (transformers
keeps a reference to the config, so from_pretrained builds a ZeRO-3 model partitioned), then the
model. Creating the model first would make zero.Init see a world of one and fail its batch-size check.

Long because: run() is the one ordered sequence of a rank's life (process group, arguments, data, model, trainer,
outputs) and its helpers are the run directory's outputs; the parts with a life of their own live beside it
(preemption, parallel, universal, model, loss, callbacks, report), and what differs per objective is its module's
steps (sft, preference, grpo, reward: finetune.train.objective_steps).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import resource
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional

from finetune.recipe import Recipe
from finetune.rundir.layout import read_run_dir
from finetune.rundir.names import (
    ADAPTER_CONFIG, ADAPTER_DIR, AUTO_FILE, ENV_FILE, FINAL_LOGITS_FILE, MODEL_DIR, REPORT_FILE,
    SUMMARY_FILE, TENSORBOARD_DIR, TOKENIZER_DIR, ZERO_CHECKPOINT_DIR,
)
from finetune.rundir.run_dir import command_line
from finetune.train.dist import all_gather, barrier, is_cpu_accelerator
from finetune.train.dist import rank as process_rank

LOGITS_BATCH = 4  # examples in the fixed verification batch (the first training examples)
# Tokens kept of each: enough to tell two sets of weights apart, while the file stays small at any length
# (4 x 64 x 128,256 float32 logits: 131 MB; whole 2,048-token rows would be 4.2 GB).
LOGITS_TOKENS = 64
LIBRARIES = ("torch", "deepspeed", "transformers", "peft", "bitsandbytes", "accelerate", "datasets",
             "safetensors", "tokenizers", "trl")


# ------------------------------------------------------------------------------------------------
# The run inputs, adjusted at run time


def adapt_deepspeed_config(config: dict[str, Any], on_cpu: bool) -> dict[str, Any]:
    """Adjustments for the accelerator found at run time (recorded in deepspeed.effective.json).

    On DeepSpeed's CPU accelerator, Adam/AdamW run as torch.optim (torch_adam): FusedAdam is a CUDA
    kernel, and DeepSpeedCPUAdam would first compile a C++ op for a few dozen tensors.
    """
    config = json.loads(json.dumps(config))
    optimizer = config.get("optimizer")
    if on_cpu and isinstance(optimizer, dict) and str(optimizer.get("type", "")).lower() in ("adam", "adamw"):
        optimizer.setdefault("params", {})["torch_adam"] = True
    return config


def training_arguments_kwargs(kwargs: dict[str, Any], field_names: set[str]) -> dict[str, Any]:
    """training_args.json as this transformers' TrainingArguments spells it.

    Newer transformers renamed gradient_checkpointing* to activation_checkpointing* (the old names
    still work, with a FutureWarning on every rank); the rendered file keeps the names every
    supported version reads.
    """
    out = dict(kwargs)
    for old, new in (("gradient_checkpointing", "activation_checkpointing"),
                     ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")):
        if old in out and new in field_names and old in field_names and new not in out:
            out[new] = out.pop(old)
    return out


def peak_memory() -> tuple[int, str]:
    """(bytes, kind): CUDA max_memory_allocated on a GPU, else this process's peak RSS."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated()), "cuda_max_memory_allocated"
    # Linux reports ru_maxrss in KiB (macOS in bytes).
    scale = 1 if sys.platform == "darwin" else 1024
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale, "cpu_peak_rss"


def peak_memory_reserved() -> Optional[int]:
    """CUDA max_memory_reserved (what the caching allocator held at most: allocated + its cache and
    fragmentation, closer to nvidia-smi than max_memory_allocated); None without a GPU."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_reserved())
    return None


# ------------------------------------------------------------------------------------------------
# Outputs


def environment(world_size: int) -> dict[str, Any]:
    import importlib.metadata as md

    import torch

    versions = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    if torch.cuda.is_available():
        devices: Any = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    else:
        devices = "cpu"
    return {"versions": versions, "devices": devices, "cuda": torch.version.cuda, "world_size": world_size,
            "hostname": platform.node(), "platform": platform.platform()}


def _write_json(path: Path, data: Any) -> None:
    from finetune.fsutil import write_atomic

    write_atomic(path, json.dumps(data, indent=2) + "\n")


def _replace_dir(tmp: Path, target: Path) -> None:
    """Move a finished directory into place; an older one with that name is removed after."""
    from finetune.fsutil import replace_dir

    replace_dir(tmp, target, target.with_name(f".{target.name}.old"))


def save_weights(trainer, recipe: Recipe, ds_config: dict[str, Any], run_dir: Path, is_main: bool) -> str:
    """adapter/ (lora, qlora) or model/ (full), through Trainer.save_model on every rank.

    Under ZeRO-3 save_model gathers the partitioned weights (stage3_gather_16bit_weights_on_model_save;
    for PEFT only the trainable ones), so every rank must call it. It writes into a temporary folder
    that rank 0 then renames: a crash never leaves half an adapter under the final name. Without the
    gather, save_model writes a ZeRO checkpoint instead: it goes to zero_checkpoint/ for `finetune convert`.
    Returns the name of the folder written.
    """
    from finetune.rundir.run_dir import resolve_base

    zero = ds_config.get("zero_optimization", {})
    gathered = zero.get("stage", 0) != 3 or bool(zero.get("stage3_gather_16bit_weights_on_model_save", False))
    name = (MODEL_DIR if recipe.method == "full" else ADAPTER_DIR) if gathered else ZERO_CHECKPOINT_DIR
    tmp = run_dir / f".{name}.partial"
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    barrier()
    processing_class, trainer.processing_class = trainer.processing_class, None  # tokenizer/ holds it
    try:
        trainer.save_model(str(tmp))
    finally:
        trainer.processing_class = processing_class
    barrier()  # a ZeRO checkpoint is written by every rank
    if is_main:
        (tmp / "training_args.bin").unlink(missing_ok=True)  # a pickle; training_args.json says the same
        if name == ADAPTER_DIR:
            _record_base_model(tmp / ADAPTER_CONFIG, resolve_base(recipe))
        if gathered and not any(tmp.glob("*.safetensors")):
            raise RuntimeError(f"saving {name}/ wrote no safetensors weights")
        _replace_dir(tmp, run_dir / name)
    barrier()
    return name


def _record_base_model(config_path: Path, base: str) -> None:
    """adapter_config.json names the absolute local base model, so `merge` needs no flag."""
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["base_model_name_or_path"] = base
    _write_json(config_path, config)


def save_final_logits(model, batch: dict[str, Any], device, path: Optional[Path]) -> None:
    """Forward the fixed batch in eval mode (every rank: ZeRO-3 gathers weights collectively).

    One sequence at a time, each one's logits moved to the CPU before the next: the whole batch's
    logits at once (and their float32 copy) held 4 x seq x vocab x 6 B on the GPU (5.9 GiB of whole
    2,048-token rows at Llama-3's 128,256 vocab: more than the training step's loss, after it).
    The batch is right-padded rows with an attention mask (the objective's `fixed_batch`: finetune.train.sft).
    """
    import torch
    from safetensors.torch import save_file

    inputs = {k: v for k, v in batch.items() if k != "labels"}
    rows = len(inputs["input_ids"])
    was_training = model.training
    model.eval()
    with torch.no_grad():
        logits = torch.cat([model(**{k: v[i:i + 1].to(device) for k, v in inputs.items()},
                                  use_cache=False).logits.cpu().float() for i in range(rows)])
    model.train(was_training)
    if path is not None:
        tensors = {"logits": logits.contiguous(), **{k: v.contiguous() for k, v in inputs.items()}}
        tmp = path.with_name(f".{path.name}.tmp")
        save_file(tensors, str(tmp))
        # safetensors creates the file 0600; the run directory is shared like the rest of its files
        from finetune.fsutil import give_usual_mode

        give_usual_mode(tmp)
        os.replace(tmp, path)


def summarize(trainer, clock, world_size: int, memory: list[tuple[int, str]], extra: dict[str, Any],
              token_replicas: int = 1) -> dict[str, Any]:
    state = trainer.state
    history = state.log_history
    losses = [{k: entry[k] for k in ("step", "epoch", "loss", "learning_rate", "grad_norm") if k in entry}
              for entry in history if "loss" in entry]
    evals = [{k: entry[k] for k in ("step", "epoch", "eval_loss") if k in entry} for entry in history if "eval_loss" in entry]
    tokens = int(state.num_input_tokens_seen or 0) // token_replicas  # AutoTP ranks each count the same tokens
    seconds = clock.seconds
    summary: dict[str, Any] = {
        "steps": state.global_step,
        "epochs": state.epoch,
        "train_loss_first": losses[0]["loss"] if losses else None,
        "train_loss_last": losses[-1]["loss"] if losses else None,
        "eval_loss_last": evals[-1]["eval_loss"] if evals else None,
        "tokens_trained": tokens,
        # throughput of this process's run only: after a resume the clock restarts, so do the tokens
        # None when the trainer counts no tokens (TRL's ORPO/CPO batches have no `input_ids` column to count)
        "tokens_per_second": (tokens - clock.tokens_at_start // token_replicas) / seconds if seconds > 0 and tokens else None,
        "wall_seconds": seconds,
        "world_size": world_size,
        "peak_memory_bytes": [m[0] for m in memory],
        "peak_memory_kind": memory[0][1] if memory else None,
        # read when training ended, before the verification forward and the saving: what `finetune plan` predicts
        "peak_memory_scope": "training",
    }
    summary.update(extra)
    summary["loss_history"] = losses
    summary["eval_history"] = evals
    return summary


# ------------------------------------------------------------------------------------------------
# The run


def check_packing_support(model, recipe) -> None:
    """Packed / padding-free examples are kept apart only through position_ids (lint R114): a model whose
    forward does not take them would attend across examples, and the Trainer would silently drop the
    column as unused."""
    import inspect

    from finetune.data.tokenize import DataError

    if not (recipe.data.packing or recipe.data.padding_free):
        return
    if "position_ids" not in inspect.signature(model.forward).parameters:
        mode = "packing" if recipe.data.packing else "padding_free"
        raise DataError(f"data.{mode}: {type(model).__name__} takes no position_ids, so packed examples would attend to "
                        f"each other; set data.{mode}: false")


def run(run_dir: Path, resume: bool = False) -> None:
    recipe, ds_config, args_kwargs = read_run_dir(run_dir)
    started = time.perf_counter()
    from finetune.train.startup import Startup
    startup = Startup(run_dir)  # before the heavy imports: `launch` ends here, `imports` begins
    _quiet_libraries()

    import deepspeed
    import transformers
    from transformers import TrainingArguments

    from finetune.builtin import ensure_builtin_model, is_builtin
    from finetune.train import memory_trace, profile, syncs
    from finetune.train.callbacks import EffectiveDeepSpeedConfig, LastStepLogged, LossPlot, ProgressLines, TrainClock
    from finetune.train.finite import FiniteGuard
    from finetune.train import parallel
    from finetune.train.model import count_parameters
    from finetune.train.objective_steps import steps_of
    from finetune.train.vlm_model import install_guard
    from finetune.tokenizer import load_tokenizer

    startup.mark("imports")
    on_cpu = is_cpu_accelerator()
    # The objective's steps, picked once: finetune.train.sft, preference (dpo, orpo, kto, simpo), grpo or reward.
    steps = steps_of(recipe, run_dir)
    ds_config = adapt_deepspeed_config(ds_config, on_cpu)
    # 1. Process group first: TrainingArguments reads the world size from it, and zero.Init in
    #    from_pretrained computes the batch size from that.
    from finetune.train import preemption

    deepspeed.init_distributed(timeout=preemption.nccl_timeout(recipe))
    # Checkpoints that are published only when complete, resume, SIGTERM -> checkpoint (preemption.py).
    startup.mark("process_group")
    resilience = preemption.setup(run_dir, recipe, ds_config, args_kwargs, resume)
    ds_config, args_kwargs = resilience.ds_config, resilience.args_kwargs
    # Our SFT collator counts the tokens on the host (finetune.train.counting); batches collated elsewhere (TRL's
    # trainers, Ulysses' data-loader adapter) are counted by the Trainer, a sync per batch (SftSteps.host_counts).
    host_counts = steps.host_counts
    engine = bool(recipe.deepspeed.enabled)  # false: transformers' Trainer alone (finetune.plan.auto decides auto)
    args_kwargs = {**args_kwargs, "output_dir": str(run_dir), **({"deepspeed": ds_config} if engine else {}),
                   "include_num_input_tokens_seen": "no" if host_counts else "non_padding"}
    args_kwargs = training_arguments_kwargs(args_kwargs, {f.name for f in dataclasses.fields(TrainingArguments)})
    ds_config, args_kwargs = parallel.for_this_run(  # another process count, Ulysses, offload (train/parallel.py)
        resilience.checkpoint, ds_config, args_kwargs, _log_main(process_rank() == 0), engine)
    if on_cpu:
        args_kwargs["use_cpu"] = True
    os.environ.setdefault("TENSORBOARD_LOGGING_DIR", str(run_dir / TENSORBOARD_DIR))
    # 2. The DeepSpeed config, registered with transformers (before the model is created). TRL's objectives use
    #    its config class, a TrainingArguments subclass with their own keys.
    training_args = steps.arguments(TrainingArguments, args_kwargs)
    _ = training_args.device  # sets the CUDA device of this rank (bitsandbytes quantizes onto it)
    is_main = training_args.process_index == 0
    world_size = training_args.world_size
    transformers.set_seed(recipe.training.seed)
    if is_main:
        _write_json(run_dir / ENV_FILE, environment(world_size))

    # 3. Model files (the built-in tiny model is created by preflight; this is a no-op then), tokenizer, data.
    with training_args.main_process_first(local=True, desc="built-in model"):
        model_path = str(ensure_builtin_model(recipe.model.name_or_path)) if is_builtin(recipe.model.name_or_path) \
            else recipe.model.name_or_path
    tokenizer = load_tokenizer(recipe, model_path)
    train_set, eval_set = steps.datasets(tokenizer, model_path, is_main, args_kwargs, on_cpu)
    startup.mark("data")

    # 4. The model, built partitioned under ZeRO-3, then LoRA and gradient checkpointing.
    model = steps.load_model(model_path, tokenizer)  # reward: a one-score head on the base model
    check_packing_support(model, recipe)
    # No KV cache while training: it is for generation, and with one transformers skips the packed-
    # sequence mask (masking_utils). Restored before saving, so model/ generates with a cache.
    use_cache, model.config.use_cache = getattr(model.config, "use_cache", True), False
    model = steps.prepare(model, model_path)  # TRL's: the adapter is TRL's to add; maybe a reference model
    parallel.apply_tiled_mlp(model, recipe.training)  # DeepSpeed ALST's TiledMLP when training.tiled_mlp
    tower_guard = install_guard(model, recipe, world_size)  # a VLM under several processes: every batch enters the tower
    if recipe.training.loss_kernel == "chunked":
        from finetune.chunks import chunk_count
        from finetune.loss_kernel import use_chunked_loss

        t = recipe.training
        use_chunked_loss(model, chunk_count(t.micro_batch_size * recipe.data.max_length, model.config.vocab_size,
                                            t.loss_chunk_tokens))
    startup.mark("model")
    clock = TrainClock()
    # FiniteGuard before the preemption callback: a state that is not finite is refused (on_save) before that one
    # publishes it. The preemption callback before the clock: the clock sees a checkpoint it decides on
    # (control.should_save).
    guard = FiniteGuard(run_dir, resilience.checkpoint, node_local=resilience.callback.node_local)
    callbacks = [guard, resilience.callback, clock, EffectiveDeepSpeedConfig(run_dir), LossPlot(run_dir), LastStepLogged()]
    if os.environ.get(profile.ENV) or os.environ.get(syncs.ENV):  # issue 35: the steady window starts after it
        clock.warmup += profile.PROFILE_STEPS
        profile_to, syncs_to = profile.wanted(), syncs.wanted()  # rank 0's, before the clock stamps (profile.Window)
        if profile_to is not None or syncs_to is not None:
            callbacks.insert(callbacks.index(clock), profile.callback(profile_to, syncs_to))
    trace_to = memory_trace.wanted()  # the harness's memory rows: what is live at the peak (issue 35)
    if trace_to is not None:
        callbacks.append(memory_trace.callback(trace_to))
    trainer = steps.make_trainer(model, training_args, train_set, eval_set, tokenizer, callbacks, model_path)
    clock.counter = getattr(trainer, "counted", None)  # a CountingTrainer's host counts (sft)
    trainable, total = count_parameters(trainer.model)
    _log_main(is_main)(f"parameters: {trainable:,} trainable of {total:,} ({recipe.method})")
    if os.environ.get("TQDM_DISABLE"):  # output relayed line by line (see finetune.run.launch.supervision): plain progress lines
        from finetune.progress_env import progress_interval

        trainer.add_callback(ProgressLines(progress_interval()))
    checkpoint = resilience.checkpoint
    startup.mark("trainer")
    try:
        trainer.train(resume_from_checkpoint=checkpoint)
    except preemption.AlreadyTrained as done:
        _log_main(is_main)(f"{Path(checkpoint).name} is the training's last step ({done}): nothing is left to "
                           "train; writing the outputs")
        clock.ended = time.perf_counter()
        resilience.callback.finishing = True
    resilience.raise_if_stopped()  # stopped by a signal: the checkpoint is complete; no final outputs
    # The training peak, what `finetune plan` predicts: read before the outputs' own forward.
    memory = all_gather(peak_memory())
    reserved = all_gather(peak_memory_reserved())
    if clock.counter is not None:  # the ranks' host counts (collective)
        trainer.state.num_input_tokens_seen = clock.tokens_at_start + clock.tokens_this_start()
    steady = run_speed(clock, trainer.model, world_size)
    dummy_forwards = all_gather(tower_guard.dummy_runs) if tower_guard is not None else None

    # 5. Outputs: the weights first, so that nothing after training can cost them.
    trainer.model.config.use_cache = use_cache
    saved = save_weights(trainer, recipe, ds_config, run_dir, is_main)
    batch = steps.fixed_batch(trainer, train_set, tokenizer.pad_token_id, LOGITS_BATCH, LOGITS_TOKENS)
    save_final_logits(trainer.model, batch, training_args.device, run_dir / FINAL_LOGITS_FILE if is_main else None)
    if is_main:
        tmp_tok = run_dir / ".tokenizer.partial"
        shutil.rmtree(tmp_tok, ignore_errors=True)
        tokenizer.save_pretrained(str(tmp_tok))
        steps.save_beside_tokenizer(tmp_tok)  # a VLM's processor as trained
        _replace_dir(tmp_tok, run_dir / TOKENIZER_DIR)
        extra = {"method": recipe.method, "zero_stage": recipe.deepspeed.stage if engine else None,
                 "deepspeed": engine, "output": saved,
                 "trainable_parameters": trainable, "total_parameters": total,
                 "train_sequences": len(train_set), "eval_sequences": len(eval_set) if eval_set is not None else 0,
                 "resumed_from": checkpoint, "total_seconds": time.perf_counter() - started,
                 "peak_memory_reserved_bytes": reserved if any(r is not None for r in reserved) else None,
                 "loss_kernel": recipe.training.loss_kernel, "startup": startup.split(clock), "steady": steady,
                 "auto": _read_json(run_dir / AUTO_FILE).get("values")}
        extra.update(steps.summary_extra(trainer.state.log_history))
        from finetune.train import moe

        extra.update(moe.summary_extra(recipe, model_path, trainer.state.log_history))
        if dummy_forwards is not None:  # micro batches without an image that ran the tower anyway, per rank
            extra["tower_guard_dummy_forwards"] = dummy_forwards
        summary = summarize(trainer, clock, world_size, memory, extra, token_replicas=recipe.parallel.tensor)
        _write_json(run_dir / SUMMARY_FILE, summary)
        aux = (f" (router aux loss {_fmt(summary['aux_loss_first'])} -> {_fmt(summary['aux_loss_last'])}, weight "
               f"{summary['router_aux_loss_coef']})" if summary.get("aux_loss_last") is not None else "")
        _log_main(True)(f"done: {summary['steps']} steps, {loss_text(summary['loss_history'])}{aux}, "
                        f"{summary['tokens_per_second'] or 0:.0f} tokens/s; {saved}/ in {run_dir}")
        _log_main(True)(speed_line(summary))
        line = steps.summary_line(summary)  # TRL's objectives: their reward metrics
        if line is not None:
            _log_main(True)(line)
        from finetune.train.report import write_run_report

        for note in write_run_report(run_dir, trainer.state.log_history):
            _log_main(True)(note)
        _log_main(True)(f"report: {run_dir / REPORT_FILE}")
        if saved == ZERO_CHECKPOINT_DIR:
            _log_main(True)("the weights are a ZeRO checkpoint (gather_16bit_weights_on_model_save is false): "
                            f"run `{command_line('finetune', 'convert', run_dir)}` for an adapter or model")
    barrier()
    resilience.callback.finished()  # a signal from here on ends the process as usual: everything is written


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _fmt(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def loss_text(losses: list[dict[str, Any]]) -> str:
    """'loss 7.148 -> 2.397' (first and last logged step), or 'loss 0.039 at step 1' when one step was logged."""
    if not losses:
        return "loss n/a"
    if len(losses) == 1:
        return f"loss {_fmt(losses[0].get('loss'))} at step {losses[0].get('step')}"
    return f"loss {_fmt(losses[0].get('loss'))} -> {_fmt(losses[-1].get('loss'))}"


def run_speed(clock, model, world_size: int) -> dict[str, Any]:
    """summary.json's `steady` (finetune.speed): MFU on a GPU whose peak the table knows, for a model whose shape
    the planner reads (collective: every rank's counts)."""
    from finetune.plan.archs import ArchError, arch_from_config
    from finetune.speed import peak_bf16_flops

    import torch

    try:
        config = getattr(model, "config", None)
        arch = arch_from_config(config.to_dict(), "run") if config is not None else None
    except (ArchError, KeyError, TypeError, ValueError):
        arch = None
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    peak, source = peak_bf16_flops(gpu) if gpu else (None, None)
    out = clock.steady(world_size, arch, peak)
    out.update(gpu=gpu, peak_flops=peak, peak_source=source)
    if gpu is None and out["tokens_per_second"] is not None:
        out["reason"] = "no MFU on a CPU"
    return out


def speed_line(summary: dict[str, Any]) -> str:
    """The console's speed line: the steady figures beside the start-up split (finetune.train.startup)."""
    from finetune.speed import steady_text
    from finetune.train.startup import startup_text

    return f"speed: {steady_text(summary.get('steady'))}; {startup_text(summary.get('startup'))}"


def _log_main(is_main: bool):
    def log(message: str) -> None:
        if is_main:
            print(f"[finetune] {message}", flush=True)

    return log


def _quiet_libraries() -> None:
    """Rank 0 keeps transformers' warnings; the others only report errors (N copies help nobody)."""
    from finetune import quiet

    quiet.install()
    rank = process_rank()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Deprecations raised by one library calling another, once per step and rank; nothing to act on here.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r".*(is_gradient_checkpointing|gradient_checkpointing_(en|dis)able). is deprecated",
                            category=FutureWarning)  # TRL toggles checkpointing around each reference forward
    # accelerate on a CPU: "OMP_NUM_THREADS/MKL_NUM_THREADS unset, we set it at N" (it picks cores / ranks itself).
    warnings.filterwarnings("ignore", message=r"OMP_NUM_THREADS/MKL_NUM_THREADS unset", category=UserWarning)
    # peft 0.21's check of rank_pattern / alpha_pattern looks at targeted modules only (tuners_utils.inject_adapter),
    # so the fused gate_up_proj's 2r (finetune.models.targets), which it does apply, is reported as ignored.
    warnings.filterwarnings("ignore", message=r"The following (rank|alpha)_pattern keys did not match any targeted module",
                            category=RuntimeWarning)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    if rank != 0:
        import datasets
        import transformers

        transformers.utils.logging.set_verbosity_error()
        datasets.utils.logging.set_verbosity_error()
        datasets.disable_progress_bars()


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m finetune.train.runner", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, type=Path, help="Run directory written by `finetune train`.")
    parser.add_argument("--resume", action="store_true", help="Continue from the newest complete checkpoint-N in the run directory.")
    # The deepspeed launcher appends --local_rank=N unless given --no_local_rank; LOCAL_RANK is in the environment.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    from finetune.errors import FinetuneError
    from finetune.rundir.checkpoint import EXIT_PREEMPTED, CheckpointError
    from finetune.train.shutdown import close_process_group

    try:
        run(args.run_dir.resolve(), resume=args.resume)
        close_process_group()
    except FinetuneError as exc:
        if exc.exit_code == EXIT_PREEMPTED or isinstance(exc, CheckpointError):
            from finetune.train.preemption import exit_code_for

            return exit_code_for(exc, args.run_dir.resolve()) or 1  # the rank that stopped says so
        # The launcher shows rank 0's console; one line, no traceback, for problems in the inputs.
        for line in exc.lines():
            print(line, file=sys.stderr, flush=True)
        return exc.exit_code
    except Exception as exc:  # a full / read-only disk: one line, no traceback
        from finetune.train.preemption import exit_code_for

        code = exit_code_for(exc, args.run_dir.resolve())
        if code is None:
            raise
        return code
    return 0


if __name__ == "__main__":
    import signal

    from torch.distributed.elastic.multiprocessing.errors import record

    from finetune.parentdeath import die_with_parent

    # torchrun starts ranks in sessions of their own and does nothing for them when it is SIGKILLed:
    # a rank whose launcher is gone has nobody to publish its checkpoint, so it goes too.
    die_with_parent(signal.SIGKILL)

    from finetune.train.shutdown import run_as_rank

    # record: an uncaught exception goes to torchrun's error file, so `finetune train` names the rank and
    # the exception. run_as_rank: os._exit after an orderly shutdown (finetune/train/shutdown.py).
    run_as_rank(record(main))
