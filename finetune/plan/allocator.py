"""What PyTorch's CUDA caching allocator reserves beyond the tensors (`max_memory_reserved` over
`max_memory_allocated`), from its documented rules.

The rules, from c10/cuda/CUDACachingAllocator.cpp (pytorch/pytorch at 001074d2; the same constants since
torch 1.x): every request is rounded up to a multiple of 512 bytes (`kMinBlockSize`, `round_size`);
requests up to 1 MiB (`kSmallSize`) come from the small pool, packed into 2 MiB segments (`kSmallBuffer`);
larger ones from the large pool, where a request under 10 MiB (`kMinLargeAlloc`) that no cached block
serves gets a 20 MiB segment (`kLargeBuffer`) to split, and a request of 10 MiB or more a segment of its
own size rounded up to 2 MiB (`kRoundLarge`; all in `get_allocation_size`). A freed block goes back to
its pool: the smallest cached block that fits serves the next request (`get_free_block`, best fit), and
is split only when more than 1 MiB would remain (`should_split`, large pool); nothing is returned to
CUDA until a cudaMalloc fails (then every unsplit cached block is freed and the malloc retried:
`release_cached_blocks`) or `empty_cache` is called.

With `expandable_segments:True` (what `finetune train` sets unless the user configured the allocator:
constants.TRAINING_ALLOC_CONF) each pool has one segment per stream that grows by mapping pages, 2 MiB
for the small pool and 20 MiB for the large one (the file's Note [Expandable Segments]), and any block
is split when 512 bytes or more remain (`should_split`): tensors tile the segment with no 2 MiB rounding,
and a freed block of one size can serve a request of another, so a batch longer than the ones before
fits in what they freed plus new pages instead of leaving slivers in fixed-size segments.

What is modelled (planner._overhead): the rounding of the tensors that live for the whole run (weights:
one allocation each, per-tensor sizes from the parameter groups), exactly by the rules above; the
cached blocks of torch's gradients (freed by zero_grad, same sizes next step); and fragmentation of
what each phase allocates and frees, which the rules alone do not decide (it depends on the order of
requests): constants.FRAGMENTATION, fitted to the Qwen README's fixed-shape rows. Not modelled: the
growth of the cache when every batch has a different shape without expandable segments (a new longest
batch cannot reuse the segments cut for shorter ones; they stay cached until an allocation fails, so
the reserved figure reflects the run's history, up to the GPU's size). That history is not decided by
the documented rules (it depends on the order of lengths); the stated bound (finetune/plan/bound.py)
carries it as its own setup class, measured on the corpus rows that train on varying lengths.
"""

from __future__ import annotations

import bisect
import re
from typing import Iterable, Mapping, Optional

from finetune.plan.constants import ALLOC_CONF_NAMES
from finetune.units import MiB

K_MIN_BLOCK_SIZE = 512  # kMinBlockSize: every request rounded to a multiple of it
K_SMALL_SIZE = 1 * MiB  # kSmallSize: the largest small-pool request
K_SMALL_BUFFER = 2 * MiB  # kSmallBuffer: small-pool segment (and expandable small-pool page)
K_MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc: from here a request gets a segment of its own size
K_LARGE_BUFFER = 20 * MiB  # kLargeBuffer: segment for 1-10 MiB requests (and expandable large-pool page)
K_ROUND_LARGE = 2 * MiB  # kRoundLarge: rounding of a segment of its own


