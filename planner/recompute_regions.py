"""What recomputing a named piece of a block would re-make (``planner.measure`` installs the meter).

Megatron-Core recomputes named pieces of a block besides the attention core (``--recompute-modules``,
``TransformerConfig.recompute_modules`` at core_v0.14):

- ``mla_up_proj``: latent attention's query and key/value up-projections and the rotary embedding after them, run
  as a checkpoint that discards its outputs (the queries, keys and values the attention core reads are re-made in
  the backward);
- ``mlp``: a dense block's MLP, run as a checkpoint that keeps its output; ``shared_experts`` likewise a MoE
  block's shared experts;
- ``layernorm``: the norms in front of the attention and the MLP, their outputs discarded and re-made (measured as
  ``input_norm`` and ``mlp_norm``);
- ``moe_act``: the routed experts' activation, its output (the product of a gated one) discarded and re-made.

``RegionMarks`` marks each storage an op makes inside such a region: for ``mlp`` and ``shared_experts``, every op
while the module runs, less its output; for ``layernorm``, the norms' outputs (what a fused norm kernel saves inside,
its input and a statistic a token, stays;
the linears' inputs among what the output-keeping pieces make are measured apart, as an FP8 recipe saves those at half
their size); for ``moe_act``, the output of the activation module of Hugging Face's
packed experts (``planner.experts``) and what is computed from it up to the next matmul of the same experts call;
for ``mla_up_proj``, the up-projections' outputs and every op of the same attention call that reads a marked
storage, up to the attention core (whose outputs are not re-made). What a region's recomputation frees is what the
ledger charged to storages so marked (the region's inputs stay: their producers or the checkpoint hold them), but a
gated activation's output, which the cost model takes off already where the framework fuses the activation
(``LayerStats.fused_gate_saving_bytes``); what it re-runs is its modules' forward FLOPs (FlopCounterMode's count for
each, ``measure._finalize``; a norm's or an activation's are not counted, as FlopCounterMode counts no elementwise
work).

Not counted: Megatron-Core's Transformer Engine layers fuse the norm in front of a linear into it, so its checkpoint
of a dense MLP (and of the up-projections, under ``qk_layernorm``) re-makes the norm's output too, which a Hugging
Face model computes outside the piece: about an eighth more than measured for DeepSeek-V3's dense MLP (7,168 of
55,296 elements a token), a fortieth for its up-projections (2,048 of 81,920).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode

from tessera.planner.experts import is_packed_experts
from tessera.planner.kernels import CORE_OPS

UP_PROJECTIONS = ("q_b_proj", "kv_b_proj", "q_proj", "linear_q_up_proj", "linear_kv_up_proj", "linear_q_proj")
"""What ``mla_up_proj`` re-runs, by module name, in an attention module that has a key/value up-projection
(``KV_UP_PROJECTIONS``): Hugging Face's DeepSeek-V2/V3 and Kimi K2, Megatron-Core's MLA; the query's own projection
where the model has no query compression (``q_proj``, ``linear_q_proj``), as Megatron-Core recomputes it then."""
KV_UP_PROJECTIONS = ("kv_b_proj", "linear_kv_up_proj")
"""Latent attention's key/value up-projection, by module name: what makes an attention module latent attention."""
MLP_CHILDREN = ("mlp", "feed_forward", "moe")
"""A block's MLP (its MoE layer in a MoE block), by the name of the block's child: Hugging Face's, torchtitan's,
Tessera's own models'."""
NORM_CHILDREN = {"input_norm": ("input_layernorm", "attention_norm", "attn_norm"),
                 "mlp_norm": ("post_attention_layernorm", "ffn_norm", "mlp_norm")}
"""The norms in front of a block's attention and of its MLP, by the name of the block's child: Hugging Face's,
torchtitan's, Tessera's own models' (what Megatron-Core's ``layernorm`` re-makes, where its layers keep them apart:
``cost_models.module_recompute``; not the norms inside latent attention, nor of queries and keys)."""
SHARED_EXPERT_CHILDREN = ("shared_experts", "shared_expert", "shared")
"""A MoE block's always-active experts, by the name of its MLP's child: Hugging Face's DeepSeek and Qwen2-MoE,
Tessera's own."""
KEEPING = ("mlp", "shared_experts")
"""The pieces recomputed as a checkpoint that keeps its output (the rest discard theirs)."""
REGIONS = ("mla_up_proj", "mlp", "input_norm", "mlp_norm", "shared_experts", "moe_act")
"""What is measured (``LayerStats.<region>_saved_bytes``): Megatron-Core's pieces, its ``layernorm`` as its two norms."""
WITH_MATMULS = ("mla_up_proj", "mlp", "shared_experts")
"""The pieces whose recomputation re-runs matmuls (``LayerStats.<piece>_flops``); the others' is elementwise."""
WITH_MATMUL_INPUTS = ("mlp", "shared_experts")
"""The pieces that free some linears' inputs, but not only those (``LayerStats.<piece>_linear_input_bytes``; a norm's
output and the routed experts' activation are all linear input, the up-projections' pieces none)."""
MATMULS = tuple(op for op in (torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.addmm, torch.ops.aten.baddbmm,
                              getattr(torch.ops.aten, "_grouped_mm", None)) if op is not None)
