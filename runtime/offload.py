"""Activation offload per block: the tensors a block saves for backward are kept in host memory in between.

A block whose policy is ``offload`` (``Strategy.block_recompute``) recomputes nothing: while its forward runs,
autograd's saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``, the mechanism under
``torch.autograd.graph.save_on_cpu``) replace each tensor it saves by a copy in host memory, and its backward
gets each one back on the device. So the device holds the block's activations only between its forward's ops
and around its backward, not across the rest of the step. On a CPU rank the "host" is the same memory, so the
copy is a same-device copy: the offload is still real (autograd holds the copies, not the tensors the forward
made), only it saves no memory.

**Copies and prefetch.** Copies back are issued ahead of use: when a block's backward starts (its first saved
tensor is asked for), every tensor it saved is copied back, and so are those of the offloaded block that ran
before it in the same forward (the one whose backward comes next): one block ahead, so the device holds at most
two blocks' copies at once (``cost_models.offload``'s transit buffer). On CUDA both directions run on a side
stream of their own (one per device), so they overlap the compute stream's kernels:

- copy-out: the side stream waits for the compute stream (the tensor is written), copies into pinned host
  memory, and the tensor is marked as used by the side stream (``Tensor.record_stream``) so the caching
  allocator does not hand its memory out again before the copy has run;
- copy-in: issued on the side stream (after that tensor's copy-out, the stream is in order) into memory the
  side stream allocates, with an event recorded behind it; the backward's use waits for the event on the
  compute stream (``Stream.wait_event``) and marks the copy as used by the compute stream.

The pinned host buffers are the caching host allocator's, which keeps each until the copies using it have run.
On a CPU rank the same steps run synchronously (no streams): the bookkeeping is the one CUDA runs.

What is copied and what is not:

- parameters and views of them (``nn.Parameter``, including FSDP2's unsharded ones and tensor-parallel
  ``DTensor`` ones; a linear saves ``weight.t()``) stay where they are: they are resident anyway (or FSDP2 gathers
  them again for the backward), and a copy would only move weights over the host link;
- a ``DTensor`` activation (tensor and sequence parallelism) is offloaded as its local shard and rebuilt with
  the same mesh, placements, shape and stride (``save_on_cpu`` would allocate its global shape);
- tensors already in host memory are copied too (on CPU ranks), so the copy's effect is the same everywhere.

Like ``runtime.recompute`` the hooks are forward pre/post hooks on the block (no wrapper): module and
parameter FQNs are unchanged, and FSDP2, tensor parallelism, pipeline stages (which call the user's block
modules: ``runtime.pipeline_split``) and expert parallelism compose with it. Which block ran before which is
recorded per forward call (each micro-batch's forward through the stage), so a pipeline schedule that holds
several micro-batches prefetches within the same one. A schedule that runs a block's backward as two passes
(zero-bubble: input, then weight gradients) unpacks a tensor twice; the first use takes the prefetched copy, the
second copies it back again, and the host copy stays with autograd, which frees it with the graph.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.tensor import DTensor


@dataclass
class OffloadStats:
    """What one block's hooks moved, for tests and the report: tensors and bytes copied out, tensors used again
    in backward, and tensors whose copy back was issued ahead of their use (prefetched)."""

    packed: int = 0
    packed_bytes: int = 0
    unpacked: int = 0
    prefetched: int = 0


@dataclass(eq=False)
class _Packed:
    """A saved tensor in host memory: its local data, for a ``DTensor`` how to rebuild it, and its copy back
    once issued (the device tensor and, on CUDA, the event that marks it complete)."""

    host: torch.Tensor
    device: torch.device
    forward: "_Forward"  # the block's forward call that saved it (kept alive by its tensors only)
    dtensor: tuple | None = None  # (mesh, placements, shape, stride)
    back: tuple[torch.Tensor, torch.cuda.Event | None] | None = None


@dataclass(eq=False)
class _Forward:
    """One forward call of an offloaded block: weak references to what it saved (autograd's graph owns them) and
    to the offloaded block's call that ran before it, whose tensors its backward prefetches."""

    stats: OffloadStats
    saved: list[weakref.ref] = field(default_factory=list)
    before: weakref.ref | None = None
    started: bool = False  # its backward has asked for a tensor (and prefetched)


class _Copier:
    """The copies of every offloaded block of one process: a side stream per CUDA device, none on CPU, and the
    forward call that finished last (the next one's predecessor)."""

    def __init__(self) -> None:
        self.streams: dict[torch.device, torch.cuda.Stream] = {}
        self.last: weakref.ref | None = None

    def side_stream(self, device: torch.device) -> torch.cuda.Stream | None:
        if device.type != "cuda":
            return None
        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device)
        return self.streams[device]

    def copy_out(self, local: torch.Tensor, *, pin_memory: bool) -> torch.Tensor:
        """A host copy of ``local``: on the side stream after the compute stream's writes (CUDA), else at once."""
        side = self.side_stream(local.device)
        host = torch.empty_like(local, device="cpu", pin_memory=pin_memory and side is not None)
        if side is None:
            host.copy_(local)
            return host
        side.wait_stream(torch.cuda.current_stream(local.device))
        with torch.cuda.stream(side):
            host.copy_(local, non_blocking=host.is_pinned())
        local.record_stream(side)  # its memory is not reused before the copy has read it
        return host

    def copy_in(self, packed: _Packed) -> None:
        """Issue ``packed``'s copy back to its device (ahead of use where called early)."""
        side = self.side_stream(packed.device)
        if side is None:
            packed.back = (packed.host.to(packed.device, copy=True), None)
            return
        with torch.cuda.stream(side):  # in order behind this tensor's copy-out
            local = packed.host.to(packed.device, non_blocking=packed.host.is_pinned(), copy=True)
            done = torch.cuda.Event()
            done.record(side)
        packed.back = (local, done)

    @staticmethod
    def take(packed: _Packed) -> torch.Tensor:
        """The device copy of ``packed``, ready for the compute stream (waited for; consumed)."""
        local, done = packed.back
        packed.back = None
        if done is not None:
            compute = torch.cuda.current_stream(local.device)
            compute.wait_event(done)
            local.record_stream(compute)  # freed by the compute stream's use, not the side stream's
        return local


