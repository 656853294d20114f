"""What the runtime runs of the experts' own tensor-parallel degree (``Strategy.etp``, Megatron's "MoE parallel
folding", Liu et al. 2025, arXiv:2504.14960), in one place for the search (``planner.space``, which never offers
what it refuses) and the runtime (``runtime.expert_parallel.check_expert_folding``, which raises it).

The runtime folds to ``etp = 1``: the experts of every MoE layer run whole on an ``(expert_dp, expert_ep)`` grid over
each pipeline stage's ``dp x tp`` ranks (``runtime.mesh.expert_grid``). ``cost_models.sparse`` prices any ``etp``.
"""

from __future__ import annotations

from tessera.cost_models.types import Strategy


def folding_refusal(strategy: Strategy) -> str | None:
    """Why the runtime cannot run ``strategy``'s experts on their own tensor-parallel degree, in one line (None when
    it can, or when they use ``tp``): it folds to ``etp = 1`` only (whole experts on the folded grid), with
    ``ep > 1``, without context parallelism, and only where a data-parallel wrapping averages the experts'
    ``expert_dp`` replicas (``dp > 1`` or ZeRO >= 1)."""
    etp, tp = strategy.expert_tp, strategy.tp
    if etp == tp:
        return None
    if etp != 1:
        return (f"etp={etp} between 1 and tp={tp}: the runtime folds experts only to etp=1 (each expert whole on one "
                "rank); plan etp=1 or drop etp")
    if strategy.ep == 1:
        return f"etp=1 below tp={tp} with ep=1: folded experts need ep > 1 (dividing dp*tp); plan ep >= 2 or drop etp"
    if strategy.cp > 1:
        return f"etp=1 below tp={tp} with cp={strategy.cp}: folded experts with context parallelism are not implemented; plan cp=1 or drop etp"
    if strategy.dp == 1 and strategy.zero == 0 and strategy.expert_dp > 1:
        return (f"etp=1 below tp={tp}: the experts' {strategy.expert_dp} replicas (dp*tp/ep) need their gradients "
                "averaged, but dp=1 with ZeRO-0 wraps nothing; plan ep = dp*tp, zero >= 1, or drop etp")
    return None
