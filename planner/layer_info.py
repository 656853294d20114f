"""What capture reads off the module tree and the traced graph, besides measurements.

- **kind**: ``embedding`` (an ``nn.Embedding``, or a layer holding one outside the repeated blocks), ``norm``,
  ``head`` (the last layer owning a linear whose output reaches the model output), ``block`` (a composite element
  of a ModuleList / ModuleDict / Sequential), else ``other``.
- **tensor-parallel pairs** (``tp_pairs``): Megatron-LM's column/row split, found in the data flow of the traced
  graph. A linear (``nn.Linear``, or Hugging Face's ``Conv1D``) is a *row* when linears of the same layer reach its
  input through elementwise, reshaping and attention ops only -- no normalisation (which is where the residual
  stream is read) and no routing index (``topk``, ``argmax``...) -- and it maps back to the width they read
  (``row.out_features == column.in_features``). Those linears are its *columns*. The role is ``expert`` for a row
  under an ``experts`` module, ``attention`` when the path crosses an attention op (SDPA, softmax), else ``mlp``.
  Hugging Face's packed experts (3-D parameters) are not linears: each stacked experts module adds one ``expert``
  pair, its first and last 3-D weights (``stacked_expert_pairs``), as tensor parallelism splits it.
  A user leaf module is one graph node, so pairs inside it are not seen. A repeated container element that the
  tracer recorded as one node (``tessera.planner.front_ends``) gets its representative's pairs, renamed; when that
  would not be exact (a linear inside the representative fed from outside it) ``NotReplicable`` is raised and
  capture traces every element instead.
- **heads**: query heads as measured at the SDPA call; **kv_heads**: an attribute of the layer's modules or the
  model's ``config`` named ``num_key_value_heads`` / ``num_kv_heads`` / ``n_kv_heads`` / ``kv_heads`` when
  present (Hugging Face repeats key/value heads before SDPA), else the key heads measured at the SDPA call.
- **experts**: the length of a ModuleList named ``experts``, or an integer ``num_experts`` / ``num_local_experts``
  attribute of a module in the layer (the largest found). **expert parameters**: the parameters under the
  layer's outermost modules named ``experts`` (a ModuleList of experts, or Hugging Face's packed experts); the
  router and a shared expert are dense. **top_k**: an integer ``top_k`` / ``num_experts_per_tok`` /
  ``moe_top_k`` attribute of a module in the layer or of the model's ``config`` (0 if none is declared).
- **vocab_size**: the head's output width; an embedding layer's, when it holds an ``nn.Embedding`` of that many rows.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import nn

from tessera.cost_models.layer_stats import LayerStats, LinearPair
from tessera.cost_models.tp_rules import linear_dims, moe_containers
from tessera.cost_models.types import LayerKind
from tessera.planner.replay import CONTAINERS

NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm)
_NORM_OPS = ("layer_norm", "rms_norm", "group_norm", "batch_norm")
_ATTENTION_OPS = ("scaled_dot_product", "softmax")
_INDEX_OPS = ("topk", "argmax", "argmin", "argsort", "one_hot", "nonzero")
_KV_NAMES = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "kv_heads")
_EXPERT_NAMES = ("num_experts", "num_local_experts")
_TOP_K_NAMES = ("top_k", "num_experts_per_tok", "moe_top_k")


def is_norm(module: nn.Module) -> bool:
    """A normalisation layer, by class or by a class name ending in ``Norm`` (``LlamaRMSNorm``)."""
    return isinstance(module, NORMS) or type(module).__name__.lower().endswith("norm")


def layer_kind(module: nn.Module, *, is_head: bool, in_container: bool) -> LayerKind:
    """Role of a layer (see the module docstring)."""
    if isinstance(module, nn.Embedding) or (not in_container and _holds(module, nn.Embedding)):
        return "embedding"
    if is_norm(module):
        return "norm"
    if is_head:
        return "head"
    if in_container and any(True for _ in module.children()):
        return "block"
    return "other"


def has_linear(module: nn.Module) -> bool:
    """Whether the module is or holds a linear layer."""
    return any(linear_dims(m) is not None for m in module.modules())


def matrix_facts(module: nn.Module) -> dict[str, int]:
    """The widest dimension of the module's dense matrix weights (two or more dimensions) and the largest element
    count of any (a stack of expert matrices counts one of them): what an FP8 cast of a matmul operand allocates
    scales with. Routed experts' widths are left out of the first: each expert sees only the tokens routed to it."""
    matrices = [(name, p.shape[-2:]) for name, p in module.named_parameters() if p.dim() >= 2]
    dense = [shape for name, shape in matrices if "experts" not in name.split(".")]
    return {"widest_matrix_dim": max((max(shape) for shape in dense), default=0),
            "largest_matrix_params": max((shape[0] * shape[1] for _, shape in matrices), default=0)}


