"""Per-layer planning (issue 21): the mixed integer program against brute force, its materialisation, and the
cost model of the per-block options it chooses (activation offload, ZeRO-3 blocks keeping gathered weights)."""

import itertools

import pytest

from tessera.cost_models import Strategy, TrainingConfig, estimate
from tessera.cost_models.layer_stats import LayerStats
from tessera.cost_models.profiles import MEGATRON
from tessera.planner.ilp_mixed import KindCoefficients, block_kinds, solve_mixed
from tessera.planner.refine import materialise_options
from tessera.topology.presets import load_cluster

GiB = 2**30
OPTIONS = ("none", "full", "offload")


def kind_stage(base_time, base_memory, *, kinds, comm=0.0):
    """A stage's coefficients: kind ``g`` costs ``(g + 1)`` times kind 0 (seconds, GiB)."""
    per = {"none": (1.0, 10.0), "full": (1.35, 2.0), "offload": (1.1, 4.0)}
    return KindCoefficients(
        base_time_s=base_time, base_memory_bytes=base_memory * GiB, base_comm_s=0.0, base_compute_s=0.0,
        time_s=tuple({o: (g + 1) * t for o, (t, _) in per.items()} for g in range(kinds)),
        memory_bytes=tuple({o: (g + 1) * m * GiB for o, (_, m) in per.items()} for g in range(kinds)),
        comm_s=tuple({o: comm for o in per} for _ in range(kinds)),
        compute_s=tuple({o: 0.0 for o in per} for _ in range(kinds)),
    )


def brute_force(stages, kinds, *, budget, slots):
    """The smallest ``slots * pace`` over every contiguous split and every option of every block."""
    best = None
    blocks = len(kinds)
    for cuts in itertools.combinations(range(1, blocks), len(stages) - 1):
        bounds = (0, *cuts, blocks)
        for choice in itertools.product(OPTIONS, repeat=blocks):
            paces = []
            for s, st in enumerate(stages):
                span = range(bounds[s], bounds[s + 1])
                memory = st.base_memory_bytes + sum(st.memory_bytes[kinds[i]][choice[i]] for i in span)
                if memory > budget:
                    break
                paces.append(st.base_time_s + sum(st.time_s[kinds[i]][choice[i]] for i in span))
            else:
                step = slots * max(paces)
                best = step if best is None else min(best, step)
    return best


@pytest.mark.parametrize(
    ("kinds", "bases", "budget"),
    [
        ((0, 0, 1, 1, 0), [(0.5, 5), (0.0, 8)], 30),
        ((1, 0, 0, 0, 1, 0), [(0.2, 3), (0.1, 2), (0.9, 12)], 28),
        ((0, 1, 0, 1, 0, 1), [(0.0, 0), (0.0, 0)], 40),
    ],
)
def test_mixed_program_matches_brute_force(kinds, bases, budget):
    stages = [kind_stage(t, m, kinds=2) for t, m in bases]
    expected = brute_force(stages, kinds, budget=budget * GiB, slots=3.0)
    result = solve_mixed(stages, kinds=kinds, budget_bytes=budget * GiB, slots=3.0, micro_batches=4)
    assert expected is not None and result is not None
    assert result.step_s == pytest.approx(expected, abs=1e-4)  # integer microseconds, slots in thousandths
    assert result.status == "OPTIMAL" and sum(result.stage_blocks) == len(kinds) and min(result.stage_blocks) >= 1
    # The options it lists reproduce its pace: block i on the stage its cut says, under its option.
    stage_of = [s for s, n in enumerate(result.stage_blocks) for _ in range(n)]
    paces = [st.base_time_s + sum(st.time_s[kinds[i]][result.options[i]] for i in range(len(kinds)) if stage_of[i] == s)
             for s, st in enumerate(stages)]
    assert max(paces) == pytest.approx(result.pace_s, abs=1e-4)


