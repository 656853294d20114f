"""Activation offload per block: the tensors a block saves for backward are kept in host memory in between.

A block whose policy is ``offload`` (``Strategy.block_recompute``) recomputes nothing: while its forward runs,
autograd's saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``, the mechanism under
``torch.autograd.graph.save_on_cpu``) replace each tensor it saves by a copy in host memory, and its backward
copies each one back to the device when it needs it. So the device holds the block's activations only between
its forward's ops, not across the rest of the step. On CUDA the host copy is pinned and both copies are
non-blocking (they queue on the compute stream; the caching host allocator keeps a pinned buffer until its
copy has run). On a CPU rank the "host" is the same memory, so the copy is a same-device copy: the offload is
still real (autograd holds the copies, not the tensors the forward made), only it saves no memory.

What is copied and what is not:

- parameters and views of them (``nn.Parameter``, including FSDP2's unsharded ones and tensor-parallel
  ``DTensor`` ones; a linear saves ``weight.t()``) stay where they are: they are resident anyway (or FSDP2 gathers them again for the backward), and a copy would
  only move weights over the host link;
- a ``DTensor`` activation (tensor and sequence parallelism) is offloaded as its local shard and rebuilt with
  the same mesh, placements, shape and stride (``save_on_cpu`` would allocate its global shape);
- tensors already in host memory are copied too (on CPU ranks), so the copy's effect is the same everywhere.

Like ``runtime.recompute`` the hooks are forward pre/post hooks on the block (no wrapper): module and
parameter FQNs are unchanged, and FSDP2, tensor parallelism, pipeline stages (which call the user's block
modules: ``runtime.pipeline_split``) and expert parallelism compose with it. A schedule that runs a block's
backward as two passes (zero-bubble: input, then weight gradients) unpacks a tensor twice; each unpack makes a
new device copy and leaves the host copy to autograd, which frees it with the graph.

Not done: prefetching a block's tensors on a side stream ahead of its backward (the copies back happen as its
backward reaches each tensor, on the compute stream).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.tensor import DTensor


@dataclass
class OffloadStats:
    """What one block's hooks moved, for tests and the report: tensors and bytes copied out, and back."""

    packed: int = 0
    packed_bytes: int = 0
    unpacked: int = 0


@dataclass(frozen=True)
class _Packed:
    """A saved tensor in host memory: its local data, and for a ``DTensor`` how to rebuild it."""

    host: torch.Tensor
    device: torch.device
    dtensor: tuple | None = None  # (mesh, placements, shape, stride)


class BlockOffload:
    """The saved-tensor hooks of one block, entered in its forward pre-hook and left in its forward hook."""

    def __init__(self, *, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self.stats = OffloadStats()
        self._active: list[saved_tensors_hooks] = []

    @torch.no_grad()
    def pack(self, tensor: torch.Tensor) -> torch.Tensor | _Packed:
        if isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter):  # a weight, or its view (w.t())
            return tensor
        local, spec = tensor, None
        if isinstance(tensor, DTensor):
            local, spec = tensor.to_local(), (tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride())
        pinned = self.pin_memory and local.is_cuda
        host = torch.empty_like(local, device="cpu", pin_memory=pinned)
        host.copy_(local, non_blocking=pinned)
        self.stats.packed += 1
        self.stats.packed_bytes += host.numel() * host.element_size()
        return _Packed(host, local.device, spec)

    @torch.no_grad()
    def unpack(self, packed: torch.Tensor | _Packed) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        self.stats.unpacked += 1
        local = packed.host.to(packed.device, non_blocking=packed.host.is_pinned(), copy=True)
        if packed.dtensor is None:
            return local
        mesh, placements, shape, stride = packed.dtensor
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)

    def enter(self, module: nn.Module, args) -> None:
        hooks = saved_tensors_hooks(self.pack, self.unpack)
        hooks.__enter__()
        self._active.append(hooks)

    def leave(self, module: nn.Module, args, output) -> None:
        if self._active:  # always_call: also when the forward raised, so the hooks never leak past the block
            self._active.pop().__exit__(None, None, None)


def apply_offload(model: nn.Module, block_fqns: Sequence[str], *, pin_memory: bool = True) -> dict[str, BlockOffload]:
    """Offload the saved activations of the modules in ``block_fqns`` to host memory (in place; FQNs unchanged).

    ``pin_memory`` pins the host copies of CUDA tensors (copies of host tensors are never pinned). Returns each
    block's hooks (``.stats`` counts what they moved). Apply it where recomputation is applied: before tensor
    parallelism, compilation and data-parallel wrapping.
    """
    offloads = {}
    for fqn in block_fqns:
        module, offload = model.get_submodule(fqn), BlockOffload(pin_memory=pin_memory)
        module.register_forward_pre_hook(offload.enter)
        module.register_forward_hook(offload.leave, always_call=True)
        offloads[fqn] = offload
    return offloads
