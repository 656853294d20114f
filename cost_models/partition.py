"""Split a model's layers into pipeline stages and sum what each stage holds.

Blocks are divided as evenly as possible into ``pp * V`` chunks (``V`` virtual stages per rank for the
interleaved schedule); chunk ``c`` runs on stage ``c % pp``. Layers before the first block (embeddings)
join stage 0 and layers after the last block (final norm, head, loss) join stage ``pp - 1``, as
Megatron-LM and torchtitan place them.

Each block has its own activation policy (``Strategy.block_recompute``: recomputation or offload) and, under
ZeRO-3, its own resharding (``Strategy.block_reshard``): a stage's totals sum its blocks under theirs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from tessera.cost_models.layer_stats import LayerStats
from tessera.cost_models.types import Recompute, Strategy
from tessera.errors import ConfigError

TP_SHARDED_KINDS = ("block", "embedding", "head")
DEFAULT_TP_PAIRS_PER_BLOCK = 2  # attention and MLP, when capture did not report the pairs
DEFAULT_LINEARS_PER_BLOCK = 6  # q, k, v, o, up, down, when capture did not report the pairs


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
    dispatch_bytes: float = 0.0  # token activations one dispatch all-to-all carries per sequence (sum over layers)
    recompute_dispatch_bytes: float = 0.0  # the part of dispatch_bytes whose forward is recomputed (full)
    attention_layers: int = 0  # layers with attention: each runs one K/V ring per pass under cp
    kv_bytes: float = 0.0  # keys + values per sequence, summed over attention layers (what the cp ring moves)
    recompute_kv_bytes: float = 0.0  # the part of kv_bytes whose attention core is recomputed (selective or full)
    attention_core_flops: float = 0.0  # forward FLOPs of the attention cores per sequence (hides the ring)
    kv_heads: int = 0  # fewest key/value heads of the stage's attention layers (tp beyond it replicates K/V)
    # What the runtime holds around the loss and outside the blocks (``cost_models.memory``).
    root_sharded_params: int = 0  # parameters outside blocks that tp divides (embeddings, head): FSDP's root group
    root_replicated_params: int = 0  # parameters outside blocks that every tp rank keeps whole (final norm)
    loss_saved_bytes: int = 0  # what the stage's loss layer saves per sequence (log-probabilities), 0 if none
    logits_bytes: int = 0  # per sequence, the output of the layer feeding the loss (the stage's pipeline output)
    loss_kernel: str = "torch"  # the cross-entropy kernel the loss runs as (:func:`with_loss_kernel`)
    loss_traffic_saving_bytes: int = 0  # per sequence, the activation traffic a fused loss kernel does not make
    # What CUDA's fused torch.rms_norm saves less than the composite measured (:func:`with_fused_norms`), per sequence.
    norm_saving_bytes: int = 0  # in the layers not recomputed
    selective_norm_saving_bytes: int = 0  # in the selective blocks (kept under the attention-core policy only)
    largest_block_params: int = 0  # parameters of the stage's largest block (an FSDP unit under ZeRO-3)
    widest_matrix_dim: int = 0  # the widest dimension of the blocks' matrix weights (LayerStats.widest_matrix_dim)
    largest_matrix_params: int = 0  # elements of the blocks' largest matrix weight
    largest_tensor_params: int = 0  # elements of the stage's largest parameter: that matrix, or a root embedding's or head's
    embedding_params: int = 0  # parameters of embedding layers (vocabulary-parallel under tp)
    sp_gathered_bytes: int = 0  # per sequence, inputs of column-parallel linears that sp all-gathers and saves whole
    linears: int = 0  # linears of the blocks' pairs and heads: each costs framework overhead per micro-batch
    head_forward_flops: float = 0.0  # the head's forward FLOPs per sequence (FP8 recipes keep it in bf16)
    head_backward_flops: float = 0.0  # the head's backward FLOPs per sequence
    # Per-block activation offload and ZeRO-3 resharding (``cost_models.offload``, ``memory``, ``communication``).
    offloaded_bytes: int = 0  # per sequence, what offloaded blocks save: copied to host in forward, back for backward
    offload_buffer_bytes: int = 0  # per sequence, device copies an offloading stage holds at once (two blocks' worth)
    kept_params: int = 0  # parameters of blocks that keep their gathered weights to their backward (ZeRO-3)
    kept_expert_params: int = 0  # the routed-expert part of kept_params
    kept_blocks: int = 0  # how many blocks keep their gathered weights
    recomputed_block_params: int = 0  # parameters of the blocks recomputed in part or whole (selective, full)
    # Selective blocks measured for an op-level policy, as a framework with one runs them (``profiles.selective_policy``).
    selective_core_flops: float = 0.0  # the part of recompute_flops that is those blocks' attention cores
    op_selective_recompute_flops: float = 0.0  # what op-level selective recomputation re-runs of those blocks
    selective_traffic_bytes: int = 0  # those blocks' activation traffic (their elementwise work re-runs whole)
    selective_saved_bytes: int = 0  # the part of saved_bytes that is those blocks' (attention-core policy)
    op_selective_saved_bytes: int = 0  # what they keep under the op-level policy instead
    op_selective_buffer_bytes: int = 0  # one of them recomputed: what its backward materialises again at once
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
    first, last = (block_ids[0], block_ids[-1]) if block_ids else (len(layers), len(layers) - 1)
    result: list[list[LayerStats]] = []
    start = first
    for size in sizes:
        result.append(list(layers[start : start + size]))
        start += size
    result[0][:0] = layers[:first]
    result[-1].extend(layers[last + 1 :])
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
    layer list), its length, index, block policies and kept blocks; a hit is trusted only if those objects are
    the same.
    """
    if not stage:
        return stage_totals(stage, index, policies, kept=kept)
    key = (id(stage[0]), id(stage[-1]), len(stage), index,
           tuple((policies.get(layer.fqn, "none"), layer.fqn in kept) for layer in stage if layer.kind == "block"))
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
        recompute_flops=sum(_recomputed_flops(layer, policy[layer.fqn]) for layer in blocks),
        saved_bytes=sum(_saved_bytes(layer, policy[layer.fqn]) for layer in stage),
        activation_traffic_bytes=sum(layer.saved_bytes_no_recompute for layer in stage),
        recompute_buffer_bytes=max((b.saved_bytes_no_recompute for b in full), default=0),
        full_recompute_blocks=len(full),
        tp_allreduce_bytes=sum(_tp_allreduce_bytes(layer) for layer in stage),
        tp_allreduce_count=sum(_tp_allreduce_count(layer) for layer in stage),
        boundary_bytes=stage[-1].output_bytes if stage else 0,
        blocks=len(blocks),
        hidden_size=max((block_width(b) for b in blocks), default=0),
        **_sparse_and_long_totals(stage, policy),
        **_root_and_loss_totals(stage),
        **_norm_savings(stage, policy),
        sp_gathered_bytes=sum(_sp_gathered_bytes(layer, policy[layer.fqn]) for layer in stage),
        linears=sum(_linears(layer) for layer in stage),
        **_offload_and_kept_totals(blocks, policy, kept),
        **_selective_totals(blocks, policy),
        autocast=autocast,
    )


