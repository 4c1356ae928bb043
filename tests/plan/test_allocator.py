"""The caching allocator's documented rules (finetune/plan/allocator.py, from c10/cuda/CUDACachingAllocator.cpp)
and their replay over a traced step's allocations."""

from __future__ import annotations

from dataclasses import replace

import pytest

from finetune.plan.allocator import (
    K_LARGE_BUFFER, K_SMALL_BUFFER, CachingAllocator, expandable_in_training, replay, resident_reserved,
    round_size, segment_size,
)
from finetune.units import MiB


def test_rounding_and_segment_sizes_follow_the_source():
    assert [round_size(n) for n in (1, 512, 513, 1000)] == [512, 512, 1024, 1024]
    # get_allocation_size: <= 1 MiB -> 2 MiB segment; < 10 MiB -> 20 MiB; else rounded up to 2 MiB.
    assert segment_size(MiB) == K_SMALL_BUFFER == 2 * MiB
    assert segment_size(MiB + 512) == segment_size(10 * MiB - 512) == K_LARGE_BUFFER == 20 * MiB
    assert segment_size(10 * MiB) == 10 * MiB and segment_size(11 * MiB) == 12 * MiB


def test_resident_tensors_share_segments_as_the_rules_pack_them():
    # Small tensors pack 2 MiB segments; 8 MiB ones share 20 MiB segments two at a time; 32 MiB ones fit exactly.
    assert resident_reserved([(5, 512 * 1024)], expandable=False) == 4 * MiB
    assert resident_reserved([(3, 8 * MiB)], expandable=False) == 40 * MiB
    assert resident_reserved([(4, 32 * MiB), (1, 33 * MiB)], expandable=False) == 4 * 32 * MiB + 34 * MiB
    # Expandable segments: 512-byte blocks tile one segment per pool, mapped in 2 / 20 MiB pages.
    assert resident_reserved([(3, 8 * MiB)], expandable=True) == 40 * MiB
    assert resident_reserved([(4, 32 * MiB), (1, 33 * MiB)], expandable=True) == 180 * MiB


def test_a_replay_reuses_cached_blocks_for_jump():
    step = [("alloc", 1, 100 * MiB), ("alloc", 2, 50 * MiB), ("free", 1), ("alloc", 3, 30 * MiB), ("free", 2),
            ("free", 3)]
    allocator = replay([300 * MiB], [step] * 3, expandable=False)
    # The 30 MiB request splits the freed 100 MiB block: nothing is reserved beyond the peak.
    assert allocator.peak_allocated == allocator.peak_reserved == 450 * MiB


def test_growing_shapes_leave_segments_behind_without_expandable_segments():
    steps = [[("alloc", 1, int(k * 100 * MiB)), ("alloc", 2, int(k * 50 * MiB)), ("free", 1), ("free", 2)]
             for k in (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)]
    fixed = replay([], steps, expandable=False)
    assert fixed.peak_allocated == 150 * MiB and fixed.peak_reserved > 3 * fixed.peak_allocated
    grown = replay([], steps, expandable=True)
    assert grown.peak_reserved <= fixed.peak_allocated + K_LARGE_BUFFER
    # Before a cudaMalloc over the GPU's memory, cached segments are released (no OOM: they were free).
    capped = replay([], steps, expandable=False, capacity=400 * MiB)
    assert capped.peak_reserved <= 400 * MiB and capped.ooms == 0


def test_freed_neighbours_coalesce():
    allocator = CachingAllocator()
    a, b = allocator.malloc(12 * MiB), allocator.malloc(5 * MiB)
    assert allocator.reserved == 12 * MiB + 20 * MiB
    c = allocator.malloc(5 * MiB)  # split off the rest of the 20 MiB segment
    allocator.free(b)
    allocator.free(c)
    d = allocator.malloc(15 * MiB)  # the segment's blocks merged back: 20 MiB free serves it
    assert allocator.reserved == 32 * MiB and d.size == 15 * MiB
    allocator.free(a)
    allocator.free(d)
    assert allocator.allocated == 0


def test_training_runs_with_expandable_segments_unless_the_user_said_otherwise():
    assert expandable_in_training({}) is True
    assert expandable_in_training({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}) is False
    assert expandable_in_training({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}) is True
    assert expandable_in_training({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,expandable_segments:False"}) \
        is False
    # torch's newer name counts as the user's setting too; where both are set, torch 2.13 reads the older one
    assert expandable_in_training({"PYTORCH_ALLOC_CONF": "expandable_segments:False"}) is False
    assert expandable_in_training({"PYTORCH_ALLOC_CONF": ""}) is False
    assert expandable_in_training({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                                   "PYTORCH_ALLOC_CONF": "expandable_segments:False"}) is True


def test_plan_reports_the_allocator_setting():
    from finetune.plan import plan
    from finetune.plan.archs import BY_NAME
    from finetune.plan.setup import Setup

    arch = BY_NAME["qwen2.5-0.5b"]
    base = Setup(arch=arch, params=arch.total_params, method="lora", deepspeed=False)
    on, off = plan(base), plan(replace(base, expandable_segments=False))
    assert on.memory_views["allocated"] == off.memory_views["allocated"]
    assert "expandable_segments on" in on.render_text() and "expandable_segments off" in off.render_text()
    assert on.to_json()["memory"]["expandable_segments"] is True


def test_traced_step_replayed_through_the_allocator():
    """The tiny Llama's traced allocations (one step per length) through the rules: the replayed allocated peak
    holds the resident tensors and the step's, reserved is at least that, and growing lengths without
    expandable segments reserve at least what one jump to the longest does; with expandable segments, no more
    (but a page)."""
    pytest.importorskip("transformers")
    from tests.plan.trace.test_trace import TINY, _tiny
    from finetune.plan.trace.allocations import allocation_profile

    setup = _tiny(seq_len=128)
    resident, steps = allocation_profile(setup, [32, 64, 96, 128, 128], config=TINY)
    assert all(event[0] in ("alloc", "free") for step in steps for event in step)
    jump = replay(resident, steps[:1] + steps[-1:], expandable=False, first_step_keeps=True)
    assert jump.peak_allocated > sum(resident) and jump.peak_reserved >= jump.peak_allocated
    growing = replay(resident, steps[:-1], expandable=False, first_step_keeps=True)
    assert growing.peak_allocated == jump.peak_allocated  # the same longest step
    assert growing.peak_reserved >= jump.peak_reserved
    # Expandable segments map 20 MiB pages: at the tiny model's scale that is one page more at most.
    assert replay(resident, steps[:-1], expandable=True, first_step_keeps=True).peak_reserved <= \
        growing.peak_reserved + K_LARGE_BUFFER


def test_trace_reports_the_replayed_reserved_and_extrapolates_it():
    """`finetune plan --trace` replays its step through the rules; a 7-layer model traced at 2-4 layers and
    extrapolated is within one 20 MiB segment of the same model traced whole."""
    pytest.importorskip("transformers")
    from tests.plan.trace.test_trace import TINY, _tiny
    from finetune.plan.trace.step import trace

    setup = _tiny(seq_len=128, expandable_segments=False)
    deep = {**TINY, "num_hidden_layers": 7}
    whole = trace(setup, deep, extrapolate=False)
    assert whole.reserved >= whole.peak
    extrapolated = trace(setup, deep)
    assert "extrapolated" in extrapolated.notes[0]
    assert abs(extrapolated.reserved - whole.reserved) <= K_LARGE_BUFFER
    assert "as max_memory_reserved" in whole.render_text() and whole.to_json()["reserved"] == whole.reserved
