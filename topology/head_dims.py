"""How a fused attention kernel's rate depends on the head dimension, from the kernel papers' figures.

The catalog's attention rates (``catalog.yaml`` ``attention_tflops``) are at head dim 128. The same kernels run
slower per FLOP at head dim 64 (less work per byte loaded into shared memory), and at 256 FlashAttention-2 and cuDNN
lose a little again. ``head_dim_rate`` gives a kernel's rate at a head dim over its rate at 128: the median, over
the sequence lengths of each figure (512 to 16K; the ratio moves little with length), of the bars at that head dim
over the bars at 128, causal masks, BF16/FP16, read off the figures:

- FlashAttention-2, forward + backward: Dao 2023 (arXiv 2307.08691), Figure 4 (A100 80GB SXM4) (c) and (d) and
  Figure 7 (H100 80GB SXM5) (c) and (d), head dims 64 and 128 (the repository's
  ``assets/flash2_a100_fwd_bwd_benchmark.png`` and ``assets/flash2_h100_fwd_bwd_benchmark.png``). The Triton
  FlashAttention of the same figures (A100 only), likewise.
- Forward only, H100 80GB SXM5: Shah et al. 2024, 'FlashAttention-3' (arXiv 2407.08608), Figure 5 (b), (d) and (f),
  head dims 64, 128 and 256 (``assets/flash3_fp16_fwd.png``): cuDNN, FlashAttention-3, FlashAttention-2's forward
  beside its forward + backward figures, and Triton's beside its A100 forward + backward. No backward figure at these
  head dims gives cuDNN's or FlashAttention-3's: their forward ratio is taken for the backward too (assumed;
  FlashAttention-2's forward ratio at 64 on the H100, 0.89, lies between its forward + backward ratios on the H100,
  0.87, and on the A100, 0.90).

Between the head dims measured the ratio is linear in the head dim, beyond them flat. A kernel compiled for a few
head dims runs a head at the next one up, its padded columns computed and thrown away (``COMPILED_HEAD_DIMS``):
PyTorch SDPA's copy of FlashAttention-2 has kernels for 32, 64, 96, 128, 160, 192, 224 and 256
(``aten/src/ATen/native/transformers/cuda/flash_attn/static_switch.h``; the flash-attn package had the same until it
dropped 224 in 2024 and 160 in 2025), FlashAttention-3's backward rounds to 64, 96, 128, 192 or 256
(``hopper/flash_api.cpp`` ``round_up_headdim``, at Dao-AILab/flash-attention 0251105a; its forward, a third of the
work, is taken alike), the Triton kernel to a power of two up to 128, its limit (``flash_attn/flash_attn_triton.py``
``BLOCK_HEADDIM``). So a head of 112 runs FlashAttention-2's kernel for 128 at 112/128 of its rate. These kernels run
keys and values of one width: a head whose values are narrower (DeepSeek-V3's latent attention: keys of 192, values of
128) is run at the wider, the values padded. cuDNN's rounding is not published: its heads are taken at the mean of their
key and value widths as they are. The ratios come from Ampere and Hopper figures; Blackwell parts take them too (no
figure at these head dims found for them).
"""

from __future__ import annotations

import functools
import statistics
from typing import NamedTuple

REFERENCE_HEAD_DIM = 128
"""The head dim of the catalog's attention rates."""

