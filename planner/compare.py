"""Tessera's plan next to hand-tuned baselines on the same cost model: each baseline's completion (fields it leaves
out filled by the planner), whether it fits or can run at all, and the step-time terms that differ most."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pydantic import BaseModel, ConfigDict

from tessera.cost_models import estimate as estimate_strategy
from tessera.cost_models.layer_stats import LayerStats
from tessera.cost_models.types import Estimate, Strategy, TrainingConfig
from tessera.cost_models.error_bands import gap_band
from tessera.cost_models.profiles import TESSERA, ImplementationProfile
from tessera.errors import ConfigError, TesseraError
from tessera.planner.layer_graph import LayerGraph
from tessera.planner.plan import Plan
from tessera.planner.plan_facts import GiB, gib, step_terms
from tessera.planner.search import fitting_or_leanest, rank_candidates
from tessera.planner.space import check_layer_pins
from tessera.topology.cluster import Cluster

FROZEN = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class TermChange(BaseModel):
    """How one term of the step time differs between a baseline and the plan."""

    model_config = FROZEN

    term: str
    """Step-time term (``compute``, ``bubble``, ``exposed tp_allreduce``...)."""
    plan_s: float
    """Seconds per step the plan spends on it."""
    baseline_s: float
    """Seconds per step the baseline spends on it."""
    delta_s: float
    """``baseline_s - plan_s``: positive where the baseline is slower."""


class BaselineComparison(BaseModel):
    """One hand-tuned configuration evaluated on the plan's cost model, against the plan."""

    model_config = FROZEN

    requested: str
    """The baseline as the user wrote it (fields left out were filled by the planner)."""
    runs_on: str = "tessera"
    """The framework it was priced as running on (``cost_models.profiles``; a baseline read from a framework's
    configuration: that framework)."""
    strategy: Strategy | None = None
    """The complete strategy evaluated; None when the baseline cannot run at all."""
    estimate: Estimate | None = None
    """Its predicted cost; None when it cannot run at all."""
    error: str | None = None
    """Why the baseline cannot run (e.g. dp does not divide the global batch); None when it was evaluated."""
    throughput_ratio: float | None = None
    """Plan tokens/s divided by baseline tokens/s (above 1: the plan is faster)."""
    term_changes: tuple[TermChange, ...] = ()
    """Every step-time term, largest absolute change first."""
    memory_delta_bytes: int = 0
    """Baseline peak memory per device minus the plan's."""
    over_budget_bytes: int = 0
    """How far the baseline's peak exceeds device memory (0 when it fits)."""
    reason: str
    """The difference in one sentence: the term that changed most, memory, and fit."""

    @property
    def fits(self) -> bool:
        """Whether the baseline runs and fits in device memory."""
        return self.estimate is not None and self.estimate.fits


class Comparison(BaseModel):
    """Tessera's plan next to hand-tuned baselines on the same model, cluster and cost model."""

    model_config = FROZEN

    model_name: str
    """Model preset or class."""
    cluster: str
    """Cluster spec."""
    training: TrainingConfig
    """Global batch, sequence length and precision."""
    plan_strategy: Strategy
    """The strategy Tessera chose."""
    plan_estimate: Estimate
    """Its predicted cost."""
    candidates_evaluated: int
    """Strategies the search estimated."""
    search_time_s: float
    """Wall time the search took."""
    baselines: tuple[BaselineComparison, ...]
    """Each baseline, in the order given."""
    likely: str | None = None
    """The plan's likely step time from the held-out published runs of its regime (``Plan.error_band``); None on
    this machine's CPU."""
    likely_high_s: float | None = None
    """The upper end of that range, in seconds."""
    inside_high_s: float | None = None
    """The slowest predicted step time a configuration may have and still really be as fast as the plan: the plan's
    predicted step times the gap band's upper end (``error_bands.gap_band``; the plan's own band without one)."""

    def baselines_inside_band(self) -> list[int]:
        """Baselines (numbered from 1) that fit and may really be as fast as the plan (predicted at most
        ``inside_high_s``): the cost model's error on the gap between two configurations of one workload is as large
        as what separates them from the plan."""
        high = self.inside_high_s if self.inside_high_s is not None else self.likely_high_s  # a record made before
        if high is None:
            return []
        return [i for i, b in enumerate(self.baselines, start=1) if b.estimate is not None and b.estimate.fits
                and b.estimate.step_time_s <= high]


def compare_to_baseline(plan: Estimate, *, requested: str, strategy: Strategy, estimate: Estimate) -> BaselineComparison:
    """How ``estimate`` (a baseline) differs from the plan's estimate, and why."""
    mine, theirs = step_terms(plan), step_terms(estimate)
    changes = sorted(
        (TermChange(term=t, plan_s=mine.get(t, 0.0), baseline_s=theirs.get(t, 0.0), delta_s=theirs.get(t, 0.0) - mine.get(t, 0.0))
         for t in dict.fromkeys([*mine, *theirs])),
        key=lambda change: -abs(change.delta_s),
    )
    ratio = plan.tokens_per_s / estimate.tokens_per_s
    over = max(0, estimate.peak_memory_bytes - estimate.memory_budget_bytes)
    result = BaselineComparison(
        requested=requested, strategy=strategy, estimate=estimate, throughput_ratio=ratio, term_changes=tuple(changes),
        memory_delta_bytes=estimate.peak_memory_bytes - plan.peak_memory_bytes, over_budget_bytes=over, reason="",
    )
    return result.model_copy(update={"reason": _baseline_reason(result, plan)})


