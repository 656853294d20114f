"""What recomputing a named piece of a block would re-make (``planner.measure`` installs the meter).

Megatron-Core recomputes named pieces of a block besides the attention core (``--recompute-modules``,
``TransformerConfig.recompute_modules`` at core_v0.14):

- ``mla_up_proj``: latent attention's query and key/value up-projections and the rotary embedding after them, run
  as a checkpoint that discards its outputs (the queries, keys and values the attention core reads are re-made in
  the backward);
- ``mlp``: a dense block's MLP, run as a checkpoint that keeps its output.

``RegionMarks`` marks each storage an op makes inside such a region: for ``mlp``, every op while a block's MLP child
runs, less its output; for ``mla_up_proj``, the up-projections' outputs and every op that reads a marked storage, up
to the attention core (whose outputs are not re-made). What a region's recomputation frees is what the ledger
charged to storages so marked (the region's inputs stay: their producers or the checkpoint hold them); what it
re-runs is its modules' forward FLOPs (FlopCounterMode's count for each, ``measure._finalize``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode

from tessera.planner.kernels import CORE_OPS

UP_PROJECTIONS = ("q_b_proj", "kv_b_proj", "linear_q_up_proj", "linear_kv_up_proj")
"""Latent attention's up-projections, by module name: Hugging Face's DeepSeek-V2/V3 and Kimi K2, Megatron-Core's MLA."""
MLP_CHILDREN = ("mlp", "feed_forward")
"""A block's MLP, by the name of the block's child: Hugging Face's, torchtitan's."""
REGIONS = ("mla_up_proj", "mlp")
"""The pieces measured, by Megatron-Core's names (``Strategy.recompute_modules``)."""


def _storages(value: object) -> list:
    return [t.untyped_storage() for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


class RegionMarks(TorchDispatchMode):
    """In the forward, which storages each block's recomputable pieces make (see the module docstring)."""

    def __init__(self, model: nn.Module, layers: tuple[str, ...]) -> None:
        super().__init__()
        self.model, self.layers = model, layers
        self.marks: dict[int, tuple[object, set[str]]] = {}  # storage id -> (storage: keeps ids unique, regions)
        self.open_mlps = 0  # MLP regions running (nested MLPs count once)
        self.modules: dict[str, dict[str, list[str]]] = {}  # layer -> region -> FQNs of its modules
        self.handles: list = []

    @contextmanager
    def installed(self) -> Iterator[RegionMarks]:
        """The mode entered with a hook on every region module of ``layers``."""
        for layer in self.layers:
            found = self.modules[layer] = {region: [] for region in REGIONS}
            module = self.model.get_submodule(layer)
            for name, child in module.named_children():
                if name in MLP_CHILDREN:
                    found["mlp"].append(f"{layer}.{name}")
                    self.handles += [child.register_forward_pre_hook(self._mlp_started),
                                     child.register_forward_hook(self._mlp_finished, always_call=True)]
            for name, child in module.named_modules():
                if name.rsplit(".", 1)[-1] in UP_PROJECTIONS:
                    found["mla_up_proj"].append(f"{layer}.{name}")
                    self.handles.append(child.register_forward_hook(self._up_projected))
        try:
            with self:
                yield self
        finally:
            for handle in self.handles:
                handle.remove()
            self.handles = []

    def saved_bytes(self, charged: dict[int, int]) -> dict[str, int]:
        """Of ``charged`` (storage id -> bytes the ledger charged it), the bytes each region made."""
        made = dict.fromkeys(REGIONS, 0)
        for key, nbytes in charged.items():
            for region in self.marks.get(key, (None, ()))[1]:
                made[region] += nbytes
        return made

    def _mark(self, value: object, region: str, *, besides: frozenset[int] = frozenset()) -> None:
        """Mark the storages of ``value`` but those in ``besides`` (an op's inputs: a view or an in-place op makes
        no storage of its own)."""
        for storage in _storages(value):
            if id(storage) not in besides:
                self.marks.setdefault(id(storage), (storage, set()))[1].add(region)

    def _mlp_started(self, _module: nn.Module, _args: tuple) -> None:
        self.open_mlps += 1

    def _mlp_finished(self, _module: nn.Module, _args: tuple, output: object) -> None:
        self.open_mlps -= 1
        for storage in _storages(output):  # the checkpoint returns it: kept, not re-made
            self.marks.get(id(storage), (None, set()))[1].discard("mlp")

    def _up_projected(self, _module: nn.Module, _args: tuple, output: object) -> None:
        self._mark(output, "mla_up_proj")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch protocol
        out = func(*args, **(kwargs or {}))
        read = frozenset(id(s) for s in _storages((args, kwargs)))
        if self.open_mlps:
            self._mark(out, "mlp", besides=read)
        if func.overloadpacket not in CORE_OPS and any(
                "mla_up_proj" in self.marks.get(key, (None, ()))[1] for key in read):
            self._mark(out, "mla_up_proj", besides=read)
        return out
