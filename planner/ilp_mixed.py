"""Integer program for blocks that are not alike: per-block options and contiguous stage boundaries.

``planner.ilp`` solves a stack of identical blocks with recomputation only, exactly, by tabulation. This
program is the general case: blocks of several kinds in model order (a kind is one ``LayerStats.signature``:
DeepSeek-V3's dense first layers and its MoE layers, Gemma's local and global attention layers), and per block
an option ``o = (activation policy, reshard)``: the policy none / selective / full recomputation or offload,
and under ZeRO-3 whether the block frees its gathered weights after its forward (``reshard``) or keeps them to
its backward (``keep``: one all-gather fewer per micro-batch, its unsharded weights held).

Sets: stages ``s = 0..P-1``; kinds ``g``; options ``o in O``; blocks ``i = 0..L-1`` in model order, block ``i`` of
kind ``k(i)``; ``K[g](j) = |{i < j : k(i) = g}|``, the kind-``g`` blocks among the first ``j`` (a table).

Coefficients, all from the cost model by evaluating stage ``s`` with one and with two kind-``g`` blocks under
``o`` (as ``planner.ilp.coefficients``): per block ``t[s,g,o]`` seconds per micro-batch on the stage's critical
path, ``m[s,g,o]`` bytes, ``d[s,g,o]`` ZeRO-3 collective seconds per micro-batch and ``c[s,g,o]`` compute seconds
per micro-batch that hides them; ``T0[s]``, ``M0[s]``, ``D0[s]``, ``C0[s]`` the stage without blocks. ``S`` is
the schedule's slots (micro-batches plus bubble, ``planner.refine``), ``m`` the micro-batches per step.

Variables: cuts ``0 = b[0] < b[1] < ... < b[P] = L`` (stage ``s`` runs blocks ``b[s] .. b[s+1]-1``); counts
``x[s,g,o] in Z>=0``; the pace ``T``; the exposed ZeRO-3 traffic ``E >= 0``.

    minimise    S T + E, then sum_{s,g,o != (none, reshard)} x[s,g,o]          (lexicographic: two solves)
    subject to  b[s+1] - b[s] >= 1                                   for all s     (nonempty_s)
                sum_o x[s,g,o] = K[g](b[s+1]) - K[g](b[s])           for all s, g  (kind_s_g; element constraints)
                M0[s] + sum_{g,o} m[s,g,o] x[s,g,o] <= B             for all s     (memory_s)
                T0[s] + sum_{g,o} t[s,g,o] x[s,g,o] <= T             for all s     (pace_s)
                m (D0[s] + sum d x - C0[s] - sum c x) <= E           for all s     (exposed_s; ZeRO-3 only)
                objective <= the incumbent's step                                  (incumbent; when given)

With interleaving (``V > 1``) the cuts are those of the ``P V`` chunks (chunk ``c`` on stage ``c mod P``), each
nonempty, and a stage's count of kind ``g`` sums its chunks' ``K[g](b[c+1]) - K[g](b[c])``. The chunks holding
the embedding (the first) and the head and loss (the last) may hold fewer blocks than the others, as without
interleaving the first and last stages may, so a heavy vocabulary gets its own stage weight. As the schedule's
bubble is priced for chunks of even time, chunk sizes ``n[c] = b[c+1] - b[c]`` stay near even: ``n[c] <=
ceil(L / (P V)) + 1`` (``chunk_c``), a stage's other chunks within one block of each other (``even_c_d``), and the
first and last chunk no larger than their stage's others (``edge_c_d``). Which blocks of a kind inside a stage take which option does not change any cost (they are alike), so
the solution lists them in a fixed order. Time is in integer microseconds, memory in MiB rounded against the
plan (coefficients up, the budget down). Solved with CP-SAT; the search re-checks every solution with
``estimate``, which also charges what the linear model leaves out (one block's recomputation buffer, overlap
tails).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ortools.sat.python import cp_model

from tessera.cost_models.communication import dp_comm_s, sharded_comm_slowdown
from tessera.cost_models.estimate import stage_time
from tessera.cost_models.layer_stats import LayerStats
from tessera.cost_models.memory import stage_memory
from tessera.cost_models.partition import split_blocks, stage_totals
from tessera.cost_models.types import Strategy, TrainingConfig
from tessera.planner.ilp import TIME_UNIT_S, _gap, _run
from tessera.topology.cluster import Cluster
from tessera.topology.hardware import LOCAL_CPU

MEMORY_UNIT_BYTES = 2**20
DEFAULT_OPTION = "none"
KEEP = "+keep"
"""Suffix of an option whose block keeps its gathered weights to its backward (``none+keep``)."""


@dataclass(frozen=True)
class KindCoefficients:
    """One stage's linear costs: ``base + per_block[g][o] * count`` for time, memory, ZeRO-3 traffic and compute."""

    base_time_s: float
    base_memory_bytes: float
    base_comm_s: float
    base_compute_s: float
    time_s: tuple[dict[str, float], ...]  # per kind: option -> seconds per block per micro-batch
    memory_bytes: tuple[dict[str, float], ...]  # per kind: option -> bytes per block
    comm_s: tuple[dict[str, float], ...]  # per kind: option -> ZeRO-3 collective seconds per micro-batch
    compute_s: tuple[dict[str, float], ...]  # per kind: option -> compute seconds per micro-batch


