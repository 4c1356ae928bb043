"""`LiveTensors`: a torch dispatch mode that counts the bytes of live tensor storages, by kind.

Every aten op's outputs are looked at as it returns; a storage not seen before is counted from then on
and dropped when Python frees it (a weak reference's callback), which is when the caching allocator
gets the block back. Storages that exist before the mode is entered (the parameters, the optimizer's
states) are counted from the start. Kinds:
- weights: parameters and buffers; optimizer: the optimizer's state tensors;
- gradients: storages that became a parameter's .grad (post-accumulate-grad hooks);
- logits: tensors whose last dimension is the vocabulary (the logits, their fp32 copy, the log-probs
  and their gradients);
- activations: created in forward (alive at a backward peak: saved for backward);
- temporaries: created in backward or in the optimizer step (with checkpointing, the recomputed layer).

Each phase's peak is also kept per place (`place_peaks`), a place being where the step is, named the same
at every depth: the module running (its decoder layer as first, last or mid), else in backward the module
whose gradient came last (finetune.plan.trace.step extrapolates each place from shallow models).

Imported only by finetune.plan.trace.step (it imports torch at the top).
"""

from __future__ import annotations

import re
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


LAYER = re.compile(r"layers\.(\d+)")


def _nbytes(storage) -> int:
    return storage.nbytes()


class LiveTensors(TorchDispatchMode):
    def __init__(self, model, optimizer, vocab: int, inputs=()):
        super().__init__()
        self.vocab = vocab
        self.names = {id(m): n for n, m in model.named_modules()}
        self.depth = 1 + max((int(m.group(1)) for n in self.names.values() for m in LAYER.finditer(n)), default=-1)
        self._places: dict[str, str] = {}
        self._owners = {id(p): n.rpartition(".")[0] for n, p in model.named_parameters()}
        self.place_peaks: dict[str, dict[str, tuple[int, dict[str, int], str]]] = {}
        self.phase = "forward"
        self.live: dict[int, tuple[weakref.ref, int, str]] = {}
        self.totals = {k: 0 for k in ("weights", "optimizer", "gradients", "activations", "logits", "temporaries")}
        self.current = 0
        self.peak = 0
        self.peak_phase = "forward"
        self.peak_kinds: dict[str, int] = dict(self.totals)
        self.peak_module = ""
        self.phase_peaks: dict[str, int] = {}
        self.phase_kinds: dict[str, dict[str, int]] = {}
        self.phase_modules: dict[str, str] = {}
        self.stack: list[str] = []
        self._handles = []
        # The allocation log a caching-allocator replay reads (finetune/plan/allocator.py): the storages
        # that exist when the mode starts (`resident`, bytes), then ("alloc", serial, bytes) / ("free", serial)
        # in the order torch creates and Python frees them.
        self.resident: list[int] = []
        self.events: list[tuple] = []
        self._serial = 0
        self._started = False
        for p in model.parameters():
            self._add(p.untyped_storage(), "weights")
        for b in model.buffers():
            self._add(b.untyped_storage(), "weights")
        for t in inputs:  # the batch: input ids and labels
            self._add(t.untyped_storage(), "activations")
        for p in model.parameters():  # accumulated gradients of earlier micro batches
            if p.grad is not None:
                self._add(p.grad.untyped_storage(), "gradients")
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    self._add(value.untyped_storage(), "optimizer")
        for p in model.parameters():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
        self._handles.append(torch.nn.modules.module.register_module_forward_pre_hook(self._enter))
        self._handles.append(torch.nn.modules.module.register_module_forward_hook(self._leave))
        self._started = True
        self._note()

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        self._phase, self.place, self._grad_place = value, "", ""

    def _placed(self, name: str) -> str:
        """A module's place: its name with the decoder layer's index as first, last or mid."""
        place = self._places.get(name)
        if place is None:
            def where(m):
                i = int(m.group(1))
                return "layers." + ("first" if i == 0 else "last" if i == self.depth - 1 else "mid")
            place = self._places[name] = LAYER.sub(where, name)
        return place

    # -- bookkeeping ---------------------------------------------------------------------------

    def _add(self, storage, kind: str) -> None:
        key = id(storage)
        if key in self.live or _nbytes(storage) == 0:
            return
        size = _nbytes(storage)
        ref = weakref.ref(storage, lambda _, key=key: self._drop(key))
        self._serial += 1
        self.live[key] = (ref, size, kind, self._serial)
        if self._started:
            self.events.append(("alloc", self._serial, size))
        else:
            self.resident.append(size)
        self.totals[kind] += size
        self.current += size

    def _drop(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self.events.append(("free", entry[3]))
            self.totals[entry[2]] -= entry[1]
            self.current -= entry[1]

    def _relabel(self, storage, kind: str) -> None:
        entry = self.live.get(id(storage))
        if entry is None:
            self._add(storage, kind)
        elif entry[2] != kind:
            self.totals[entry[2]] -= entry[1]
            self.totals[kind] += entry[1]
            self.live[id(storage)] = (entry[0], entry[1], kind, entry[3])

    def _note(self) -> None:
        if self.current > self.phase_peaks.get(self.phase, -1):
            self.phase_peaks[self.phase] = self.current
            self.phase_kinds[self.phase] = dict(self.totals)
            self.phase_modules[self.phase] = self.stack[-1] if self.stack else ""
        places = self.place_peaks.setdefault(self.phase, {})
        if self.current > places.get(self.place, (-1,))[0]:
            places[self.place] = (self.current, dict(self.totals), self.stack[-1] if self.stack else "")
        if self.current > self.peak:
            self.peak = self.current
            self.peak_phase = self.phase
            self.peak_kinds = dict(self.totals)
            self.peak_module = self.stack[-1] if self.stack else ""

    def _kind(self, tensor) -> str:
        if tensor.dim() and tensor.shape[-1] == self.vocab:
            return "logits"
        return "activations" if self.phase == "forward" else "temporaries"

    # -- hooks ---------------------------------------------------------------------------------

    def _on_grad(self, param) -> None:
        if param.grad is not None:
            self._grad_place = self._placed(self._owners.get(id(param), ""))
            if not self.stack:
                self.place = self._grad_place
            self._relabel(param.grad.untyped_storage(), "gradients")
            self._note()

    def _enter(self, module, args) -> None:
        name = self.names.get(id(module))
        if name is not None:
            self.stack.append(name)
            self.place = self._placed(name)

    def _leave(self, module, args, out) -> None:
        if self.names.get(id(module)) is not None and self.stack:
            self.stack.pop()
            self.place = self._placed(self.stack[-1]) if self.stack else self._grad_place

    def __exit__(self, *args):
        for handle in self._handles:
            handle.remove()
        return super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t.untyped_storage(), self._kind(t))
        self._note()
        return out
