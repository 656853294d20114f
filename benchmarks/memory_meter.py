"""Peak live tensor bytes of a block of code on CPU, where no allocator statistics exist.

A ``TorchDispatchMode`` sees every op's outputs; each new storage is counted until it is freed (a weakref
finalizer subtracts it). Wrapper subclasses (DTensor) are flattened to their local tensors. The bytes
alive when the meter starts (parameters, gradients, optimizer state) are passed in as ``baseline_bytes``.
Unlike MemTracker it needs no module hooks, so modules called several times per step (gradient
accumulation, pipeline schedules) are fine. Pass the resident tensors as ``resident`` so that in-place updates
and views of them (the optimizer step) are not counted again. It cannot see storage that is not an op's output:
FSDP2's ``untyped_storage().resize_()`` allocations, C++ allocations (DDP's reducer). :class:`AllocatorMeter`
sees those and is what ``memory_truth.py`` measures with; this meter's ``snapshot`` says what was live at its
peak (op and shape), for breakdowns.
"""

from __future__ import annotations

import ctypes
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


class PeakMemoryMeter(TorchDispatchMode):
    """``with PeakMemoryMeter(baseline) as meter: ...``; then ``meter.peak_bytes``."""

    def __init__(self, baseline_bytes: int = 0, *, snapshot: bool = False, resident: tuple = ()) -> None:
        super().__init__()
        # Storages already counted in ``baseline_bytes``: in-place updates and views of them are not new.
        self.live = {t.untyped_storage().data_ptr(): 0 for t in resident}
        self.current = baseline_bytes
        self.peak_bytes = baseline_bytes
        self.snapshot = snapshot
        """Keep ``peak_live``: what each storage alive at the peak is (slow; for breakdowns)."""
        self.peak_live: dict[int, tuple[int, str, tuple]] = {}
        """At the peak: storage key -> (bytes, creating op, shape). Only with ``snapshot``."""
        self._origin: dict[int, tuple[str, tuple]] = {}
        self._func = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._func = str(func)
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
        if self.snapshot:
            self._origin[key] = (self._func, tuple(tensor.shape))
        if self.current > self.peak_bytes:
            self.peak_bytes = self.current
            if self.snapshot:
                self.peak_live = {k: (n, *self._origin[k]) for k, n in self.live.items() if n}
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)
        self._origin.pop(key, None)


def resident_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of parameters, gradients and optimizer state held right now (local shards only)."""
    tensors = [p for p in module.parameters()] + [p.grad for p in module.parameters() if p.grad is not None]
    tensors += [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    seen, total = set(), 0
    for tensor in tensors:
        for storage in _storages(tensor.to_local() if hasattr(tensor, "to_local") else tensor):
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def _storages(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages holding ``tensor``'s data: its own, or those of the tensors a wrapper subclass holds (torchao's
    FP8-gathering weights wrap their fp32 shard, and have no storage of their own)."""
    if not is_traceable_wrapper_subclass(tensor):
        return [tensor.untyped_storage()]
    names, _ = tensor.__tensor_flatten__()
    return [storage for name in names for storage in _storages(getattr(tensor, name))]


class AllocatorMeter:
    """``with AllocatorMeter(baseline) as meter: ...``; then ``meter.peak_bytes``: the peak of what the CPU
    allocator handed out, from the running total it reports with each of the profiler's memory events
    (``torch.profiler``, ``profile_memory=True``).

    Unlike :class:`PeakMemoryMeter` it sees allocations made outside the dispatcher: FSDP2 allocates its
    unsharded parameters with ``untyped_storage().resize_()`` (``_fsdp_param.alloc_storage``), and C++
    components (DDP's reducer, autograd's gradient accumulation into buckets) allocate directly. Bytes alive
    when it starts are passed in as ``baseline_bytes``.

    Why the allocator's running total and not the sum of the events: the profiler records memory events only
    on the threads it profiles, and gloo frees some buffers on its worker threads. Its reduce-scatter clones
    the input (``c10d::_reduce_scatter_base_`` -> ``aten::clone``; likewise ``reduce_scatter_tensor_coalesced_``)
    and the work object holding the clone is dropped last by whichever thread loses the race after ``wait()``
    returns: the caller or the worker. When it is the worker, the free has no event, and a sum of events keeps
    that buffer alive for the rest of the step: 0 to 4 such buffers per rank, different on every rank and
    every run (small-gpt's ZeRO-2 step read 97.7 to 112.0 MiB; the allocator's total, 97.7 on every rank). c10's ``caffe2_report_cpu_memory_usage`` flag makes
    the reporter behind the events (``ProfiledCPUMemoryReporter``) count allocations and frees on every
    thread, and each event carries its total (``total_allocated``), so the frees on gloo's threads are seen
    at the caller's next allocation.
    """

    def __init__(self, baseline_bytes: int = 0) -> None:
        self.baseline_bytes = baseline_bytes
        self.peak_bytes = baseline_bytes
        self.peak_op = ""
        """The operator whose allocation reached the peak (where in the step it happened)."""
        self._profile = None
        self._flag = _cpu_memory_usage_flag()
        self._flag_before = False

    def __enter__(self) -> AllocatorMeter:
        from torch.profiler import ProfilerActivity, profile

        self._flag_before, self._flag.value = self._flag.value, True  # count frees on every thread (class docstring)
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._profile.__exit__(*exc)
        self._flag.value = self._flag_before
        events = sorted(_cpu_allocation_events(self._profile), key=lambda event: event.start_time_ns)
        if not events:
            return
        # The total also counts whatever the flag or earlier profiling left tracked: measure from the start.
        first = events[0].extra_fields
        start_total = first.total_allocated - first.alloc_size
        for event in events:
            current = self.baseline_bytes + event.extra_fields.total_allocated - start_total
            if current > self.peak_bytes:
                self.peak_bytes, self.peak_op = current, event.parent.name if event.parent else ""


def _cpu_allocation_events(profile) -> list:
    """The profile's allocation and free events on the CPU (from its event tree, which keeps their totals)."""
    from torch._C._profiler import _EventType

    found, pending = [], list(profile.profiler.kineto_results.experimental_event_tree())
    while pending:
        event = pending.pop()
        pending.extend(event.children)
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            found.append(event)
    return found


def _cpu_memory_usage_flag() -> ctypes.c_bool:
    """c10's ``FLAGS_caffe2_report_cpu_memory_usage`` (``c10/core/CPUAllocator.cpp``), which no Python API sets."""
    library = next((Path(torch.__file__).parent / "lib").glob("*c10.*"), None)
    if library is None:
        raise RuntimeError(f"no c10 library under {Path(torch.__file__).parent / 'lib'}; AllocatorMeter needs it")
    return ctypes.c_bool.in_dll(ctypes.CDLL(str(library)), "FLAGS_caffe2_report_cpu_memory_usage")


def ddp_bucket_bytes(module: torch.nn.Module) -> int:
    """Bytes of a ``DistributedDataParallel`` wrapper's gradient buckets (0 for anything else).

    The reducer allocates one flat tensor per bucket at construction, covering every parameter that requires a
    gradient (``Reducer::initialize_buckets``), so the buckets together hold a second copy of the gradients
    (unless ``gradient_as_bucket_view=True``). They are not parameters, gradients or optimizer state, and they
    exist before any step, so neither meter sees them: they are added to the baseline.
    """
    if not isinstance(module, torch.nn.parallel.DistributedDataParallel):
        return 0
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
