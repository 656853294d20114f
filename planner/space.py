"""The search space: every strategy the model, the cluster and the batch admit.

Axes: ``dp * tp * pp * cp = world``, and ``ep`` carved out of ``dp`` (``Strategy``'s mesh convention). Tensor
parallelism stays inside the innermost link level (a node) and divides the attention heads; pipeline
parallelism never has more stages than blocks; dp divides the global batch. Per axis choice: ZeRO stage,
micro-batch, recomputation, and for pipelines the schedule. Sequence parallelism is on whenever tp > 1: it
moves the same bytes as plain tensor parallelism and divides activations further.

Expert and context parallelism, pruned so that dense, short-sequence searches keep their size:

- ``ep > 1`` only for a model with routed experts; ``ep`` divides every MoE layer's experts and ``dp``.
- ``cp > 1`` only when a sequence is long (``seq_len >= LONG_CONTEXT_TOKENS``): below that, activations fit
  without it and the K/V ring only adds traffic (Llama 3 pre-trains 8K without CP and uses CP 16 at 128K,
  arXiv:2407.21783 Sec. 3.3.2). ``2 * cp`` divides ``seq_len`` (zig-zag chunks) and every rank keeps at least
  ``MIN_TOKENS_PER_CP_RANK`` tokens, so the ring's steps stay long enough to hide behind attention.

Pinned fields (``--fix``) are taken as given, even where a default rule (tp inside a node, cp only for long
sequences) would forbid them. Per-block pins are applied, never dropped: ``block_recompute`` is every
candidate's recomputation (its uniform ``recompute`` then stays ``none`` unless pinned too), and
``chunk_blocks`` admits only the pipelines of ``pp * virtual_stages == len(chunk_blocks)`` chunks.
``check_layer_pins`` refuses, before any search, per-block pins that do not match the model.

The experts' own tensor-parallel degree (``Strategy.etp``, MoE parallel folding, Liu et al. 2025,
arXiv:2504.14960): Megatron-Core lays the experts' ``etp x ep x edp`` grid over each stage's ``tp x dp`` ranks
(``etp`` divides ``tp``; ``ep`` divides ``dp * tp / etp``). The runtime folds to ``etp = 1`` (``runtime.mesh.
expert_grid``; ``cost_models.folding.folding_refusal`` says what else it needs), so for a model with routed experts and tp > 1 the
space adds folded ``etp = 1`` candidates for the ``ep`` that divide ``dp * tp`` but not ``dp``
(:func:`expert_tp_degrees`; a pinned ``etp=1`` folds every ``ep``); ``cost_models.sparse`` prices them with the rest
and the search keeps the fastest. Dense models get none (no extra
candidates), and a pinned ``etp`` is taken as given, refused in one line when the runtime cannot fold to it.

What the runtime refuses for one model (``LayerGraph.unavailable_axes``, ``planner.capabilities``) is keyed by
feature: an axis (``tp``), ``etp`` (folded experts), ``accumulation`` (more than one micro-batch per step), ``recompute`` (any block
recomputed), ``zero-bubble`` (that pipeline schedule), or a combination joined by ``+`` (``tp+zero``: tensor parallelism with ZeRO >= 1 over more than one
data-parallel rank). No candidate uses every feature of any key (:func:`model_refusal`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping
from types import MappingProxyType

from tessera.cost_models import Strategy, TrainingConfig
from tessera.cost_models.folding import folding_refusal
from tessera.cost_models.layer_stats import LayerStats
from tessera.cost_models.types import RUNTIME_EXCLUSIVE, runtime_conflict, schedule_refusal, strategy_features
from tessera.errors import ConfigError
from tessera.topology.cluster import Cluster

MAX_MICRO_BATCH = 16
LONG_CONTEXT_TOKENS = 16384
MIN_TOKENS_PER_CP_RANK = 2048
ZERO_STAGES = (0, 1, 2, 3)
VIRTUAL_STAGES = (2, 3, 4)


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n`` in increasing order, in O(sqrt n) steps."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def mesh_shapes(
    layers: list[LayerStats], cluster: Cluster, training: TrainingConfig, pins: Mapping[str, object], *,
    unavailable: Mapping[str, str] = MappingProxyType({}), exclusive: tuple[tuple[str, str], ...] = RUNTIME_EXCLUSIVE,
) -> Iterator[tuple[int, int, int, int, int]]:
    """(dp, tp, pp, cp, ep) shapes of the world the model and topology admit (``dp * tp * pp * cp = world``),
    none using an ``unavailable`` axis or a pair of axes the runtime does not combine (``exclusive``)."""
    world, blocks = cluster.num_devices, sum(layer.kind == "block" for layer in layers)
    heads = {h for layer in layers for h in (layer.attention_heads, layer.kv_heads) if h}
    experts = {layer.experts for layer in layers if layer.experts}
    for tp in divisors(world):
        if pins.get("sp") and tp == 1:
            continue  # sequence parallelism splits over the tensor-parallel ranks: a pin of it asks for some
        if "tp" in pins:
            if tp != pins["tp"]:
                continue
        elif cluster.devices_per_node % tp or any(h % tp for h in heads):
            continue  # a tensor-parallel group must tile the node (the fast link domain) and split the heads
        for cp in context_degrees(world // tp, training, pins):
            for pp in divisors(world // (tp * cp)):
                dp = world // (tp * cp * pp)
                if pp > max(blocks, 1) or training.global_batch % dp:
                    continue
                if pins.get("pp", pp) == pp and pins.get("dp", dp) == dp:
                    for ep in expert_degrees(dp * tp if may_fold(tp, cp, experts, pins, unavailable) else dp,
                                             experts, pins):
                        if runtime_applies(dict(tp=tp, pp=pp, cp=cp, ep=ep), unavailable, exclusive):
                            yield dp, tp, pp, cp, ep


def model_features(strategy: Strategy, training: TrainingConfig, *, features: set[str] | None = None) -> set[str]:
    """``strategy_features`` (``features``, where already computed) plus the model-dependent ones
    ``unavailable_axes`` may name (module docstring)."""
    used = set(strategy_features(strategy) if features is None else features)
    if strategy.zero >= 1 and strategy.dp * strategy.cp > 1:
        used.add("zero")
    if training.global_batch // (strategy.dp * strategy.micro_batch) > 1:
        used.add("accumulation")
    if strategy.recompute != "none" or any(policy != "none" for policy in strategy.block_recompute or ()):
        used.add("recompute")
    if strategy.expert_tp != strategy.tp:
        used.add("etp")
    return used


PIN_OFF = {"sp": "sp=false", "selective": "recompute=full", "offload": "recompute=full",
           "block-reshard": "block_reshard left out", "expert-folding": "etp left out", "zero-bubble": "schedule=1f1b",
           "zero-3": "zero=2"}
"""A pin that turns a ``strategy_features`` feature off, for the error that names a refused pair."""


def model_refusal(used: set[str], unavailable: Mapping[str, str]) -> str | None:
    """The first key of ``unavailable`` all of whose features (``tp+zero``: both) are ``used``, or None."""
    return next((key for key in unavailable if set(key.split("+")) <= used), None)


def runtime_applies(
    degrees: Mapping[str, int], unavailable: Mapping[str, str], exclusive: tuple[tuple[str, str], ...] = RUNTIME_EXCLUSIVE
) -> bool:
    """No axis of degree > 1 is unavailable for the model and no two are ones the runtime does not combine."""
    used = {axis for axis, degree in degrees.items() if degree > 1}
    return not used & set(unavailable) and runtime_conflict(used, exclusive) is None


def context_degrees(ranks: int, training: TrainingConfig, pins: Mapping[str, object]) -> list[int]:
    """Context-parallel degrees to try among ``ranks`` (see the module docstring)."""
    if "cp" in pins:
        cp = int(pins["cp"])
        return [cp] if ranks % cp == 0 and training.seq_len % (2 * cp) == 0 else []
    if training.seq_len < LONG_CONTEXT_TOKENS:
        return [1]
    return [cp for cp in divisors(ranks)
            if training.seq_len % (2 * cp) == 0 and training.seq_len // cp >= MIN_TOKENS_PER_CP_RANK]


def expert_degrees(ranks: int, experts: set[int], pins: Mapping[str, object]) -> list[int]:
    """Expert-parallel degrees to try on ``ranks`` (``dp``, or ``dp * tp`` where experts may fold): divisors of it
    and of every layer's experts."""
    if "ep" in pins:
        ep = int(pins["ep"])
        return [ep] if ranks % ep == 0 and (ep == 1 or experts and all(e % ep == 0 for e in experts)) else []
    if not experts:
        return [1]
    return [ep for ep in divisors(ranks) if all(e % ep == 0 for e in experts)]