# Bars (TFLOP/s) at 512, 1K, 2K, 4K, 8K and 16K tokens, causal.
_BARS: dict[str, dict[int, list[list[float]]]] = {
    "fa2": {
        64: [[88, 119, 140, 156, 165, 171], [141, 192, 232, 257, 273, 284], [180, 229, 262, 284, 295, 299]],
        128: [[99, 133, 155, 173, 182, 189], [163, 221, 265, 294, 308, 328], [191, 260, 298, 319, 333, 335]],
        256: [[None] * 6, [None] * 6, [208, 251, 278, 293, 297, 298]],
    },
    "fa-triton": {
        64: [[59, 75, 79, 76, 79, 80], [152, 291, 342, 363, 377, 363]],
        128: [[50, 61, 68, 74, 78, 80], [146, 273, 323, 353, 369, 378]],
    },
    "cudnn": {
        64: [[225, 288, 334, 363, 379, 388]],
        128: [[315, 410, 484, 518, 529, 539]],
        256: [[308, 391, 450, 483, 497, 509]],
    },
    "fa3": {
        64: [[197, 265, 371, 420, 460, 473]],
        128: [[292, 423, 521, 579, 602, 616]],
        256: [[286, 427, 537, 612, 628, 642]],
    },
}
"""Per kernel and head dim, one row per figure, in the same order at every head dim: FlashAttention-2's A100 and H100
forward + backward figures and its H100 forward (FlashAttention-3 paper); Triton's A100 forward + backward and H100
forward; cuDNN's and FlashAttention-3's H100 forward. ``None``: no bar."""


@functools.cache
def _ratios(kernel: str) -> tuple[tuple[int, float], ...]:
    """``((head dim, rate over the rate at 128), ...)`` in increasing head dim: the median over every bar that has a
    partner at 128 in the same figure."""
    bars = _BARS[kernel]
    points = []
    for dim, rows in sorted(bars.items()):
        pairs = [(value, reference) for row, reference_row in zip(rows, bars[REFERENCE_HEAD_DIM])
                 for value, reference in zip(row, reference_row) if value is not None]
        points.append((dim, statistics.median(value / reference for value, reference in pairs)))
    return tuple(points)


class HeadDims(NamedTuple):
    """The widths of an attention core's key (and query) heads and of its value heads; 0: not measured."""

    key: float = 0.0
    value: float = 0.0


COMPILED_HEAD_DIMS = {"fa2": (32, 64, 96, 128, 160, 192, 224, 256), "fa3": (64, 96, 128, 192, 256),
                      "fa-triton": (16, 32, 64, 128)}
"""The head dims each kernel has compiled code for (module docstring); cuDNN is not listed: taken as it is."""


def head_dim_rate(kernel: str, dims: HeadDims) -> float:
    """``kernel``'s rate on heads of ``dims`` over its rate at head dim 128, counting only the columns the heads
    have (1 where the widths are not measured, or for a kernel without figures)."""
    if not dims.key or kernel not in _BARS:
        return 1.0
    sizes = COMPILED_HEAD_DIMS.get(kernel)
    if sizes is None:
        return _measured_rate(kernel, (dims.key + dims.value) / 2)
    wider = max(dims)
    compiled = next((size for size in sizes if wider <= size), wider)  # past the last: run as it is
    return _measured_rate(kernel, compiled) * (dims.key + dims.value) / (2 * compiled)


def stage_head_rate(kernel: str, heads: tuple[tuple[float, HeadDims], ...]) -> float:
    """``kernel``'s rate over its rate at head dim 128 on a stage whose attention cores run ``heads`` (FLOPs or their
    shares, widths): the FLOPs over the time each width's take at its own rate, so stages add up (1 for none)."""
    flops = sum(weight for weight, _ in heads)
    if not flops:
        return 1.0
    return flops / sum(weight / head_dim_rate(kernel, dims) for weight, dims in heads)


def _measured_rate(kernel: str, head_dim: float) -> float:
    """The figures' ratio at ``head_dim``: linear between the head dims measured, flat beyond them."""
    points = _ratios(kernel)
    if head_dim <= points[0][0]:
        return points[0][1]
    if head_dim >= points[-1][0]:
        return points[-1][1]
    upper = next(i for i, (dim, _) in enumerate(points) if dim >= head_dim)
    (d0, r0), (d1, r1) = points[upper - 1], points[upper]
    return r0 + (head_dim - d0) / (d1 - d0) * (r1 - r0)
