"""Measure what DeepSpeed really allocates for tiny Llamas, in one CPU process (gloo), for tests/plan/test_planner.py.

    python tests/launches/deepspeed_probe.py '[{"kind": "zero3_live", ...}, ...]'

Prints one line `RESULT <json>` with, per case:
- kind "zero3_live": the peak of the ZeRO-3 parameter coordinator's available-parameter count
  (n_available_params) after every fetch, per step (steady state from the second step);
- kind "buffers": element counts of DeepSpeed's buffers seen during backward (reduce bucket buffers,
  gradient partitions) and of the optimizer's fp32 partition and states after the step;
- kind "step_grads": per ZeRO-3 sub-group, its element count and the peak bytes of tensors that
  `_prepare_fp32_grad_for_sub_group` allocates (and of those still alive when it returns);
- kind "whole_step": the peak bytes of every live tensor storage, from building the model through two
  steps, in the second step's backward and in its optimizer step (and what is alive after it).
"""

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
os.environ.setdefault("MASTER_PORT", "29561")

import deepspeed  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from finetune.train.shutdown import close_process_group, run_as_rank  # noqa: E402


# torch's fused AdamW (its CPU kernel): updates in place with no temporaries, as DeepSpeed's FusedAdam on
# a GPU does, without JIT-compiling DeepSpeed's fused_adam op for the CPU accelerator (a minute of CI).
def optimizer():
    return {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True, "fused": True}}


def build(case, ds):
    cfg = LlamaConfig(**case["config"])
    torch.manual_seed(0)
    if ds["zero_optimization"]["stage"] == 3:
        with deepspeed.zero.Init(config_dict_or_path=ds):
            model = LlamaForCausalLM(cfg)
    else:
        model = LlamaForCausalLM(cfg)
    if case.get("ckpt"):
        from finetune.train.model import enable_checkpointing
        enable_checkpointing(model)
    if case.get("lora"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=case["lora"], lora_alpha=16, lora_dropout=0.0,
                                                 target_modules="all-linear"))
    params = [p for p in model.parameters() if p.requires_grad]
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=ds)
    return cfg, engine, opt


def zero3_live(case):
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
          "optimizer": optimizer(),
          "zero_optimization": {"stage": 3, **case["zero"]}}
    cfg, engine, opt = build(case, ds)
    coord = opt.parameter_offload.get_param_coordinator()
    fetch = coord.fetch_sub_module
    peak = [0]

    def counting_fetch(*args, **kwargs):
        out = fetch(*args, **kwargs)
        peak[0] = max(peak[0], coord._PartitionedParameterCoordinator__n_available_params)
        return out

    coord.fetch_sub_module = counting_fetch
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    peaks = []
    for _ in range(3):
        peak[0] = 0
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        peaks.append(peak[0])
    engine.destroy()
    return peaks


def buffers(case):
    zero = {"stage": case["stage"], **case["zero"]}
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
          "optimizer": optimizer(), "zero_optimization": zero}
    cfg, engine, opt = build(case, ds)
    seen = {}

    def during_backward(grad):
        # The embedding output's gradient arrives last: every bucket buffer exists by now.
        if case["stage"] == 3:
            seen["bucket_buffers"] = [b.buffer.numel() for b in opt.ipg_buckets.values()
                                      if getattr(b, "buffer", None) is not None]
            seen["grad_partition"] = opt.grad_partitions_flat_buffer.numel()
        else:
            seen["bucket_buffers"] = [t.numel() for b in opt.ipg_buckets.values() for t in b.buffer]
        return grad

    def watch(module, inputs, output):
        if output.requires_grad:
            output.register_hook(during_backward)

    engine.module.get_input_embeddings().register_forward_hook(watch)
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    if case["stage"] in (1, 2):
        seen["grads_in_partition"] = None if opt.grads_in_partition is None else opt.grads_in_partition.numel()
    engine.step()
    if case["stage"] == 3:
        seen["fp32_partition"] = sum(t.numel() for t in opt.fp32_partitioned_groups_flat)
        states = [s for s in opt.optimizer.state.values()]
    else:
        seen["fp32_partition"] = sum(t.numel() for t in opt.single_partition_of_fp32_groups)
        states = [s for s in opt.optimizer.state.values()]
    seen["optimizer_state_elements"] = sum(v.numel() for s in states for k, v in s.items()
                                           if torch.is_tensor(v) and v.dim() > 0)
    engine.destroy()
    return seen


