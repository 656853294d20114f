"""Recomputing named pieces of a block (``Strategy.recompute_modules``): Megatron-Core's ``--recompute-modules``.

Megatron-Core recomputes pieces of a block by name besides the attention core (``TransformerConfig.recompute_modules``
at core_v0.14; its recipes for DeepSeek-V3 name ``mla_up_proj``, and ``mlp`` for the dense blocks). Capture measures,
per block, what each piece makes of the saved activations and its forward FLOPs (``planner.recompute_regions``:
``LayerStats.mla_up_proj_*``, ``mlp_*``, ``layernorm_*``, ``shared_experts_*``). A strategy naming pieces gives each
block not fully recomputed or offloaded what they free and what they re-run (``LayerStats.module_recompute_*``),
which the memory model takes off the block's saved bytes and the compute model prices as linears re-run with their
casts (``compute.arithmetic_s``, ``compute.stage_compute_s``); a norm's or an activation's re-run is elementwise
work, not priced.

``mlp`` counts in dense blocks only, as Megatron-Core recomputes only its dense MLPs by that name. What ``mlp`` and
``shared_experts`` free leaves out their gated activation's output, which the memory model takes off already where
the framework fuses the activation (``LayerStats.fused_gate_saving_bytes``): a framework that does not keeps that
output here, though the checkpoint would free it too (``moe_act`` likewise). ``moe`` re-runs a MoE block's MLP child
whole, its expert all-to-alls included (``sparse.ep_comm_s``), as a checkpoint that keeps its output; its FLOPs are
priced at the linears' rate, without the narrow experts' slowdown.

Applied where a strategy is priced (``estimate.stage_split``). The planner's lower bounds and per-block integer
program read the blocks without them (a looser bound, a more cautious memory check): it never chooses them, as
Tessera's runtime does not run them. The bytes are those capture measured in its own dtype, not under autocast: the
frameworks that train by autocast (Tessera's runtime, torchtitan) recompute no named pieces.
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
    """``block`` with what recomputing ``modules`` frees and re-runs: ``mlp`` in dense blocks only, ``moe`` (the MoE
    block's MLP child whole, its token exchange again) in MoE blocks only, where it holds ``shared_experts`` and
    ``moe_act``."""
    whole_moe = "moe" in modules and bool(block.experts)
    pieces = [(block.mla_up_proj_saved_bytes, block.mla_up_proj_flops) if "mla_up_proj" in modules else (0, 0.0),
              (block.mlp_saved_bytes, block.mlp_flops) if "mlp" in modules and not block.experts or whole_moe else (0, 0.0),
              (block.layernorm_saved_bytes, 0.0) if "layernorm" in modules else (0, 0.0)]
    if not whole_moe:
        pieces += [(block.shared_experts_saved_bytes, block.shared_experts_flops) if "shared_experts" in modules else (0, 0.0),
                   (block.moe_act_saved_bytes, 0.0) if "moe_act" in modules else (0, 0.0)]
    return block.model_copy(update={"module_recompute_saving_bytes": sum(saving for saving, _ in pieces),
                                    "module_recompute_flops": sum(flops for _, flops in pieces),
                                    "module_recompute_exchanges": whole_moe})


def unmeasured_pieces_note(layers: Sequence[LayerStats], modules: tuple[str, ...]) -> tuple[str, ...]:
    """A note naming the pieces of ``modules`` that no block of ``layers`` has as capture measured them (a model
    without latent attention, or whose attention capture saw no fused core; no dense MLP child): priced as nothing."""
    blocks = [layer for layer in layers if layer.kind == "block"]
    found = {"mla_up_proj": any(b.mla_up_proj_flops for b in blocks),
             "mlp": any(b.mlp_flops for b in blocks if not b.experts),
             "layernorm": any(b.layernorm_saved_bytes for b in blocks),
             "shared_experts": any(b.shared_experts_flops for b in blocks),
             "moe_act": any(b.moe_act_saved_bytes for b in blocks),
             "moe": any(b.mlp_flops for b in blocks if b.experts)}
    missing = [piece for piece in modules if not found[piece]]
    if not missing:
        return ()
    return (f"recompute_modules {'/'.join(missing)}: capture found no such piece in this model's blocks (latent "
            "attention's up-projections before a fused attention core, a dense block's MLP child, the norms in front "
            "of the attention and the MLP, a MoE block's shared experts, packed routed experts' activation, a MoE "
            "block's MLP child), so "
            "nothing is freed or re-run for it",)
