"""What the forward saves for the backward, per layer (``planner.measure`` installs both meters).

``Ledger``: the storages autograd saves (``saved_tensors_hooks``), each charged once to the layer that first saves it,
and which of them selective recomputation keeps (saved outside an attention core, or an input a checkpoint of the
core holds). ``SavedOps``: the outputs an op-level selective policy chooses from (each ``aten.mm`` call, the
attention cores), and the activations the linears read (what an FP8 recipe casts).
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode

from tessera.planner.kernels import CORE_OPS
from tessera.planner.tally import Scope, Tally


class Ledger:
    """Storages saved for backward, each charged once to its first saver, and which of them selective recompute
    keeps (saved outside an attention core, or an input a checkpoint of the core holds)."""

    def __init__(self, tallies: dict[str, Tally], scope: Scope, resident: dict[int, object]) -> None:
        self.tallies, self.scope, self.resident = tallies, scope, resident
        self.owner: dict[int, str] = {}
        self.nbytes: dict[int, int] = {}
        self.kept: set[int] = set()
        self.refs: dict[int, object] = {}  # holding the storages keeps their ids unique
        self.charged: list[int] = []  # storages in the order they were first charged
        self.norm_savings: list[tuple[int, int]] = []  # (mark, saving) of each torch.rms_norm call reported
        self.gated: set[int] = set()  # gated activations' outputs charged as fused_gate_saving_bytes
        self.in_core = False

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """``saved_tensors_hooks`` pack hook."""
        self._charge(tensor, kept=not self.in_core)
        return tensor

    def rms_norm(self, mark: int, fused_bytes: int | None, *, declared: bool = False) -> None:
        """``kernels.KernelObserver.rms_norm``: what the call saved since ``mark`` beyond ``fused_bytes``, charged to
        the running layer (nothing it did not save: under a model's own checkpoint the call saves nothing here); a
        ``declared`` norm's apart (``Tally.declared_norm_saving_bytes``), less what ``torch.rms_norm`` calls inside it
        reported already."""
        if fused_bytes is None:
            return
        saving = max(0, sum(self.since(mark)) - fused_bytes)
        tally = self.tallies[self.scope.current()]
        if declared:
            inner = sum(nbytes for at, nbytes in self.norm_savings if at >= mark)
            tally.declared_norm_saving_bytes += max(0, saving - inner)
        else:
            tally.fused_norm_saving_bytes += saving
            self.norm_savings.append((mark, saving))

    def gated_activation(self, mark: int, activation: torch.Tensor) -> None:
        """``kernels.KernelObserver.gated_activation``: the activation's output, charged to the running layer where the
        product saved it first (not under a model's own checkpoint, nor one saved already)."""
        key = id(activation.untyped_storage())
        if key in self.charged[mark:]:
            self.tallies[self.scope.current()].fused_gate_saving_bytes += self.nbytes[key]
            self.gated.add(key)

    def _charge(self, tensor: torch.Tensor, *, kept: bool) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self.resident:
            return
        if key not in self.owner:
            self._own(key, storage, storage.nbytes())
        if kept:
            self.kept.add(key)

    def _own(self, key: int, ref: object, nbytes: int) -> None:
        self.owner[key], self.nbytes[key], self.refs[key] = self.scope.current(), nbytes, ref
        self.tallies[self.owner[key]].saved_bytes += nbytes
        self.charged.append(key)

    def mark(self) -> int:
        """A point to measure what is charged from (``since``)."""
        return len(self.charged)

    def since(self, mark: int) -> tuple[int, int]:
        """(kept, other) bytes first charged after ``mark``: what selective recomputation keeps, and the rest."""
        keys = self.charged[mark:]
        kept = sum(self.nbytes[k] for k in keys if k in self.kept)
        return kept, sum(self.nbytes[k] for k in keys) - kept

    def charge_replayed(self, kept: int, other: int) -> None:
        """Charge what a replayed element would have saved (``replay.ElementReplay``) to the running layer."""
        for nbytes, is_kept in ((kept, True), (other, False)):
            if nbytes:
                token = object()  # stands for the storages it would have saved
                self._own(id(token), token, nbytes)
                if is_kept:
                    self.kept.add(id(token))

    def attention_started(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          inputs: tuple[torch.Tensor, ...]) -> None:
        tally = self.tallies[self.scope.current()]
        tally.heads, tally.kv_heads = query.shape[1], key.shape[1]
        tally.kv_head_width = key.shape[-1] + value.shape[-1]
        tally.query_head_width = query.shape[-1]
        tally.saved_bytes_selective = 0  # measured: filled in by selective_bytes
        for tensor in inputs:
            storage = tensor.untyped_storage()
            self.kept.add(id(storage))
            self.refs.setdefault(id(storage), storage)
        self.in_core = True

    def keep_for_backward(self, tensor: torch.Tensor) -> None:
        self._charge(tensor, kept=not self.in_core)  # inside a core: re-made when selective recompute re-runs it

    def attention_finished(self) -> None:
        self.in_core = False

    def selective_bytes(self) -> dict[str, int]:
        """Per layer: bytes of its storages that stay saved when the attention cores are recomputed."""
        kept: dict[str, int] = {}
        for key, layer in self.owner.items():
            if key in self.kept:
                kept[layer] = kept.get(layer, 0) + self.nbytes[key]
        return kept


class SavedOps(TorchDispatchMode):
    """In the forward, the FLOPs and output bytes of each ``aten.mm`` call (in call order), the output bytes of the
    ``aten.addmm`` calls and of each attention core, charged to the layer running (what an op-level selective policy
    chooses from); and what the layer's linears read (``aten.mm``, ``addmm`` and ``bmm`` against a weight)."""

    def __init__(self, scope: Scope, tallies: dict[str, Tally], resident: dict[int, object]) -> None:
        super().__init__()
        self.scope, self.tallies, self.resident = scope, tallies, resident
        self.read: dict[tuple, tuple[object, int]] = {}  # (layer, view) a linear read -> (storage: keeps ids unique, bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch protocol
        out = func(*args, **(kwargs or {}))
        packet = func.overloadpacket
        if packet is torch.ops.aten.mm:
            (m, k), n = args[0].shape, args[1].shape[1]
            self.tallies[self.scope.current()].mm_calls.append((2 * m * k * n, out.nbytes))
            self._linear(args[0], args[1])
        elif packet is torch.ops.aten.addmm:
            self.tallies[self.scope.current()].addmm_output_bytes += out.nbytes
            self._linear(args[1], args[2])
        elif packet is torch.ops.aten.bmm:  # batched experts: every expert's tokens against its weight
            self._linear(args[0], args[1])
        elif packet in CORE_OPS:
            self.tallies[self.scope.current()].core_output_bytes += sum(
                t.nbytes for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out

    def _linear(self, activation: torch.Tensor, weight: torch.Tensor) -> None:
        """A linear's call: its FLOPs, and its activation's bytes the first time one of the layer's linears reads that
        view (q, k and v read one; experts read their own slices of one dispatched buffer)."""
        if id(weight.untyped_storage()) not in self.resident:
            return  # two activations multiplied: not a linear, nothing an FP8 recipe casts
        layer = self.scope.current()
        tally = self.tallies[layer]
        tally.linear_flops += 2 * activation.numel() * weight.shape[-1]
        tally.linear_call_input_bytes += activation.nbytes
        storage = activation.untyped_storage()
        view = (layer, id(storage), activation.storage_offset(), tuple(activation.shape), activation.stride())
        if view not in self.read:
            self.read[view] = (storage, activation.nbytes)
            tally.linear_input_bytes += activation.nbytes

    def linear_inputs(self, layer: str) -> list[tuple[int, int]]:
        """(storage id, bytes) of each distinct view ``layer``'s linears read (what ``linear_input_bytes`` sums)."""
        return [(key, nbytes) for (owner, key, *_), (_, nbytes) in self.read.items() if owner == layer]


class WeightCopies(TorchDispatchMode):
    """Adds to ``resident`` each copy made of a resident storage (autocast's cast of a weight): the ledger skips
    it as it skips the weight, since the cost model prices autocast's copies on their own."""

    def __init__(self, resident: dict[int, object]) -> None:
        super().__init__()
        self.resident = resident

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch protocol
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and id(args[0].untyped_storage()) in self.resident:
            storage = out.untyped_storage()
            self.resident[id(storage)] = storage
        return out