def test_mixed_program_is_infeasible_when_nothing_fits_and_honours_the_incumbent():
    stages = [kind_stage(0.0, 0, kinds=1)] * 2
    assert solve_mixed(stages, kinds=(0, 0, 0, 0), budget_bytes=3 * GiB, slots=1.0, micro_batches=1) is None
    fits = solve_mixed(stages, kinds=(0, 0, 0, 0), budget_bytes=100 * GiB, slots=1.0, micro_batches=1)
    assert fits is not None and fits.pace_s == pytest.approx(2.0)
    assert solve_mixed(stages, kinds=(0, 0, 0, 0), budget_bytes=100 * GiB, slots=1.0, micro_batches=1,
                       step_limit_s=1.9) is None


def test_mixed_program_keeps_the_default_where_memory_allows():
    """At the optimal pace the second solve moves no block off ``none`` that need not move."""
    stages = [kind_stage(0.0, 0, kinds=2)] * 2
    result = solve_mixed(stages, kinds=(0, 1, 1, 0), budget_bytes=100 * GiB, slots=1.0, micro_batches=1)
    assert result is not None and set(result.options) == {"none"}


def test_materialise_options_writes_per_block_policies_resharding_and_stage_sizes():
    key = Strategy.parse("dp=2,pp=2,zero=3,mbs=1,recompute=none")
    strategy = materialise_options(key, ["none+keep", "full", "offload", "none"], chunk_blocks=(1, 3))
    assert strategy.block_recompute == ("none", "full", "offload", "none")
    assert strategy.block_reshard == (False, True, True, True) and strategy.chunk_blocks == (1, 3)
    uniform = materialise_options(key, ["full"] * 4, chunk_blocks=(2, 2))
    assert uniform.recompute == "full" and not uniform.block_recompute and not uniform.block_reshard
    assert not uniform.chunk_blocks


