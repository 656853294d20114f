"""Split a model's layers into pipeline stages and sum what each stage holds.

Blocks are divided as evenly as possible into ``pp * V`` chunks (``V`` virtual stages per rank for the
interleaved schedule); chunk ``c`` runs on stage ``c % pp``. Layers before the first block (embeddings)
join stage 0 and layers after the last block (final norm, head, loss) join stage ``pp - 1``, as
Megatron-LM and torchtitan place them.

Each block has its own activation policy (``Strategy.block_recompute``: recomputation or offload) and, under
ZeRO-3, its own resharding (``Strategy.block_reshard``): a stage's totals sum its blocks under theirs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from tessera.cost_models.layer_stats import LayerStats
from tessera.cost_models.layer_sums import (
    TP_SHARDED_KINDS, block_tp_reductions, block_width, fused_saving_totals, layer_linear_input_bytes, layer_linears,
    layer_recomputed_flops, layer_saved_bytes, layer_sp_gathered_bytes, layer_tp_allreduce_bytes,
    layer_tp_allreduce_count, matmul_selective_blocks, module_recompute_totals, offload_and_kept_totals,
    root_and_loss_totals, selective_totals, sparse_and_long_totals,
)
from tessera.cost_models.types import Recompute, Strategy
from tessera.errors import ConfigError
from tessera.topology.head_dims import HeadDims


@dataclass(frozen=True)
class StageTotals:
    """What one pipeline stage computes and holds for ONE sequence, before tensor-parallel division.

    Equality and hashing ignore ``index``: stages that hold the same work compare equal, so a cost is
    computed once per distinct stage (the middle stages of a deep pipeline are all alike).
    """

    index: int = field(compare=False)
    sharded_params: int  # parameters that tensor parallelism divides (blocks, vocabulary matrices)
    replicated_params: int  # parameters every tensor-parallel rank keeps whole (norms, ...)
    largest_layer_params: int
    forward_flops: float
    backward_flops: float
    recompute_flops: float
    saved_bytes: int  # under the strategy's recompute policy
    activation_traffic_bytes: int  # activations the forward writes (no recompute): drives elementwise time
    recompute_buffer_bytes: int  # one block's full activations, live while it is recomputed
    full_recompute_blocks: int  # blocks whose forward (and its tensor-parallel all-reduces) runs twice
    tp_allreduce_bytes: float  # activation bytes all-reduced per sequence per pass (sum over pairs)
    tp_allreduce_count: int  # all-reduces per pass (latency is paid per collective)
    boundary_bytes: int  # activation sent to the next stage per sequence
    blocks: int
    hidden_size: int
    # Expert and context parallelism (``cost_models.sparse``); all zero for a dense model.
    expert_params: int = 0  # routed-expert parameters (part of sharded_params): expert parallelism divides them
    largest_layer_expert_params: int = 0  # the routed-expert part of the largest layer
    moe_layers: int = 0  # layers with routed experts: each costs a dispatch and a combine all-to-all per pass
    experts: int = 0  # routed experts of the stage's MoE layers (the fewest): how a per-node dispatch spreads
    top_k: int = 0  # experts each token is sent to (the most of the stage's MoE layers)
    expert_forward_flops: float = 0.0  # the routed experts' part of forward_flops
    expert_backward_flops: float = 0.0  # the routed experts' part of backward_flops
    expert_width: int = 0  # the narrowest expert matrix dimension of the stage's MoE layers (0: none seen)
    dispatch_bytes: float = 0.0  # token activations one dispatch all-to-all carries per sequence (sum over layers)
    recompute_dispatch_bytes: float = 0.0  # the part of dispatch_bytes whose forward is recomputed (full, or its piece moe)
    attention_layers: int = 0  # layers with attention: each runs one K/V ring per pass under cp
    kv_bytes: float = 0.0  # keys + values per sequence, summed over attention layers (what the cp ring moves)
    kv_repeated_bytes: float = 0.0  # the same with every query head's K/V (what a ring of repeated K/V moves)
    recompute_kv_bytes: float = 0.0  # the part of kv_bytes whose attention core is recomputed (selective or full)
    full_recompute_kv_bytes: float = 0.0  # the part of it in fully recomputed blocks
    attention_core_flops: float = 0.0  # forward FLOPs of the attention cores per sequence (hides the ring)
    attention_head_widths: tuple[tuple[float, HeadDims], ...] = ()  # (share of cores' FLOPs, head widths): kernel rate
    kv_heads: int = 0  # fewest key/value heads of the stage's attention layers (tp beyond it replicates K/V)
    # What the runtime holds around the loss and outside the blocks (``cost_models.memory``).
    root_sharded_params: int = 0  # parameters outside blocks that tp divides (embeddings, head): FSDP's root group
    root_replicated_params: int = 0  # parameters outside blocks that every tp rank keeps whole (final norm)
    loss_saved_bytes: int = 0  # what the stage's loss layer saves per sequence (log-probabilities), 0 if none
    logits_bytes: int = 0  # per sequence, the output of the layer feeding the loss (the stage's pipeline output)
    loss_kernel: str = "torch"  # the cross-entropy kernel the loss runs as (``stage_views.with_loss_kernel``)
    loss_traffic_saving_bytes: int = 0  # per sequence, the activation traffic a fused loss kernel does not make
    # What CUDA's fused torch.rms_norm saves less than the composite measured, per sequence
    # (``stage_views.with_fused_norms``).
    norm_saving_bytes: int = 0  # in the layers not recomputed
    selective_norm_saving_bytes: int = 0  # in the selective blocks (kept under the attention-core policy only)
    norm_traffic_saving_bytes: int = 0  # in every layer: the activation traffic a fused rms_norm does not make
    # The same for the norms the model declares RMSNorm kernel layers (``LayerStats.declared_norm_saving_bytes``).
    declared_norm_saving_bytes: int = 0
    selective_declared_norm_saving_bytes: int = 0
    declared_norm_traffic_saving_bytes: int = 0
    # What a fused gated-MLP kernel saves less than the composite measured (``stage_views.with_fused_gates``), likewise.
    gate_saving_bytes: int = 0
    selective_gate_saving_bytes: int = 0
    gate_traffic_saving_bytes: int = 0
    largest_block_params: int = 0  # parameters of the stage's largest block (an FSDP unit under ZeRO-3)
    widest_matrix_dim: int = 0  # the widest dimension of the blocks' matrix weights (LayerStats.widest_matrix_dim)
    largest_matrix_params: int = 0  # elements of the blocks' largest matrix weight
    largest_tensor_params: int = 0  # elements of the stage's largest parameter: that matrix, or a root embedding's or head's
    embedding_params: int = 0  # parameters of embedding layers (vocabulary-parallel under tp)
    sp_gathered_bytes: int = 0  # per sequence, inputs of column-parallel linears that sp all-gathers and saves whole
    linears: int = 0  # linears of the blocks' pairs and heads: each costs framework overhead per micro-batch
    linear_input_bytes: int = 0  # per sequence, what the blocks' linears read: what an FP8 recipe casts
    linear_call_input_bytes: int = 0  # the same at every linear call: what a recipe casting per linear casts
    head_forward_flops: float = 0.0  # the head's forward FLOPs per sequence (FP8 recipes keep it in bf16)
    head_backward_flops: float = 0.0  # the head's backward FLOPs per sequence
    # Per-block activation offload and ZeRO-3 resharding (``cost_models.offload``, ``memory``, ``communication``).
    offloaded_bytes: int = 0  # per sequence, what offloaded blocks save: copied to host in forward, back for backward
    offload_buffer_bytes: int = 0  # per sequence, device copies an offloading stage holds at once (two blocks' worth)
    offloaded_blocks: int = 0  # blocks whose saved activations go to host memory
    kept_params: int = 0  # parameters of blocks that keep their gathered weights to their backward (ZeRO-3)
    kept_expert_params: int = 0  # the routed-expert part of kept_params
    kept_blocks: int = 0  # how many blocks keep their gathered weights
    recomputed_block_params: int = 0  # parameters of the blocks recomputed in part or whole (selective, full)
    module_recompute_flops: float = 0.0  # matmul FLOPs of the named pieces recomputed (Strategy.recompute_modules)
    module_recompute_linear_input_bytes: int = 0  # the linears' inputs among what those pieces free
    # Selective blocks measured for an op-level policy, as a framework with one runs them (``profiles.selective_policy``).
    selective_core_flops: float = 0.0  # the part of recompute_flops that is those blocks' attention cores
    op_selective_recompute_flops: float = 0.0  # what op-level selective recomputation re-runs of those blocks
    selective_traffic_bytes: int = 0  # those blocks' activation traffic (their elementwise work re-runs whole)
    selective_saved_bytes: int = 0  # the part of saved_bytes that is those blocks' (attention-core policy)
    op_selective_saved_bytes: int = 0  # what they keep under the op-level policy instead
    op_selective_buffer_bytes: int = 0  # one of them recomputed: what its backward materialises again at once
    op_selective_blocks: int = 0  # how many they are
    op_selective_gathered_bytes: int = 0  # per sequence, their share of sp_gathered_bytes (one input per linear pair)
    # Every selective block as a policy keeping all matmul outputs runs it (``profiles.selective_policy`` ``matmuls``).
    selective_blocks_saved_bytes: int = 0  # what every selective block keeps under the attention-core policy
    matmul_selective_saved_bytes: int = 0  # what they keep under the matmuls policy instead (where measured)
    matmul_selective_buffer_bytes: int = 0  # one of them recomputed: what its backward materialises again at once
    matmul_selective_traffic_bytes: int = 0  # their activation traffic (their elementwise work re-runs whole)
    matmul_selective_core_flops: float = 0.0  # their attention cores' forward FLOPs (part of recompute_flops)
    matmul_selective_pair_bytes: int = 0  # per sequence, one residual-width output per linear pair of those blocks
    matmul_selective_gathered_bytes: int = 0  # the same in the residual stream's dtype (fp32 under autocast)
    # The same stage with every saved-bytes figure as measured under torch.autocast (``memory.autocasts``), or None
    # where capture did not measure it: the memory model reads its activations on the paths that autocast.
    autocast: StageTotals | None = None

    def amended(self, **changes: object) -> StageTotals:
        """``dataclasses.replace`` for the memory model's hot path (it amends stages ~10^5 times a search): a copy
        with ``changes`` set, without re-running the generated ~70-argument ``__init__``, which validates nothing."""
        unknown = changes.keys() - self.__dict__.keys()
        if unknown:
            raise TypeError(f"StageTotals has no field {', '.join(sorted(unknown))}")
        copy = object.__new__(StageTotals)
        copy.__dict__.update(self.__dict__, **changes)
        return copy


def split_blocks(layers: Sequence[LayerStats], strategy: Strategy) -> list[list[LayerStats]]:
    """The layers each pipeline stage runs, in model order (a stage's chunks concatenated)."""
    stages: list[list[LayerStats]] = [[] for _ in range(strategy.pp)]
    for chunk, chunk_layers in enumerate(split_chunks(layers, strategy)):
        stages[chunk % strategy.pp].extend(chunk_layers)
    return stages


def split_chunks(layers: Sequence[LayerStats], strategy: Strategy) -> list[list[LayerStats]]:
    """The layers of each of the ``pp * V`` pipeline chunks, in model order."""
    block_ids = [i for i, layer in enumerate(layers) if layer.kind == "block"]
    chunks = strategy.pp * strategy.virtual_stages
    if not block_ids and chunks == 1:  # no repeated blocks (a small CNN): one stage runs every layer
        return [list(layers)]
    if len(block_ids) < chunks:
        raise ConfigError(
            f"pp={strategy.pp} x virtual_stages={strategy.virtual_stages} needs at least {chunks} blocks; "
            f"the model has {len(block_ids)}: lower pp"
        )
    sizes = strategy.chunk_blocks or tuple(len(block_ids) // chunks + (c < len(block_ids) % chunks) for c in range(chunks))
    if len(sizes) != chunks or sum(sizes) != len(block_ids) or min(sizes) < 1:
        raise ConfigError(
            f"chunk_blocks={'/'.join(map(str, sizes))} must give each of the {chunks} chunks at least one block "
            f"and sum to the model's {len(block_ids)} blocks"
        )
    result: list[list[LayerStats]] = [[] for _ in sizes]
    waiting: list[LayerStats] = []  # layers before a block join its chunk (an encoder-decoder's decoder embeddings)
    blocks = iter([chunk for chunk, size in enumerate(sizes) for _ in range(size)])  # each block's chunk, in order
    for layer in layers:
        waiting.append(layer)
        if layer.kind == "block":
            result[next(blocks)].extend(waiting)
            waiting = []
    result[-1].extend(waiting)  # after the last block: the final norm, the head, the loss
    return result


def block_policies(layers: Sequence[LayerStats], strategy: Strategy) -> dict[str, Recompute]:
    """Recomputation policy of every block, by FQN."""
    blocks = [layer.fqn for layer in layers if layer.kind == "block"]
    if strategy.block_recompute and len(strategy.block_recompute) != len(blocks):
        raise ConfigError(
            f"block_recompute lists {len(strategy.block_recompute)} policies but the model has {len(blocks)} blocks"
        )
    return {fqn: strategy.recompute_of_block(i) for i, fqn in enumerate(blocks)}


def kept_blocks(layers: Sequence[LayerStats], strategy: Strategy) -> frozenset[str]:
    """FQNs of the blocks that keep their gathered weights from forward to backward (ZeRO-3,
    ``Strategy.block_reshard`` False); empty unless some block does."""
    if strategy.zero != 3 or not strategy.block_reshard:
        return frozenset()
    blocks = [layer.fqn for layer in layers if layer.kind == "block"]
    if len(strategy.block_reshard) != len(blocks):
        raise ConfigError(
            f"block_reshard lists {len(strategy.block_reshard)} flags but the model has {len(blocks)} blocks"
        )
    return frozenset(fqn for i, fqn in enumerate(blocks) if not strategy.reshards_block(i))


_TOTALS_CACHE: dict[tuple, tuple[LayerStats, LayerStats, StageTotals]] = {}
_TOTALS_CACHE_LIMIT = 65536


def cached_stage_totals(
    stage: Sequence[LayerStats], index: int, policies: Mapping[str, Recompute], *, kept: frozenset[str] = frozenset()
) -> StageTotals:
    """``stage_totals`` memoised: the search estimates thousands of strategies over the same stages.

    Keyed by the identity of the stage's first and last layer objects (a stage is a contiguous slice of one
    layer list), its length, index, block policies, kept blocks and the blocks' named pieces recomputed
    (``cost_models.module_recompute``: the same ends frame them); a hit is trusted only if those objects are the same.
    """
    if not stage:
        return stage_totals(stage, index, policies, kept=kept)
    key = (id(stage[0]), id(stage[-1]), len(stage), index,
           tuple((policies.get(layer.fqn, "none"), layer.fqn in kept, layer.module_recompute_saving_bytes,
                  layer.module_recompute_linear_input_bytes, layer.module_recompute_flops,
                  layer.module_recompute_exchanges) for layer in stage if layer.kind == "block"))
    hit = _TOTALS_CACHE.get(key)
    if hit is not None and hit[0] is stage[0] and hit[1] is stage[-1]:
        return hit[2]
    if len(_TOTALS_CACHE) >= _TOTALS_CACHE_LIMIT:
        _TOTALS_CACHE.clear()
    totals = stage_totals(stage, index, policies, kept=kept)
    _TOTALS_CACHE[key] = (stage[0], stage[-1], totals)
    return totals


def stage_totals(
    stage: Sequence[LayerStats], index: int, policies: Mapping[str, Recompute], *, kept: frozenset[str] = frozenset()
) -> StageTotals:
    """Sum a stage's layers, each block under its activation policy (``policies`` by FQN); ``kept``: the blocks
    that keep their gathered weights to their backward (ZeRO-3)."""
    view = [under_autocast(layer) for layer in stage]
    autocast = None
    if any(seen is not layer for seen, layer in zip(view, stage)):
        autocast = replace(stage_totals(view, index, policies, kept=kept), **_autocast_boundary(stage, view, policies))
    blocks = [layer for layer in stage if layer.kind == "block"]
    policy = {layer.fqn: policies.get(layer.fqn, "none") for layer in stage}
    full = [b for b in blocks if policy[b.fqn] == "full"]
    sharded = sum(layer.param_count for layer in stage if layer.kind in TP_SHARDED_KINDS)
    return StageTotals(
        index=index,
        sharded_params=sharded,
        replicated_params=sum(layer.param_count for layer in stage) - sharded,
        largest_layer_params=max((layer.param_count for layer in stage), default=0),
        forward_flops=sum(layer.forward_flops for layer in stage),
        backward_flops=sum(layer.backward_flops for layer in stage),
        recompute_flops=sum(layer_recomputed_flops(layer, policy[layer.fqn]) for layer in blocks),
        **module_recompute_totals([b for b in blocks if policy[b.fqn] in ("none", "selective")]),
        saved_bytes=sum(layer_saved_bytes(layer, policy[layer.fqn]) for layer in stage),
        activation_traffic_bytes=sum(layer.saved_bytes_no_recompute for layer in stage),
        recompute_buffer_bytes=max((b.saved_bytes_no_recompute for b in full), default=0),
        full_recompute_blocks=len(full),
        tp_allreduce_bytes=sum(layer_tp_allreduce_bytes(layer) for layer in stage),
        tp_allreduce_count=sum(layer_tp_allreduce_count(layer) for layer in stage),
        boundary_bytes=stage[-1].output_bytes if stage else 0,
        blocks=len(blocks),
        hidden_size=max((block_width(b) for b in blocks), default=0),
        **sparse_and_long_totals(stage, policy),
        **root_and_loss_totals(stage),
        **fused_saving_totals(stage, policy),
        sp_gathered_bytes=sum(layer_sp_gathered_bytes(layer, policy[layer.fqn]) for layer in stage),
        linears=sum(layer_linears(layer) for layer in stage),
        linear_input_bytes=round(sum(layer_linear_input_bytes(layer) for layer in stage)),
        linear_call_input_bytes=round(sum(layer_linear_input_bytes(layer, per_call=True) for layer in stage)),
        **offload_and_kept_totals(blocks, policy, kept),
        **selective_totals(blocks, policy),
        autocast=autocast,
    )


_AUTOCAST_FIELDS = {
    "saved_bytes_no_recompute": "autocast_saved_bytes_no_recompute",
    "saved_bytes_full_recompute": "autocast_saved_bytes_full_recompute",
    "saved_bytes_selective": "autocast_saved_bytes_selective",
    "saved_bytes_op_selective": "autocast_saved_bytes_op_selective",
    "saved_bytes_matmul_selective": "autocast_saved_bytes_matmul_selective",
    "fused_norm_saving_bytes": "autocast_fused_norm_saving_bytes",
}
_AUTOCAST_VIEWS: dict[int, tuple[LayerStats, LayerStats]] = {}


def _autocast_boundary(
    stage: Sequence[LayerStats], view: Sequence[LayerStats], policies: Mapping[str, Recompute]
) -> dict:
    """What is in the residual stream's dtype (fp32 under autocast): what a pipeline stage sends on (its last
    block's output) and what sequence parallelism gathers in front of a selective block's linear pairs. Only those:
    the other uses of ``output_bytes`` (tensor-parallel reductions, keys and values) are linear outputs, in the
    compute dtype either way."""
    last = stage[-1]
    residual = {layer.fqn: layer.output_bytes if layer.autocast_output_bytes is None else layer.autocast_output_bytes
                for layer in stage}
    gathered = sum(block_tp_reductions(b) * residual[b.fqn] for b in matmul_selective_blocks(view, policies))
    return {"boundary_bytes": residual[last.fqn], "matmul_selective_gathered_bytes": gathered}


def under_autocast(layer: LayerStats) -> LayerStats:
    """``layer`` with its saved bytes as measured under autocast (their autocast fields cleared; its
    ``autocast_output_bytes`` stays, for :func:`_autocast_boundary`); ``layer`` itself where capture did not
    measure them. Memoised by identity (a search sums the same layers many times)."""
    if layer.autocast_saved_bytes_no_recompute is None:
        return layer
    hit = _AUTOCAST_VIEWS.get(id(layer))
    if hit is not None and hit[0] is layer:
        return hit[1]
    view = layer.model_copy(update={
        **{plain: getattr(layer, measured) for plain, measured in _AUTOCAST_FIELDS.items()},
        **dict.fromkeys(_AUTOCAST_FIELDS.values()),
        "declared_norm_saving_bytes": 0,  # measured without autocast only (LayerStats)
    })
    if len(_AUTOCAST_VIEWS) >= _TOTALS_CACHE_LIMIT:
        _AUTOCAST_VIEWS.clear()
    _AUTOCAST_VIEWS[id(layer)] = (layer, view)
    return view
