"""LayerGraph: the captured model as an ordered graph of layers keyed by module FQN, with measured statistics.

It is what capture produces and what search and the cost models read. It holds no torch objects, so it
round-trips through JSON (``model_dump_json`` / ``model_validate_json``) and can be saved next to a plan.
"""

from __future__ import annotations

from functools import cached_property

import networkx as nx
from pydantic import BaseModel, ConfigDict, model_validator

from tessera.cost_models.types import LayerStats


class LayerGraph(BaseModel):
    """Layers of one model in execution order, the data flow between them, and how they were measured."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    model_name: str
    """Model spec or class name the graph was captured from (``llama3-70b``)."""
    seq_len: int
    """Tokens per sequence the statistics were measured for (every number is for ONE sequence)."""
    dtype: str
    """Dtype of parameters and activations during measurement (``bf16``, ``fp16``, ``fp32``)."""
    front_end: str
    """Tracer that produced the layer order and edges (``torch.fx.symbolic_trace``)."""
    layers: tuple[LayerStats, ...]
    """Per-layer statistics in model (execution) order; the last is the ``loss``."""
    edges: tuple[tuple[str, str], ...]
    """Data flow ``(producer FQN, consumer FQN)`` between layers, from the traced graph."""

    @model_validator(mode="after")
    def _check_names(self) -> "LayerGraph":
        names = [layer.fqn for layer in self.layers]
        if len(set(names)) != len(names):
            raise ValueError("layer FQNs must be unique; a layer appears twice in `layers`")
        unknown = {fqn for edge in self.edges for fqn in edge} - set(names)
        if unknown:
            raise ValueError(f"edges name layers that are not in `layers`: {sorted(unknown)}")
        return self

    @cached_property
    def _by_fqn(self) -> dict[str, LayerStats]:
        return {layer.fqn: layer for layer in self.layers}

    def layer(self, fqn: str) -> LayerStats:
        """Statistics of the layer ``fqn``; KeyError lists a few valid names when unknown."""
        try:
            return self._by_fqn[fqn]
        except KeyError:
            raise KeyError(f"no layer {fqn!r}; layers are {[layer.fqn for layer in self.layers[:6]]}...") from None

    @property
    def blocks(self) -> tuple[LayerStats, ...]:
        """The repeated transformer blocks, in order."""
        return tuple(layer for layer in self.layers if layer.kind == "block")

    @property
    def param_count(self) -> int:
        """Parameters of the whole model (tied weights counted once)."""
        return sum(layer.param_count for layer in self.layers)

    @property
    def forward_flops(self) -> float:
        """Forward FLOPs of one sequence, loss included."""
        return sum(layer.forward_flops for layer in self.layers)

    @property
    def backward_flops(self) -> float:
        """Backward FLOPs of one sequence, loss included."""
        return sum(layer.backward_flops for layer in self.layers)

    def unique_signatures(self) -> dict[str, list[str]]:
        """Signature -> FQNs sharing it, in model order (identical blocks collapse to one entry)."""
        groups: dict[str, list[str]] = {}
        for layer in self.layers:
            groups.setdefault(layer.signature, []).append(layer.fqn)
        return groups

    def to_networkx(self) -> nx.DiGraph:
        """Directed graph with one node per FQN (attribute ``stats``: the LayerStats, ``order``: position)."""
        graph = nx.DiGraph(model_name=self.model_name, seq_len=self.seq_len, dtype=self.dtype)
        for order, layer in enumerate(self.layers):
            graph.add_node(layer.fqn, stats=layer, order=order)
        graph.add_edges_from(self.edges)
        return graph
