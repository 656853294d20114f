"""``estimate``: one strategy in, predicted step time, throughput and per-device memory out."""

from __future__ import annotations

from collections.abc import Sequence

from tessera.cost_models.communication import data_parallel_comm_s, exposed_comm_s
from tessera.cost_models.compute import microbatch_compute_s, optimizer_step_s
from tessera.cost_models.memory import memory_by_category
from tessera.cost_models.types import Estimate, LayerStats, Strategy, TrainingConfig
from tessera.errors import ConfigError, NotModelledError
from tessera.topology.cluster import Cluster


def estimate(
    layers: Sequence[LayerStats], cluster: Cluster, training: TrainingConfig, strategy: Strategy
) -> Estimate:
    """Predict one optimizer step of ``strategy`` on ``cluster`` for a model described by ``layers``."""
    check_supported(cluster, strategy)
    micro_batches = strategy.gradient_accumulation(training.global_batch)
    forward, backward, recompute = microbatch_compute_s(layers, cluster.device, training, strategy)
    comm = data_parallel_comm_s(layers, cluster, training, strategy)
    blocks = sum(layer.kind == "block" for layer in layers)
    exposed = exposed_comm_s(comm, forward_s=forward, backward_s=backward, micro_batches=micro_batches, blocks=blocks)
    params = sum(layer.param_count for layer in layers)
    optimizer = optimizer_step_s(params / (strategy.dp if strategy.zero == 3 else 1), cluster.device)
    step = micro_batches * (forward + backward + recompute) + exposed + optimizer
    memory = memory_by_category(layers, training, strategy, on_cpu=cluster.device.name == "local-cpu")
    model_flops = sum(layer.forward_flops + layer.backward_flops for layer in layers) * training.global_batch
    return Estimate(
        step_time_s=step,
        compute_time_s=micro_batches * (forward + backward),
        recompute_time_s=micro_batches * recompute,
        optimizer_time_s=optimizer,
        exposed_comm_time_s=exposed,
        comm_time_by_kind_s=comm,
        memory_by_category_bytes=memory,
        peak_memory_bytes=sum(memory.values()),
        memory_budget_bytes=cluster.device.memory_bytes,
        tokens_per_s=training.tokens_per_step / step,
        model_flops_per_step=model_flops,
        mfu=model_flops / (step * cluster.num_devices * cluster.device.peak_flops(training.precision)),
        notes=_notes(strategy),
    )


def check_supported(cluster: Cluster, strategy: Strategy) -> None:
    """Raise unless the strategy uses only what this cost model implements and fits the cluster."""
    missing = [f"{axis}={getattr(strategy, axis)}" for axis in ("tp", "pp", "cp", "ep") if getattr(strategy, axis) > 1]
    if missing or strategy.sp:
        raise NotModelledError(
            f"{', '.join(missing) or 'sp=true'}: tensor/pipeline/context/expert parallelism is not modelled yet "
            "(cost-model issue); plan with data parallelism (dp, zero=0|3) for now"
        )
    if strategy.world_size != cluster.num_devices:
        raise ConfigError(
            f"strategy {strategy.to_string()} uses {strategy.world_size} ranks but cluster {cluster.name} has "
            f"{cluster.num_devices} devices; set dp={cluster.num_devices}"
        )


def _notes(strategy: Strategy) -> tuple[str, ...]:
    notes = ["GPU compute at a constant 46% of peak, fitted to published data-parallel runs"]
    if strategy.zero == 3:
        notes.append("FSDP2: gathers per block before forward and backward; reduce-scatter every micro-batch")
    return tuple(notes)
