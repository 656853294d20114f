"""What each layer adds to its pipeline stage's totals (``partition.stage_totals``), under its block's activation
policy: saved bytes, recomputed FLOPs, tensor-parallel reductions and linears, and the dictionaries of
``StageTotals`` fields for the root and loss, expert and context parallelism, offloaded and kept blocks, selective
recomputation and fused norms."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from tessera.cost_models.layer_stats import LayerStats
from tessera.cost_models.types import Recompute
from tessera.topology.head_dims import HeadDims

TP_SHARDED_KINDS = ("block", "embedding", "head")
LINEAR_INPUT_SHARE = 14 / 34
"""Share of a block's saved activations that are its linears' inputs, where capture did not measure them
(``LayerStats.linear_input_bytes``): in Korthikanti et al.'s per-layer accounting of a GPT block (arXiv 2205.05198
Sec. 4.1, 34 sbh bytes) the QKV input (2 sbh), the projection input (2 sbh), the first MLP input (2 sbh) and the
second MLP input (8 sbh). A gated MLP's block reads less of what it saves (a Llama 3 block: about 0.6 of this)."""
DEFAULT_TP_PAIRS_PER_BLOCK = 2  # attention and MLP, when capture did not report the pairs
DEFAULT_LINEARS_PER_BLOCK = 6  # q, k, v, o, up, down, when capture did not report the pairs
_PAIR_CACHE_LIMIT = 65536


def fused_saving_totals(stage: Sequence[LayerStats], policy: Mapping[str, Recompute]) -> dict:
    """The StageTotals fields of what fused kernels save less than the composites capture measured: CUDA's
    ``rms_norm`` (``LayerStats.fused_norm_saving_bytes``), the declared RMSNorm layers' kernel
    (``LayerStats.declared_norm_saving_bytes``) and a gated MLP's (``LayerStats.fused_gate_saving_bytes``)."""
    # a graph captured before the figure existed has None under autocast: nothing known
    return {**_saving_totals("norm", [(policy[layer.fqn], layer.fused_norm_saving_bytes or 0) for layer in stage]),
            **_saving_totals("declared_norm", [(policy[layer.fqn], layer.declared_norm_saving_bytes) for layer in stage]),
            **_saving_totals("gate", [(policy[layer.fqn], layer.fused_gate_saving_bytes) for layer in stage])}


def _saving_totals(kernel: str, saving: list[tuple[Recompute, int]]) -> dict:
    """``<kernel>_saving_bytes`` (layers not recomputed), ``selective_<kernel>_saving_bytes`` and
    ``<kernel>_traffic_saving_bytes`` (every layer) from each layer's (policy, saving)."""

    def by(kind: str) -> int:
        return sum(bytes_ for layer_kind, bytes_ in saving if layer_kind == kind)

    return {f"{kernel}_saving_bytes": by("none"), f"selective_{kernel}_saving_bytes": by("selective"),
            f"{kernel}_traffic_saving_bytes": sum(bytes_ for _, bytes_ in saving)}


def selective_totals(blocks: Sequence[LayerStats], policy: Mapping[str, Recompute]) -> dict:
    """The StageTotals fields of the selectively recomputed blocks."""
    # Blocks measured for the op-level policy only (a block without the figures keeps the attention-core policy).
    selective = [b for b in blocks if policy[b.fqn] == "selective" and b.op_selective_recompute_flops > 0]
    kept = [layer_saved_bytes(b, "selective") for b in selective]
    op_kept = [k if b.saved_bytes_op_selective is None else less_named_pieces(b, b.saved_bytes_op_selective)
               for b, k in zip(selective, kept)]
    every = [b for b in blocks if policy[b.fqn] == "selective"]
    measured = matmul_selective_blocks(blocks, policy)
    pairs = sum(block_tp_reductions(b) * b.output_bytes for b in measured)
    attention_kept = [layer_saved_bytes(b, "selective") for b in every]
    matmul_kept = [k if b.saved_bytes_matmul_selective is None else less_named_pieces(b, b.saved_bytes_matmul_selective)
                   for b, k in zip(every, attention_kept)]
    return {
        "selective_blocks_saved_bytes": sum(attention_kept),
        "matmul_selective_saved_bytes": sum(matmul_kept),
        "matmul_selective_buffer_bytes": max((b.saved_bytes_no_recompute - k for b, k in zip(every, matmul_kept)),
                                             default=0),
        "matmul_selective_traffic_bytes": sum(b.saved_bytes_no_recompute for b in measured),
        "matmul_selective_core_flops": sum(b.selective_recompute_flops for b in measured),
        "matmul_selective_pair_bytes": pairs,
        "matmul_selective_gathered_bytes": pairs,
        "selective_core_flops": sum(b.selective_recompute_flops for b in selective),
        "op_selective_recompute_flops": sum(b.op_selective_recompute_flops for b in selective),
        "selective_traffic_bytes": sum(b.saved_bytes_no_recompute for b in selective),
        "selective_saved_bytes": sum(kept),
        "op_selective_saved_bytes": sum(op_kept),
        "op_selective_buffer_bytes": max((b.saved_bytes_no_recompute - k for b, k in zip(selective, op_kept)),
                                         default=0),
        "op_selective_blocks": len(selective),
        "op_selective_gathered_bytes": sum(block_tp_reductions(b) * b.output_bytes for b in selective),
    }


