"""LayerGraph: the captured model as an ordered graph of layers keyed by module FQN, with measured statistics.

It is what capture produces and what search and the cost models read. It holds no torch objects, so it
round-trips through JSON (``model_dump_json`` / ``model_validate_json``) and can be saved next to a plan.

**Scaling in shape.** Every statistic is for the measured inputs -- by default ONE sequence of ``seq_len`` tokens;
a micro-batch of ``b`` sequences costs ``b`` times as much (FLOPs and bytes are linear in the batch with no
constant term, up to a few bytes per attention call for the kernel's RNG state). In the sequence length ``s`` the
FLOPs and bytes of a transformer are polynomials of degree <= 2 (linear layers ~ s, attention scores ~ s^2), so
capture measures at three lengths (``s``, ``s // 2``, ``s // 4``) and stores the exact interpolating polynomial of
each statistic (``seq_scaling``). ``at_seq_len`` evaluates them: the planner varies the sequence without
re-tracing. The fit is exact where the statistics are polynomials; a statistic with rounding in it (e.g. a
mixture-of-experts capacity ``ceil(top_k * s / experts * factor)``) is exact at the measured lengths and gives
the unrounded value in between.
"""

from __future__ import annotations

import hashlib
import json
from fractions import Fraction
from functools import cached_property

import networkx as nx
from pydantic import BaseModel, ConfigDict, model_validator

from tessera.cost_models.layer_stats import LayerStats
from tessera.errors import CaptureError
from tessera.planner.layer_info import with_windowed_attention

SCALED_FIELDS = (
    "forward_flops",
    "backward_flops",
    "saved_bytes_no_recompute",
    "saved_bytes_selective",
    "saved_bytes_full_recompute",
    "output_bytes",
    "selective_recompute_flops",
    "op_selective_recompute_flops",
    "saved_bytes_op_selective",
    "saved_bytes_matmul_selective",
    "linear_input_bytes",
    "linear_call_input_bytes",
    "expert_forward_flops",
    "expert_backward_flops",
    "autocast_saved_bytes_no_recompute",
    "autocast_saved_bytes_full_recompute",
    "autocast_saved_bytes_selective",
    "autocast_saved_bytes_op_selective",
    "autocast_saved_bytes_matmul_selective",
    "autocast_output_bytes",
    "fused_norm_saving_bytes",
    "autocast_fused_norm_saving_bytes",
    "declared_norm_saving_bytes",
    "fused_gate_saving_bytes",
    "mla_up_proj_saved_bytes",
    "mla_up_proj_flops",
    "mlp_saved_bytes",
    "mlp_flops",
    "mlp_linear_input_bytes",
    "input_norm_saved_bytes",
    "mlp_norm_saved_bytes",
    "shared_experts_saved_bytes",
    "shared_experts_flops",
    "shared_experts_linear_input_bytes",
    "moe_act_saved_bytes",
)
"""LayerStats fields that depend on the sequence length (the rest are properties of the module)."""


class SeqScaling(BaseModel):
    """One layer's statistics as exact polynomials of the sequence length: ``c0 + c1 * s + c2 * s**2``."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    fqn: str
    """Layer the polynomials belong to."""
    signature_key: str
    """Hash of the layer's class, kind and parameter shapes: with the numbers it gives ``LayerStats.signature``."""
    coefficients: dict[str, tuple[int | float, int | float, int | float]]
    """Field name (one of ``SCALED_FIELDS``) -> (c0, c1, c2); a field measured as ``None`` is absent."""


