"""The search's shortcuts change no answer: pinned re-searches that skip hopeless candidates (``only_best``),
estimates shared between searches (``Priced``), and meta builds that skip weight initialisers."""

from __future__ import annotations

import pytest
import torch

from tessera.cost_models import TrainingConfig, estimate
from tessera.cost_models.estimate import peak_memory_bytes
from tessera.models import build_model
from tessera.models.meta_init import skipping_init_on_meta
from tessera.planner.capture import capture_preset
from tessera.planner.search import Priced, rank_candidates
from tessera.topology import load_cluster


@pytest.fixture(scope="module")
def moe():
    # Mixtral on 16 GPUs at 4K: most candidates overflow (only_best skips ~90% of them), a few fit at each ep.
    training = TrainingConfig(global_batch=64, seq_len=4096, precision="bf16")
    graph = capture_preset("mixtral-8x7b", seq_len=4096)
    return graph, load_cluster("dgx-h100:nodes=2"), training


def _fastest_fitting_or_leanest(ranked):
    fitting = [pair for pair in ranked if pair[1].fits]
    return fitting[0] if fitting else min(ranked, key=lambda pair: pair[1].peak_memory_bytes)


@pytest.mark.parametrize("ep", [1, 2, 8])
def test_only_best_finds_what_the_full_search_finds(moe, ep):
    graph, cluster, training = moe
    full = rank_candidates(graph, cluster, training, pins={"ep": ep})
    short = rank_candidates(graph, cluster, training, pins={"ep": ep}, only_best=True)
    assert len(short) < len(full) / 2  # it did skip
    assert _fastest_fitting_or_leanest(short) == _fastest_fitting_or_leanest(full)


def test_only_best_finds_the_leanest_when_nothing_fits(moe):
    graph, cluster, training = moe
    pins = {"ep": 2, "zero": 1, "recompute": "none", "micro_batch": 4}  # nothing fits without recomputation
    full = rank_candidates(graph, cluster, training, pins=pins)
    assert not any(est.fits for _, est in full)
    short = rank_candidates(graph, cluster, training, pins=pins, only_best=True)
    assert len(short) < len(full)
    assert _fastest_fitting_or_leanest(short) == _fastest_fitting_or_leanest(full)


def test_shared_estimates_are_the_estimates(moe):
    graph, cluster, training = moe
    priced = Priced()
    first = rank_candidates(graph, cluster, training, priced=priced)
    again = rank_candidates(graph, cluster, training, pins={"ep": first[0][0].ep}, priced=priced)
    layers = list(graph.layers)
    for strategy, est in again[:20]:
        assert est == estimate(layers, cluster, training, strategy)
        assert peak_memory_bytes(layers, cluster, training, strategy) == est.peak_memory_bytes


def test_meta_builds_skip_initialisers_and_real_ones_do_not():
    meta = build_model("llama-tiny", device="meta")
    torch.manual_seed(0)
    real = build_model("llama-tiny")
    assert [(n, p.shape, p.dtype) for n, p in meta.named_parameters()] == [
        (n, p.shape, p.dtype) for n, p in real.named_parameters()]
    with skipping_init_on_meta():
        on_meta = torch.empty(4, 4, device="meta")
        assert torch.nn.init.normal_(on_meta) is on_meta
        on_cpu = torch.zeros(4, 4)
        torch.nn.init.normal_(on_cpu)
        on_cpu.uniform_()
    assert on_cpu.abs().sum() > 0  # real tensors are still initialised
