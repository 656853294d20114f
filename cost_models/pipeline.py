"""Pipeline schedules: how long a step takes and how many micro-batches each stage keeps in flight.

With ``p`` stages, ``m`` micro-batches per step and ``t`` the slowest stage's time per micro-batch:

- GPipe and 1F1B: ``(m + p - 1) t``; bubble fraction ``(p - 1) / m`` (Narayanan et al. SC'21, Sec. 2.2).
  GPipe keeps all ``m`` micro-batches' activations; 1F1B keeps at most ``p - s`` on stage ``s``.
- Interleaved with ``V`` chunks per rank: ``(m + (p - 1) / V) t``; the first stage keeps
  ``p (1 + (p - 1) / (p V))`` micro-batches' worth (Narayanan et al. SC'21 Sec. 2.2; Korthikanti et al. Sec. 4).
- Zero-bubble (ZB-H1): about a third of 1F1B's bubble at 1F1B's memory (Qi et al., "Zero Bubble
  Pipeline Parallelism", ICLR'24, Sec. 3).
"""

from __future__ import annotations

from tessera.cost_models.types import Strategy


def bubble_micro_batches(strategy: Strategy) -> float:
    """Idle time per step in units of one micro-batch's time on the slowest stage."""
    p = strategy.pp
    if p == 1:
        return 0.0
    return {
        "gpipe": p - 1.0,
        "1f1b": p - 1.0,
        "interleaved": (p - 1.0) / strategy.virtual_stages,
        "zero-bubble": (p - 1.0) / 3,
    }[strategy.schedule]


def in_flight_micro_batches(strategy: Strategy, *, stage: int, micro_batches: int) -> float:
    """Micro-batches whose activations stage ``stage`` holds at its peak."""
    p = strategy.pp
    if p == 1:
        return 1.0
    if strategy.schedule == "gpipe":
        return float(micro_batches)
    held = float(min(micro_batches, p - stage))
    if strategy.schedule == "interleaved":
        held *= 1 + (p - 1) / (p * strategy.virtual_stages)
    return held