"""Where the marks of ``moe_act`` stop: the experts' second projection reads the activation's output."""


def _storages(value: object) -> list:
    return [t.untyped_storage() for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


@dataclass
class _Attention:
    """One latent attention call running: the storages made in it, those marked, whether an attention core ran."""

    made: set[int] = field(default_factory=set)
    marked: list[int] = field(default_factory=list)
    core_ran: bool = False


class RegionMarks(TorchDispatchMode):
    """In the forward, which storages each block's recomputable pieces make (see the module docstring). The marks of
    ``mla_up_proj`` spread only within the latent attention module that made them, and stop at its attention core;
    a call in which no core ran (hand-written attention) leaves its layer's piece unmeasured (nothing freed, nothing
    re-run)."""

    def __init__(self, model: nn.Module, layers: tuple[str, ...]) -> None:
        super().__init__()
        self.model, self.layers = model, layers
        self.marks: dict[int, tuple[object, set[str]]] = {}  # storage id -> (storage: keeps ids unique, regions)
        self.open = dict.fromkeys(KEEPING, 0)  # calls of each output-keeping piece running
        self.attention: list[_Attention] = []  # latent attention calls running, innermost last
        self.experts_calls = 0  # packed experts calls running
        self.modules: dict[str, dict[str, list[str]]] = {}  # layer -> region -> FQNs of its modules
        self.unmeasured: set[str] = set()  # layers whose latent attention ran no attention core
        self.handles: list = []

    @contextmanager
    def installed(self) -> Iterator[RegionMarks]:
        """The mode entered with a hook on every region module of ``layers``."""
        for layer in self.layers:
            self._hook_layer(layer, self.model.get_submodule(layer))
        try:
            with self:
                yield self
        finally:
            for handle in self.handles:
                handle.remove()
            self.handles = []

    def _hook_layer(self, layer: str, module: nn.Module) -> None:
        found = self.modules[layer] = {region: [] for region in REGIONS}
        for name, child in module.named_children():
            if name in MLP_CHILDREN:
                self._hook_keeping(found["mlp"], "mlp", f"{layer}.{name}", child)
                for inner, shared in child.named_children():
                    if inner in SHARED_EXPERT_CHILDREN:
                        self._hook_keeping(found["shared_experts"], "shared_experts", f"{layer}.{name}.{inner}", shared)
            for region, names in NORM_CHILDREN.items():
                if name in names:
                    self.handles.append(child.register_forward_hook(
                        lambda m, a, o, region=region: self._mark_made(a, o, region)))
        for experts in module.modules():
            if is_packed_experts(experts) and isinstance(experts.act_fn, nn.Module):
                self.handles += [experts.register_forward_pre_hook(self._experts_started),
                                 experts.register_forward_hook(self._experts_finished, always_call=True),
                                 experts.act_fn.register_forward_hook(self._activated)]
        for name, attention in module.named_modules():
            children = dict(attention.named_children())
            if not any(kv in children for kv in KV_UP_PROJECTIONS):
                continue
            self.handles += [attention.register_forward_pre_hook(self._attention_started),
                             attention.register_forward_hook(
                                 lambda m, a, o, layer=layer: self._attention_finished(layer), always_call=True)]
            prefix = f"{layer}.{name}" if name else layer
            for child_name in UP_PROJECTIONS:
                if child_name in children:
                    found["mla_up_proj"].append(f"{prefix}.{child_name}")
                    self.handles.append(children[child_name].register_forward_hook(self._up_projected))

    def saved_bytes(self, layer: str, charged: dict[int, int], *, gated: set[int]) -> dict[str, int]:
        """Of ``charged`` (storage id -> bytes the ledger charged ``layer``), the bytes each region made, but a gated
        activation's output (``gated``: the fused-gate saving has it, ``LayerStats.fused_gate_saving_bytes``)."""
        made = self.bytes_made([(key, nbytes) for key, nbytes in charged.items() if key not in gated])
        if layer in self.unmeasured:
            made["mla_up_proj"] = 0
        return made

    def bytes_made(self, pieces: list[tuple[int, int]]) -> dict[str, int]:
        """Of ``pieces`` ((storage id, bytes), ...), the bytes each region made."""
        made = dict.fromkeys(REGIONS, 0)
        for key, nbytes in pieces:
            for region in self.marks.get(key, (None, ()))[1]:
                made[region] += nbytes
        return made

    def region_modules(self, layer: str) -> dict[str, list[str]]:
        """The modules whose FLOPs each region of ``layer`` re-runs (none for a piece not measured)."""
        found = dict(self.modules.get(layer, {}))
        if layer in self.unmeasured:
            found["mla_up_proj"] = []
        return found

    def _mark(self, storages: list, region: str) -> None:
        for storage in storages:
            self.marks.setdefault(id(storage), (storage, set()))[1].add(region)
            if region == "mla_up_proj" and self.attention:
                self.attention[-1].marked.append(id(storage))

    def _marked(self, key: int, region: str) -> bool:
        return region in self.marks.get(key, (None, ()))[1]

    def _hook_keeping(self, found: list[str], region: str, fqn: str, module: nn.Module) -> None:
        """Mark what ``module`` (at ``fqn``, added to ``found``) makes while it runs, less its output."""
        found.append(fqn)

        def started(_module: nn.Module, _args: tuple) -> None:
            self.open[region] += 1

        def finished(_module: nn.Module, _args: tuple, output: object) -> None:
            self.open[region] -= 1
            for storage in _storages(output):  # the checkpoint returns it: kept, not re-made
                self.marks.get(id(storage), (None, set()))[1].discard(region)

        self.handles += [module.register_forward_pre_hook(started),
                         module.register_forward_hook(finished, always_call=True)]

    def _experts_started(self, _module: nn.Module, _args: tuple) -> None:
        self.experts_calls += 1

    def _experts_finished(self, _module: nn.Module, _args: tuple, _output: object) -> None:
        self.experts_calls -= 1

    def _activated(self, _module: nn.Module, args: tuple, output: object) -> None:
        if self.experts_calls:
            self._mark_made(args, output, "moe_act")

    def _mark_made(self, args: tuple, output: object, region: str) -> None:
        """Mark what a module's call made: its output's storages that are not its inputs'."""
        read = {id(s) for s in _storages(args)}
        self._mark([s for s in _storages(output) if id(s) not in read], region)

    def _attention_started(self, _module: nn.Module, _args: tuple) -> None:
        self.attention.append(_Attention())

    def _attention_finished(self, layer: str) -> None:
        call = self.attention.pop()
        if not call.core_ran:  # no fused core to stop at: what the piece frees is not known
            self.unmeasured.add(layer)
            for key in call.marked:
                self.marks[key][1].discard("mla_up_proj")

    def _up_projected(self, _module: nn.Module, _args: tuple, output: object) -> None:
        self._mark(_storages(output), "mla_up_proj")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch protocol
        out = func(*args, **(kwargs or {}))
        read = {id(s) for s in _storages((args, kwargs))}
        fresh = [s for s in _storages(out) if id(s) not in read]  # a view or an in-place op makes no storage
        for region, calls in self.open.items():
            if calls:
                self._mark(fresh, region)
        if self.attention:
            self._spread(func, read, fresh, out)
        if self.experts_calls and func.overloadpacket not in MATMULS and any(
                self._marked(key, "moe_act") for key in read):
            self._mark(fresh, "moe_act")
        return out

    def _spread(self, func, read: set[int], fresh: list, out: object) -> None:  # noqa: ANN001 - an aten op
        """Within a latent attention call: what an op computes from a marked storage is marked, up to the core; a
        buffer made in the call and filled in place from one (a key assembled by ``copy_``) too."""
        call = self.attention[-1]
        call.made.update(id(s) for s in fresh)
        if func.overloadpacket in CORE_OPS:
            call.core_ran = True
            return
        if not any(self._marked(key, "mla_up_proj") for key in read):
            return
        filled = [s for s in _storages(out) if id(s) in read and id(s) in call.made]
        self._mark(fresh + filled, "mla_up_proj")
