"""Capture's second measurement under ``torch.autocast`` (fp32 weights, bf16 compute), against a real autocast run,
and the memory model reading it on exactly the runtime paths that autocast."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from tessera.cost_models import Strategy, TrainingConfig, estimate
from tessera.models import build_model, model_config
from tessera.planner.capture import capture
from tessera.planner.layer_graph import LayerGraph
from tessera.topology import load_cluster

H, T = 96, 48
SPEC = f"gpt:layers=3,hidden={H},heads=4,vocab=128,seq={T}"
BENCHMARKS = str(Path(__file__).parents[2] / "benchmarks")


@pytest.fixture(scope="module")
def graph() -> LayerGraph:
    return capture(build_model(SPEC), seq_len=T, fit_seq_scaling=True)


@pytest.fixture
def saved_bytes():
    """``benchmarks/autocast_saved.py``'s count of what a real forward saves (scripts, not a package)."""
    sys.path.insert(0, BENCHMARKS)
    import autocast_saved

    yield autocast_saved.saved_bytes
    sys.path.remove(BENCHMARKS)


@pytest.mark.parametrize("spec", [SPEC, "llama-tiny"])  # llama: rotary embeddings hand SDPA fp32 q and k
def test_a_model_under_autocast_saves_what_a_real_autocast_run_saves(spec: str, saved_bytes) -> None:
    torch.manual_seed(0)
    model = build_model(spec)
    config = model_config(spec)
    ids = torch.randint(0, config.vocab, (1, config.seq_len))
    real, copies = saved_bytes(model, ids, autocast=True)
    in_bf16, _ = saved_bytes(copy.deepcopy(model).to(torch.bfloat16), ids, autocast=False)
    layers = [layer for layer in capture(model, seq_len=config.seq_len).layers if layer.kind != "loss"]
    measured = sum(layer.autocast_saved_bytes_no_recompute for layer in layers)
    assert measured == pytest.approx(real, rel=0.02)  # the kernels differ: flash RNG state, the logsumexp
    assert copies > 0 and real > 1.1 * in_bf16  # the fp32 residual stream, a bf16 cast per linear
    assert measured > 1.1 * sum(layer.saved_bytes_no_recompute for layer in layers)


def test_under_autocast_a_recomputed_block_keeps_its_fp32_input(graph: LayerGraph) -> None:
    block = graph.blocks[1]
    assert block.saved_bytes_full_recompute == T * H * 2
    assert block.autocast_saved_bytes_full_recompute == T * H * 4
    assert block.autocast_output_bytes == 2 * block.output_bytes  # the residual stream a pipeline stage sends on
    assert graph.at_seq_len(2 * T).blocks[1].autocast_saved_bytes_full_recompute == 2 * T * H * 4


def test_fp32_captures_measure_nothing_under_autocast() -> None:
    fp32 = capture(build_model(SPEC, device="meta"), seq_len=T, dtype=torch.float32)
    assert all(layer.autocast_saved_bytes_no_recompute is None for layer in fp32.layers)


@pytest.mark.parametrize("pins, autocasts", [
    ("dp=4,zero=0", True),  # DDP: torch.autocast over fp32 weights
    ("dp=1,pp=2,tp=2,schedule=1f1b", True),  # tp and pp without data parallelism
    ("dp=4,zero=1", False),  # FSDP2 casts the weights: activations in bf16 as captured
])
def test_the_memory_model_reads_autocast_activations_only_where_the_runtime_autocasts(
    graph: LayerGraph, pins: str, autocasts: bool
) -> None:
    layers = list(graph.layers)
    plain = [layer.model_copy(update={"autocast_saved_bytes_no_recompute": None}) for layer in layers]
    cluster = load_cluster("cpu:ranks=4")
    training = TrainingConfig(global_batch=8, seq_len=T, precision="bf16")
    strategy = Strategy.parse(f"{pins},mbs=2,recompute=none")
    with_autocast = estimate(layers, cluster, training, strategy).peak_memory_bytes
    without = estimate(plain, cluster, training, strategy).peak_memory_bytes
    assert (with_autocast > without) is autocasts


def test_a_pipeline_under_autocast_sends_its_fp32_residual_stream(graph: LayerGraph) -> None:
    layers = list(graph.layers)
    plain = [layer.model_copy(update={"autocast_output_bytes": None}) for layer in layers]
    cluster = load_cluster("cpu:ranks=2")
    strategy = Strategy.parse("dp=1,pp=2,mbs=2,recompute=none")
    sent = {precision: [estimate(graph_layers, cluster, TrainingConfig(global_batch=8, seq_len=T, precision=precision),
                                 strategy).comm_time_by_kind_s["pp_p2p"] for graph_layers in (layers, plain)]
            for precision in ("bf16", "fp32")}
    assert sent["bf16"][0] > sent["bf16"][1]  # autocast: the block outputs are fp32
    assert sent["fp32"][0] == sent["fp32"][1]  # no autocast: as captured


@pytest.mark.parametrize("spec", [SPEC, "llama-tiny"])  # biased linears (aten.addmm) and plain ones (aten.mm)
def test_the_runtimes_selective_policy_keeps_the_blocks_input_and_every_linears_output(spec: str) -> None:
    model = build_model(spec, device="meta")
    config = model_config(spec)
    block = capture(model, seq_len=config.seq_len).blocks[1]
    linears = [m for m in model.blocks[1].modules() if isinstance(m, torch.nn.Linear)]
    outputs = sum(m.out_features for m in linears) * config.seq_len * 2  # bf16
    assert block.saved_bytes_matmul_selective == config.seq_len * config.hidden * 2 + outputs
    assert block.saved_bytes_full_recompute < block.saved_bytes_matmul_selective < block.saved_bytes_no_recompute