def block(fqn, *, signature="b", params=50_000_000, saved=400 * 2**20, flops=2e12):
    return LayerStats(fqn=fqn, kind="block", signature=signature, param_count=params, forward_flops=flops,
                      backward_flops=2 * flops, saved_bytes_no_recompute=saved, saved_bytes_full_recompute=saved // 20,
                      output_bytes=saved // 20, hidden_size=4096)


def model(*blocks):
    embedding = LayerStats(fqn="emb", kind="embedding", signature="e", param_count=10_000_000, forward_flops=0,
                           backward_flops=0, saved_bytes_no_recompute=0, saved_bytes_full_recompute=0, output_bytes=2**20)
    loss = LayerStats(fqn="loss", kind="loss", signature="l", param_count=0, forward_flops=0, backward_flops=0,
                      saved_bytes_no_recompute=0, saved_bytes_full_recompute=0, output_bytes=4)
    return [embedding, *blocks, loss]


def test_block_kinds_group_by_signature_in_model_order():
    kinds, representatives = block_kinds(model(block("a", signature="x"), block("b", signature="y"), block("c", signature="x")))
    assert kinds == [0, 1, 0] and [b.fqn for b in representatives] == ["a", "b"]


def test_offload_trades_device_memory_for_host_link_time():
    layers = model(*(block(f"b{i}") for i in range(4)))
    cluster, training = load_cluster("dgx-h100:nodes=1"), TrainingConfig(global_batch=8, seq_len=4096)
    plain = estimate(layers, cluster, training, Strategy.parse("dp=8,zero=1,mbs=1,recompute=none"))
    offload = estimate(layers, cluster, training, Strategy.parse("dp=8,zero=1,mbs=1,recompute=offload"))
    saved = 4 * 400 * 2**20
    # The saved activations leave the device; two blocks' worth stays in transit.
    assert plain.memory_by_category_bytes["activations"] - offload.memory_by_category_bytes["activations"] == \
        pytest.approx(saved - 2 * 400 * 2**20, rel=1e-6)
    # Tessera's runtime copies on the compute stream (profiles.TESSERA.offload_copies_overlap False): each micro-batch
    # pays 4 blocks x 400 MiB out and back over the 64 GB/s host link.
    per_stage = offload.stage_time_per_micro_batch_s[0]
    assert per_stage["offload"] == pytest.approx(2 * saved / 64e9, rel=1e-9)
    assert offload.step_time_s > plain.step_time_s
    assert offload.recompute_time_s == 0
    # Transformer Engine's offload (Megatron-Core) copies on a stream of its own: only what a pass cannot hide is
    # exposed, the copy-out beyond the forward and the copy-in beyond the backward.
    beside = estimate(layers, cluster, training, Strategy.parse("dp=8,zero=1,mbs=1,recompute=offload"), profile=MEGATRON)
    part = beside.stage_time_per_micro_batch_s[0]
    copy = saved / 64e9
    assert part["offload"] == pytest.approx(max(0, copy - part["forward"]) + max(0, copy - part["backward"]), rel=1e-9)
    assert part["offload"] < per_stage["offload"]


def test_a_block_keeping_its_gathered_weights_saves_gathers_and_holds_its_weights():
    layers = model(*(block(f"b{i}") for i in range(4)))
    cluster, training = load_cluster("dgx-h100:nodes=1"), TrainingConfig(global_batch=32, seq_len=4096)
    resharding = estimate(layers, cluster, training, Strategy.parse("dp=8,zero=3,mbs=1"))
    keeping = estimate(layers, cluster, training, Strategy.parse("dp=8,zero=3,mbs=1,block_reshard=2xfalse/2xtrue"))
    gathers = [e.comm_time_by_kind_s["fsdp_allgather"] for e in (resharding, keeping)]
    # 4 micro-batches: 8 gathers of every block, 4 of the two that keep theirs (100M of the 210M parameters).
    share = 100_000_000 / 210_000_000
    assert gathers[1] / gathers[0] == pytest.approx((8 - 4 * share) / 8, rel=1e-9)
    held = 2 * 50_000_000 * 2  # two blocks' bf16 weights, whole (no tp)
    assert keeping.memory_by_category_bytes["parameters"] - resharding.memory_by_category_bytes["parameters"] == \
        pytest.approx(held, rel=1e-6)


def graph_of(layers):
    from tessera.planner.layer_graph import LayerGraph

    return LayerGraph(model_name="synthetic", seq_len=4096, dtype="bf16", front_end="synthetic", layers=tuple(layers),
                      edges=tuple((a.fqn, b.fqn) for a, b in zip(layers, layers[1:])))


def test_stage_cuts_balance_blocks_that_are_not_alike():
    """Four heavy blocks (three times the FLOPs) then twelve light ones on two pipeline stages: even stages put
    the heavy ones and four light ones together; the per-kind program's cut is as good as the best of all 15."""
    from tessera.planner.search import search

    heavy = [block(f"h{i}", signature="heavy", flops=6e12) for i in range(4)]
    light = [block(f"l{i}", signature="light", flops=2e12) for i in range(12)]
    layers = model(*heavy, *light)
    cluster, training = load_cluster("dgx-h100:nodes=1"), TrainingConfig(global_batch=64, seq_len=4096)
    pins = {"pp": 2, "tp": 1, "zero": 1, "schedule": "1f1b", "micro_batch": 1}
    plan = search(graph_of(layers), cluster, training, pins=pins)
    key = Strategy.parse("dp=4,pp=2,zero=1,mbs=1,schedule=1f1b")
    cuts = {cut: estimate(layers, cluster, training, key.model_copy(update={"chunk_blocks": (cut, 16 - cut)}))
            for cut in range(1, 16)}
    best = min(e.step_time_s for e in cuts.values() if e.fits)
    assert plan.estimate.step_time_s <= best * (1 + 1e-9)
    assert plan.estimate == estimate(layers, cluster, training, plan.strategy)  # the plan is what estimate says
    assert plan.uniform is not None and plan.uniform.estimate.step_time_s / plan.estimate.step_time_s > 1.1
    assert plan.strategy.chunk_blocks[0] < 8  # the heavy blocks' stage holds fewer


@pytest.mark.parametrize("cluster_spec", ["dgx-h100:nodes=1", "dgx-a100:nodes=2"])
def test_on_a_uniform_stack_every_option_switched_on_is_never_slower(cluster_spec):
    from tessera.planner.refine import ALL_BLOCK_OPTIONS
    from tessera.planner.search import search

    layers = model(*(block(f"b{i}", saved=1200 * 2**20, params=400_000_000) for i in range(16)))
    cluster, training = load_cluster(cluster_spec), TrainingConfig(global_batch=64, seq_len=4096)
    today = search(graph_of(layers), cluster, training)
    every = search(graph_of(layers), cluster, training, block_options=ALL_BLOCK_OPTIONS)
    assert every.estimate.step_time_s <= today.estimate.step_time_s
    assert every.estimate.fits and today.estimate.fits


def test_offload_frees_nothing_on_a_cpu_rank_whose_memory_is_the_hosts():
    cluster = load_cluster("cpu:ranks=2")
    layers = model(*(block(f"b{i}") for i in range(2)))
    training = TrainingConfig(global_batch=2, seq_len=4096, precision="fp32")
    plain, offload = (estimate(layers, cluster, training, Strategy.parse(f"dp=2,mbs=1,recompute={p}"))
                      for p in ("none", "offload"))
    assert offload.memory_by_category_bytes["activations"] == plain.memory_by_category_bytes["activations"]


def chunk_layouts(blocks: int, chunk_stages: list[int]):
    """Every chunk layout ``solve_mixed``'s balance constraints allow (its docstring), by enumeration."""
    chunks, edges = len(chunk_stages), {0, len(chunk_stages) - 1}
    most = -(-blocks // chunks) + 1
    for sizes in itertools.product(range(1, most + 1), repeat=chunks):
        if sum(sizes) != blocks:
            continue
        mates = [[sizes[d] for d in range(chunks) if chunk_stages[d] == chunk_stages[c] and d not in edges and d != c]
                 for c in range(chunks)]
        if all(sizes[c] <= min(m, default=sizes[c]) if c in edges else all(abs(sizes[c] - n) <= 1 for n in m)
               for c, m in enumerate(mates)):
            yield sizes


def test_interleaved_chunks_lighten_the_head_chunk_as_brute_force_says():
    # Two stages, two chunks each (chunk c on stage c % 2); stage 1 holds a heavy head (3 blocks' time).
    stages, chunk_stages, kinds = [kind_stage(0.0, 0, kinds=1), kind_stage(3.0, 0, kinds=1)], [0, 1, 0, 1], (0,) * 12
    result = solve_mixed(stages, kinds=kinds, budget_bytes=1000 * GiB, slots=2.0, micro_batches=4,
                         chunk_stages=chunk_stages)
    best = min(max(sum(n for n, st in zip(sizes, chunk_stages) if st == s) + stages[s].base_time_s for s in (0, 1))
               for sizes in chunk_layouts(len(kinds), chunk_stages))
    assert result is not None and result.pace_s == pytest.approx(best, abs=1e-4)
    assert result.chunk_blocks in set(chunk_layouts(len(kinds), chunk_stages))
    assert result.chunk_blocks[-1] < 3  # the head's chunk holds fewer than the even 3
    assert result.stage_blocks == (sum(result.chunk_blocks[0::2]), sum(result.chunk_blocks[1::2]))


def test_interleaved_plans_give_a_heavy_head_its_own_chunk_weight():
    """A vocabulary-sized head (six blocks' FLOPs) on the last chunk of an interleaved pipeline: the search makes
    that chunk lighter, and the plan beats the even chunks of the same outer candidate."""
    from tessera.planner.search import search

    head = LayerStats(fqn="head", kind="head", signature="h", param_count=500_000_000, forward_flops=12e12,
                      backward_flops=24e12, saved_bytes_no_recompute=2**30, saved_bytes_full_recompute=2**30,
                      output_bytes=2**30, hidden_size=4096, vocab_size=128000)
    layers = model(*(block(f"b{i}") for i in range(16)))
    layers.insert(-1, head)
    cluster, training = load_cluster("dgx-h100:nodes=1"), TrainingConfig(global_batch=64, seq_len=4096)
    pins = {"pp": 2, "tp": 1, "zero": 1, "schedule": "interleaved", "virtual_stages": 2, "micro_batch": 1}
    plan = search(graph_of(layers), cluster, training, pins=pins)
    even = estimate(layers, cluster, training, plan.strategy.model_copy(update={"chunk_blocks": ()}))
    assert plan.strategy.chunk_blocks and plan.strategy.chunk_blocks[-1] < 4
    assert plan.estimate.step_time_s < even.step_time_s