def _norm_savings(stage: Sequence[LayerStats], policy: Mapping[str, Recompute]) -> dict:
    """The StageTotals fields of what CUDA's fused ``rms_norm`` saves less (``LayerStats.fused_norm_saving_bytes``)."""
    def by(kind: str) -> int:  # a graph captured before the figure existed has None under autocast: nothing known
        return sum(layer.fused_norm_saving_bytes or 0 for layer in stage if policy[layer.fqn] == kind)

    return {"norm_saving_bytes": by("none"), "selective_norm_saving_bytes": by("selective")}


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
    gathered = sum(_block_tp_reductions(b) * residual[b.fqn] for b in _matmul_selective(view, policies))
    return {"boundary_bytes": residual[last.fqn], "matmul_selective_gathered_bytes": gathered}


def _matmul_selective(stage: Sequence[LayerStats], policies: Mapping[str, Recompute]) -> list[LayerStats]:
    """The selective blocks measured for the matmuls policy (``LayerStats.saved_bytes_matmul_selective``)."""
    return [layer for layer in stage if layer.kind == "block" and policies.get(layer.fqn) == "selective"
            and layer.saved_bytes_matmul_selective is not None]


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
    })
    if len(_AUTOCAST_VIEWS) >= _TOTALS_CACHE_LIMIT:
        _AUTOCAST_VIEWS.clear()
    _AUTOCAST_VIEWS[id(layer)] = (layer, view)
    return view


