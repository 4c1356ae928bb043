"""The allocation profile of training steps at several sequence lengths: what a caching-allocator replay
(finetune/plan/allocator.py) needs to see how the cache grows when batches change shape
(`python scripts/plan_corpus.py --allocator`; docs/plan.md, "The allocator").

Every layer is traced (no extrapolation: the order of allocations is what matters), on fake tensors as
finetune/plan/trace/step.py runs them. Imports torch, transformers and peft.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from finetune.plan.setup import Setup
from finetune.plan.trace.step import (
    build_model, cuda_only_terms, cuda_paths, data_decisions, fake_parameters, hf_config, make_batch, make_optimizer,
    run_step, trainer_autocast,
)


def allocation_profile(setup: Setup, lengths: list[int], config: Optional[dict] = None):
    """(resident bytes, one event list per step) of training steps at `lengths` tokens, all layers traced:
    what finetune.plan.allocator.replay needs. The first step creates the optimizer's states (kept); the
    cuBLAS workspaces (cuda_only_terms: allocated once from the caching allocator) are resident."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from finetune.plan.trace.live_tensors import LiveTensors

    cfg = hf_config(setup, config)
    model = build_model(setup, cfg)
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    fake_parameters(model, mode)
    resident: Optional[list[int]] = None
    steps = []
    with mode, data_decisions(setup), cuda_paths():
        optimizer = make_optimizer(model, setup)
        for length in lengths:
            batch = make_batch(replace(setup, seq_len=length), cfg["vocab_size"])
            tracker = LiveTensors(model, optimizer, vocab=cfg["vocab_size"], inputs=batch.values())
            with tracker:
                run_step(model, optimizer, batch, tracker, autocast=trainer_autocast(setup))
            if resident is None:
                resident = list(tracker.resident) + [b for name, when, b, _ in cuda_only_terms(setup, cfg)
                                                     if name.startswith("cuBLAS")]
            steps.append(list(tracker.events))
            del batch, tracker
    return resident, steps
