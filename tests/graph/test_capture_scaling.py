"""Statistics as functions of the sequence length (exact polynomial fit) and of the micro-batch (linear)."""

from __future__ import annotations

import pytest
import torch

from tessera.errors import CaptureError
from tessera.models import build_model
from tessera.planner.capture import capture, capture_preset, fit_lengths
from tessera.planner.layer_graph import LayerGraph, evaluate, fit_polynomial


def test_fit_is_exact_on_quadratics_and_rational_otherwise() -> None:
    assert fit_polynomial({s: 7 + 3 * s + 5 * s**2 for s in (64, 32, 16)}) == (7, 3, 5)
    assert fit_polynomial({3: 4, 2: 2, 1: 1}) == (1, -0.5, 0.5)  # not integral: floats, evaluated and rounded
    assert evaluate((1, -0.5, 0.5), 3) == 4
    assert fit_polynomial({3: None, 2: 2, 1: 1}) is None
    assert fit_lengths(2048) == (2048, 1024, 512) and fit_lengths(2) == (2, 3, 4)


@pytest.mark.parametrize(
    "spec",
    [
        "gpt:layers=3,hidden=96,heads=4,vocab=128,seq=64",
        "llama-tiny:layers=3",
        # top_k * T / experts is a whole number at 64, 32, 16 and 48, so the capacity is exactly polynomial.
        "moe-tiny",
    ],
)
def test_at_seq_len_equals_a_direct_capture(spec: str) -> None:
    graph = capture_preset(spec, seq_len=64, fit_seq_scaling=True)
    rescaled = graph.at_seq_len(48)
    direct = capture_preset(spec, seq_len=48, fit_seq_scaling=True)
    assert rescaled.layers == direct.layers  # every statistic and every signature
    assert rescaled == direct  # and the polynomials themselves
    assert graph.at_seq_len(64) == graph


def test_attention_makes_flops_quadratic_and_bytes_linear() -> None:
    graph = capture_preset("gpt:layers=3,hidden=96,heads=4,vocab=128,seq=64", seq_len=64, fit_seq_scaling=True)
    block = {s.fqn: s for s in graph.seq_scaling}["blocks.1"].coefficients
    c0, c1, c2 = block["forward_flops"]
    assert (c0, c1, c2) == (0, 2 * 12 * 96 * 96, 4 * 96)  # 24 s h^2 + 4 s^2 h: Narayanan et al. 2021, eq. 3
    assert block["saved_bytes_no_recompute"][2] == 0  # flash attention: no (T, T) tensor is saved
    assert block["saved_bytes_no_recompute"][0] == 24  # the kernel's RNG seed and offset, whatever T is


def test_scaling_survives_json_and_long_sequences() -> None:
    graph = capture_preset("llama-tiny", seq_len=32, fit_seq_scaling=True)
    again = LayerGraph.model_validate_json(graph.model_dump_json())
    assert again == graph and again.at_seq_len(1 << 20) == graph.at_seq_len(1 << 20)
    long = graph.at_seq_len(1 << 20)
    assert long.blocks[0].forward_flops > 1000 * graph.blocks[0].forward_flops  # quadratic term dominates


def test_fixed_example_inputs_cannot_be_rescaled() -> None:
    model = build_model("gpt-tiny", device="meta")
    ids = torch.zeros(1, 16, dtype=torch.long)
    graph = capture(model, seq_len=16, example_inputs=(ids,), fit_seq_scaling=True)
    assert graph.seq_scaling == ()
    with pytest.raises(CaptureError, match="function of seq_len"):
        graph.at_seq_len(32)
    by_function = capture(model, seq_len=16, example_inputs=lambda s: (torch.zeros(1, s, dtype=torch.long),), fit_seq_scaling=True)
    assert by_function.layers == graph.layers and by_function.at_seq_len(32).seq_len == 32


def test_statistics_are_linear_in_the_micro_batch() -> None:
    model = build_model("llama-tiny", device="meta")
    one = capture(model, seq_len=32, example_inputs=(torch.zeros(1, 32, dtype=torch.long),))
    four = capture(model, seq_len=32, example_inputs=(torch.zeros(4, 32, dtype=torch.long),))
    for a, b in zip(one.layers, four.layers):
        assert b.forward_flops == 4 * a.forward_flops and b.backward_flops == 4 * a.backward_flops
        assert b.saved_bytes_full_recompute == 4 * a.saved_bytes_full_recompute
        assert b.output_bytes == 4 * a.output_bytes or a.fqn == "loss"  # the loss is one scalar
        # Per attention call the flash kernel keeps a 24-byte RNG seed/offset whatever the batch: the only
        # constant term; a scalar loss likewise.
        assert abs(b.saved_bytes_no_recompute - 4 * a.saved_bytes_no_recompute) <= 3 * 24
