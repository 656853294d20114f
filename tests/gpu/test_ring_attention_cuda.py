"""On a GPU: the ring's per-block CUDA flash kernels (``runtime.context_parallel._block_forward``/``_backward``)
against one SDPA call, forward and backward, in bf16 (a ring of one rank visits every kind of block)."""

import pytest
import torch
import torch.nn.functional as F

from tessera.runtime.context_parallel import RingAttention
from tessera.tests.unit.test_ring_blocks import OneRankRing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none is present"),
]


def test_ring_blocks_on_cuda_flash_match_one_causal_sdpa():
    torch.manual_seed(0)
    B, heads, kv_heads, T, hd = 2, 8, 2, 1024, 128
    make = lambda h: torch.randn(B, h, T, hd, dtype=torch.bfloat16, device="cuda", requires_grad=True)  # noqa: E731
    q, k, v = make(heads), make(kv_heads), make(kv_heads)
    grad = torch.randn(B, heads, T, hd, dtype=torch.bfloat16, device="cuda")
    out = RingAttention.apply(q, k, v, OneRankRing(T), hd ** -0.5)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad)
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)