class LayerGraph(BaseModel):
    """Layers of one model in execution order, the data flow between them, and how they were measured."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    model_name: str
    """Model spec or class name the graph was captured from (``llama3-70b``)."""
    seq_len: int
    """Tokens per sequence the statistics were measured for (every number is for ONE sequence; with fixed
    ``example_inputs`` given to capture, for those inputs, and ``seq_len`` is the label the caller gave)."""
    dtype: str
    """Dtype of parameters and activations during measurement (``bf16``, ``fp16``, ``fp32``)."""
    front_end: str
    """Tracer that produced the layer order and edges (``torch.fx.symbolic_trace``, ``torch.export``, ``make_fx``)."""
    layers: tuple[LayerStats, ...]
    """Per-layer statistics in model (execution) order; the last is the ``loss``."""
    edges: tuple[tuple[str, str], ...]
    """Data flow ``(producer FQN, consumer FQN)`` between layers, from the traced graph."""
    fallback_reasons: tuple[str, ...] = ()
    """Why each front end tried before ``front_end`` could not trace the model, one line each."""
    seq_scaling: tuple[SeqScaling, ...] = ()
    """Per-layer polynomials in the sequence length (empty when captured with fixed example inputs)."""
    windowed_attention: bool = False
    """The model's declared attention kernel computes only the pairs inside sliding windows (FlashAttention,
    flex attention: ``layer_info.windowed_kernel``), so each local block's attention core is priced at its
    window's share (``layer_info.with_windowed_attention``); measured as SDPA, and rescaled before the cut."""
    unavailable_axes: dict[str, str] = {}
    """Parallel axes (``tp``, ``pp``, ``ep``) the runtime cannot apply to this model -> why, one line each
    (``tessera.planner.capabilities``); the search plans only within the others."""
    token_inputs: bool = True
    """Captured on token ids of ``seq_len`` positions; False: on the user's ``example_inputs`` (an image, a feature
    vector), so a row of the batch is a sample and throughput is counted in samples, not tokens."""

    @model_validator(mode="after")
    def _check_names(self) -> "LayerGraph":
        names = [layer.fqn for layer in self.layers]
        if len(set(names)) != len(names):
            raise ValueError("layer FQNs must be unique; a layer appears twice in `layers`")
        unknown = {fqn for edge in self.edges for fqn in edge} - set(names)
        if unknown:
            raise ValueError(f"edges name layers that are not in `layers`: {sorted(unknown)}")
        if self.seq_scaling and [s.fqn for s in self.seq_scaling] != names:
            raise ValueError("seq_scaling must hold one entry per layer, in the order of `layers`")
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

    def at_seq_len(self, seq_len: int) -> "LayerGraph":
        """The same model at another sequence length, from the fitted polynomials (no re-tracing)."""
        if not self.seq_scaling:
            raise CaptureError(
                f"{self.model_name} was captured without sequence scaling, so its statistics cannot be rescaled; "
                "capture it with fit_seq_scaling=True and token-id inputs or example_inputs given as a function of seq_len"
            )
        if seq_len <= 0:
            raise CaptureError(f"seq_len must be positive, got {seq_len}")
        window_seq_len = seq_len if self.windowed_attention else 0
        layers = tuple(_rescaled(layer, scaling, seq_len, window_seq_len=window_seq_len)
                       for layer, scaling in zip(self.layers, self.seq_scaling))
        fields = {name: getattr(self, name) for name in type(self).model_fields}
        return type(self)(**{**fields, "seq_len": seq_len, "layers": layers})

    def to_networkx(self) -> nx.DiGraph:
        """Directed graph with one node per FQN (attribute ``stats``: the LayerStats, ``order``: position)."""
        graph = nx.DiGraph(model_name=self.model_name, seq_len=self.seq_len, dtype=self.dtype)
        for order, layer in enumerate(self.layers):
            graph.add_node(layer.fqn, stats=layer, order=order)
        graph.add_edges_from(self.edges)
        return graph


# ----------------------------------------------------------------------------------------------- scaling


def fit_polynomial(values: dict[int, int | float | None]) -> tuple[int | float, int | float, int | float] | None:
    """Exact (c0, c1, c2) through three (length, value) points (Lagrange, in rationals); None if a value is."""
    if any(v is None for v in values.values()):
        return None
    (s0, v0), (s1, v1), (s2, v2) = ((Fraction(s), Fraction(v)) for s, v in values.items())
    d01, d12 = (v1 - v0) / (s1 - s0), (v2 - v1) / (s2 - s1)
    c2 = (d12 - d01) / (s2 - s0)
    c1 = d01 - c2 * (s0 + s1)
    c0 = v0 - c1 * s0 - c2 * s0 * s0
    return tuple(int(c) if c.denominator == 1 else float(c) for c in (c0, c1, c2))  # type: ignore[return-value]


def evaluate(coefficients: tuple[int | float, int | float, int | float], seq_len: int) -> int:
    """Value of a fitted statistic at ``seq_len`` (statistics are whole FLOPs and bytes)."""
    c0, c1, c2 = coefficients
    return max(0, round(c0 + c1 * seq_len + c2 * seq_len * seq_len))


def layer_signature(signature_key: str, stats: LayerStats) -> str:
    """Short stable hash of the layer's key and every measured number: identical blocks share it."""
    numbers = stats.model_dump(mode="json", exclude={"fqn", "signature"})
    return hashlib.sha1(json.dumps([signature_key, numbers], sort_keys=True).encode()).hexdigest()[:12]