def may_fold(tp: int, cp: int, experts: set[int], pins: Mapping[str, object], unavailable: Mapping[str, str]) -> bool:
    """Whether the space holds folded experts (``etp = 1 < tp``) for this tp and cp: routed experts, expert
    parallelism available, no context parallelism, and ``etp`` not pinned to ``tp``."""
    pinned = pins.get("etp")
    return (bool(experts) and tp > 1 and cp == 1 and "ep" not in unavailable and "etp" not in unavailable
            and (pinned is None or int(pinned) != tp))


def expert_tp_degrees(dp: int, tp: int, ep: int, folds: bool, pins: Mapping[str, object]) -> list[int | None]:
    """The experts' tensor-parallel degrees for one mesh shape: ``None`` (= tp) when ``ep`` divides ``dp``, else the
    folded ``1`` when the space folds (:func:`may_fold`) and ``ep`` divides ``dp * tp``; a pinned ``etp`` as given.

    Unpinned, folding is tried only for an ep larger than dp admits (its distinct gain: experts spread over the
    tensor-parallel ranks too), not beside every unfolded ep: that would double the candidates of every MoE search
    (DeepSeek-V3 on 2048 GPUs: 16216 -> 31092); this way 19084."""
    if "etp" in pins and pins["etp"] is not None:
        return [None if int(pins["etp"]) == tp else int(pins["etp"])]
    if dp % ep == 0:
        return [None]
    return [1] if folds and (dp * tp) % ep == 0 else []


