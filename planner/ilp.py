"""Integer program: per-block recomputation and pipeline stage sizes for one outer candidate.

For a fixed mesh shape, ZeRO stage, micro-batch and schedule, choose how many blocks each pipeline stage
runs and which of them are recomputed (none / selective / full) so that the slowest stage is as fast as
possible while every stage fits in device memory.

Sets: stages ``s = 0..P-1``; recomputation policies ``r in R``; ``L`` blocks (identical; a model whose
blocks differ is planned here with its heaviest block, which over-approximates time and memory, and also by
``planner.ilp_mixed``, whose program gives every kind of block its own coefficients, chooses contiguous stage
cuts in model order and adds per-block offload and ZeRO-3 resharding; ``planner.refine`` keeps the faster).

The per-stage cost is linear: a block costs ``t[s, r]`` seconds per micro-batch and ``m[s, r]`` bytes on
stage ``s`` under ``r``, and ``T0[s]``, ``M0[s]`` are what the stage costs besides its blocks (embedding,
head, loss, buffers, reserve, one block's recomputation buffer). All of them come from the cost model
itself, by evaluating a stage with one and with two blocks, so the program and ``estimate`` agree; the
search re-checks every solution with ``estimate``.

Because the blocks are identical, the policy mix inside a stage depends only on how many blocks it holds.
So the inner choice is solved exactly per stage and tabulated, for every ``n = 1..L``:

    f[s](n) = min  T0[s] + sum_r t[s, r] x[r]   over  x in Z>=0^R,  sum_r x[r] = n,  M0[s] + sum_r m[s, r] x[r] <= B

(ties: the fewest recomputed blocks, ``c[s](n)``; ``n`` is infeasible when no mix fits). The integer program
over the stage sizes ``n[s]`` is then, with ``T`` the pace:

    minimise    T, then sum_s c[s](n[s])                               (lexicographic: two solves)
    subject to  sum_s n[s] = L                                         (assign)
                n[s] in {n : f[s](n) is defined}         for all s     (memory_s, nonempty_s: the domain)
                f[s](n[s]) <= T                          for all s     (pace_s, an element constraint)

With interleaving (V > 1) chunk sizes stay even and only recomputation is chosen (``n[s]`` fixed to the
stage's share). The program has ``P`` integer variables however deep the model is. Solved with OR-Tools
CP-SAT on integers (time in microseconds); the tabulation enumerates the policy counts with numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from tessera.cost_models.estimate import stage_time
from tessera.cost_models.layer_stats import LayerStats
from tessera.cost_models.memory import stage_memory
from tessera.cost_models.partition import StageTotals, split_blocks, stage_totals
from tessera.cost_models.types import Recompute, Strategy, TrainingConfig
from tessera.topology.cluster import Cluster
from tessera.topology.hardware import LOCAL_CPU

TIME_UNIT_S = 1e-6
SOLVER_TIME_LIMIT_S = 2.0
INFEASIBLE = 2**40  # a table entry no pace can reach


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
    on_cpu = cluster.device.name == LOCAL_CPU
    result = []
    for index, stage_layers in enumerate(split_blocks(layers, strategy)):
        others = [layer for layer in stage_layers if layer.kind != "block"]
        time, memory = {}, {}
        for policy in policies:
            costs = []
            for count in (1, 2):
                totals = _stand_in_totals(others, block, count, index, policy)
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


_STAND_IN_TOTALS: dict[tuple, tuple[list[LayerStats], StageTotals]] = {}


def _stand_in_totals(others: list[LayerStats], block: LayerStats, count: int, index: int, policy: Recompute
                     ) -> StageTotals:
    """The totals of stage ``index`` holding ``others`` and ``count`` copies of ``block`` under ``policy``, memoised:
    the outer candidates a search refines share their stages' layers (keyed by identity; a hit is trusted only while
    the same objects are held)."""
    key = (tuple(map(id, others)), id(block), count, index, policy)
    hit = _STAND_IN_TOTALS.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[0], [*others, block])):
        return hit[1]
    if len(_STAND_IN_TOTALS) >= 65536:
        _STAND_IN_TOTALS.clear()
    blocks = [block.model_copy(update={"fqn": f"__block{i}"}) for i in range(count)]
    totals = stage_totals([*others, *blocks], index, {b.fqn: policy for b in blocks})
    _STAND_IN_TOTALS[key] = ([*others, block], totals)
    return totals


def solve(
    stages: Sequence[StageCoefficients], *, blocks: int, budget_bytes: float, fixed_blocks: Sequence[int] | None = None,
    pace_limit_s: float | None = None, tables: Sequence["StageTable"] | None = None,
) -> IlpResult | None:
    """Solve the program; ``fixed_blocks`` pins blocks per stage (interleaving). None when infeasible.

    ``pace_limit_s`` is a cut from outside (the pace a candidate must beat to matter): a program that
    cannot beat it is reported infeasible. ``tables``: :func:`stage_tables` of the same arguments, if at hand.
    """
    tables = tables or stage_tables(stages, blocks=blocks, budget_bytes=budget_bytes)
    if any(not table.feasible for table in tables):
        return None
    model = cp_model.CpModel()
    sizes = add_assignment_constraints(model, tables, blocks=blocks, fixed_blocks=fixed_blocks)
    pace = add_pace_constraints(model, sizes, tables, pace_limit_s=pace_limit_s)
    model.minimize(pace)
    first, status = _run(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    # Second solve: the pace held at its optimum, the fewest recomputed blocks.
    model.add(pace <= first.value(pace)).with_name("pace_optimum")
    model.minimize(sum(_element(model, n, table.recomputed, f"c[{s}]") for s, (n, table) in enumerate(zip(sizes, tables))))
    for var in (pace, *sizes):
        model.add_hint(var, first.value(var))
    second, final = _run(model)
    chosen = [second.value(n) for n in sizes]
    return IlpResult(
        blocks=tuple(table.mixes[n] for table, n in zip(tables, chosen)),
        pace_s=second.value(pace) * TIME_UNIT_S,
        status=second.status_name(final) if status == cp_model.OPTIMAL else first.status_name(status),
        wall_time_s=first.wall_time + second.wall_time,
        gap=_gap(first),
    )


def stage_tables(stages: Sequence[StageCoefficients], *, blocks: int, budget_bytes: float) -> list["StageTable"]:
    """Every stage's table (:func:`stage_table`): compute once, pass to :func:`optimal_pace_s` and :func:`solve`."""
    return [stage_table(st, blocks=blocks, budget_bytes=budget_bytes) for st in stages]