class _NewBytes:
    """Peak bytes of tensor storages created by torch ops while active (alive ones counted, freed ones
    dropped as their storages expire)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                outer.track(out, (args, kwargs))
                return out

        self.mode = Mode()
        self.refs = {}
        self.peak = 0

    def live(self):
        return sum(n for ref, n in self.refs.values() if not ref.expired())

    def track(self, out, inputs):
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._pytree import tree_flatten

        # A view (or an in-place op) returns an input's storage: not a new allocation.
        old = {t.untyped_storage().data_ptr() for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() and t.untyped_storage().data_ptr() not in old:
                storage = t.untyped_storage()
                self.refs.setdefault(storage.data_ptr(), (StorageWeakRef(storage), storage.nbytes()))
        self.peak = max(self.peak, self.live())


class _AllBytes(_NewBytes):
    """_NewBytes over a whole run: a storage at an address an expired one had is a new allocation (the
    allocator reuses freed memory), and expired entries are dropped as the table grows."""

    def track(self, out, inputs):
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._pytree import tree_flatten

        old = {t.untyped_storage().data_ptr() for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() and t.untyped_storage().data_ptr() not in old:
                storage = t.untyped_storage()
                entry = self.refs.get(storage.data_ptr())
                if entry is None or entry[0].expired():
                    self.refs[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        if len(self.refs) > 20000:
            self.refs = {k: v for k, v in self.refs.items() if not v[0].expired()}
        self.peak = max(self.peak, self.live())


def whole_step(case):
    h = case["config"]["hidden_size"]
    zero = {"stage": case["stage"], "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": h * h,
            **case.get("zero", {})}
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
          "optimizer": optimizer(), "zero_optimization": zero}
    tracker = _AllBytes()
    seen = {}
    with tracker.mode:
        cfg, engine, opt = build(case, ds)
        ids = torch.randint(0, cfg.vocab_size, (1, case["seq"]))
        for _ in range(2):
            tracker.peak = tracker.live()
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            seen["backward"] = tracker.peak
            tracker.peak = tracker.live()
            engine.step()
            seen["step"] = tracker.peak
            seen["after"] = tracker.live()
    engine.destroy()
    return seen


def step_grads(case):
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
          "optimizer": optimizer(),
          "zero_optimization": {"stage": 3, **case["zero"]}}
    cfg, engine, opt = build(case, ds)
    prepare = opt._prepare_fp32_grad_for_sub_group
    seen = []

    def measured_prepare(sub_group_id):
        tracker = _NewBytes()
        with tracker.mode:
            prepare(sub_group_id)
        seen.append({"elements": opt.fp32_partitioned_groups_flat[sub_group_id].numel(),
                     "peak_bytes": tracker.peak, "kept_bytes": tracker.live()})

    opt._prepare_fp32_grad_for_sub_group = measured_prepare
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.destroy()
    return seen


PROBES = {"zero3_live": zero3_live, "buffers": buffers, "step_grads": step_grads, "whole_step": whole_step}


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    results = [PROBES[c["kind"]](c) for c in json.loads(sys.argv[1])]
    print("RESULT " + json.dumps(results), flush=True)
    close_process_group()


if __name__ == "__main__":
    run_as_rank(main)  # ends like a real rank: a gloo thread can abort at finalization (finetune/train/shutdown.py)