def _ceil(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def round_size(n: int) -> int:
    """The block size a request of `n` bytes takes (`round_size`)."""
    return _ceil(max(n, 1), K_MIN_BLOCK_SIZE)


def segment_size(n: int) -> int:
    """The cudaMalloc a request of `n` bytes makes when no cached block serves it (`get_allocation_size`)."""
    if n <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if n < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return _ceil(n, K_ROUND_LARGE)


def resident_reserved(tensors: list[tuple[int, int]], expandable: bool) -> int:
    """Bytes reserved for tensors allocated once, in order, and never freed ((count, bytes) pairs: the
    weights). Small ones share 2 MiB segments; 1-10 MiB ones share 20 MiB segments (a block is split
    when more than 1 MiB remains, so a segment holds as many as fit, the rest of it stays cached);
    larger ones get their own segment rounded to 2 MiB. With expandable segments every block is
    rounded to 512 bytes and tiles one segment per pool, mapped in 2 / 20 MiB pages."""
    small = sum(count * round_size(size) for count, size in tensors if size <= K_SMALL_SIZE)
    large = [(count, round_size(size)) for count, size in tensors if size > K_SMALL_SIZE]
    if expandable:
        return _ceil(small, K_SMALL_BUFFER) + _ceil(sum(count * size for count, size in large), K_LARGE_BUFFER)
    reserved = _ceil(small, K_SMALL_BUFFER)
    medium = 0
    for count, size in large:
        if size < K_MIN_LARGE_ALLOC:
            per_segment = max(1, K_LARGE_BUFFER // size)
            medium += -(-count // per_segment) * K_LARGE_BUFFER
        else:
            reserved += count * segment_size(size)
    return reserved + medium


def resident_waste(tensors: list[tuple[int, int]], expandable: bool) -> int:
    """What the caching allocator reserves for `tensors` beyond their own bytes."""
    return resident_reserved(tensors, expandable) - sum(count * size for count, size in tensors)


def user_alloc_conf(environ: Mapping[str, str]) -> str | None:
    """The allocator setting a user made in `environ`, or None. torch reads two names:
    PYTORCH_ALLOC_CONF (its documented name since 2.9) and PYTORCH_CUDA_ALLOC_CONF (the older one); where
    both are set, the older wins in torch 2.13's CUDA allocator (c10/cuda/CUDAAllocatorConfig.h: the
    variables in ALLOC_CONF_NAMES' order), while other versions of that header read the newer first."""
    return next((environ[name] for name in ALLOC_CONF_NAMES if name in environ), None)


def expandable_in_training(environ: Mapping[str, str]) -> bool:
    """Whether `finetune train` started from this environment runs with expandable segments: it sets
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless the user set either variable
    (run/launch/commands.py), and a user's value has them only if it says so (the last
    `expandable_segments:` option wins)."""
    conf = user_alloc_conf(environ)
    if conf is None:
        return True
    values = re.findall(r"expandable_segments\s*:\s*(\w+)", conf)
    return bool(values) and values[-1].lower() == "true"


class _Block:
    __slots__ = ("segment", "offset", "size", "small", "free", "prev", "next")

    def __init__(self, segment: int, offset: int, size: int, small: bool):
        self.segment, self.offset, self.size, self.small = segment, offset, size, small
        self.free, self.prev, self.next = False, None, None


class CachingAllocator:
    """A replay of the caching allocator's documented rules (module docstring) over a sequence of
    allocations and frees of one stream: best fit from each pool's cached blocks, splitting, coalescing
    of neighbours within a segment, new segments of `segment_size`, and with a `capacity`, the release of
    every unsplit cached segment before a cudaMalloc that would exceed it (then OOM if it still does).
    With `expandable`, each pool is one segment that grows at its end by 2 / 20 MiB pages and every
    block is split down to 512 bytes. Reports the peaks `max_memory_allocated` (block sizes, as the real
    counter) and `max_memory_reserved` would. Not modelled: other streams (NCCL's, DeepSpeed's side
    streams: their blocks are cached separately), max_split_size_mb and roundup_power2_divisions, and
    the garbage collection threshold (all off by default)."""

    def __init__(self, expandable: bool = False, capacity: Optional[int] = None):
        self.expandable, self.capacity = expandable, capacity
        self.free_blocks: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}  # small? -> sorted
        self.blocks: dict[tuple[int, int], _Block] = {}  # (segment, offset) of free blocks
        self.ends: dict[bool, _Block] = {}  # expandable: the last block of each pool's segment
        self.segments = 0
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self.ooms = 0

    # -- free-block index ------------------------------------------------------------------------

    def _insert(self, small: bool, block: _Block) -> None:
        block.free = True
        bisect.insort(self.free_blocks[small], (block.size, block.segment, block.offset))
        self.blocks[(block.segment, block.offset)] = block

    def _remove(self, small: bool, block: _Block) -> None:
        blocks = self.free_blocks[small]
        del blocks[bisect.bisect_left(blocks, (block.size, block.segment, block.offset))]
        del self.blocks[(block.segment, block.offset)]
        block.free = False

    # -- allocation ------------------------------------------------------------------------------

    def malloc(self, nbytes: int) -> _Block:
        size = round_size(nbytes)
        small = size <= K_SMALL_SIZE
        blocks = self.free_blocks[small]
        i = bisect.bisect_left(blocks, (size, -1, -1))
        if i < len(blocks):
            block = self.blocks[blocks[i][1:]]
            self._remove(small, block)
        elif self.expandable:
            block = self._expand(small, size)
        else:
            block = self._new_segment(small, size)
        remaining = block.size - size
        if remaining >= K_MIN_BLOCK_SIZE and (small or self.expandable or remaining > K_SMALL_SIZE):
            rest = _Block(block.segment, block.offset + size, remaining, small)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            elif self.expandable:
                self.ends[small] = rest
            block.next, block.size = rest, size
            self._insert(small, rest)
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def _grow(self, nbytes: int) -> None:
        if self.capacity is not None and self.reserved + nbytes > self.capacity:
            self._release_cached()
            if self.reserved + nbytes > self.capacity:
                self.ooms += 1  # the run would stop here; counted so the caller can say so
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def _new_segment(self, small: bool, size: int) -> _Block:
        nbytes = segment_size(size)
        self._grow(nbytes)
        self.segments += 1
        return _Block(self.segments, 0, nbytes, small)

    def _expand(self, small: bool, size: int) -> _Block:
        page = K_SMALL_BUFFER if small else K_LARGE_BUFFER
        end = self.ends.get(small)
        tail = end.size if end is not None and end.free else 0
        grow = _ceil(size - tail, page)
        self._grow(grow)
        if tail:
            self._remove(small, end)
            end.size += grow
            return end
        self.segments += 1 if end is None else 0
        block = _Block(end.segment if end else self.segments, end.offset + end.size if end else 0, grow, small)
        block.prev = end
        if end is not None:
            end.next = block
        self.ends[small] = block
        return block

    def _release_cached(self) -> None:
        """Before failing, the allocator frees every cached block that is a whole segment (`release_cached_blocks`;
        with expandable segments, the free pages at each segment's end)."""
        for small in (True, False):
            for key in list(self.free_blocks[small]):
                block = self.blocks[key[1:]]
                whole = block.prev is None and block.next is None
                if whole and not self.expandable:
                    self._remove(small, block)
                    self.reserved -= block.size
                elif self.expandable and block is self.ends.get(small):
                    pages = block.size // (K_SMALL_BUFFER if small else K_LARGE_BUFFER)
                    unmapped = pages * (K_SMALL_BUFFER if small else K_LARGE_BUFFER)
                    if unmapped:
                        self._remove(small, block)
                        block.size -= unmapped
                        self.reserved -= unmapped
                        if block.size:
                            self._insert(small, block)
                        else:
                            self.ends[small] = block.prev
                            if block.prev is not None:
                                block.prev.next = None

    def free(self, block: _Block) -> None:
        small = block.small
        self.allocated -= block.size
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._remove(small, neighbour)
                block = self._absorb(small, neighbour, block) if neighbour is block.prev else \
                    self._absorb(small, block, neighbour)
        self._insert(small, block)

    def _absorb(self, small: bool, left: _Block, right: _Block) -> _Block:
        """Merge the free neighbour `right` into `left` (adjacent in one segment); returns `left`."""
        left.size += right.size
        left.next = right.next
        if right.next is not None:
            right.next.prev = left
        if self.ends.get(small) is right:
            self.ends[small] = left
        return left


Event = tuple  # ("alloc", key, nbytes) or ("free", key)


def replay(resident: Iterable[int], steps: Iterable[list[Event]], expandable: bool,
           capacity: Optional[int] = None, first_step_keeps: bool = False) -> CachingAllocator:
    """Allocate the `resident` tensors (weights, optimizer states: kept for the run), then replay each
    step's events in turn. Keys are per step; what a step leaves allocated is freed at its end (the next
    step's zero_grad and Python free it), except, with `first_step_keeps`, what the first step leaves: the
    optimizer's states a run's first step creates."""
    allocator = CachingAllocator(expandable, capacity)
    for nbytes in resident:
        allocator.malloc(nbytes)
    for index, events in enumerate(steps):
        live: dict = {}
        for event in events:
            if event[0] == "alloc":
                live[event[1]] = allocator.malloc(event[2])
            elif event[1] in live:
                allocator.free(live.pop(event[1]))
        if not (first_step_keeps and index == 0):
            for block in live.values():
                allocator.free(block)
    return allocator