def optimal_pace_s(
    stages: Sequence[StageCoefficients], *, blocks: int, budget_bytes: float, fixed_blocks: Sequence[int] | None = None,
    tables: Sequence["StageTable"] | None = None,
) -> float | None:
    """The program's optimal pace, found without the solver (None when infeasible): a bound to prune with.

    Each table is increasing in ``n`` and feasible on a prefix, so a pace ``T`` is reachable exactly when
    every stage holds at least one block within ``T`` and together they hold ``L``; the optimum is the
    smallest table entry that is reachable (binary search). The solver still makes the final choice.
    ``tables`` are :func:`stage_tables` of the same arguments, when already computed.
    """
    tables = tables or stage_tables(stages, blocks=blocks, budget_bytes=budget_bytes)
    if fixed_blocks is not None:
        paces = [table.time_units[n] for table, n in zip(tables, fixed_blocks)]
        return None if max(paces) >= INFEASIBLE else max(paces) * TIME_UNIT_S
    values = sorted({t for table in tables for t in table.time_units[1:] if t < INFEASIBLE})

    def reachable(pace: int) -> bool:
        held = [sum(1 for t in table.time_units[1:] if t <= pace) for table in tables]
        return min(held) >= 1 and sum(held) >= blocks

    if not values or not reachable(values[-1]):
        return None
    low, high = 0, len(values) - 1
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if reachable(values[middle]) else (middle + 1, high)
    return values[low] * TIME_UNIT_S


@dataclass(frozen=True)
class StageTable:
    """One stage's exact inner optimum for every block count ``n = 0..L`` (index ``n``)."""

    time_units: tuple[int, ...]  # f(n) in TIME_UNIT_S; INFEASIBLE where no mix of n blocks fits
    recomputed: tuple[int, ...]  # blocks recomputed by the chosen mix
    mixes: tuple[dict[str, int], ...]  # policy -> count

    @property
    def feasible(self) -> list[int]:
        """Block counts (>= 1) the stage can hold."""
        return [n for n in range(1, len(self.time_units)) if self.time_units[n] < INFEASIBLE]