def matmul_selective_blocks(stage: Sequence[LayerStats], policies: Mapping[str, Recompute]) -> list[LayerStats]:
    """The selective blocks measured for the matmuls policy (``LayerStats.saved_bytes_matmul_selective``)."""
    return [layer for layer in stage if layer.kind == "block" and policies.get(layer.fqn) == "selective"
            and layer.saved_bytes_matmul_selective is not None]


def offload_and_kept_totals(blocks: Sequence[LayerStats], policy: Mapping[str, Recompute], kept: frozenset[str]) -> dict:
    """The StageTotals fields of offloaded blocks and of blocks that keep their gathered weights."""
    offloaded = [b.saved_bytes_no_recompute for b in blocks if policy[b.fqn] == "offload"]
    held = [b for b in blocks if b.fqn in kept]
    return {
        "offloaded_bytes": sum(offloaded),
        "offloaded_blocks": len(offloaded),
        # The block whose backward runs and the next one prefetched back from host (copy-in ahead of use).
        "offload_buffer_bytes": 2 * max(offloaded, default=0),
        "kept_params": sum(b.param_count for b in held),
        "kept_expert_params": sum(b.expert_param_count for b in held),
        "kept_blocks": len(held),
        "recomputed_block_params": sum(b.param_count for b in blocks if policy[b.fqn] in ("selective", "full")),
    }


def layer_sp_gathered_bytes(layer: LayerStats, recompute: Recompute) -> float:
    """Per sequence, what sequence parallelism all-gathers in front of a layer's column-parallel linears and the
    linears save for their weight gradient: one residual-width input per linear pair of a block (unless the
    block is fully recomputed, which saves only its input), and the head's input."""
    if layer.kind == "block" and recompute != "full":
        return block_tp_reductions(layer) * layer.output_bytes
    if layer.kind == "head":
        return layer.saved_bytes_full_recompute
    return 0.0


def layer_linear_input_bytes(layer: LayerStats, *, per_call: bool = False) -> float:
    """Per sequence, what a block's linears read (an FP8 recipe casts it), each distinct input once or, ``per_call``,
    at every linear call: as measured, else (either count) the GPT share of what the block saves; 0 outside blocks
    (the head stays in bf16)."""
    if layer.kind != "block":
        return 0.0
    measured = layer.linear_call_input_bytes if per_call else layer.linear_input_bytes
    if measured is not None:
        return measured
    return LINEAR_INPUT_SHARE * layer.saved_bytes_no_recompute


def root_and_loss_totals(stage: Sequence[LayerStats]) -> dict:
    """The StageTotals fields of the layers outside blocks and of the loss (see ``cost_models.memory``)."""
    root = [layer for layer in stage if layer.kind != "block"]
    losses = [i for i, layer in enumerate(stage) if layer.kind == "loss"]
    embedded = any(layer.kind == "embedding" for layer in root)  # else a multi-token-prediction module's copy
    embedding_copy = 0 if embedded else max((layer.mtp_embedding_params for layer in stage), default=0)
    return {
        "root_sharded_params": sum(layer.param_count for layer in root if layer.kind in TP_SHARDED_KINDS) + embedding_copy,
        "root_replicated_params": sum(layer.param_count for layer in root if layer.kind not in TP_SHARDED_KINDS),
        "loss_saved_bytes": sum(stage[i].saved_bytes_no_recompute for i in losses),
        "logits_bytes": sum(stage[i - 1].output_bytes for i in losses if i > 0),
        "largest_block_params": max((layer.param_count for layer in stage if layer.kind == "block"), default=0),
        "widest_matrix_dim": max((layer.widest_matrix_dim for layer in stage), default=0),
        "largest_matrix_params": max((layer.largest_matrix_params for layer in stage), default=0),
        "embedding_params": sum(layer.param_count for layer in root if layer.kind == "embedding"),
        "largest_tensor_params": max([layer.largest_matrix_params for layer in stage]
                                     + [layer.param_count for layer in root if layer.kind in ("embedding", "head")]),
        "head_forward_flops": sum(layer.forward_flops for layer in root if layer.kind == "head"),
        "head_backward_flops": sum(layer.backward_flops for layer in root if layer.kind == "head"),
    }