def signed(stats: LayerStats, signature_key: str) -> LayerStats:
    """``stats`` with its signature (``layer_signature``) filled in."""
    return stats.model_copy(update={"signature": layer_signature(signature_key, stats)})


def _rescaled(layer: LayerStats, scaling: SeqScaling, seq_len: int, *, window_seq_len: int = 0) -> LayerStats:
    """``layer`` at ``seq_len`` from its polynomials (fitted on dense measurements), then its window cut."""
    values = {name: evaluate(c, seq_len) for name, c in scaling.coefficients.items()}
    stats = LayerStats.model_validate({**layer.model_dump(), **values})
    if window_seq_len:
        stats = with_windowed_attention(stats, seq_len=window_seq_len)
    return signed(stats, scaling.signature_key)


# ----------------------------------------------------------------------------------------------- repetition


def repeat_last_block(graph: LayerGraph, blocks: int) -> LayerGraph | None:
    """``graph`` with its last block repeated until its container holds ``blocks`` blocks, named on in order
    (``blocks.5`` -> ``blocks.6``, ...): what capturing the deeper model gives when its extra blocks are copies of
    the last one. Each copy takes the inputs the last block takes from outside the stack, the stack's chain runs on
    through the copies, and what the last block fed after the stack is fed by the last copy.

    None when the graph does not show that pattern -- the last block must measure like the block before it (one
    signature), read the stack only from it, and that block must take the same inputs from outside the stack and
    feed nothing outside it: then the deeper model must be captured whole."""
    fqns = [layer.fqn for layer in graph.layers]
    last = graph.blocks[-1].fqn if graph.blocks else ""
    container, _, index = last.rpartition(".")
    before = f"{container}.{int(index) - 1}" if index.isdigit() else ""
    if not before or before not in fqns or blocks <= int(index) + 1 or graph.layer(before).signature != graph.layer(last).signature:
        return None
    stack = {fqn for fqn in fqns if fqn.rpartition(".")[0] == container}
    outside_inputs = {fqn: sorted(a for a, b in graph.edges if b == fqn and a not in stack) for fqn in (before, last)}
    chained = {a for a, b in graph.edges if b == last and a in stack} == {before}
    if not chained or outside_inputs[before] != outside_inputs[last] or any(a == before and b not in stack for a, b in graph.edges):
        return None
    copies = [f"{container}.{i}" for i in range(int(index) + 1, blocks)]
    at = fqns.index(last) + 1
    layers = [*graph.layers[:at], *(graph.layers[at - 1].model_copy(update={"fqn": c}) for c in copies), *graph.layers[at:]]
    scaling = list(graph.seq_scaling)
    if scaling:
        scaling[at:at] = [scaling[at - 1].model_copy(update={"fqn": c}) for c in copies]
    incoming: dict[str, list[tuple[str, str]]] = {}  # consumer -> its edges, as capture lists them: consumers in order
    for a, b in graph.edges:
        incoming.setdefault(b, []).append((copies[-1] if a == last and b not in stack else a, b))
    for previous, copy in zip([last, *copies], copies):
        incoming[copy] = [(previous if a == before else a, copy) for a, _ in incoming[last]]
    edges = [edge for layer in layers for edge in incoming.get(layer.fqn, ())]
    fields = {name: getattr(graph, name) for name in type(graph).model_fields}
    return type(graph)(**{**fields, "layers": tuple(layers), "edges": tuple(edges), "seq_scaling": tuple(scaling)})


# ----------------------------------------------------------------------------------------------- multi-token prediction

