"""Recomputing named pieces of a block (``Strategy.recompute_modules``): Megatron-Core's ``--recompute-modules``.

Megatron-Core recomputes pieces of a block by name besides the attention core (``TransformerConfig.recompute_modules``
at core_v0.14; its recipes for DeepSeek-V3 name ``mla_up_proj``, and ``mlp`` for the dense blocks). Capture measures,
per block, what each piece makes of the saved activations, the part of that linears read, and its forward FLOPs
(``planner.recompute_regions``: ``LayerStats.mla_up_proj_*``, ``mlp_*``, ``input_norm_*``, ``mlp_norm_*``,
``shared_experts_*``, ``moe_act_*``). A strategy naming pieces gives each block not fully recomputed or offloaded
what they free and what they re-run (``LayerStats.module_recompute_*``): the memory model takes the bytes off the
block's saved activations (under an FP8 recipe that saves linears' inputs at half their size, only that half of
theirs: ``fp8.saved_input_reduction_bytes``) and the compute model prices the FLOPs as linears re-run with their casts
(``compute.arithmetic_s``, ``compute.stage_compute_s``); a norm's or an activation's re-run is elementwise work, not
priced.

How Megatron-Core lays out a block with Transformer Engine decides what each name frees:

- ``mlp``: a dense block's MLP, as a checkpoint that keeps its output (MoE blocks have ``moe`` instead).
- ``layernorm``: the norms that are modules of their own. Transformer Engine fuses the norm in front of the
  attention into its first linear unless the attention is latent, and the norm in front of the MLP into its first
  linear unless the block is MoE (whose router reads the normed input too): so the input norm in latent-attention
  blocks, the pre-MLP norm in MoE blocks, nothing in a dense Llama block.
- ``moe``: a MoE block's MLP whole, as a checkpoint that keeps its output, its expert all-to-alls run again
  (``sparse.ep_comm_s``: six a micro-batch where four were); its FLOPs are priced at the linears' rate, without the
  narrow experts' slowdown. It holds ``moe_act`` (freed by it already) and ``shared_experts``, whose checkpoint
  inside it runs their forward a third time.
- What ``mlp``, ``shared_experts``, ``moe_act`` and ``moe`` free leaves out their gated activations' outputs, which
  the memory model takes off already where the framework fuses the activation
  (``LayerStats.fused_gate_saving_bytes``): a framework that does not keeps those here, though the checkpoint would
  free them too.

Applied where a strategy is priced (``estimate.stage_split``). The planner's lower bounds and per-block integer
program read the blocks without them (a looser bound, a more cautious memory check): it never chooses them, as
Tessera's runtime does not run them. The bytes are those capture measured in its own dtype, not under autocast: the
frameworks that train by autocast (Tessera's runtime, torchtitan) recompute no named pieces.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

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


class _Piece(NamedTuple):
    saved: int
    linear_inputs: int
    flops: float


def _recomputing(block: LayerStats, modules: tuple[str, ...]) -> LayerStats:
    """``block`` with what recomputing ``modules`` frees and re-runs (see the module docstring)."""
    pieces = [_named_piece(block, name, modules) for name in modules]
    return block.model_copy(update={
        "module_recompute_saving_bytes": sum(p.saved for p in pieces),
        "module_recompute_linear_input_bytes": sum(p.linear_inputs for p in pieces),
        "module_recompute_flops": sum(p.flops for p in pieces),
        "module_recompute_exchanges": "moe" in modules and bool(block.experts)})


def _named_piece(block: LayerStats, name: str, modules: tuple[str, ...]) -> _Piece:
    """What the piece ``name`` is in ``block`` when ``modules`` are recomputed together."""
    moe = bool(block.experts)
    latent = block.mla_up_proj_flops > 0
    if name == "mla_up_proj":
        return _Piece(block.mla_up_proj_saved_bytes, 0, block.mla_up_proj_flops)
    if name == "mlp" and not moe or name == "moe" and moe:
        return _Piece(block.mlp_saved_bytes, block.mlp_linear_input_bytes, block.mlp_flops)
    if name == "layernorm":
        normed = block.input_norm_saved_bytes * latent + block.mlp_norm_saved_bytes * moe
        return _Piece(normed, normed, 0.0)
    if name == "shared_experts" and "moe" in modules and moe:  # nested in moe's checkpoint: its forward once more
        return _Piece(0, 0, block.shared_experts_flops)
    if name == "shared_experts":
        return _Piece(block.shared_experts_saved_bytes, block.shared_experts_linear_input_bytes,
                      block.shared_experts_flops)
    if name == "moe_act" and not ("moe" in modules and moe):
        return _Piece(block.moe_act_saved_bytes, block.moe_act_saved_bytes, 0.0)
    return _Piece(0, 0, 0.0)


def unmeasured_pieces_note(layers: Sequence[LayerStats], modules: tuple[str, ...]) -> tuple[str, ...]:
    """A note naming the pieces of ``modules`` that no block of ``layers`` has as capture measured them (a model
    without latent attention, or whose attention capture saw no fused core; no dense MLP child): priced as nothing."""
    blocks = [layer for layer in layers if layer.kind == "block"]
    missing = [name for name in modules if not any(any(_named_piece(b, name, (name,))) for b in blocks)]
    if not missing:
        return ()
    return (f"recompute_modules {'/'.join(missing)}: capture found no such piece in this model's blocks (latent "
            "attention's up-projections before a fused attention core, a dense block's MLP child, a norm Megatron-Core "
            "keeps apart from a linear, a MoE block's shared experts, packed routed experts' activation, a MoE "
            "block's MLP child), so nothing is freed or re-run for it",)
