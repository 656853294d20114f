"""Numbers in, seconds and bytes out: compute, memory and communication cost of a strategy."""

from tessera.cost_models.estimate import estimate
from tessera.cost_models.layer_stats import LayerStats
from tessera.cost_models.types import Estimate, Strategy, TrainingConfig

__all__ = ["Estimate", "LayerStats", "Strategy", "TrainingConfig", "estimate"]
