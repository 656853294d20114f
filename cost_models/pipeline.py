"""Pipeline schedules: how long a step takes and how many micro-batches each stage keeps in flight.

With ``p`` stages, ``m`` micro-batches per step and ``t`` the slowest stage's time per micro-batch:

- GPipe and 1F1B: ``(m + p - 1) t``; bubble fraction ``(p - 1) / m`` (Narayanan et al. SC'21, Sec. 2.2).
  GPipe keeps all ``m`` micro-batches' activations; 1F1B keeps at most ``p - s`` on stage ``s`` (all ``m`` when
  ``m < p``: PyTorch's 1F1B needs ``m >= p``, so the runtime then runs GPipe).
- Interleaved with ``V`` chunks per rank: ``(m + (p - 1) / V) t``; the first stage keeps
  ``p (1 + (p - 1) / (p V))`` micro-batches' worth (Narayanan et al. SC'21 Sec. 2.2; Korthikanti et al. Sec. 4).
- Zero-bubble (ZB-H1): about a third of 1F1B's bubble at 1F1B's memory (Qi et al., "Zero Bubble
  Pipeline Parallelism", ICLR'24, Sec. 3).
- A step run as ``n`` schedule calls (``Strategy.pipeline_passes``: gradient accumulated over them) has ``n``
  bubbles, each call's in-flight micro-batches at ``m / n``.

Ranks that share CPU cores (``DeviceSpec.solo_speedup`` ``S > 1``, stage times at the all-ranks-busy rate)
do not waste a bubble: while a stage waits, the others get its share of the cores and run up to ``S`` times
faster. The step is then bounded by the work (every rank busy: ``m`` times the mean stage time) and by the
slowest stage's chain at full speed (``(m + bubble) t / S``); the larger bound is the estimate.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from tessera.cost_models.types import Strategy


def bubble_micro_batches(strategy: Strategy) -> float:
    """Idle time per step in units of one micro-batch's time on the slowest stage: each of the step's
    ``pipeline_passes`` fills and drains the pipeline."""
    p = strategy.pp
    if p == 1:
        return 0.0
    return strategy.pipeline_passes * {
        "gpipe": p - 1.0,
        "1f1b": p - 1.0,
        "interleaved": (p - 1.0) / strategy.virtual_stages,
        "zero-bubble": (p - 1.0) / 3,
    }[strategy.schedule]


def micro_batches_per_call(strategy: Strategy, micro_batches: int) -> int:
    """The micro-batches one schedule call runs: a step's ``micro_batches`` over its ``pipeline_passes``."""
    return micro_batches // strategy.pipeline_passes


def in_flight_micro_batches(strategy: Strategy, *, stage: int, micro_batches: int) -> float:
    """Micro-batches whose activations stage ``stage`` holds at its peak (``micro_batches`` a step, run in
    ``pipeline_passes`` schedule calls of their share each)."""
    p = strategy.pp
    if p == 1:
        return 1.0
    micro_batches = micro_batches_per_call(strategy, micro_batches)
    if strategy.schedule == "gpipe" or (strategy.schedule == "1f1b" and micro_batches < p):
        return float(micro_batches)  # 1F1B with m < p runs as GPipe (runtime.pipeline.single_stage_schedule)
    if strategy.schedule == "zero-bubble" and strategy.zero < 3:
        # PyTorch's ZB1P (ScheduleInterleavedZeroBubble) runs rank r's weight-gradient halves r micro-batches
        # late (``_get_1f1b_rank_ops(num_1f1b_microbatches=rank)``) and a micro-batch's saved activations live
        # until its weight half: p - r in flight as in 1F1B plus r awaiting their weight gradients. Under
        # ZeRO-3 the measured peaks are 1F1B's (benchmarks/local_truth.py: its zero-bubble ZeRO-3 rows).
        return float(min(micro_batches, p))
    held = float(min(micro_batches, p - stage))
    if strategy.schedule == "interleaved":
        held *= 1 + (p - 1) / (p * strategy.virtual_stages)
    return held


def pipeline_time_s(
    strategy: Strategy, *, micro_batches: int, stage_times_s: Sequence[float], solo_speedup: float = 1.0
) -> float:
    """Seconds the schedule takes for ``micro_batches`` given each stage's time per micro-batch (module docstring)."""
    slowest = max(stage_times_s)
    chain = (micro_batches + bubble_micro_batches(strategy)) * slowest
    work = micro_batches * statistics.fmean(stage_times_s)
    return max(work, chain / solo_speedup)


def pipeline_slots_lower_bound(strategy: Strategy, *, micro_batches: int, solo_speedup: float = 1.0) -> float:
    """Slots ``k`` with ``pipeline_time_s >= k * mean stage time`` for any stage times (the step's lower bound)."""
    return max(micro_batches, (micro_batches + bubble_micro_batches(strategy)) / solo_speedup)