@dataclass(frozen=True)
class MixedResult:
    """The solved program: each block's option in model order, blocks per stage, the objective, statistics."""

    options: tuple[str, ...]  # per block, model order
    stage_blocks: tuple[int, ...]
    chunk_blocks: tuple[int, ...]  # per pipeline chunk in model order (the stages' when one chunk each)
    step_s: float
    pace_s: float
    status: str
    wall_time_s: float
    gap: float


def option_name(policy: str, *, reshard: bool) -> str:
    """``"full"``, or ``"full+keep"`` for a block that keeps its gathered weights."""
    return policy if reshard else policy + KEEP


def split_option(option: str) -> tuple[str, bool]:
    """``"full+keep"`` -> ``("full", False)``: the activation policy and whether the block reshards."""
    return (option[: -len(KEEP)], False) if option.endswith(KEEP) else (option, True)


def block_kinds(layers: Sequence[LayerStats]) -> tuple[list[int], list[LayerStats]]:
    """Each block's kind (its signature's index, in order of first appearance) and one block of each kind."""
    index: dict[str, int] = {}
    representatives: list[LayerStats] = []
    kinds = []
    for layer in layers:
        if layer.kind != "block":
            continue
        if layer.signature not in index:
            index[layer.signature] = len(representatives)
            representatives.append(layer)
        kinds.append(index[layer.signature])
    return kinds, representatives


def kind_coefficients(
    layers: Sequence[LayerStats], cluster: Cluster, training: TrainingConfig, strategy: Strategy,
    *, options: Sequence[str], measure: StageMeasure | None = None,
) -> list[KindCoefficients]:
    """Per stage, the linear costs of every kind under every option, measured with the cost model on the stage's
    own other layers (embedding, head) with one and with two blocks of the kind."""
    _, representatives = block_kinds(layers)
    measure = measure or StageMeasure(cluster, training, strategy)
    result = []
    for index, stage_layers in enumerate(split_blocks(layers, strategy)):
        others = tuple(layer for layer in stage_layers if layer.kind != "block")
        pairs = [{o: measure.one_and_two(others, index, g, block, o) for o in options}
                 for g, block in enumerate(representatives)]
        # Per measure i (time, memory, traffic, compute): slope two - one; intercept 2 one - two.
        slopes = [tuple({o: two[i] - one[i] for o, (one, two) in kind.items()} for kind in pairs) for i in range(4)]
        intercepts = [[2 * one[i] - two[i] for kind in pairs for one, two in kind.values()] for i in range(4)]
        result.append(KindCoefficients(
            base_time_s=max(intercepts[0]), base_memory_bytes=max(intercepts[1]), base_comm_s=max(intercepts[2]),
            base_compute_s=min(intercepts[3]), time_s=slopes[0], memory_bytes=slopes[1], comm_s=slopes[2],
            compute_s=slopes[3],
        ))
    return result


def pace_lower_bound_s(
    layers: Sequence[LayerStats], strategy: Strategy, *, options: Sequence[str], measure: StageMeasure,
) -> float:
    """The program's pace at least, from times alone (no memory measured): every stage's base and every block
    at its cheapest (any stage, any option), spread perfectly over the stages."""
    kinds, representatives = block_kinds(layers)
    stages = split_blocks(layers, strategy)
    bases, cheapest = [], [float("inf")] * len(representatives)
    for index, stage_layers in enumerate(stages):
        others = tuple(layer for layer in stage_layers if layer.kind != "block")
        base = 0.0
        for g, block in enumerate(representatives):
            for o in options:
                one, two = (measure.time(others, g, block, o, count) for count in (1, 2))
                cheapest[g] = min(cheapest[g], two[0] - one[0])
                base = max(base, 2 * one[0] - two[0])
        bases.append(base)
    return (sum(bases) + sum(cheapest[k] for k in kinds)) / len(stages)


