"""``estimate``: one strategy in, predicted step time, throughput and per-device memory out.

The step is the pipeline's time for all micro-batches on its slowest stage (compute, recomputation,
exposed tensor-parallel and point-to-point communication, plus the schedule's bubble), then the exposed
data-parallel communication and the optimizer update. Memory is checked on every stage; the worst one
is reported.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from tessera.cost_models.communication import dp_comm_s, exposed_dp_comm_s, pp_comm_s, tp_comm_s
from tessera.cost_models.compute import GPU_CALIBRATION, Calibration, device_calibration, optimizer_step_s, stage_compute_s
from tessera.cost_models.memory import local_params, stage_memory
from tessera.cost_models.partition import StageTotals, block_policies, cached_stage_totals, split_blocks
from tessera.cost_models.pipeline import bubble_micro_batches
from tessera.cost_models.types import Estimate, LayerStats, Strategy, TrainingConfig
from tessera.errors import ConfigError, NotModelledError
from tessera.topology.cluster import Cluster


@dataclass(frozen=True)
class StageTime:
    """Seconds one micro-batch spends on one stage, by part."""

    forward: float
    backward: float
    recompute: float
    tp_comm: float
    pp_comm: float

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.recompute + self.tp_comm + self.pp_comm

    def parts(self) -> dict[str, float]:
        """The parts by name (what a pipeline timeline draws)."""
        return {"forward": self.forward, "backward": self.backward, "recompute": self.recompute,
                "tp_comm": self.tp_comm, "pp_comm": self.pp_comm}


def estimate(
    layers: Sequence[LayerStats], cluster: Cluster, training: TrainingConfig, strategy: Strategy,
    *, calibration: Calibration = GPU_CALIBRATION,
) -> Estimate:
    """Predict one optimizer step of ``strategy`` on ``cluster`` for a model described by ``layers``.

    ``calibration`` overrides the fitted compute-efficiency curve (calibration uses it).
    """
    check_supported(layers, cluster, strategy)
    micro_batches = strategy.gradient_accumulation(training.global_batch)
    policies = block_policies(layers, strategy)
    stages = [cached_stage_totals(s, i, policies) for i, s in enumerate(split_blocks(layers, strategy))]
    # Middle stages of a deep pipeline are identical apart from their index: cost each distinct one once.
    distinct = {replace(stage, index=0): None for stage in stages}
    for stage in distinct:
        distinct[stage] = (stage_time(stage, cluster, training, strategy, calibration=calibration),
                           dp_comm_s(stage, cluster, training, strategy, micro_batches=micro_batches,
                                     zero3_slowdown=device_calibration(cluster.device, calibration).zero3_comm_slowdown))
    times = [distinct[replace(stage, index=0)][0] for stage in stages]
    dp = [distinct[replace(stage, index=0)][1] for stage in stages]
    slowest = max(range(len(stages)), key=lambda i: times[i].total)
    bubble = bubble_micro_batches(strategy) * times[slowest].total
    exposed_dp = [
        exposed_dp_comm_s(comm, strategy, forward_s=t.forward, backward_s=t.backward,
                          micro_batches=micro_batches, blocks=stage.blocks)
        for comm, t, stage in zip(dp, times, stages)
    ]
    optimizer = max(optimizer_step_s(_optimizer_params(stage, strategy), cluster.device) for stage in stages)
    step = micro_batches * times[slowest].total + bubble + max(exposed_dp) + optimizer
    memory = [stage_memory(stage, training, strategy, micro_batches=micro_batches,
                           on_cpu=cluster.device.name == "local-cpu") for stage in stages]
    worst = max(range(len(stages)), key=lambda i: sum(memory[i].values()))
    model_flops = sum(layer.forward_flops + layer.backward_flops for layer in layers) * training.global_batch
    hardware_flops = model_flops + sum(stage.recompute_flops for stage in stages) * training.global_batch
    peak_rate = cluster.num_devices * cluster.device.peak_flops(training.precision)
    t = times[slowest]
    return Estimate(
        step_time_s=step,
        compute_time_s=micro_batches * (t.forward + t.backward),
        recompute_time_s=micro_batches * t.recompute,
        optimizer_time_s=optimizer,
        exposed_comm_time_s=micro_batches * (t.tp_comm + t.pp_comm) + max(exposed_dp),
        bubble_time_s=bubble,
        comm_time_by_kind_s=_comm_by_kind(t, dp[slowest], micro_batches),
        memory_by_category_bytes=memory[worst],
        peak_memory_bytes=sum(memory[worst].values()),
        stage_peak_memory_bytes=tuple(sum(m.values()) for m in memory),
        stage_memory_by_category_bytes=tuple(memory),
        stage_time_per_micro_batch_s=tuple(time.parts() for time in times),
        micro_batches=micro_batches,
        memory_budget_bytes=cluster.device.memory_bytes,
        num_devices=cluster.num_devices,
        tokens_per_s=training.tokens_per_step / step,
        model_flops_per_step=model_flops,
        hardware_flops_per_step=hardware_flops,
        mfu=model_flops / (step * peak_rate),
        hfu=hardware_flops / (step * peak_rate),
    )


def stage_time(
    stage: StageTotals, cluster: Cluster, training: TrainingConfig, strategy: Strategy,
    *, calibration: Calibration = GPU_CALIBRATION,
) -> StageTime:
    """Seconds one micro-batch spends on ``stage``."""
    forward, backward, recompute = stage_compute_s(stage, cluster.device, training, strategy, calibration=calibration)
    return StageTime(forward, backward, recompute, tp_comm_s(stage, cluster, training, strategy),
                     pp_comm_s(stage, cluster, strategy))


def check_supported(layers: Sequence[LayerStats], cluster: Cluster, strategy: Strategy) -> None:
    """Raise unless the strategy uses only what this cost model implements and fits the cluster and model."""
    if strategy.cp > 1 or strategy.ep > 1:
        raise NotModelledError(
            f"cp={strategy.cp}, ep={strategy.ep}: context and expert parallelism are not modelled yet "
            "(sparse-and-long issue); use cp=1, ep=1"
        )
    if strategy.world_size != cluster.num_devices:
        raise ConfigError(
            f"strategy {strategy.to_string()} uses {strategy.world_size} ranks but cluster {cluster.name} has "
            f"{cluster.num_devices} devices; make dp*tp*pp*cp*ep = {cluster.num_devices}"
        )
    heads = {layer.attention_heads for layer in layers if layer.attention_heads}
    if any(h % strategy.tp for h in heads):
        raise ConfigError(f"tp={strategy.tp} does not divide the attention heads {sorted(heads)}; pick a divisor")


def _optimizer_params(stage: StageTotals, strategy: Strategy) -> float:
    return local_params(stage, strategy) / (strategy.dp if strategy.zero >= 1 else 1)


def _comm_by_kind(t: StageTime, dp: dict[str, float], micro_batches: int) -> dict[str, float]:
    kinds = {"tp_allreduce": micro_batches * t.tp_comm, "pp_p2p": micro_batches * t.pp_comm, **dp}
    return {kind: seconds for kind, seconds in kinds.items() if seconds > 0}