def evaluate_baseline(
    graph: LayerGraph, cluster: Cluster, training: TrainingConfig, *, requested: str, pins: Mapping[str, object],
    plan: Estimate, runs_on: ImplementationProfile = TESSERA,
) -> BaselineComparison:
    """Evaluate one baseline as ``tessera.evaluate`` does (fields left out are the planner's best), as the framework
    ``runs_on`` runs it, and compare it.

    When no completion of the baseline fits, its leanest completion is the one compared, so the comparison
    says by how much it misses at best; when the search prunes every completion (model state alone
    overflows the device), that leanest completion is estimated directly.
    """
    note = " (no completion fits: its leanest is shown)"
    try:
        check_layer_pins(pins, list(graph.layers))  # per-block pins that cannot fit the model have no completion
    except ConfigError as exc:
        return baseline_error(requested, str(exc))
    try:
        scored = rank_candidates(graph, cluster, training, pins=pins, profile=runs_on)
        strategy, estimate = fitting_or_leanest(scored)
    except ConfigError:
        try:
            strategy, estimate = leanest_completion(graph.layers, cluster, training, pins, profile=runs_on)
        except TesseraError as exc:
            return baseline_error(requested, str(exc))
    except TesseraError as exc:
        return baseline_error(requested, str(exc))
    result = compare_to_baseline(plan, requested=requested, strategy=strategy, estimate=estimate).model_copy(
        update={"runs_on": runs_on.name})
    return result if estimate.fits else result.model_copy(update={"reason": result.reason + note})


def leanest_completion(
    layers: Sequence[LayerStats], cluster: Cluster, training: TrainingConfig, pins: Mapping[str, object],
    *, profile: ImplementationProfile = TESSERA,
) -> tuple[Strategy, Estimate]:
    """The pinned fields with the leanest choice for every other one (micro-batch 1, full recomputation,
    ZeRO-3 where dp x cp ranks share the weights, sequence parallelism; dp takes the devices left), estimated."""
    fields: dict[str, object] = {"micro_batch": 1, "recompute": "full", **pins}
    inner = 1
    for axis in ("tp", "pp", "cp"):  # ep is part of dp
        inner *= int(fields.get(axis, 1))
    fields.setdefault("dp", max(cluster.num_devices // inner, 1))
    fields.setdefault("zero", 3 if int(fields["dp"]) * int(fields.get("cp", 1)) > 1 else 0)  # over the dp x cp ranks
    fields.setdefault("sp", int(fields.get("tp", 1)) > 1)
    strategy = Strategy.model_validate(fields)
    return strategy, estimate_strategy(list(layers), cluster, training, strategy, profile=profile)


def baseline_error(requested: str, message: str) -> BaselineComparison:
    """A baseline that cannot run at all (no strategy matches it)."""
    return BaselineComparison(requested=requested, error=message, reason=f"cannot run: {message}")


def describe_change(change: TermChange, *, values: bool = True) -> str:
    """``bubble +1.234 s (1.500 s vs 0.266 s)``: one term's change, baseline against plan."""
    sign = "+" if change.delta_s >= 0 else "-"
    text = f"{change.term} {sign}{abs(change.delta_s):.3f} s"
    return text + (f" ({change.baseline_s:.3f} s vs {change.plan_s:.3f} s)" if values else "")


def _baseline_reason(b: BaselineComparison, plan: Estimate) -> str:
    e, ratio = b.estimate, b.throughput_ratio
    then = [describe_change(c, values=False) for c in b.term_changes[1:3] if abs(c.delta_s) >= 0.0005]
    change = describe_change(b.term_changes[0]) + (f", then {', '.join(then)}" if then else "")
    memory = f"memory {gib(e.peak_memory_bytes)} vs {gib(plan.peak_memory_bytes)} GiB per device"
    if b.over_budget_bytes:
        return (f"does not fit: {b.over_budget_bytes / GiB:.2f} GiB over the {e.memory_budget_bytes / GiB:.4g} GiB "
                f"device ({memory}); were it to fit, Tessera's plan would be {ratio:.2f}x its throughput; "
                f"biggest change: {change}")
    speed = (f"Tessera's plan is {ratio:.2f}x the baseline's throughput" if ratio >= 1
             else f"the baseline is {1 / ratio:.2f}x faster")
    return f"{speed}; biggest change: {change}; {memory}; the baseline fits"


def build_comparison(plan: Plan, baselines: Sequence[BaselineComparison]) -> Comparison:
    """The comparison record of ``plan`` against already evaluated ``baselines``."""
    band = plan.error_band()
    gaps = band and (gap_band() or band)
    return Comparison(
        model_name=plan.model_name, cluster=plan.cluster, training=plan.training, plan_strategy=plan.strategy,
        plan_estimate=plan.estimate, candidates_evaluated=plan.candidates_evaluated,
        search_time_s=plan.search_time_s, baselines=tuple(baselines),
        likely=band and band.describe(plan.estimate.step_time_s),
        likely_high_s=band and band.range_s(plan.estimate.step_time_s)[1],
        inside_high_s=gaps and plan.estimate.step_time_s * gaps.high,
    )


def why_it_lost(candidate: Estimate, best: Estimate, verdict: str, *, values: bool = True) -> str:
    """A runner-up's verdict with the step-time term that differs most from the chosen plan: of a slower runner-up,
    the term that grew most (one that shrank is not why it lost)."""
    changes = compare_to_baseline(best, requested="", strategy=Strategy(), estimate=candidate).term_changes
    slower = candidate.step_time_s > best.step_time_s
    change = next((c for c in changes if c.delta_s > 0), changes[0]) if slower else changes[0]
    return f"{verdict}; most: {describe_change(change, values=values)}"
