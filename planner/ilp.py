"""Integer program: per-block recomputation and pipeline stage sizes for one outer candidate.

For a fixed mesh shape, ZeRO stage, micro-batch and schedule, choose how many blocks each pipeline stage
runs and which of them are recomputed (none / selective / full) so that the slowest stage is as fast as
possible while every stage fits in device memory.

Sets: stages ``s = 0..P-1``; recomputation policies ``r in R``; ``L`` blocks (identical; a model whose
blocks differ is planned with its heaviest block, which over-approximates time and memory).

Variables: ``x[s, r] in Z>=0`` = blocks on stage ``s`` under policy ``r``; ``T >= 0`` the pace.

    minimise    T  (then, among equal T, the number of recomputed blocks)
    subject to  sum_{s,r} x[s, r] = L                                   (assign)
                sum_r x[s, r] >= 1                        for all s       (nonempty_s)
                M0[s] + sum_r m[s, r] x[s, r] <= B        for all s       (memory_s)
                T0[s] + sum_r t[s, r] x[s, r] <= T        for all s       (pace_s)

``t[s, r]`` and ``m[s, r]`` are a block's time per micro-batch and memory on stage ``s`` under ``r``, and
``T0[s]``, ``M0[s]`` what the stage costs besides its blocks (embedding, head, loss, buffers, reserve,
one block's recomputation buffer). All of them come from the cost model itself, by evaluating a stage
with one and with two blocks, so the program and ``estimate`` agree; the search re-checks the solution
with ``estimate``. With interleaving (V > 1) chunk sizes stay even and only recomputation is chosen
(``x[s, r]`` summed per stage must equal the stage's fixed share). Repeated blocks are what keep the
program small: ``P * |R|`` integers however deep the model is. Solved with OR-Tools CP-SAT on integers
(time in microseconds, memory in KiB).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ortools.sat.python import cp_model

from tessera.cost_models.estimate import stage_time
from tessera.cost_models.memory import stage_memory
from tessera.cost_models.partition import split_blocks, stage_totals
from tessera.cost_models.types import LayerStats, Recompute, Strategy, TrainingConfig
from tessera.topology.cluster import Cluster

TIME_UNIT_S = 1e-6
MEMORY_UNIT_BYTES = 1024
SOLVER_TIME_LIMIT_S = 2.0


@dataclass(frozen=True)
class StageCoefficients:
    """Linear cost of one stage: ``base + per_block[r] * blocks`` for time and memory."""

    base_time_s: float
    base_memory_bytes: float
    time_per_block_s: dict[str, float]
    memory_per_block_bytes: dict[str, float]


@dataclass(frozen=True)
class IlpResult:
    """The solved program: blocks per stage and policy, the pace, and the solver's statistics."""

    blocks: tuple[dict[str, int], ...]  # per stage: policy -> count
    pace_s: float
    status: str
    wall_time_s: float
    gap: float


def coefficients(
    layers: Sequence[LayerStats], cluster: Cluster, training: TrainingConfig, strategy: Strategy,
    *, policies: Sequence[Recompute],
) -> list[StageCoefficients]:
    """Per-stage linear costs measured with the cost model (one block vs two blocks)."""
    block = max((layer for layer in layers if layer.kind == "block"), key=lambda b: (b.forward_flops, b.param_count))
    micro_batches = strategy.gradient_accumulation(training.global_batch)
    on_cpu = cluster.device.name == "local-cpu"
    result = []
    for index, stage_layers in enumerate(split_blocks(layers, strategy)):
        others = [layer for layer in stage_layers if layer.kind != "block"]
        time, memory = {}, {}
        for policy in policies:
            costs = []
            for count in (1, 2):
                blocks = [block.model_copy(update={"fqn": f"__block{i}"}) for i in range(count)]
                totals = stage_totals([*others, *blocks], index, {b.fqn: policy for b in blocks})
                costs.append((stage_time(totals, cluster, training, strategy).total,
                              sum(stage_memory(totals, training, strategy, micro_batches=micro_batches, on_cpu=on_cpu).values())))
            time[policy] = (costs[1][0] - costs[0][0], costs[0][0] - (costs[1][0] - costs[0][0]))
            memory[policy] = (costs[1][1] - costs[0][1], costs[0][1] - (costs[1][1] - costs[0][1]))
        result.append(StageCoefficients(
            base_time_s=max(base for _, base in time.values()),
            base_memory_bytes=max(base for _, base in memory.values()),
            time_per_block_s={p: slope for p, (slope, _) in time.items()},
            memory_per_block_bytes={p: slope for p, (slope, _) in memory.items()},
        ))
    return result