def sparse_and_long_totals(stage: Sequence[LayerStats], policy: Mapping[str, Recompute]) -> dict:
    """The StageTotals fields expert and context parallelism cost (see ``cost_models.sparse``)."""
    moe = [layer for layer in stage if layer.experts]
    attention = [layer for layer in stage if layer.attention_heads]
    if not moe and not attention:
        return {}
    largest = max(stage, key=lambda layer: layer.param_count)
    # Dispatch all-to-all payload: each token goes to top_k experts, carrying its hidden activation (the layer's
    # output width and dtype), times the load factor the experts were measured at.
    dispatch = {layer.fqn: layer.top_k * layer.expert_capacity_factor * layer.output_bytes for layer in moe}
    kv = {layer.fqn: kv_bytes(layer) for layer in attention}
    return {
        "expert_params": sum(layer.expert_param_count for layer in moe),
        "largest_layer_expert_params": largest.expert_param_count,
        "moe_layers": len(moe),
        "experts": min((layer.experts for layer in moe), default=0),
        "top_k": max((layer.top_k for layer in moe), default=0),
        "expert_forward_flops": sum(layer.expert_forward_flops for layer in moe),
        "expert_backward_flops": sum(layer.expert_backward_flops for layer in moe),
        "expert_width": min((layer.expert_width for layer in moe if layer.expert_width), default=0),
        "dispatch_bytes": sum(dispatch.values()),
        "recompute_dispatch_bytes": sum(dispatch[layer.fqn] for layer in moe if _exchanges_again(layer, policy)),
        "attention_layers": len(attention),
        "kv_bytes": sum(kv.values()),
        "kv_repeated_bytes": sum(kv_bytes(layer, repeated=True) for layer in attention),
        "recompute_kv_bytes": sum(b for fqn, b in kv.items() if policy.get(fqn, "none") in ("selective", "full")),
        "full_recompute_kv_bytes": sum(b for fqn, b in kv.items() if policy.get(fqn) == "full"),
        "attention_core_flops": sum(layer.selective_recompute_flops for layer in attention),
        "attention_head_widths": attention_head_widths(attention),
        "kv_heads": min(layer.kv_heads or layer.attention_heads for layer in attention),
    }


def _exchanges_again(layer: LayerStats, policy: Mapping[str, Recompute]) -> bool:
    """Whether a MoE layer's forward all-to-alls run again in its backward: recomputed whole, or its MoE piece in a
    block that keeps its activations (``moe``)."""
    recompute = policy.get(layer.fqn, "none")
    return recompute == "full" or layer.module_recompute_exchanges and recompute in ("none", "selective")


def attention_head_widths(attention: Sequence[LayerStats]) -> tuple[tuple[float, HeadDims], ...]:
    """``((share of the cores' forward FLOPs, their key and value head widths), ...)``, one entry per distinct widths,
    in the order first seen: what a fused kernel's rate on the layers depends on (``head_dims.stage_head_rate``; shares,
    not FLOPs, so that stages of one width share one entry and the rate lookups their cache). A layer
    whose query width was not measured has keys and values of half its ``kv_head_width`` each; one with neither,
    unknown widths (priced at the catalog's 128)."""
    measured: dict[tuple[int, int], float] = {}  # by the measured widths (a search sums ~10^5 stages)
    for layer in attention:
        widths = (layer.query_head_width, layer.kv_head_width)
        measured[widths] = measured.get(widths, 0.0) + layer.selective_recompute_flops
    flops: dict[HeadDims, float] = {}
    for widths, weight in measured.items():
        dims = _head_dims(*widths)
        flops[dims] = flops.get(dims, 0.0) + weight
    total = sum(flops.values())
    return tuple((weight / total, dims) for dims, weight in flops.items() if weight)


def _head_dims(query_width: int, kv_width: int) -> HeadDims:
    key = query_width or kv_width / 2
    return HeadDims(key, kv_width - key) if kv_width else HeadDims()


def kv_bytes(layer: LayerStats, *, repeated: bool = False) -> float:
    """Keys and values of one sequence through ``layer``'s attention: ``kv_heads`` heads (every query head's where
    ``repeated`` to them) of ``kv_head_width`` a token, in the output's dtype; unmeasured (or the layer's width
    unknown), two heads of ``hidden / heads`` each (the layer's output width over its heads)."""
    kv_heads = layer.attention_heads if repeated else layer.kv_heads or layer.attention_heads
    if layer.kv_head_width and layer.hidden_size:
        return layer.output_bytes / layer.hidden_size * kv_heads * layer.kv_head_width
    return 2 * layer.output_bytes * kv_heads / layer.attention_heads


