"""Communication of the data-parallel axis per step, and how much of it compute hides."""

from __future__ import annotations

from collections.abc import Sequence

from tessera.cost_models.memory import FP32, compute_dtype_bytes
from tessera.cost_models.types import LayerStats, Strategy, TrainingConfig
from tessera.topology.cluster import Cluster
from tessera.topology.collectives import all_gather_time, all_reduce_time, reduce_scatter_time


def data_parallel_comm_s(
    layers: Sequence[LayerStats], cluster: Cluster, training: TrainingConfig, strategy: Strategy
) -> dict[str, float]:
    """Seconds per step of each data-parallel collective kind (before overlap)."""
    if strategy.dp == 1:
        return {}
    params = sum(layer.param_count for layer in layers)
    group = {"group_size": strategy.dp, "stride": strategy.world_size // strategy.dp}
    if strategy.zero == 0:
        # DDP all-reduces fp32 gradients once per step (no_sync on earlier micro-batches).
        return {"dp_allreduce": all_reduce_time(cluster, params * FP32, **group)}
    micro_batches = strategy.gradient_accumulation(training.global_batch)
    gathered = params * compute_dtype_bytes(training)
    # FSDP2 gathers parameters before forward and again before backward (reshard_after_forward=True),
    # and reduce-scatters fp32 gradients after every micro-batch's backward.
    return {
        "fsdp_allgather": 2 * micro_batches * all_gather_time(cluster, gathered, **group),
        "fsdp_reducescatter": micro_batches * reduce_scatter_time(cluster, params * FP32, **group),
    }


def exposed_comm_s(comm: dict[str, float], *, forward_s: float, backward_s: float, micro_batches: int, blocks: int) -> float:
    """Communication left on the critical path after overlap with compute.

    DDP overlaps the gradient all-reduce with the last micro-batch's backward, except the last bucket
    (~1/blocks of it). FSDP prefetches the next block's gather during the current block's compute and
    overlaps reduce-scatter with the next block's backward; the first gather and last reduce-scatter of
    each pass stay exposed (~1/blocks of each).
    """
    blocks = max(blocks, 1)
    if "dp_allreduce" in comm:
        total = comm["dp_allreduce"]
        return max(total - backward_s, total / blocks)
    total = sum(comm.values())
    hidden_by = micro_batches * (forward_s + backward_s)
    return max(total - hidden_by, total / blocks)