class BlockOffload:
    """The saved-tensor hooks of one block, entered in its forward pre-hook and left in its forward hook."""

    def __init__(self, *, pin_memory: bool, copier: _Copier | None = None) -> None:
        self.pin_memory = pin_memory
        self.copier = copier or _Copier()
        self.stats = OffloadStats()
        self._active: list[tuple[saved_tensors_hooks, _Forward]] = []

    @torch.no_grad()
    def pack(self, tensor: torch.Tensor) -> torch.Tensor | _Packed:
        if isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter):  # a weight, or its view (w.t())
            return tensor
        local, spec = tensor, None
        if isinstance(tensor, DTensor):
            local, spec = tensor.to_local(), (tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride())
        forward = self._active[-1][1]
        packed = _Packed(self.copier.copy_out(local, pin_memory=self.pin_memory), local.device, forward, spec)
        forward.saved.append(weakref.ref(packed))
        self.stats.packed += 1
        self.stats.packed_bytes += packed.host.numel() * packed.host.element_size()
        return packed

    @torch.no_grad()
    def unpack(self, packed: torch.Tensor | _Packed) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        self.stats.unpacked += 1
        if not packed.forward.started:
            self._start_backward(packed.forward)
        if packed.back is None:  # not prefetched, or taken already (a second use: zero-bubble's weight pass)
            self.copier.copy_in(packed)
        local = self.copier.take(packed)
        if packed.dtensor is None:
            return local
        mesh, placements, shape, stride = packed.dtensor
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)

    def _start_backward(self, forward: _Forward) -> None:
        """The block's backward begins: copy back all it saved, and what the block before it saved."""
        forward.started = True
        before = forward.before() if forward.before else None
        for call in (forward, before):
            if call is None:
                continue
            for ref in call.saved:
                if (packed := ref()) is not None and packed.back is None:
                    self.copier.copy_in(packed)
                    call.stats.prefetched += call is before
            call.saved = []  # all issued: a later use copies again (zero-bubble's weight pass, retain_graph)

    def enter(self, module: nn.Module, args) -> None:
        forward = _Forward(self.stats, before=self.copier.last)
        self.copier.last = None  # one successor per forward call
        hooks = saved_tensors_hooks(self.pack, self.unpack)
        hooks.__enter__()
        self._active.append((hooks, forward))

    def leave(self, module: nn.Module, args, output) -> None:
        if self._active:  # always_call: also when the forward raised, so the hooks never leak past the block
            hooks, forward = self._active.pop()
            hooks.__exit__(None, None, None)
            self.copier.last = weakref.ref(forward)


def apply_offload(model: nn.Module, block_fqns: Sequence[str], *, pin_memory: bool = True) -> dict[str, BlockOffload]:
    """Offload the saved activations of the modules in ``block_fqns`` to host memory (in place; FQNs unchanged).

    ``pin_memory`` pins the host copies of CUDA tensors (copies of host tensors are never pinned). The blocks share
    one copier (side streams, the order of their forward calls: ``runtime.offload``). Returns each block's hooks
    (``.stats`` counts what they moved). Apply it where recomputation is applied: before tensor parallelism,
    compilation and data-parallel wrapping.
    """
    offloads, copier = {}, _Copier()
    for fqn in block_fqns:
        module, offload = model.get_submodule(fqn), BlockOffload(pin_memory=pin_memory, copier=copier)
        module.register_forward_pre_hook(offload.enter)
        module.register_forward_hook(offload.leave, always_call=True)
        offloads[fqn] = offload
    return offloads