def block_width(layer: LayerStats) -> int:
    """Hidden size of a block: measured, or from its parameters (~12 h^2 in a transformer block)."""
    return layer.hidden_size or int(math.sqrt(layer.param_count / 12))


def layer_recomputed_flops(layer: LayerStats, recompute: Recompute) -> float:
    return {"none": 0.0, "offload": 0.0, "selective": layer.selective_recompute_flops, "full": layer.forward_flops}[recompute]


def layer_saved_bytes(layer: LayerStats, recompute: Recompute) -> int:
    """What a layer keeps on the device for its backward (an offloaded block: nothing; its copy-in buffer is
    ``offload_buffer_bytes``)."""
    if layer.kind != "block":
        return layer.saved_bytes_no_recompute
    if recompute == "offload":
        return 0
    if recompute == "full":
        return layer.saved_bytes_full_recompute
    kept = layer.saved_bytes_selective if recompute == "selective" and layer.saved_bytes_selective is not None else (
        layer.saved_bytes_no_recompute)
    return less_named_pieces(layer, kept)


def module_recompute_totals(kept: Sequence[LayerStats]) -> dict:
    """The StageTotals fields of the named pieces recomputed in the blocks that keep their activations (``kept``:
    none or selective; ``cost_models.module_recompute``)."""
    return {"module_recompute_flops": sum(b.module_recompute_flops for b in kept),
            "module_recompute_linear_input_bytes": sum(b.module_recompute_linear_input_bytes for b in kept)}


def less_named_pieces(block: LayerStats, kept: int) -> int:
    """What ``block`` keeps of ``kept`` once the pieces ``Strategy.recompute_modules`` names free what they made
    (``cost_models.module_recompute``); its input stays either way."""
    if not block.module_recompute_saving_bytes:
        return kept
    return max(block.saved_bytes_full_recompute, kept - block.module_recompute_saving_bytes)


def layer_tp_allreduce_count(layer: LayerStats) -> int:
    if layer.kind == "block":
        return block_tp_reductions(layer)
    return int(layer_tp_allreduce_bytes(layer) > 0)


def block_tp_reductions(layer: LayerStats) -> int:
    """Activation all-reduces of a tensor-parallel block per pass: one per linear pair, except that the routed
    experts' pairs (one per expert) share one: their partial outputs are combined before the reduction, as
    Megatron-Core's MoE layer does."""
    if not layer.tp_pairs:
        return DEFAULT_TP_PAIRS_PER_BLOCK
    return _pair_counts(layer.tp_pairs)[0]


def layer_linears(layer: LayerStats) -> int:
    """Linears whose framework overhead a micro-batch pays (``DeviceSpec.linear_overhead_s``): a block's pairs'
    (the routed experts counted as one pair, as for their reduction), a head's one."""
    if layer.kind == "head":
        return 1
    if layer.kind != "block":
        return 0
    if not layer.tp_pairs:
        return DEFAULT_LINEARS_PER_BLOCK
    return _pair_counts(layer.tp_pairs)[1]


_PAIR_COUNTS: dict[int, tuple[tuple, tuple[int, int]]] = {}


def _pair_counts(pairs: tuple) -> tuple[int, int]:
    """(reductions, linears) of a block's pairs, memoised by the tuple's identity (an MoE block lists one pair
    per expert, and copies of a block share the tuple): the search sums them for thousands of stages."""
    hit = _PAIR_COUNTS.get(id(pairs))
    if hit is not None and hit[0] is pairs:
        return hit[1]
    dense = [pair for pair in pairs if pair.role != "expert"]
    experts = [pair for pair in pairs if pair.role == "expert"][:1]
    counts = (len(dense) + len(experts), sum(len(pair.column) + 1 for pair in dense + experts))
    if len(_PAIR_COUNTS) >= _PAIR_CACHE_LIMIT:
        _PAIR_COUNTS.clear()
    _PAIR_COUNTS[id(pairs)] = (pairs, counts)
    return counts


def layer_tp_allreduce_bytes(layer: LayerStats) -> float:
    """Bytes all-reduced per pass when the layer is tensor-parallel (Megatron: one per linear pair)."""
    if layer.kind == "block":
        return block_tp_reductions(layer) * layer.output_bytes
    if layer.kind == "embedding" and layer.param_count:
        return layer.output_bytes  # vocabulary-parallel embedding: partial lookups are summed
    if layer.kind == "head":
        return layer.saved_bytes_full_recompute  # column-parallel head: input gradient summed in backward
    return 0.0