def with_mtp_modules(graph: LayerGraph, count: int) -> LayerGraph:
    """``graph`` with ``count`` multi-token-prediction modules (DeepSeek-V3, arXiv:2412.19437 Sec. 2.2; Megatron-Core's
    ``mtp_num_layers``; transformers' ``MtpLayer``, which builds the same module for inference), for pricing a
    framework that trains them: each is a copy of the last block (``mtp.0``, ...) behind RMSNorms of the previous
    hidden state and of the next tokens' embeddings and a projection of the two, concatenated, back to the hidden
    size (2h x h parameters, 4h^2 forward FLOPs a token, and its 2h-wide input and the two norms' inputs saved); then
    the final norm, the head (its weights shared) and the loss run once more for each module, so every layer after
    the blocks costs ``1 + count`` times its FLOPs and activations. The shared embedding's second lookup is left
    out; a pipeline stage that runs the modules without the embedding holds a copy of it
    (``LayerStats.mtp_embedding_params``). The modules come after the last block, so a pipeline's last chunk holds
    them (``chunk_blocks`` counts them as blocks), as Megatron-Core places them; Tessera's runtime does not run
    them."""
    if count <= 0 or not graph.blocks:
        return graph
    last = graph.blocks[-1]
    at = [layer.fqn for layer in graph.layers].index(last.fqn) + 1
    h = last.hidden_size
    if not h:
        raise CaptureError(f"{graph.model_name}: its last block has no measured hidden size, so the multi-token "
                           "prediction modules cannot be sized; capture a model whose blocks report it")
    hidden_bytes = last.output_bytes / graph.seq_len  # one token's hidden state, in the dtype it was measured in
    extras = {"forward_flops": 4 * h * h, "backward_flops": 8 * h * h, "linear_input_bytes": 2 * hidden_bytes,
              "linear_call_input_bytes": 2 * hidden_bytes}  # per token
    saved = 4 * hidden_bytes  # the projection's 2h-wide input and the two norms' inputs, per token
    kept = 2 * hidden_bytes  # a fully recomputed module keeps its two inputs
    for name in SCALED_FIELDS:
        if name.startswith(("saved_bytes", "autocast_saved_bytes")):
            extras[name] = kept if "full_recompute" in name else saved
    scaling = {s.fqn: s for s in graph.seq_scaling}
    embedding_params = sum(layer.param_count for layer in graph.layers if layer.kind == "embedding")
    modules, module_scaling = [], []
    for index in range(count):
        fqn = f"mtp.{index}"
        values = {name: getattr(last, name) + round(per_token * graph.seq_len) for name, per_token in extras.items()
                  if getattr(last, name) is not None}
        modules.append(last.model_copy(update={
            **values, "fqn": fqn, "signature": f"{last.signature}:mtp",
            "param_count": last.param_count + 2 * h * h + 3 * h, "mtp_embedding_params": embedding_params}))
        if last.fqn in scaling:
            coefficients = {name: (c[0], c[1] + extras.get(name, 0), c[2])
                            for name, c in scaling[last.fqn].coefficients.items()}
            module_scaling.append(SeqScaling(fqn=fqn, signature_key=f"{scaling[last.fqn].signature_key}:mtp",
                                             coefficients=coefficients))
    factor, repeated = 1 + count, [name for name in SCALED_FIELDS if name not in ONE_CALL_AT_A_TIME]
    after = [layer.model_copy(update={name: _times(getattr(layer, name), factor) for name in repeated})
             for layer in graph.layers[at:]]
    after_scaling = [s.model_copy(update={"coefficients": {name: tuple(_times(c, factor) for c in cs) if name in repeated
                                                           else cs for name, cs in s.coefficients.items()}})
                     for s in graph.seq_scaling[at:]]
    chain = [last.fqn, *(m.fqn for m in modules)]  # each module reads the hidden state before it
    embeddings = [layer.fqn for layer in graph.layers if layer.kind == "embedding"][:1]  # and the next tokens'
    heads = [layer.fqn for layer in graph.layers[at:at + 1]]  # and its output goes through the final norm and head
    edges = [*graph.edges, *((before, module) for before, module in zip(chain, chain[1:])),
             *((e, module) for module in chain[1:] for e in embeddings), *((module, h) for module in chain[1:] for h in heads)]
    fields = {name: getattr(graph, name) for name in type(graph).model_fields}
    return type(graph)(**{
        **fields, "layers": (*graph.layers[:at], *modules, *after), "edges": tuple(edges),
        "seq_scaling": (*graph.seq_scaling[:at], *module_scaling, *after_scaling) if graph.seq_scaling else (),
        "model_name": f"{graph.model_name} + {count} MTP"})


ONE_CALL_AT_A_TIME = ("output_bytes", "autocast_output_bytes")
"""What the layers after the blocks make per call and free before the next module's call (the logits, their gradient
and the loss's working tensors, sized from the head's output): not repeated per module, unlike what each keeps."""


def _times(value, factor: int):
    """``value`` times ``factor``, kept whole where it was (bytes), None where unmeasured."""
    if value is None:
        return None
    return value * factor if isinstance(value, float) else int(value) * factor