def _selective_totals(blocks: Sequence[LayerStats], policy: Mapping[str, Recompute]) -> dict:
    """The StageTotals fields of the selectively recomputed blocks."""
    # Blocks measured for the op-level policy only (a block without the figures keeps the attention-core policy).
    selective = [b for b in blocks if policy[b.fqn] == "selective" and b.op_selective_recompute_flops > 0]
    kept = [_saved_bytes(b, "selective") for b in selective]
    op_kept = [k if b.saved_bytes_op_selective is None else b.saved_bytes_op_selective for b, k in zip(selective, kept)]
    every = [b for b in blocks if policy[b.fqn] == "selective"]
    measured = _matmul_selective(blocks, policy)
    pairs = sum(_block_tp_reductions(b) * b.output_bytes for b in measured)
    attention_kept = [_saved_bytes(b, "selective") for b in every]
    matmul_kept = [k if b.saved_bytes_matmul_selective is None else b.saved_bytes_matmul_selective
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
    }


def op_level_selective(stage: StageTotals, selective_policy: str) -> bool:
    """Whether ``stage``'s selective blocks run as an op-level policy does (``selective_policy`` ``op``,
    ``profiles.ImplementationProfile``); blocks not measured for it (a graph captured before it was, a block whose
    experts were replayed) keep the attention-core policy."""
    return selective_policy == "op" and stage.op_selective_recompute_flops > 0


def as_selective_memory(stage: StageTotals, selective_policy: str, *, tp: int = 1, sp: bool = False) -> StageTotals:
    """``stage`` with its selective blocks keeping what ``selective_policy`` keeps (``profiles.selective_policy``):
    the attention-core policy's figures as summed, the others' swapped in, and one such block recomputed at a time
    on top of them.

    Under tensor and sequence parallelism the ``matmuls`` policy also keeps, per linear pair, the gathered input
    whole (the residual stream's dtype: fp32 under autocast), the row-parallel matmul's partial sum whole and the
    reduce-scattered output (``1/tp``). The ``1/tp`` share of the per-layer figure holds ``1/tp`` of the partial
    sum, and ``memory.sp_gathered_input_bytes`` adds ``1 - 1/tp`` of one residual-width tensor per pair: what is
    left to add per device is one gathered input and one ``1/tp`` output per pair (measured on small-gpt,
    ``benchmarks/memory_truth.py --pins``: ``tp=4`` 11% short and ``dp=2,tp=2`` 4% short without them). Tensor
    parallelism without sequence parallelism keeps the attention-core figure, which is larger (measured 4-13% over
    there), though its recompute time is the matmuls policy's (``compute``: the runtime runs that policy either
    way)."""
    if op_level_selective(stage, selective_policy):
        return as_op_level_memory(stage)
    if selective_policy != "matmuls" or not stage.matmul_selective_traffic_bytes or (tp > 1 and not sp):
        return stage
    saved = stage.saved_bytes - stage.selective_blocks_saved_bytes + stage.matmul_selective_saved_bytes
    if tp > 1:  # saved bytes are divided by tp later: what each device holds whole counts tp times here
        saved += stage.matmul_selective_gathered_bytes * tp + stage.matmul_selective_pair_bytes
    return replace(stage, saved_bytes=saved,
                   recompute_buffer_bytes=max(stage.recompute_buffer_bytes, stage.matmul_selective_buffer_bytes))


CROSS_ENTROPY_KERNELS = ("torch", "flash-attn", "megatron")
"""How a framework computes the loss (``profiles.cross_entropy``): torch's cross-entropy over fp32 log-probabilities
(what capture measures), flash-attn's fused ``xentropy`` kernel, or Megatron's vocabulary-parallel cross-entropy."""