def _holds(module: nn.Module, kind: type) -> bool:
    return any(isinstance(m, kind) for m in module.modules())


# ----------------------------------------------------------------------------------------------- tensor parallelism


def node_path(node: torch.fx.Node) -> str:
    """FQN of the innermost module that produced an fx node ('' for the root's own code)."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack")
    if stack:
        return next(reversed(stack.values()))[0]
    return str(node.target) if node.op == "get_attr" else ""


def enclosing(path: str, names: Iterable[str] | set[str]) -> str | None:
    """The longest name in ``names`` that is ``path`` or a module above it."""
    parts = path.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in names:
            return candidate
    return None


class NotReplicable(Exception):
    """A replica's tensor-parallel pairs cannot be copied exactly from its representative: trace it in full."""


def tp_pairs(
    graph: torch.fx.Graph, model: nn.Module, layers: dict[str, nn.Module], *,
    replicas: Mapping[str, str] | None = None, outputs: Mapping[str, tuple[torch.fx.Node, ...]] | None = None,
) -> dict[str, tuple[LinearPair, ...]]:
    """Column/row-parallel linear pairs per layer FQN, from the data flow of ``graph``.

    ``replicas`` / ``outputs``: the repeated elements recorded as one node (``front_ends.Traced``).
    """
    dims, norms = {}, set()
    for fqn, m in model.named_modules():
        if (d := linear_dims(m)) is not None:
            dims[fqn] = d
        elif is_norm(m):
            norms.add(fqn)
    feeds = _linear_feeds(graph, set(dims), norms, _Replicas(replicas or {}, outputs or {}))
    position = {fqn: i for i, fqn in enumerate(dims)}  # model order
    pairs: dict[str, list[LinearPair]] = {}
    for row in sorted(feeds, key=position.__getitem__):
        layer = enclosing(row, layers)
        sources = {c for c, _ in feeds[row] if enclosing(c, layers) == layer and dims[c][0] == dims[row][1]}
        columns = sorted(sources, key=position.__getitem__)
        if layer is None or not columns:
            continue
        crossed_attention = any(att for c, att in feeds[row] if c in columns)
        role = "expert" if "experts" in row.split(".") else "attention" if crossed_attention else "mlp"
        relative = [name.removeprefix(layer + ".") for name in (*columns, row)]
        pairs.setdefault(layer, []).append(LinearPair(column=tuple(relative[:-1]), row=relative[-1], role=role))
    for fqn, module in layers.items():
        pairs.setdefault(fqn, []).extend(stacked_expert_pairs(module))
    return {layer: tuple(found) for layer, found in pairs.items() if found}


def stacked_expert_pairs(layer: nn.Module) -> list[LinearPair]:
    """One ``expert`` pair per stacked experts module (Hugging Face's packed experts, ``tp_rules.moe_containers``):
    the first and the last of its 3-D weights (``gate_up_proj``, ``down_proj``). They are not linears, so the data
    flow shows no pair, but tensor parallelism splits them as one -- one reduction of the combined output."""
    found = []
    for container in moe_containers(layer):
        experts = f"{container}.experts" if container else "experts"
        stacked = [name for name, p in layer.get_submodule(experts).named_parameters(recurse=False) if p.dim() == 3]
        if len(stacked) >= 2:
            found.append(LinearPair(column=(f"{experts}.{stacked[0]}",), row=f"{experts}.{stacked[-1]}", role="expert"))
    return found