class StageMeasure:
    """The cost model on a stage of given other layers plus copies of one block: stage totals and times are
    computed once per distinct stage (they do not depend on the stage's index), memory per index."""

    def __init__(self, cluster: Cluster, training: TrainingConfig, strategy: Strategy) -> None:
        self.cluster, self.training, self.strategy = cluster, training, strategy
        self.micro_batches = strategy.gradient_accumulation(training.global_batch)
        self.slowdown = sharded_comm_slowdown(cluster.device, strategy)
        self.totals: dict[tuple, object] = {}
        self.times: dict[tuple, tuple[float, float, float]] = {}

    def one_and_two(self, others: tuple, index: int, kind: int, block: LayerStats, option: str) -> tuple:
        """(time, memory, ZeRO-3 traffic per micro-batch, compute) with one and with two copies of ``block``."""
        return tuple(self._costs(others, index, kind, block, option, count) for count in (1, 2))

    def time(self, others: tuple, kind: int, block: LayerStats, option: str, count: int) -> tuple[float, float, float]:
        """(time, ZeRO-3 traffic, compute) per micro-batch of the stage with ``count`` copies of ``block``."""
        key = (tuple(layer.fqn for layer in others), kind, option, count)
        if key not in self.times:
            policy, reshard = split_option(option)
            blocks = [block.model_copy(update={"fqn": f"__block{i}"}) for i in range(count)]
            kept = frozenset() if reshard else frozenset(b.fqn for b in blocks)
            totals = stage_totals([*others, *blocks], 0, {b.fqn: policy for b in blocks}, kept=kept)
            t = stage_time(totals, self.cluster, self.training, self.strategy)
            comm = dp_comm_s(totals, self.cluster, self.training, self.strategy,
                             micro_batches=self.micro_batches, sharded_slowdown=self.slowdown)
            self.totals[key] = totals
            self.times[key] = (t.total, sum(comm.values()) / self.micro_batches, t.forward + t.backward + t.recompute)
        return self.times[key]

    def _costs(self, others, index, kind, block, option, count) -> tuple[float, float, float, float]:
        time_s, comm_s, compute_s = self.time(others, kind, block, option, count)
        totals = replace(self.totals[(tuple(layer.fqn for layer in others), kind, option, count)], index=index)
        memory = sum(stage_memory(totals, self.training, self.strategy, micro_batches=self.micro_batches,
                                  on_cpu=self.cluster.device.name == LOCAL_CPU).values())
        return time_s, memory, comm_s, compute_s


