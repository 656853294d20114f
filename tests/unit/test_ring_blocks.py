"""The ring's per-block fused attention against one SDPA call: a ring of one rank visits every kind of block
(a chunk with itself under the causal mask, a later chunk over an earlier one in full), forward and backward."""

import pytest
import torch
import torch.nn.functional as F

from tessera.errors import NotModelledError
from tessera.runtime.context_parallel import RingAttention, RingAttentionMode, _Ring, ring_attention


class OneRankRing(_Ring):
    """A ring of one rank and no process group: it visits its own two chunks and never sends."""

    def __init__(self, seq_len: int) -> None:
        self.group, self.seq_len, self.size, self.rank = None, seq_len, 1, 0

    def start_shift(self, tensor: torch.Tensor) -> tuple[torch.Tensor, list]:
        return tensor, []


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_ring_blocks_match_one_causal_sdpa(dtype, tolerance, kv_heads):
    torch.manual_seed(0)
    B, heads, T, hd = 2, 4, 32, 16
    q = torch.randn(B, heads, T, hd, dtype=dtype, requires_grad=True)
    k = torch.randn(B, kv_heads, T, hd, dtype=dtype, requires_grad=True)
    v = torch.randn(B, kv_heads, T, hd, dtype=dtype, requires_grad=True)
    grad = torch.randn(B, heads, T, hd, dtype=dtype)
    out = RingAttention.apply(q, k, v, OneRankRing(T), hd ** -0.5)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)
    for got, want in zip(grads, expected_grads):
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, atol=tolerance * 4, rtol=tolerance * 4)


def test_under_autocast_the_ring_runs_in_autocast_dtype_as_sdpa_does():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 16, 8) for _ in range(3))  # fp32, as RoPE leaves them under autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        with RingAttentionMode(OneRankRing(16)):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)


def test_fp32_attention_off_cpu_is_refused_with_the_fix():
    q = torch.empty(1, 4, 16, 8, device="meta")  # CUDA's flash kernel takes bf16/fp16 only
    with pytest.raises(NotModelledError, match="takes bf16 or fp16; this attention runs in torch.float32: train with "
                                               "precision bf16, or cp=1"):
        ring_attention(q, q, q, ring=OneRankRing(16))