def solve(
    stages: Sequence[StageCoefficients], *, blocks: int, budget_bytes: float, fixed_blocks: Sequence[int] | None = None
) -> IlpResult | None:
    """Solve the program; ``fixed_blocks`` pins blocks per stage (interleaving). None when infeasible."""
    model = cp_model.CpModel()
    policies = list(stages[0].time_per_block_s)
    x = {(s, p): model.new_int_var(0, blocks, f"x[{s},{p}]") for s in range(len(stages)) for p in policies}
    pace = model.new_int_var(0, _time(sum(st.base_time_s for st in stages) + blocks * max(max(st.time_per_block_s.values()) for st in stages)), "T")
    add_assignment_constraints(model, x, stages=len(stages), policies=policies, blocks=blocks, fixed_blocks=fixed_blocks)
    add_memory_constraints(model, x, stages, policies=policies, budget_bytes=budget_bytes)
    add_pace_constraints(model, x, pace, stages, policies=policies)
    # Lexicographic: the pace first, then as few recomputed blocks as possible (clean plans among ties).
    recomputed = sum(var for (s, p), var in x.items() if p != "none")
    model.minimize(pace * (blocks + 1) + recomputed)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = SOLVER_TIME_LIMIT_S
    solver.parameters.num_workers = 1  # deterministic: the same plan on every rank and every run
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    bound, objective = solver.best_objective_bound, solver.objective_value
    return IlpResult(
        blocks=tuple({p: solver.value(x[s, p]) for p in policies} for s in range(len(stages))),
        pace_s=solver.value(pace) * TIME_UNIT_S,
        status=solver.status_name(status),
        wall_time_s=solver.wall_time,
        gap=(objective - bound) / objective if objective else 0.0,
    )


def add_assignment_constraints(model, x, *, stages: int, policies: list[str], blocks: int, fixed_blocks) -> None:
    """Every block on exactly one stage; every stage non-empty (or exactly its pinned share)."""
    model.add(sum(x.values()) == blocks).with_name("assign")
    for s in range(stages):
        on_stage = sum(x[s, p] for p in policies)
        if fixed_blocks is None:
            model.add(on_stage >= 1).with_name(f"nonempty_{s}")
        else:
            model.add(on_stage == fixed_blocks[s]).with_name(f"share_{s}")


def add_memory_constraints(model, x, stages: Sequence[StageCoefficients], *, policies: list[str], budget_bytes: float) -> None:
    """Each stage's peak memory within the device budget."""
    for s, st in enumerate(stages):
        used = sum(_memory(st.memory_per_block_bytes[p]) * x[s, p] for p in policies)
        model.add(_memory(st.base_memory_bytes) + used <= _memory(budget_bytes, floor=True)).with_name(f"memory_{s}")


def add_pace_constraints(model, x, pace, stages: Sequence[StageCoefficients], *, policies: list[str]) -> None:
    """The pace is at least every stage's time per micro-batch."""
    for s, st in enumerate(stages):
        work = sum(_time(st.time_per_block_s[p]) * x[s, p] for p in policies)
        model.add(_time(st.base_time_s) + work <= pace).with_name(f"pace_{s}")


def binding_constraint(stages: Sequence[StageCoefficients], *, blocks: int, budget_bytes: float) -> str:
    """Which memory constraint makes the program infeasible, and the smallest budget that would fit."""
    cheapest = {s: min(st.memory_per_block_bytes.values()) for s, st in enumerate(stages)}
    # Lower bound with blocks spread to equalise memory: fill the leanest stages first.
    need = max(st.base_memory_bytes + cheapest[s] * max(1, blocks // len(stages)) for s, st in enumerate(stages))
    worst = max(range(len(stages)), key=lambda s: stages[s].base_memory_bytes + cheapest[s])
    return f"memory_{worst} binds: needs at least {need / 2**30:.1f} GiB per device, budget {budget_bytes / 2**30:.1f} GiB"


def _time(seconds: float) -> int:
    return int(round(seconds / TIME_UNIT_S))


def _memory(nbytes: float, *, floor: bool = False) -> int:
    units = nbytes / MEMORY_UNIT_BYTES
    return int(units) if floor else int(-(-units // 1))
