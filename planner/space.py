"""The search space: every strategy the model, the cluster and the batch admit.

Axes: ``dp * tp * pp = world`` (cp and ep arrive with the sparse-and-long issue). Tensor parallelism
stays inside the innermost link level (a node) and divides the attention heads; pipeline parallelism
never has more stages than blocks; dp divides the global batch. Per axis choice: ZeRO stage, micro-batch,
recomputation, and for pipelines the schedule. Sequence parallelism is on whenever tp > 1: it moves the
same bytes as plain tensor parallelism and divides activations further. Pinned fields (``--fix``) are
taken as given, even where a default rule (tp inside a node) would forbid them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from tessera.cost_models import Strategy, TrainingConfig
from tessera.cost_models.types import LayerStats
from tessera.errors import ConfigError, NotModelledError
from tessera.topology.cluster import Cluster

MAX_MICRO_BATCH = 16
ZERO_STAGES = (0, 1, 2, 3)
VIRTUAL_STAGES = (2, 3, 4)


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n`` in increasing order."""
    return [d for d in range(1, n + 1) if n % d == 0]


def mesh_shapes(layers: list[LayerStats], cluster: Cluster, training: TrainingConfig, pins: Mapping[str, object]) -> Iterator[tuple[int, int, int]]:
    """(dp, tp, pp) factorisations of the world the model and topology admit."""
    world, blocks = cluster.num_devices, sum(layer.kind == "block" for layer in layers)
    heads = {layer.attention_heads for layer in layers if layer.attention_heads}
    for tp in divisors(world):
        if "tp" in pins:
            if tp != pins["tp"]:
                continue
        elif cluster.devices_per_node % tp or any(h % tp for h in heads):
            continue  # a tensor-parallel group must tile the node (the fast link domain) and split the heads
        for pp in divisors(world // tp):
            dp = world // (tp * pp)
            if pp > max(blocks, 1) or training.global_batch % dp:
                continue
            if pins.get("pp", pp) == pp and pins.get("dp", dp) == dp:
                yield dp, tp, pp


def strategies(layers: list[LayerStats], cluster: Cluster, training: TrainingConfig, pins: Mapping[str, object]) -> Iterator[Strategy]:
    """Every candidate strategy, in a fixed order, honouring ``pins``."""
    measured_selective = any(layer.saved_bytes_selective is not None for layer in layers)
    recomputes = _pinned(pins, "recompute", ["none", "full"] + (["selective"] if measured_selective else []))
    blocks = sum(layer.kind == "block" for layer in layers)
    for dp, tp, pp in mesh_shapes(layers, cluster, training, pins):
        micro_batches = [m for m in divisors(training.global_batch // dp) if m <= MAX_MICRO_BATCH]
        for zero in _pinned(pins, "zero", ZERO_STAGES if dp > 1 else (0,)):
            for micro_batch in _pinned(pins, "micro_batch", micro_batches):
                for recompute in recomputes:
                    for schedule, chunks in _schedules(pp, blocks, pins):
                        yield Strategy(
                            dp=dp, tp=tp, pp=pp, zero=zero, micro_batch=micro_batch, recompute=recompute,
                            sp=pins.get("sp", tp > 1), schedule=schedule, virtual_stages=chunks,
                        )


def _pinned(pins: Mapping[str, object], key: str, options):
    return [pins[key]] if key in pins else list(options)


def _schedules(pp: int, blocks: int, pins: Mapping[str, object]) -> list[tuple[str, int]]:
    if "schedule" in pins and (pins["schedule"] != "interleaved" or "virtual_stages" in pins):
        return [(pins["schedule"], pins.get("virtual_stages", 1))]
    if pp == 1:
        return [("1f1b", 1)]
    interleaved = [("interleaved", v) for v in VIRTUAL_STAGES if blocks % (pp * v) == 0]
    if pins.get("schedule") == "interleaved":  # chunks per rank left to the search
        return interleaved or [("interleaved", 1)]
    return [("1f1b", 1), *interleaved, ("zero-bubble", 1)]  # GPipe: 1F1B's time with more memory; pin to get it


def check_pins(pins: Mapping[str, object], cluster: Cluster) -> None:
    """Raise if the pins ask for what is not modelled or cannot multiply to the world size."""
    if int(pins.get("cp", 1)) > 1 or int(pins.get("ep", 1)) > 1:
        raise NotModelledError("context and expert parallelism are not planned yet (sparse-and-long issue); drop cp/ep")
    product = 1
    for axis in ("dp", "tp", "pp", "cp", "ep"):
        product *= int(pins.get(axis, 1))
    if product > cluster.num_devices or cluster.num_devices % product:
        raise ConfigError(
            f"the pinned axes need {product} ranks, which does not fit the {cluster.num_devices} devices of "
            f"cluster {cluster.name}; make dp*tp*pp*cp*ep divide {cluster.num_devices}"
        )