def _linear_feeds(
    graph: torch.fx.Graph, linears: set[str], norms: set[str], replicas: "_Replicas"
) -> dict[str, set[tuple[str, bool]]]:
    """For each linear: the linears whose outputs reach its input, and whether through an attention op."""
    reach: dict[torch.fx.Node, frozenset[tuple[str, bool]]] = {}
    feeds: dict[str, set[tuple[str, bool]]] = {}
    for node in graph.nodes:
        incoming = frozenset().union(*(reach.get(n, frozenset()) for n in node.all_input_nodes))
        if node.op == "call_module" and node.target in replicas.of:
            reach[node] = replicas.expand(str(node.target), incoming, reach, feeds)
            continue
        path = node_path(node)
        linear = enclosing(path, linears) if path else None
        name = _op_name(node)
        if linear is not None:
            feeds.setdefault(linear, set()).update(src for src in incoming if src[0] != linear)
            reach[node] = frozenset({(linear, False)})
        elif (path and enclosing(path, norms)) or any(op in name for op in (*_NORM_OPS, *_INDEX_OPS)):
            reach[node] = frozenset()
        elif any(op in name for op in _ATTENTION_OPS):
            reach[node] = frozenset((src, True) for src, _ in incoming)
        else:
            reach[node] = incoming
    return feeds


class _Replicas:
    """Expands a replica node in the reach analysis: its linears' feeds and its output reach are the
    representative's with the representative's name replaced by the replica's."""

    def __init__(self, of: Mapping[str, str], outputs: Mapping[str, tuple[torch.fx.Node, ...]]) -> None:
        self.of, self.outputs = of, outputs
        self.inside: dict[str, list[str]] = {}  # representative -> the linears that ran inside it

    def expand(
        self, fqn: str, incoming: frozenset, reach: dict[torch.fx.Node, frozenset], feeds: dict[str, set]
    ) -> frozenset[tuple[str, bool]]:
        rep = self.of[fqn]
        prefix = rep + "."

        def rename(name: str) -> str:
            return fqn + name[len(rep):]

        if rep not in self.inside:
            self.inside[rep] = [linear for linear in feeds if linear.startswith(prefix)]
        for linear in self.inside[rep]:
            if any(not src.startswith(prefix) for src, _ in feeds[linear]):
                raise NotReplicable(f"{linear} is fed from outside {rep}")
            feeds[rename(linear)] = {(rename(src), crossed) for src, crossed in feeds[linear]}
        out = frozenset().union(*(reach.get(n, frozenset()) for n in self.outputs.get(rep, ())))
        own = frozenset((rename(src), crossed) for src, crossed in out if src.startswith(prefix))
        return own | incoming if len(own) < len(out) else own  # what it passes through from its inputs