def with_loss_kernel(stage: StageTotals, kernel: str) -> StageTotals:
    """``stage`` with its loss run by ``kernel`` (``CROSS_ENTROPY_KERNELS``; its backward's working tensors:
    ``memory_state.loss_gradient_bytes``). ``flash-attn`` keeps the logits as they come instead of fp32
    log-probabilities (plus one fp32 log-sum-exp per token, left out: 4 bytes beside a vocabulary's worth), and makes
    that much less of the traffic elementwise time is charged by (``loss_traffic_saving_bytes``: the FP8 terms that
    read the activation traffic as the linears' inputs leave it alone). ``megatron`` keeps an fp32 softmax, as large
    as torch's log-probabilities."""
    if kernel == stage.loss_kernel or not stage.loss_saved_bytes or not stage.logits_bytes:
        return stage
    if kernel != "flash-attn":
        return replace(stage, loss_kernel=kernel)
    saving = stage.loss_saved_bytes - stage.logits_bytes
    return replace(stage, saved_bytes=stage.saved_bytes - saving, loss_saved_bytes=stage.logits_bytes,
                   loss_traffic_saving_bytes=saving, loss_kernel=kernel)


def with_fused_norms(stage: StageTotals, selective_policy: str) -> StageTotals:
    """``stage`` with its ``torch.rms_norm`` calls run as CUDA's fused kernel (``profiles.fused_rms_norm``): each keeps
    its input alone, not what the composite measured keeps (up to two fp32 copies of it: ``planner.kernels``), in the
    layers that are not recomputed, in the selective blocks where the attention-core policy keeps their norms (the
    op-level and matmuls policies re-run them). A recomputed block's buffer (``recompute_buffer_bytes``) keeps the
    composite's figure: one block, on the safe side. Memory only: the elementwise time stays priced from the
    composite's activation traffic, the fitted proxy (taking the fused norms off it moved the published rows that run
    them 3-5% too fast: ``benchmarks/published.py``)."""
    kept = stage.norm_saving_bytes + (stage.selective_norm_saving_bytes if selective_policy == "attention" else 0)
    if not kept:
        return stage
    return replace(stage, saved_bytes=stage.saved_bytes - kept, norm_saving_bytes=0, selective_norm_saving_bytes=0)


def as_op_level_memory(stage: StageTotals) -> StageTotals:
    """``stage`` with its selective blocks keeping what the op-level policy keeps, and one of them recomputed at a
    time on top of it."""
    return replace(stage, saved_bytes=stage.saved_bytes - stage.selective_saved_bytes + stage.op_selective_saved_bytes,
                   recompute_buffer_bytes=max(stage.recompute_buffer_bytes, stage.op_selective_buffer_bytes))


def _offload_and_kept_totals(blocks: Sequence[LayerStats], policy: Mapping[str, Recompute], kept: frozenset[str]) -> dict:
    """The StageTotals fields of offloaded blocks and of blocks that keep their gathered weights."""
    offloaded = [b.saved_bytes_no_recompute for b in blocks if policy[b.fqn] == "offload"]
    held = [b for b in blocks if b.fqn in kept]
    return {
        "offloaded_bytes": sum(offloaded),
        # The block whose backward runs and the next one prefetched back from host (copy-in ahead of use).
        "offload_buffer_bytes": 2 * max(offloaded, default=0),
        "kept_params": sum(b.param_count for b in held),
        "kept_expert_params": sum(b.expert_param_count for b in held),
        "kept_blocks": len(held),
        "recomputed_block_params": sum(b.param_count for b in blocks if policy[b.fqn] in ("selective", "full")),
    }


def _sp_gathered_bytes(layer: LayerStats, recompute: Recompute) -> float:
    """Per sequence, what sequence parallelism all-gathers in front of a layer's column-parallel linears and the
    linears save for their weight gradient: one residual-width input per linear pair of a block (unless the
    block is fully recomputed, which saves only its input), and the head's input."""
    if layer.kind == "block" and recompute != "full":
        return _block_tp_reductions(layer) * layer.output_bytes
    if layer.kind == "head":
        return layer.saved_bytes_full_recompute
    return 0.0


