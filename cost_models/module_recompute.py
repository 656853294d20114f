"""Recomputing named pieces of a block (``Strategy.recompute_modules``): Megatron-Core's ``--recompute-modules``.

Megatron-Core recomputes pieces of a block by name besides the attention core (``TransformerConfig.recompute_modules``
at core_v0.14; its recipes for DeepSeek-V3 name ``mla_up_proj``, and ``mlp`` for the dense blocks). Capture measures,
per block, what each piece makes of the saved activations and its forward FLOPs (``planner.recompute_regions``:
``LayerStats.mla_up_proj_*``, ``mlp_*``). A strategy naming pieces gives each block not fully recomputed or
offloaded what they free and what they re-run (``LayerStats.module_recompute_*``), which the memory model takes off
the block's saved bytes and the compute model prices as linears re-run with their casts
(``compute.arithmetic_s``, ``compute.stage_compute_s``).

``mlp`` counts in dense blocks only, as Megatron-Core recomputes only its dense MLPs by that name. What it frees is
the MLP's saved bytes less its gated activation's output (``LayerStats.fused_gate_saving_bytes``), which the memory
model takes off already where the framework fuses the activation: a framework that does not keeps that output here,
though the checkpoint would free it too.
"""

from __future__ import annotations

from collections.abc import Sequence

from tessera.cost_models.layer_stats import LayerStats

_VIEWS: dict[tuple[int, tuple[str, ...]], tuple[Sequence[LayerStats], tuple[LayerStats, ...]]] = {}
_VIEWS_LIMIT = 256


def with_recomputed_modules(layers: Sequence[LayerStats], modules: tuple[str, ...]) -> Sequence[LayerStats]:
    """``layers`` with each block's ``module_recompute_*`` set for ``modules`` (``layers`` itself when none).
    Memoised by identity, so the estimate's per-model caches see one list per strategy's modules."""
    if not modules:
        return layers
    key = (id(layers), tuple(sorted(modules)))
    hit = _VIEWS.get(key)
    if hit is not None and hit[0] is layers:
        return hit[1]
    view = tuple(_recomputing(layer, modules) if layer.kind == "block" else layer for layer in layers)
    if len(_VIEWS) >= _VIEWS_LIMIT:
        _VIEWS.clear()
    _VIEWS[key] = (layers, view)
    return view


def _recomputing(block: LayerStats, modules: tuple[str, ...]) -> LayerStats:
    """``block`` with what recomputing ``modules`` frees and re-runs."""
    saving, flops = 0, 0.0
    if "mla_up_proj" in modules:
        saving, flops = saving + block.mla_up_proj_saved_bytes, flops + block.mla_up_proj_flops
    if "mlp" in modules and not block.experts:
        saving += max(0, block.mlp_saved_bytes - block.fused_gate_saving_bytes)
        flops += block.mlp_flops
    return block.model_copy(update={"module_recompute_saving_bytes": saving, "module_recompute_flops": flops})