def strategies(
    layers: list[LayerStats], cluster: Cluster, training: TrainingConfig, pins: Mapping[str, object], *,
    unavailable: Mapping[str, str] = MappingProxyType({}), exclusive: tuple[tuple[str, str], ...] = RUNTIME_EXCLUSIVE,
    runtime: bool = True,
) -> Iterator[Strategy]:
    """Every candidate strategy, in a fixed order, honouring ``pins``; none the runtime would refuse for the
    model's ``unavailable`` axes or for a combination (``exclusive``: Tessera's runtime's,
    ``cost_models.types.RUNTIME_EXCLUSIVE``, by default; another framework's for a run it made); ``runtime``: the
    candidates are for Tessera's runtime (:func:`runtime_refusal`)."""
    measured_selective = any(layer.saved_bytes_selective is not None for layer in layers)
    # Cheapest first: the search skips a policy once a cheaper one fits.
    recomputes = _pinned(pins, "recompute", ["none"] if "recompute" in unavailable else _recompute_options(measured_selective, pins))
    blocks = sum(layer.kind == "block" for layer in layers)
    experts = {layer.experts for layer in layers if layer.experts}
    per_block = {key: pins[key] for key in ("block_recompute", "block_reshard", "chunk_blocks") if key in pins}
    passes = pins.get("pipeline_passes", 1)  # a step's micro-batches split evenly over its schedule calls
    recomputed_blocks = any(policy in ("selective", "full") for policy in pins.get("block_recompute") or ())
    # zero-bubble with recomputation only when both are asked for by name: then the runtime says why not
    both_asked = pins.get("schedule") == "zero-bubble" and ("recompute" in pins or recomputed_blocks)
    for dp, tp, pp, cp, ep in mesh_shapes(layers, cluster, training, pins, unavailable=unavailable, exclusive=exclusive):
        if passes > 1 and pp == 1:
            continue  # only a pipeline has schedule calls to split a step into
        micro_batches = ([training.global_batch // dp] if "accumulation" in unavailable else
                         [m for m in range(1, MAX_MICRO_BATCH + 1) if (training.global_batch // dp) % (m * passes) == 0])
        etps = expert_tp_degrees(dp, tp, ep, may_fold(tp, cp, experts, pins, unavailable), pins)
        sps = {etp: pins.get("sp", _sequence_parallel_runs(tp, cp, ep, etp, unavailable, exclusive)) for etp in etps}
        # ZeRO shards over the dp * cp ranks that hold the same weights (runtime.mesh.data_mesh)
        for zero in _pinned(pins, "zero", ZERO_STAGES if dp * cp > 1 else (0,)):
            for micro_batch in _pinned(pins, "micro_batch", micro_batches):
                for recompute, etp in itertools.product(recomputes, etps):
                    for schedule, chunks in _schedules(pp, blocks, pins):
                        if schedule == "zero-bubble" and (recompute != "none" or recomputed_blocks) and not both_asked:
                            continue  # the runtime cannot recompute under a split backward (runtime.apply)
                        if "chunk_blocks" in pins and len(pins["chunk_blocks"]) != pp * chunks:
                            continue
                        strategy = Strategy(**per_block,
                            dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, zero=zero, micro_batch=micro_batch, recompute=recompute,
                            sp=sps[etp], schedule=schedule, virtual_stages=chunks,
                            # never chosen: the runtime lacks these
                            tp_overlap=pins.get("tp_overlap", False), sp_regather=pins.get("sp_regather", False),
                            pipeline_passes=passes, recompute_modules=pins.get("recompute_modules", ()),
                        )
                        if runtime_refusal(strategy, training, unavailable, exclusive, runtime=runtime) is None:
                            yield strategy


def runtime_refusal(
    strategy: Strategy, training: TrainingConfig, unavailable: Mapping[str, str] = MappingProxyType({}),
    exclusive: tuple[tuple[str, str], ...] = RUNTIME_EXCLUSIVE, *, runtime: bool = True,
) -> str | None:
    """Why the runtime would refuse ``strategy`` for a model whose ``unavailable`` axes these are, in a few words, or
    None: a combination it never runs (``exclusive``), experts folded as it cannot fold them (Tessera's runtime only:
    ``runtime``), or a feature the model rules out. The search yields only strategies without one."""
    features = strategy_features(strategy)
    if (pair := runtime_conflict(features, exclusive)) is not None:
        return f"it refuses {pair[0]} with {pair[1]}"
    if exclusive == RUNTIME_EXCLUSIVE and (why := schedule_refusal(strategy, training)) is not None:
        return why
    if runtime and folding_refusal(strategy) is not None:
        return "it cannot fold these experts"
    if (key := model_refusal(model_features(strategy, training, features=features), unavailable)) is not None:
        return f"{key} is unavailable for the model"
    return None


def check_context_pins(pins: Mapping[str, object], training: TrainingConfig) -> None:
    """Raise one line when a pinned context-parallel degree cannot split the sequence: the load-balanced (zig-zag)
    ring cuts each sequence into ``2 * cp`` chunks."""
    cp = int(pins.get("cp", 1))
    if cp > 1 and training.seq_len % (2 * cp):
        raise ConfigError(f"cp={cp} cuts each sequence into 2 x cp = {2 * cp} chunks (the load-balanced ring), and "
                          f"seq_len {training.seq_len} is not a multiple of {2 * cp}; pick a seq_len or cp that fits")


def check_expert_pins(pins: Mapping[str, object], experts: set[int]) -> None:
    """Raise one line when pinned expert parallelism cannot apply: the model has no routed experts, or ``ep`` does
    not divide a MoE layer's experts."""
    ep, etp = int(pins.get("ep", 1)), pins.get("etp")
    if (ep > 1 or etp is not None) and not experts:
        raise ConfigError(f"{'ep' if ep > 1 else 'etp'} splits routed experts, and this model has no mixture-of-experts "
                          "layer; leave ep and etp out")
    if ep > 1 and any(count % ep for count in experts):
        raise ConfigError(f"ep={ep} must divide the experts of every MoE layer ({', '.join(map(str, sorted(experts)))}); "
                          "pin a divisor of them")


def _sequence_parallel_runs(
    tp: int, cp: int, ep: int, etp: int | None, unavailable: Mapping[str, str], exclusive: tuple[tuple[str, str], ...],
) -> bool:
    """sp by default wherever tp > 1, unless the model or a combination rules it out (then sp=false, not no plan)."""
    features = {"sp"} | {a for a, d in (("ep", ep), ("cp", cp)) if d > 1} | ({"expert-folding"} if etp not in (None, tp) else set())
    return tp > 1 and "sp" not in unavailable and runtime_conflict(features, exclusive) is None


def _pinned(pins: Mapping[str, object], key: str, options):
    return [pins[key]] if key in pins else list(options)


def _recompute_options(measured_selective: bool, pins: Mapping[str, object]) -> list[str]:
    """Uniform recomputation policies to try, cheapest first; only ``none`` (unused) under ``block_recompute``."""
    if "block_recompute" in pins:
        return ["none"]
    whole_blocks = [] if pins.get("recompute_modules") else ["full"]  # named pieces are recomputed in kept blocks only
    return ["none"] + (["selective"] if measured_selective else []) + whole_blocks


def _schedules(pp: int, blocks: int, pins: Mapping[str, object]) -> list[tuple[str, int]]:
    if "schedule" in pins and (pins["schedule"] != "interleaved" or "virtual_stages" in pins):
        return [(pins["schedule"], pins.get("virtual_stages", 1))]
    if pp == 1:
        return [("1f1b", 1)]
    interleaved = [("interleaved", v) for v in _virtual_stage_options(pp, blocks, pins)]
    if pins.get("schedule") == "interleaved":  # chunks per rank left to the search
        return interleaved or [("interleaved", 1)]
    return [("1f1b", 1), *interleaved, ("zero-bubble", 1)]  # GPipe: 1F1B's time with more memory; pin to get it


def _virtual_stage_options(pp: int, blocks: int, pins: Mapping[str, object]) -> list[int]:
    """Chunks per pipeline rank to try: those that split the blocks evenly, or the one ``chunk_blocks`` implies."""
    if "chunk_blocks" in pins:
        chunks = len(pins["chunk_blocks"])
        return [chunks // pp] if chunks % pp == 0 and chunks > pp else []
    return [v for v in VIRTUAL_STAGES if blocks % (pp * v) == 0]


def check_layer_pins(pins: Mapping[str, object], layers: list[LayerStats]) -> None:
    """Raise unless the per-block pins fit the model: one ``block_recompute`` policy per block, ``chunk_blocks``
    summing to the blocks and, where ``pp`` and the chunks per rank are pinned, one size per chunk."""
    blocks = sum(layer.kind == "block" for layer in layers)
    policies = pins.get("block_recompute")
    if policies is not None and len(policies) != blocks:
        raise ConfigError(
            f"block_recompute lists {len(policies)} policies but the model has {blocks} blocks; give one per block "
            f"(e.g. block_recompute={blocks}xfull) or leave it out"
        )
    sizes = pins.get("chunk_blocks")
    if sizes is None:
        return
    if sum(sizes) != blocks:
        raise ConfigError(f"chunk_blocks gives {len(sizes)} chunks of {sum(sizes)} blocks in all but the model has "
                          f"{blocks} blocks; make the sizes add up to {blocks}")
    if "pp" in pins and (pins.get("schedule") != "interleaved" or "virtual_stages" in pins):
        chunks = int(pins["pp"]) * int(pins.get("virtual_stages", 1))
        if len(sizes) != chunks:
            raise ConfigError(f"chunk_blocks gives {len(sizes)} chunk sizes but pp={pins['pp']} x virtual_stages="
                              f"{pins.get('virtual_stages', 1)} makes {chunks} pipeline chunks; give one size per chunk")


def check_pins(
    pins: Mapping[str, object], cluster: Cluster, *, unavailable: Mapping[str, str] = MappingProxyType({}),
    exclusive: tuple[tuple[str, str], ...] = RUNTIME_EXCLUSIVE, runtime: bool = True,
) -> None:
    """Raise if the pins cannot multiply to the world size (``ep`` is part of ``dp`` and adds no ranks), use an
    axis the runtime cannot apply to the model (``unavailable``) or a combination the framework that runs them does
    not (``exclusive``: Tessera's runtime's by default, ``ImplementationProfile.refused_together``); ``runtime``:
    the pins are for Tessera's runtime (:func:`check_runtime_pins`)."""
    check_runtime_pins(pins, unavailable, exclusive, runtime=runtime)
    product = 1
    for axis in ("dp", "tp", "pp", "cp"):
        product *= int(pins.get(axis, 1))
    if product > cluster.num_devices or cluster.num_devices % product:
        raise ConfigError(
            f"the pinned axes need {product} ranks, which does not fit the {cluster.num_devices} devices of "
            f"cluster {cluster.name}; make dp*tp*pp*cp divide {cluster.num_devices}"
        )
    folded = pins.get("etp") is not None and int(pins["etp"]) != int(pins.get("tp", 1))
    carved = int(pins.get("dp", 1)) * (int(pins.get("tp", 1)) if folded else 1)
    if "dp" in pins and carved % int(pins.get("ep", 1)):
        what = "dp*tp (folded experts, etp=1)" if folded else "dp (or pin etp=1 to fold experts into tp too)"
        raise ConfigError(f"ep={pins['ep']} must divide {what} = {carved}: expert parallelism is carved out of it")


def check_runtime_pins(
    pins: Mapping[str, object], unavailable: Mapping[str, str],
    exclusive: tuple[tuple[str, str], ...] = RUNTIME_EXCLUSIVE, *, runtime: bool = True,
) -> None:
    """Raise one line naming the axis and the reason when a pin asks for what the runtime cannot apply, or for a
    pair of features the framework that runs them (``exclusive``) does not combine; ``runtime``: the strategy is for
    Tessera's runtime, whose experts fold only to ``etp`` 1 or ``tp`` (another framework's is priced as given)."""
    if pins.get("sp") and int(pins.get("tp", 2)) == 1:
        raise ConfigError("sp=true splits activations over the tensor-parallel ranks, and tp=1 is pinned; pin tp "
                          "above 1 or drop sp")
    for axis, reason in unavailable.items():
        if axis in ("tp", "pp", "cp", "ep") and int(pins.get(axis, 1)) > 1:
            reason = reason.removesuffix(f"; plan with {axis}=1").removesuffix(f" or plan with {axis}=1").rstrip(",")
            raise ConfigError(f"{axis}={pins[axis]} is unavailable for this model: {reason}; leave {axis} out or pin {axis}=1")
    used = {axis for axis in ("tp", "pp", "cp", "ep") if int(pins.get(axis, 1)) > 1}
    used |= {"sp"} if pins.get("sp") else set()
    used |= {"selective"} if pins.get("recompute") == "selective" or "selective" in (pins.get("block_recompute") or ()) else set()
    sharded = int(pins.get("dp", 1)) * int(pins.get("cp", 1)) > 1
    used |= {"zero-bubble"} if pins.get("schedule") == "zero-bubble" and int(pins.get("pp", 1)) > 1 else set()
    used |= {"zero-3"} if int(pins.get("zero", 0)) == 3 and sharded else set()
    pinned = used | ({"zero"} if int(pins.get("zero", 0)) >= 1 and sharded else set())
    pinned |= {"recompute"} if pins.get("recompute", "none") != "none" or any(
        p != "none" for p in pins.get("block_recompute") or ()) else set()
    if runtime and pins.get("etp") is not None and int(pins["etp"]) not in (1, int(pins.get("tp", 0))):
        raise ConfigError(f"etp={pins['etp']} (the experts' own tensor-parallel degree): the runtime folds experts only "
                          "to etp=1 or keeps them on tp; pin etp=1 or leave it out (tessera evaluate --runs-on megatron prices any etp "
                          "dividing tp)")
    refused = model_refusal(pinned, {k: v for k, v in unavailable.items() if k not in ("tp", "pp", "cp", "ep")})
    if refused is not None:
        raise ConfigError(f"the pins use {refused}, which the runtime cannot run on this model: {unavailable[refused]}; "
                          "pin one of them off")
    conflict = runtime_conflict(used, exclusive)
    if conflict is not None:
        a, b = conflict
        runtime = exclusive == RUNTIME_EXCLUSIVE
        elsewhere = "; to price it as Megatron-LM runs it, tessera evaluate --runs-on megatron" if runtime else ""
        raise ConfigError(f"{'the runtime' if runtime else 'that framework'} does not implement {a} together with "
                          f"{b}; pin one of them off (e.g. {PIN_OFF.get(b, f'{b}=1')} or {PIN_OFF.get(a, f'{a}=1')})"
                          f"{elsewhere}")
