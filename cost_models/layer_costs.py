"""What each layer of a strategy costs on its own: the per-layer table of a plan's report.

A layer is costed as a stage of its own, at its pipeline stage's index (its in-flight micro-batches), under its
block's activation policy and resharding: seconds per micro-batch on one device (forward, backward,
recomputation, tensor-parallel, expert and context-parallel communication) and the bytes it holds on one device
when its pipeline stage peaks (its model state and, if the stage peaks in the backward, its saved activations).
What belongs to the stage rather than to one layer is left out: the pipeline's sends, the recomputation and offload
buffers (one or two blocks' worth for the whole stage), the offload copies' unhidden part (they hide behind every
layer's compute) and the stage's other buffers. The numbers are what ``estimate`` sums for the stage, layer by
layer, so a reader can see which layers dominate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from tessera.cost_models.estimate import stage_time
from tessera.cost_models.layer_stats import LayerStats
from tessera.cost_models.memory import memory_marks
from tessera.cost_models.module_recompute import with_recomputed_modules
from tessera.cost_models.partition import StageTotals, block_policies, kept_blocks, split_chunks, stage_totals
from tessera.cost_models.types import Strategy, TrainingConfig
from tessera.topology.cluster import Cluster
from tessera.topology.hardware import LOCAL_CPU

LAYER_MEMORY_CATEGORIES = ("parameters", "gradients", "optimizer", "activations")
"""The memory categories a layer owns (``stage_memory``'s buffers and reserve are the stage's)."""


def layer_costs(
    layers: Sequence[LayerStats], cluster: Cluster, training: TrainingConfig, strategy: Strategy,
) -> dict[str, tuple[int, float]]:
    """Per layer FQN: (bytes on one device when its stage peaks, seconds per micro-batch on one device)."""
    layers = with_recomputed_modules(layers, strategy.recompute_modules)  # as estimate prices the stages
    policies, kept = block_policies(layers, strategy), kept_blocks(layers, strategy)
    micro_batches = strategy.gradient_accumulation(training.global_batch)
    on_cpu = cluster.device.name == LOCAL_CPU
    chunks = split_chunks(layers, strategy)
    ranks = [[layer for chunk, held in enumerate(chunks) if chunk % strategy.pp == rank for layer in held]
             for rank in range(strategy.pp)]
    peaks = [_peak_mark(memory_marks(stage_totals(held, rank, policies, kept=kept), training, strategy,
                                     micro_batches=micro_batches, on_cpu=on_cpu)) for rank, held in enumerate(ranks)]
    costs = {}
    for chunk, chunk_layers in enumerate(chunks):
        for layer in chunk_layers:
            totals = _without_buffers(stage_totals([layer], chunk % strategy.pp, policies, kept=kept))
            t = stage_time(totals, cluster, training, strategy)
            mark = memory_marks(totals, training, strategy, micro_batches=micro_batches, on_cpu=on_cpu)
            held = mark[peaks[chunk % strategy.pp]]  # at the moment its stage peaks
            costs[layer.fqn] = (max(0, int(sum(held.get(c, 0) for c in LAYER_MEMORY_CATEGORIES))),
                                t.total - t.pp_comm)
    return costs


def _peak_mark(marks: tuple[dict[str, float], ...]) -> int:
    return max(range(len(marks)), key=lambda index: sum(marks[index].values()))


def _without_buffers(totals: StageTotals) -> StageTotals:
    """One layer's totals without the stage's one-at-a-time buffers (they are the stage's, not the layer's), its
    autocast figures likewise."""
    autocast = totals.autocast and _without_buffers(totals.autocast)
    return replace(totals, recompute_buffer_bytes=0, op_selective_buffer_bytes=0, matmul_selective_buffer_bytes=0,
                   offload_buffer_bytes=0, offloaded_bytes=0, autocast=autocast)