def solve_mixed(
    stages: Sequence[KindCoefficients], *, kinds: Sequence[int], budget_bytes: float, slots: float,
    micro_batches: int, chunk_stages: Sequence[int] | None = None, step_limit_s: float | None = None,
    zero3: bool = False,
) -> MixedResult | None:
    """Solve the program for blocks of kinds ``kinds`` (model order); ``chunk_stages[c]``: the stage of pipeline
    chunk ``c`` in model order (interleaving: ``c % pp``), each chunk's cuts chosen (default: one chunk per stage).
    None when infeasible or when nothing beats ``step_limit_s``."""
    model = cp_model.CpModel()
    chunk_stages = list(range(len(stages))) if chunk_stages is None else list(chunk_stages)
    chunk_counts, cuts = add_stage_kind_constraints(model, kinds, stages=len(chunk_stages))
    if len(chunk_stages) > len(stages):
        add_chunk_balance_constraints(model, cuts, chunk_stages=chunk_stages, blocks=len(kinds))
    counts = [[sum(row[g] for row, st in zip(chunk_counts, chunk_stages) if st == s) for g in range(max(kinds) + 1)]
              for s in range(len(stages))]
    options = [[_undominated(st, g) for g in range(len(st.time_s))] for st in stages]
    x = add_option_counts(model, counts, options, blocks=len(kinds))
    if not add_memory_constraints(model, stages, x, budget_bytes=budget_bytes):
        return None
    pace = add_pace_constraints(model, stages, x, blocks=len(kinds))
    exposed = add_exposed_constraints(model, stages, x, micro_batches=micro_batches, on=zero3, blocks=len(kinds))
    weight = max(1, round(slots * 1000))
    objective = weight * pace + 1000 * exposed
    if step_limit_s is not None:
        model.add(objective <= int(step_limit_s / TIME_UNIT_S * 1000)).with_name("incumbent")
    model.minimize(objective)
    first, status = _run(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    model.add(objective <= int(first.objective_value)).with_name("step_optimum")
    model.minimize(sum(v for row in x for per_kind in row for o, v in per_kind.items() if o != DEFAULT_OPTION))
    for row in x:
        for per_kind in row:
            for v in per_kind.values():
                model.add_hint(v, first.value(v))
    second, final = _run(model)
    solver = second if final in (cp_model.OPTIMAL, cp_model.FEASIBLE) else first
    chunk_blocks = tuple(solver.value(cuts[c + 1]) - solver.value(cuts[c]) for c in range(len(chunk_stages)))
    block_stages = [chunk_stages[c] for c, n in enumerate(chunk_blocks) for _ in range(n)]
    return MixedResult(
        options=_block_options(kinds, block_stages, x, solver),
        stage_blocks=tuple(sum(solver.value(v) for per_kind in row for v in per_kind.values()) for row in x),
        chunk_blocks=chunk_blocks,
        step_s=solver.value(objective) / 1000 * TIME_UNIT_S,
        pace_s=solver.value(pace) * TIME_UNIT_S,
        status=first.status_name(status),
        wall_time_s=first.wall_time + second.wall_time,
        gap=_gap(first),
    )


def add_stage_kind_constraints(model, kinds: Sequence[int], *, stages: int) -> tuple[list[list], list]:
    """Cuts ``b[s]`` (nonempty stages, or chunks, in model order) and each one's count of every kind through the
    prefix tables ``K[g]`` (element constraints); returns the counts and the cuts."""
    blocks, groups = len(kinds), max(kinds) + 1
    cuts = [model.new_constant(0)]
    for s in range(1, stages):
        cuts.append(model.new_int_var(s, blocks - (stages - s), f"b[{s}]"))
    cuts.append(model.new_constant(blocks))
    for s in range(stages):
        model.add(cuts[s + 1] - cuts[s] >= 1).with_name(f"nonempty_{s}")
    prefix = [[0] * (blocks + 1) for _ in range(groups)]
    for j, kind in enumerate(kinds):
        for g in range(groups):
            prefix[g][j + 1] = prefix[g][j] + (kind == g)
    at = [[_element(model, cut, prefix[g], f"K[{g}](b[{s}])") for g in range(groups)] for s, cut in enumerate(cuts)]
    return [[at[s + 1][g] - at[s][g] for g in range(groups)] for s in range(stages)], cuts


def add_chunk_balance_constraints(model, cuts: Sequence, *, chunk_stages: Sequence[int], blocks: int) -> None:
    """Interleaved chunks of even time, as the schedule's bubble is priced (a stage's time over ``V``:
    ``cost_models.pipeline``): no chunk holds more than one block above the even split's largest (``chunk_c``); a
    stage's chunks other than the first and the last of the model differ by at most one block (``even_c_d``); the
    first (embedding) and the last (head, loss) hold at most as many as their stage's others (``edge_c_d``)."""
    sizes = [cuts[c + 1] - cuts[c] for c in range(len(chunk_stages))]
    most = -(-blocks // len(sizes)) + 1
    edges = {0, len(sizes) - 1}
    for c, size in enumerate(sizes):
        model.add(size <= most).with_name(f"chunk_{c}")
        for d in range(c + 1, len(sizes)):
            if chunk_stages[d] != chunk_stages[c] or d in edges:
                continue
            if c in edges:
                model.add(size <= sizes[d]).with_name(f"edge_{c}_{d}")
            else:
                model.add(size - sizes[d] <= 1).with_name(f"even_{c}_{d}")
                model.add(sizes[d] - size <= 1).with_name(f"even_{d}_{c}")
    for c in edges:  # the last chunk's stage-mates come before it
        for d in range(c):
            if chunk_stages[d] == chunk_stages[c] and d not in edges:
                model.add(sizes[c] <= sizes[d]).with_name(f"edge_{c}_{d}")


def add_option_counts(model, counts, options, *, blocks: int) -> list[list[dict]]:
    """``x[s][g][o]``: the kind-``g`` blocks of stage ``s`` under option ``o``, summing to the stage's count."""
    x = []
    for s, (row, stage_options) in enumerate(zip(counts, options)):
        per_stage = []
        for g, (count, kept) in enumerate(zip(row, stage_options)):
            per_kind = {o: model.new_int_var(0, blocks, f"x[{s},{g},{o}]") for o in kept}
            model.add(sum(per_kind.values()) == count).with_name(f"kind_{s}_{g}")
            per_stage.append(per_kind)
        x.append(per_stage)
    return x


def add_memory_constraints(model, stages: Sequence[KindCoefficients], x, *, budget_bytes: float) -> bool:
    """Every stage within the budget (MiB: coefficients rounded up, the budget down); False when a stage's
    base alone overflows it."""
    budget = math.floor(budget_bytes / MEMORY_UNIT_BYTES)
    for s, (st, row) in enumerate(zip(stages, x)):
        base = math.ceil(st.base_memory_bytes / MEMORY_UNIT_BYTES)
        if base > budget:
            return False
        used = sum(_mib(st.memory_bytes[g][o]) * v for g, per_kind in enumerate(row) for o, v in per_kind.items())
        model.add(base + used <= budget).with_name(f"memory_{s}")
    return True


def add_pace_constraints(model, stages: Sequence[KindCoefficients], x, *, blocks: int):
    """The pace ``T`` is at least every stage's time per micro-batch."""
    slowest = max(_units(st.base_time_s) + blocks * max(_units(t) for per in st.time_s for t in per.values())
                  for st in stages)
    pace = model.new_int_var(0, slowest, "T")
    for s, (st, row) in enumerate(zip(stages, x)):
        busy = sum(_units(st.time_s[g][o]) * v for g, per_kind in enumerate(row) for o, v in per_kind.items())
        model.add(_units(st.base_time_s) + busy <= pace).with_name(f"pace_{s}")
    return pace


def add_exposed_constraints(model, stages: Sequence[KindCoefficients], x, *, micro_batches: int, on: bool, blocks: int):
    """``E``: ZeRO-3 collectives beyond the compute that hides them, on the stage where most stays exposed."""
    if not on:
        return model.new_constant(0)
    most = max(_units(st.base_comm_s) + blocks * max(_units(d) for per in st.comm_s for d in per.values())
               for st in stages)
    exposed = model.new_int_var(0, micro_batches * most, "E")
    for s, (st, row) in enumerate(zip(stages, x)):
        net = sum((_units(st.comm_s[g][o]) - _units(st.compute_s[g][o])) * v
                  for g, per_kind in enumerate(row) for o, v in per_kind.items())
        model.add(micro_batches * (_units(st.base_comm_s) - _units(st.base_compute_s) + net) <= exposed).with_name(
            f"exposed_{s}")
    return exposed


def _undominated(st: KindCoefficients, kind: int) -> list[str]:
    """Options of a kind that no other option beats on time, memory and traffic at once (the default kept)."""
    opts = list(st.time_s[kind])

    def costs(o: str) -> tuple[float, float, float]:
        return st.time_s[kind][o], st.memory_bytes[kind][o], st.comm_s[kind][o] - st.compute_s[kind][o]

    def beaten(o: str) -> bool:
        return any(p != o and all(a <= b for a, b in zip(costs(p), costs(o))) and (costs(p) != costs(o) or p < o)
                   for p in opts)

    return [o for o in opts if o == DEFAULT_OPTION or not beaten(o)]


def _block_options(kinds: Sequence[int], block_stages: Sequence[int], x, solver) -> tuple[str, ...]:
    """Each block's option in model order: on each stage, a kind's blocks take its options heaviest first."""
    order = ("full", "selective", "offload", "none")
    queues = [[[o for o, v in sorted(per_kind.items(), key=lambda item: (order.index(split_option(item[0])[0]), item[0]))
                for _ in range(solver.value(v))] for per_kind in row] for row in x]
    return tuple(queues[stage][kind].pop(0) for kind, stage in zip(kinds, block_stages))


def _element(model, index, table: Sequence[int], name: str):
    value = model.new_int_var(min(table), max(table), name)
    model.add_element(index, list(table), value).with_name(name)
    return value


def _units(seconds: float) -> int:
    return int(round(seconds / TIME_UNIT_S))


def _mib(nbytes: float) -> int:
    return math.ceil(nbytes / MEMORY_UNIT_BYTES) if nbytes > 0 else math.floor(nbytes / MEMORY_UNIT_BYTES)