def stage_table(st: StageCoefficients, *, blocks: int, budget_bytes: float) -> StageTable:
    """Enumerate the stage's policy mixes for every block count; keep the fastest that fits (then the leanest
    in recomputation). Dominated policies (slower and no leaner than a faster one) are dropped first."""
    order = _undominated(st)
    n = np.arange(blocks + 1)[:, None]  # (L+1, 1) blocks on the stage
    slow = np.arange(blocks + 1)[None, :]  # (1, L+1) blocks under the slowest kept policy (3 policies only)
    fast, mid = order[0], order[1] if len(order) > 1 else None
    last = order[2] if len(order) > 2 else None
    count_last = slow if last else np.zeros_like(slow)
    rest = n - count_last  # blocks for the two fastest policies
    room = budget_bytes - st.base_memory_bytes - (st.memory_per_block_bytes[last] * count_last if last else 0.0)
    if mid is None:
        count_fast = rest.astype(float)
        fits = room >= st.memory_per_block_bytes[fast] * rest
    else:
        spare = room - st.memory_per_block_bytes[mid] * rest  # memory left with every one of them on ``mid``
        fits = spare >= 0
        gain = st.memory_per_block_bytes[fast] - st.memory_per_block_bytes[mid]
        count_fast = np.clip(np.floor(spare / gain), 0, rest)
    fits &= rest >= 0
    time = st.base_time_s + st.time_per_block_s[fast] * count_fast
    if last is not None:
        time = time + st.time_per_block_s[last] * count_last
    if mid is not None:
        time = time + st.time_per_block_s[mid] * (rest - count_fast)
    units = np.where(fits, np.rint(time / TIME_UNIT_S), INFEASIBLE).astype(np.int64)
    recomputed = n - count_fast if fast == "none" else n + 0 * count_fast
    key = units * (blocks + 1) + recomputed.astype(np.int64)  # lexicographic: time, then recomputation
    best = key.argmin(axis=1)
    rows = range(blocks + 1)
    return StageTable(
        time_units=tuple(int(units[i, best[i]]) for i in rows),
        recomputed=tuple(int(recomputed[i, best[i]]) for i in rows),
        mixes=tuple(_mix(st, order, int(count_fast[i, best[i]]), int(count_last[0, best[i]]), i) for i in rows),
    )


def _undominated(st: StageCoefficients) -> list[str]:
    """Policies by time per block, fastest first, keeping only those strictly leaner than every faster one."""
    kept: list[str] = []
    for policy in sorted(st.time_per_block_s, key=lambda p: (st.time_per_block_s[p], st.memory_per_block_bytes[p])):
        if not kept or st.memory_per_block_bytes[policy] < st.memory_per_block_bytes[kept[-1]]:
            kept.append(policy)
    return kept


def _mix(st: StageCoefficients, order: list[str], fast: int, last: int, n: int) -> dict[str, int]:
    mix = dict.fromkeys(st.time_per_block_s, 0)
    mix[order[0]] = fast
    if len(order) > 2:
        mix[order[2]] = last
    if len(order) > 1:
        mix[order[1]] = n - fast - (last if len(order) > 2 else 0)
    return mix


def _element(model: cp_model.CpModel, index, table: Sequence[int], name: str):
    value = model.new_int_var(min(table), max(table), name)
    model.add_element(index, list(table), value).with_name(name)
    return value


def _run(model: cp_model.CpModel) -> tuple[cp_model.CpSolver, int]:
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = SOLVER_TIME_LIMIT_S
    solver.parameters.num_workers = 1  # deterministic: the same plan on every rank and every run
    return solver, solver.solve(model)


def _gap(solver: cp_model.CpSolver) -> float:
    bound, objective = solver.best_objective_bound, solver.objective_value
    return (objective - bound) / objective if objective else 0.0


def add_assignment_constraints(model, tables: Sequence[StageTable], *, blocks: int, fixed_blocks) -> list:
    """Blocks per stage: each stage's domain is the counts that fit its memory (nonempty: at least one);
    every block on exactly one stage, or each stage exactly its pinned share."""
    sizes = []
    for s, table in enumerate(tables):
        domain = cp_model.Domain.from_values(table.feasible)
        sizes.append(model.new_int_var_from_domain(domain, f"n[{s}]"))
        if fixed_blocks is not None:
            model.add(sizes[s] == fixed_blocks[s]).with_name(f"share_{s}")
    model.add(sum(sizes) == blocks).with_name("assign")
    return sizes


def add_pace_constraints(model, sizes: Sequence, tables: Sequence[StageTable], *, pace_limit_s: float | None):
    """The pace is at least every stage's time per micro-batch at its size (and below the outside cut)."""
    ceiling = max(max(t for t in table.time_units if t < INFEASIBLE) for table in tables)
    if pace_limit_s is not None:
        ceiling = min(ceiling, _time(pace_limit_s))
    pace = model.new_int_var(0, max(ceiling, 0), "T")
    for s, (n, table) in enumerate(zip(sizes, tables)):
        model.add(_element(model, n, table.time_units, f"f[{s}]") <= pace).with_name(f"pace_{s}")
    return pace


def binding_constraint(stages: Sequence[StageCoefficients], *, blocks: int, budget_bytes: float) -> str:
    """Which memory constraint makes the program infeasible, and the smallest budget that would fit."""
    cheapest = {s: min(st.memory_per_block_bytes.values()) for s, st in enumerate(stages)}
    # Lower bound with blocks spread to equalise memory: fill the leanest stages first.
    need = max(st.base_memory_bytes + cheapest[s] * max(1, blocks // len(stages)) for s, st in enumerate(stages))
    worst = max(range(len(stages)), key=lambda s: stages[s].base_memory_bytes + cheapest[s])
    return f"memory_{worst} binds: needs at least {need / 2**30:.1f} GiB per device, budget {budget_bytes / 2**30:.1f} GiB"


def _time(seconds: float) -> int:
    return int(round(seconds / TIME_UNIT_S))
