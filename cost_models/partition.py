"""Split a model's layers into pipeline stages and sum what each stage holds.

Blocks are divided as evenly as possible into ``pp * V`` chunks (``V`` virtual stages per rank for the
interleaved schedule); chunk ``c`` runs on stage ``c % pp``. Layers before the first block (embeddings)
join stage 0 and layers after the last block (final norm, head, loss) join stage ``pp - 1``, as
Megatron-LM and torchtitan place them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tessera.cost_models.types import LayerStats, Recompute, Strategy
from tessera.errors import ConfigError

TP_SHARDED_KINDS = ("block", "embedding", "head")
DEFAULT_TP_PAIRS_PER_BLOCK = 2  # attention and MLP, when capture did not report the pairs


@dataclass(frozen=True)
class StageTotals:
    """What one pipeline stage computes and holds for ONE sequence, before tensor-parallel division."""

    index: int
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


_TOTALS_CACHE: dict[tuple, tuple[LayerStats, LayerStats, StageTotals]] = {}
_TOTALS_CACHE_LIMIT = 65536


def cached_stage_totals(stage: Sequence[LayerStats], index: int, policies: Mapping[str, Recompute]) -> StageTotals:
    """``stage_totals`` memoised: the search estimates thousands of strategies over the same stages.

    Keyed by the identity of the stage's first and last layer objects (a stage is a contiguous slice of one
    layer list), its length, index and block policies; a hit is trusted only if those objects are the same.
    """
    if not stage:
        return stage_totals(stage, index, policies)
    key = (id(stage[0]), id(stage[-1]), len(stage), index,
           tuple(policies.get(layer.fqn, "none") for layer in stage if layer.kind == "block"))
    hit = _TOTALS_CACHE.get(key)
    if hit is not None and hit[0] is stage[0] and hit[1] is stage[-1]:
        return hit[2]
    if len(_TOTALS_CACHE) >= _TOTALS_CACHE_LIMIT:
        _TOTALS_CACHE.clear()
    totals = stage_totals(stage, index, policies)
    _TOTALS_CACHE[key] = (stage[0], stage[-1], totals)
    return totals


def stage_totals(stage: Sequence[LayerStats], index: int, policies: Mapping[str, Recompute]) -> StageTotals:
    """Sum a stage's layers, each block under its recomputation policy (``policies`` by FQN)."""
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
    )


def block_width(layer: LayerStats) -> int:
    """Hidden size of a block: measured, or from its parameters (~12 h^2 in a transformer block)."""
    return layer.hidden_size or int(math.sqrt(layer.param_count / 12))


def _recomputed_flops(layer: LayerStats, recompute: Recompute) -> float:
    return {"none": 0.0, "selective": layer.selective_recompute_flops, "full": layer.forward_flops}[recompute]


def _saved_bytes(layer: LayerStats, recompute: Recompute) -> int:
    if layer.kind != "block" or recompute == "none":
        return layer.saved_bytes_no_recompute
    if recompute == "selective":
        return layer.saved_bytes_no_recompute if layer.saved_bytes_selective is None else layer.saved_bytes_selective
    return layer.saved_bytes_full_recompute


def _tp_allreduce_count(layer: LayerStats) -> int:
    if layer.kind == "block":
        return len(layer.tp_pairs) or DEFAULT_TP_PAIRS_PER_BLOCK
    return int(_tp_allreduce_bytes(layer) > 0)


def _tp_allreduce_bytes(layer: LayerStats) -> float:
    """Bytes all-reduced per pass when the layer is tensor-parallel (Megatron: one per linear pair)."""
    if layer.kind == "block":
        return (len(layer.tp_pairs) or DEFAULT_TP_PAIRS_PER_BLOCK) * layer.output_bytes
    if layer.kind == "embedding" and layer.param_count:
        return layer.output_bytes  # vocabulary-parallel embedding: partial lookups are summed
    if layer.kind == "head":
        return layer.saved_bytes_full_recompute  # column-parallel head: input gradient summed in backward
    return 0.0