def _root_and_loss_totals(stage: Sequence[LayerStats]) -> dict:
    """The StageTotals fields of the layers outside blocks and of the loss (see ``cost_models.memory``)."""
    root = [layer for layer in stage if layer.kind != "block"]
    losses = [i for i, layer in enumerate(stage) if layer.kind == "loss"]
    return {
        "root_sharded_params": sum(layer.param_count for layer in root if layer.kind in TP_SHARDED_KINDS),
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


def _sparse_and_long_totals(stage: Sequence[LayerStats], policy: Mapping[str, Recompute]) -> dict:
    """The StageTotals fields expert and context parallelism cost (see ``cost_models.sparse``)."""
    moe = [layer for layer in stage if layer.experts]
    attention = [layer for layer in stage if layer.attention_heads]
    if not moe and not attention:
        return {}
    largest = max(stage, key=lambda layer: layer.param_count)
    # Dispatch all-to-all payload: each token goes to top_k experts, carrying its hidden activation (the layer's
    # output width and dtype), times the load factor the experts were measured at.
    dispatch = {layer.fqn: layer.top_k * layer.expert_capacity_factor * layer.output_bytes for layer in moe}
    # Keys + values: 2 x kv_heads x head_dim per token, head_dim = hidden / heads (the layer's output width).
    kv = {layer.fqn: 2 * layer.output_bytes * (layer.kv_heads or layer.attention_heads) / layer.attention_heads
          for layer in attention}
    return {
        "expert_params": sum(layer.expert_param_count for layer in moe),
        "largest_layer_expert_params": largest.expert_param_count,
        "moe_layers": len(moe),
        "dispatch_bytes": sum(dispatch.values()),
        "recompute_dispatch_bytes": sum(b for fqn, b in dispatch.items() if policy.get(fqn) == "full"),
        "attention_layers": len(attention),
        "kv_bytes": sum(kv.values()),
        "recompute_kv_bytes": sum(b for fqn, b in kv.items() if policy.get(fqn, "none") in ("selective", "full")),
        "attention_core_flops": sum(layer.selective_recompute_flops for layer in attention),
        "kv_heads": min(layer.kv_heads or layer.attention_heads for layer in attention),
    }


def block_width(layer: LayerStats) -> int:
    """Hidden size of a block: measured, or from its parameters (~12 h^2 in a transformer block)."""
    return layer.hidden_size or int(math.sqrt(layer.param_count / 12))


def _recomputed_flops(layer: LayerStats, recompute: Recompute) -> float:
    return {"none": 0.0, "offload": 0.0, "selective": layer.selective_recompute_flops, "full": layer.forward_flops}[recompute]


def _saved_bytes(layer: LayerStats, recompute: Recompute) -> int:
    """What a layer keeps on the device for its backward (an offloaded block: nothing; its copy-in buffer is
    ``offload_buffer_bytes``)."""
    if layer.kind != "block" or recompute == "none":
        return layer.saved_bytes_no_recompute
    if recompute == "offload":
        return 0
    if recompute == "selective":
        return layer.saved_bytes_no_recompute if layer.saved_bytes_selective is None else layer.saved_bytes_selective
    return layer.saved_bytes_full_recompute


def _tp_allreduce_count(layer: LayerStats) -> int:
    if layer.kind == "block":
        return _block_tp_reductions(layer)
    return int(_tp_allreduce_bytes(layer) > 0)


def _block_tp_reductions(layer: LayerStats) -> int:
    """Activation all-reduces of a tensor-parallel block per pass: one per linear pair, except that the routed
    experts' pairs (one per expert) share one: their partial outputs are combined before the reduction, as
    Megatron-Core's MoE layer does."""
    if not layer.tp_pairs:
        return DEFAULT_TP_PAIRS_PER_BLOCK
    return _pair_counts(layer.tp_pairs)[0]


def _linears(layer: LayerStats) -> int:
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
    if len(_PAIR_COUNTS) >= _TOTALS_CACHE_LIMIT:
        _PAIR_COUNTS.clear()
    _PAIR_COUNTS[id(pairs)] = (pairs, counts)
    return counts


def _tp_allreduce_bytes(layer: LayerStats) -> float:
    """Bytes all-reduced per pass when the layer is tensor-parallel (Megatron: one per linear pair)."""
    if layer.kind == "block":
        return _block_tp_reductions(layer) * layer.output_bytes
    if layer.kind == "embedding" and layer.param_count:
        return layer.output_bytes  # vocabulary-parallel embedding: partial lookups are summed
    if layer.kind == "head":
        return layer.saved_bytes_full_recompute  # column-parallel head: input gradient summed in backward
    return 0.0
