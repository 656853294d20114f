"""How far to trust a predicted step time: the spread of the cost model's error on published runs of the same regime.

``benchmarks/published.py`` evaluates every published run (``benchmarks/reference/``) and writes
``error_bands.json`` beside this module from its held-out rows (the ones no constant was fitted on): per regime,
how many runs and the 10th and 90th percentile of published / predicted step time. A prediction of regime ``R``
then carries the band ``[predicted * low, predicted * high]``: where 80% of the held-out published runs of ``R``
landed against their prediction. Context parallelism is its own regime whatever the precision (its long-sequence
rows are the worst predicted), and so is mixture of experts whatever the precision (its published runs are FP8). A
regime without held-out runs takes the band of all of them, and says so. The published runs are GPU runs; a plan
for this machine's CPU gets no band (its own check is ``benchmarks/local_truth.py``).
"""

from __future__ import annotations

import functools
import json
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tessera.cost_models.types import Strategy
from tessera.cost_models.units import format_seconds_range
from tessera.topology.hardware import LOCAL_CPU

BAND_FILE = Path(__file__).with_name("error_bands.json")
QUANTILES = (0.1, 0.9)
"""The band's edges: the 10th and 90th percentile of published / predicted on the held-out runs."""
ALL_RUNS = "all"
GAPS = "gaps"
"""The band of the published over the predicted ratio of two configurations' step times (:func:`gap_band`)."""
REGIME_NAMES = {"fp8": "FP8", "cp": "context-parallel", "fsdp": "FSDP (ZeRO-3)", "ptd-p": "tensor/pipeline/data-parallel",
                "deepspeed-zero3": "DeepSpeed ZeRO-3", "moe": "mixture-of-experts", ALL_RUNS: "published"}


@dataclass(frozen=True)
class ErrorBand:
    """Where published step times fell against the prediction: ``low`` and ``high`` times the predicted step
    (``QUANTILES``) over ``runs`` held-out runs of ``regime`` (``fallback``: the regime had none, all runs used)."""

    regime: str
    runs: int
    low: float
    high: float
    fallback: bool = False

    def range_s(self, predicted_s: float) -> tuple[float, float]:
        """The likely step time, in seconds, of a prediction of ``predicted_s``."""
        return predicted_s * self.low, predicted_s * self.high

    def describe(self, predicted_s: float) -> str:
        """``12.3 to 14.0 s (80% of 18 held-out FSDP (ZeRO-3) published runs)``."""
        low, high = self.range_s(predicted_s)
        share = round(100 * (QUANTILES[1] - QUANTILES[0]))
        name = REGIME_NAMES.get(self.regime, self.regime)
        if self.fallback:
            return (f"{format_seconds_range(low, high)} ({share}% of all {self.runs} held-out published runs: "
                    f"no held-out {name} run was published)")
        return f"{format_seconds_range(low, high)} ({share}% of {self.runs} held-out {name} published runs)"


def plan_regime(strategy: Strategy, precision: str, *, moe: bool) -> str:
    """The regime a strategy's prediction is judged in, with the same precedence as the published rows' own
    (``benchmarks/published_rows.regime``): context parallelism first, then mixture of experts (its errors, on
    published FP8 runs, are its own, not the dense FP8 rows'), FP8, ZeRO-3."""
    if strategy.cp > 1:
        return "cp"
    if moe:
        return "moe"
    if precision == "fp8":
        return "fp8"
    return "fsdp" if strategy.zero == 3 else "ptd-p"


TRANSFORMER_BLOCKS = frozenset({"attention", "local-attention", "moe", "local-moe"})
"""Block kinds of the models the published runs trained."""


def prediction_band(strategy: Strategy, precision: str, *, device_name: str,
                    block_kinds: Iterable[str]) -> ErrorBand | None:
    """The band of a prediction for ``strategy`` on ``device_name`` of a model with these blocks (a routed-expert
    kind makes it mixture of experts); None on this machine's CPU, which no published run used, and for a model
    without attention blocks (a CNN, a state-space model): every published run trained a transformer."""
    kinds = set(block_kinds)
    if device_name == LOCAL_CPU or not kinds & TRANSFORMER_BLOCKS:
        return None
    moe = strategy.ep > 1 or any(kind.endswith("moe") for kind in kinds)
    return error_band(plan_regime(strategy, precision, moe=moe))


def error_band(regime: str) -> ErrorBand | None:
    """The band of ``regime`` from ``error_bands.json`` (all runs' where it has none); None without the file."""
    bands = _bands()
    if regime in bands:
        return bands[regime]
    everything = bands.get(ALL_RUNS)
    return None if everything is None else ErrorBand(regime, everything.runs, everything.low, everything.high, fallback=True)


@functools.cache
def _bands() -> dict[str, ErrorBand]:
    if not BAND_FILE.is_file():
        return {}
    raw = json.loads(BAND_FILE.read_text())
    return {name: ErrorBand(name, int(b["runs"]), float(b["low"]), float(b["high"])) for name, b in raw["regimes"].items()}


def band_from_ratios(regime: str, ratios: list[float]) -> ErrorBand:
    """The band of published / predicted ``ratios`` (two or more runs)."""
    deciles = statistics.quantiles(ratios, n=10, method="inclusive")
    return ErrorBand(regime, len(ratios), deciles[round(10 * QUANTILES[0]) - 1], deciles[round(10 * QUANTILES[1]) - 1])


def write_bands(ratios_by_regime: dict[str, list[float]], *, source: str, pair_ratios: list[float] = (),
                path: Path = BAND_FILE) -> Path:
    """Write the bands of every regime with two or more runs, and of all runs together, to ``path``; with two or
    more ``pair_ratios``, the gap band too (:func:`gap_band`)."""
    everything = [r for ratios in ratios_by_regime.values() for r in ratios]
    groups = {**{name: r for name, r in ratios_by_regime.items() if len(r) >= 2}, ALL_RUNS: everything}
    regimes = {name: _band_fields(band_from_ratios(name, ratios)) for name, ratios in sorted(groups.items())}
    if len(pair_ratios) >= 2:  # both orders of each pair: the band of a gap is that of its inverse, inverted
        regimes[GAPS] = {**_band_fields(band_from_ratios(GAPS, [q for r in pair_ratios for q in (r, 1 / r)])),
                         "runs": len(pair_ratios)}
    path.write_text(json.dumps({"source": source, "quantiles": list(QUANTILES), "regimes": regimes}, indent=2) + "\n")
    _bands.cache_clear()
    return path


def gap_band() -> ErrorBand | None:
    """Where the published ratio of two configurations' step times fell against the predicted ratio, for pairs of
    published runs of one workload (model, cluster, batch) in two configurations, at least one of each pair held
    out of the calibration; ``runs`` counts the pairs. What separates two candidates is judged by it: their
    predictions share the workload's biases, so the error of their gap is smaller than either's own. None without
    the file or the pairs."""
    return _bands().get(GAPS)


def within_gap_error(plan_s: float, other_s: float, band: ErrorBand) -> bool:
    """Whether a configuration predicted at ``other_s`` may really be as fast as the plan predicted at ``plan_s``:
    the predicted gap is inside ``band`` (a gap band, or else the plan's own band)."""
    return other_s <= plan_s * band.high


def _band_fields(band: ErrorBand) -> dict[str, float]:
    return {"runs": band.runs, "low": round(band.low, 4), "high": round(band.high, 4)}
