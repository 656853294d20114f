"""What each layer of a strategy costs on its own: the per-layer table of a plan's report.

A layer is costed as a stage of its own, at its pipeline stage's index (its in-flight micro-batches), under its
block's activation policy and resharding: seconds per micro-batch on one device (forward, backward,
recomputation, tensor-parallel, expert and context-parallel communication) and the bytes it holds on one device
at its peak (its model state and its saved activations). What belongs to the stage rather than to one layer is
left out: the pipeline's sends, the recomputation and offload buffers (one or two blocks' worth for the whole
stage), the offload copies' unhidden part (they hide behind every layer's compute) and the stage's other buffers. The numbers are what
``estimate`` sums for the stage, layer by layer, so a reader can see which layers dominate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from tessera.cost_models.estimate import stage_time
from tessera.cost_models.layer_stats import LayerStats
from tessera.cost_models.memory import stage_memory
from tessera.cost_models.partition import StageTotals, block_policies, kept_blocks, split_chunks, stage_totals
from tessera.cost_models.types import Strategy, TrainingConfig
from tessera.topology.cluster import Cluster
from tessera.topology.hardware import LOCAL_CPU

LAYER_MEMORY_CATEGORIES = ("parameters", "gradients", "optimizer", "activations")
"""The memory categories a layer owns (``stage_memory``'s buffers and reserve are the stage's)."""


def layer_costs(
    layers: Sequence[LayerStats], cluster: Cluster, training: TrainingConfig, strategy: Strategy,
) -> dict[str, tuple[int, float]]:
    """Per layer FQN: (bytes on one device at its peak, seconds per micro-batch on one device)."""
    policies, kept = block_policies(layers, strategy), kept_blocks(layers, strategy)
    micro_batches = strategy.gradient_accumulation(training.global_batch)
    on_cpu = cluster.device.name == LOCAL_CPU
    costs = {}
    for chunk, chunk_layers in enumerate(split_chunks(layers, strategy)):
        for layer in chunk_layers:
            totals = _without_buffers(stage_totals([layer], chunk % strategy.pp, policies, kept=kept))
            t = stage_time(totals, cluster, training, strategy)
            memory = stage_memory(totals, training, strategy, micro_batches=micro_batches, on_cpu=on_cpu)
            costs[layer.fqn] = (sum(memory.get(c, 0) for c in LAYER_MEMORY_CATEGORIES), t.total - t.pp_comm)
    return costs


def _without_buffers(totals: StageTotals) -> StageTotals:
    """One layer's totals without the stage's one-at-a-time buffers (they are the stage's, not the layer's), its
    autocast figures likewise."""
    autocast = totals.autocast and _without_buffers(totals.autocast)
    return replace(totals, recompute_buffer_bytes=0, offload_buffer_bytes=0, offloaded_bytes=0, autocast=autocast)
