"""Peak live tensor bytes of a block of code on CPU, where no allocator statistics exist.

A ``TorchDispatchMode`` sees every op's outputs; each new storage is counted until it is freed (a weakref
finalizer subtracts it). Wrapper subclasses (DTensor) are flattened to their local tensors. The bytes
alive when the meter starts (parameters, gradients, optimizer state) are passed in as ``baseline_bytes``.
Unlike MemTracker it needs no module hooks, so modules called several times per step (gradient
accumulation, pipeline schedules) are fine.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


class PeakMemoryMeter(TorchDispatchMode):
    """``with PeakMemoryMeter(baseline) as meter: ...``; then ``meter.peak_bytes``."""

    def __init__(self, baseline_bytes: int = 0) -> None:
        super().__init__()
        self.live = {}
        self.current = baseline_bytes
        self.peak_bytes = baseline_bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._count(tensor)
        return out

    def _count(self, tensor: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(tensor):
            names, _ = tensor.__tensor_flatten__()
            for inner in (getattr(tensor, name) for name in names):
                if isinstance(inner, torch.Tensor):
                    self._count(inner)
            return
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self.live:
            return
        self.live[key] = storage.nbytes()
        self.current += storage.nbytes()
        self.peak_bytes = max(self.peak_bytes, self.current)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)


def resident_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of parameters, gradients and optimizer state held right now (local shards only)."""
    tensors = [p for p in module.parameters()] + [p.grad for p in module.parameters() if p.grad is not None]
    tensors += [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    seen, total = set(), 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storage = local.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total