def _op_name(node: torch.fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    if node.op == "call_function":
        return getattr(node.target, "__name__", None) or str(node.target)
    return ""


# ----------------------------------------------------------------------------------------------- model facts


def attribute(module: object, name: str) -> object:
    """``getattr(module, name, None)`` without the slow failed lookup of ``nn.Module.__getattr__`` (which only
    finds parameters, buffers and submodules): capture asks this of every module of a 60,000-module model."""
    if (not isinstance(module, nn.Module) or type(module).__getattr__ is not nn.Module.__getattr__
            or name in module.__dict__ or hasattr(type(module), name)):
        return getattr(module, name, None)
    for store in ("_parameters", "_buffers", "_modules"):
        found = module.__dict__.get(store) or {}
        if name in found:
            return found[name]
    return None


def _declared(module: object, names: tuple[str, ...]) -> list[int]:
    """The integer attributes of ``module`` among ``names``, in that order."""
    return [value for name in names if isinstance(value := attribute(module, name), int)]


def kv_heads_declared(module: nn.Module, config: object) -> int:
    """Key/value heads declared by an attribute of ``module``'s submodules or by ``config`` (0 if none)."""
    for sub in module.modules():
        found = next(iter(_declared(sub, _KV_NAMES)), 0)
        if found:
            return found
    return next((getattr(config, n) for n in _KV_NAMES if isinstance(getattr(config, n, None), int)), 0)


def expert_count(module: nn.Module) -> int:
    """Routed experts in a layer (0 for a dense layer)."""
    counts = [0]
    for name, sub in module.named_modules():
        if isinstance(sub, nn.ModuleList) and name.rpartition(".")[2] == "experts":
            counts.append(len(sub))
        counts.extend(_declared(sub, _EXPERT_NAMES))
    return max(counts)


def expert_param_count(module: nn.Module) -> int:
    """Parameters under the outermost submodules named ``experts`` (0 for a dense layer)."""
    roots = [sub for name, sub in module.named_modules() if name.rpartition(".")[2] == "experts"]
    inside = {id(m) for root in roots for m in list(root.modules())[1:]}
    seen: set[int] = set()
    total = 0
    for root in roots:
        if id(root) in inside:
            continue
        for p in root.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
    return total


def expert_width(module: nn.Module) -> int:
    """The narrowest dimension of the routed experts' weight matrices (an expert's inner width, for experts narrower
    than the hidden size; 0 for a dense layer): the narrow side of their matmuls (``LayerStats.expert_width``)."""
    roots = [sub for name, sub in module.named_modules() if name.rpartition(".")[2] == "experts"]
    dims = [min(p.shape[-2:]) for root in roots for p in root.parameters() if p.dim() >= 2]
    return min(dims, default=0)


def top_k_declared(module: nn.Module, config: object) -> int:
    """Routed experts per token declared by the layer's modules or the model's config (0 if none)."""
    for sub in module.modules():
        found = next(iter(_declared(sub, _TOP_K_NAMES)), 0)
        if found:
            return found
    return next((getattr(config, n) for n in _TOP_K_NAMES if isinstance(getattr(config, n, None), int)), 0)


def embedding_vocab(module: nn.Module, vocab: int) -> int:
    """``vocab`` when the layer holds an embedding table of ``vocab`` rows, else 0."""
    found = any(isinstance(m, nn.Embedding) and m.num_embeddings == vocab for m in module.modules())
    return vocab if vocab and found else 0


def container_elements(root: nn.Module, layers: dict[str, nn.Module]) -> set[str]:
    """Layers that are elements of a ModuleList / ModuleDict / Sequential."""
    return {fqn for fqn in layers if "." in fqn and isinstance(root.get_submodule(fqn.rpartition(".")[0]), CONTAINERS)}


# ----------------------------------------------------------------------------------------------- windowed attention

WINDOWED_KERNELS = frozenset({"flash_attention_2", "flash_attention_3", "flex_attention"})
"""Hugging Face ``config._attn_implementation`` values whose kernels skip the pairs outside a sliding window:
FlashAttention's ``window_size=(w - 1, 0)`` (flash-attn >= 2.3, "sliding window local attention") computes each
query's last ``w`` keys only, and ``torch.nn.attention.flex_attention`` skips the blocks its ``BlockMask`` masks out
(Hugging Face passes the window to both). ``"sdpa"`` and ``"eager"`` apply the window as a dense ``s x s`` mask:
every pair is computed and then masked, so a windowed layer costs what a global one does (or more)."""
FLASH_BACKWARD_PER_FORWARD = 2.5
"""Attention-core backward FLOPs per forward FLOP as FlopCounterMode counts them (``torch.utils.flop_counter``:
``sdpa_backward_flop_count`` is five matmuls of the forward's two shapes: the recomputed scores, dV, dP, dQ, dK)."""


def windowed_kernel(config: object) -> bool:
    """Whether the model's declared attention implementation computes only the pairs inside a sliding window."""
    return getattr(config, "_attn_implementation", None) in WINDOWED_KERNELS


@contextlib.contextmanager
def measured_with_sdpa(config: object) -> Iterator[None]:
    """Run the model's attention through SDPA while capture measures it, then restore the declared kernel.

    Hugging Face attention modules look ``config._attn_implementation`` up on every call, so a model built for
    FlashAttention or flex attention (which may not run on meta or without its package) is measured as the
    fused SDPA core ``kernels.FusedKernels`` recognises; its windows are then priced by the declared kernel
    (``with_windowed_attention``)."""
    configs = [c for c in (config, getattr(config, "text_config", None)) if windowed_kernel(c)]
    declared = [c._attn_implementation for c in configs]
    for c in configs:
        c._attn_implementation = "sdpa"
    try:
        with _sdpa_ignoring_softcap() if configs else contextlib.nullcontext():
            yield
    finally:
        for c, implementation in zip(configs, declared):
            c._attn_implementation = implementation


@contextlib.contextmanager
def _sdpa_ignoring_softcap() -> Iterator[None]:
    """Hugging Face's SDPA attention, while capture measures, taking a ``softcap`` and ignoring it: flash and flex
    attention apply Gemma-2's logit softcapping inside the kernel (an elementwise tanh of the scores, which
    FlopCounterMode does not count and which saves nothing), transformers' SDPA refuses it. The override holds
    process-wide while capture runs (any other SDPA call meanwhile drops a softcap too), one capture at a time, and is
    removed afterwards."""
    try:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:  # a config that names a kernel without transformers: nothing to override
        yield
        return

    def attention(module, query, key, value, attention_mask, softcap=None, **kwargs):  # noqa: ARG001
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    with _SDPA_OVERRIDE:
        previous = ALL_ATTENTION_FUNCTIONS["sdpa"]
        ALL_ATTENTION_FUNCTIONS["sdpa"] = attention
        try:
            yield
        finally:
            with contextlib.suppress(KeyError):  # back to transformers' own, or to an override before ours
                del ALL_ATTENTION_FUNCTIONS["sdpa"]
            if ALL_ATTENTION_FUNCTIONS["sdpa"] is not previous:
                ALL_ATTENTION_FUNCTIONS["sdpa"] = previous


_SDPA_OVERRIDE = threading.RLock()
"""Held while :func:`_sdpa_ignoring_softcap` overrides transformers' SDPA: two captures in threads would otherwise
restore each other's."""


def window_pair_share(seq_len: int, window: int) -> float:
    """Query-key pairs a causal sliding window of ``window`` tokens computes, as a share of causal attention's:
    ``(s w - w^2 / 2) / (s^2 / 2)`` (query ``i`` sees keys ``i - w + 1 .. i``); 1 when the window covers the
    sequence. Measured core FLOPs count the full ``s x s`` product (FlopCounterMode ignores causality) and the
    calibrated attention rate prices them as causal kernels run them, so this share scales them."""
    if not window or window >= seq_len:
        return 1.0
    return (seq_len * window - window**2 / 2) / (seq_len**2 / 2)


def with_windowed_attention(stats: LayerStats, *, seq_len: int) -> LayerStats:
    """``stats`` of a block whose kernel skips the pairs outside its ``attention_window``: its attention-core FLOPs
    (``selective_recompute_flops``, forward) cut to the window's share, its forward and backward FLOPs by what
    that removes (backward ``FLASH_BACKWARD_PER_FORWARD`` times the forward's cut). Saved bytes are unchanged
    (flash kernels save O(s) per head either way). Other layers are returned as they are."""
    share = window_pair_share(seq_len, stats.attention_window)
    if share == 1.0 or not stats.selective_recompute_flops:
        return stats
    cut = round(stats.selective_recompute_flops * (1 - share))  # statistics are whole FLOPs
    return stats.model_copy(update={
        "forward_flops": stats.forward_flops - cut,
        "backward_flops": max(0, stats.backward_flops - FLASH_BACKWARD_PER_FORWARD * cut),
        "selective_recompute_flops": stats.selective_recompute_flops - cut,
    })
