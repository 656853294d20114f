"""Activation offload's copies back (``runtime.offload``): each block's backward copies back all it saved and the
previous offloaded block's tensors ahead of their use; gradients are those of training without offload.

Run on CPU, where the copies are synchronous; the same bookkeeping drives CUDA's side stream
(``tests/gpu/test_offload_cuda.py`` checks the streams themselves)."""

from __future__ import annotations

import torch
from torch import nn

from tessera.runtime.offload import apply_offload


def stack(blocks: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16)) for _ in range(blocks)))


def gradients(model: nn.Module, x: torch.Tensor, **backward) -> dict[str, torch.Tensor]:
    model(x).square().sum().backward(**backward)
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_each_backward_prefetches_the_block_before_it_and_gradients_are_unchanged():
    plain, offloaded = stack(), stack()
    offloads = apply_offload(offloaded, ["0", "2", "3"])  # block 1 keeps its tensors: 2's predecessor is 0
    x = torch.randn(8, 16)
    torch.testing.assert_close(gradients(offloaded, x), gradients(plain, x), rtol=0, atol=0)
    stats = {fqn: offload.stats for fqn, offload in offloads.items()}
    assert all(s.packed and s.unpacked == s.packed for s in stats.values())
    # Backward runs 3, 2, 1, 0: 3 prefetches 2, 2 prefetches 0 (across the block without offload); 3 has no successor.
    assert stats["3"].prefetched == 0
    assert stats["2"].prefetched == stats["2"].packed and stats["0"].prefetched == stats["0"].packed


def run_two_micro_batches(model: nn.Module, xs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Two forwards in flight (as a pipeline stage holds them), backwards in reverse, then the first graph again."""
    losses = [model(x).square().sum() for x in xs]
    for loss in reversed(losses):
        loss.backward(retain_graph=True)
    losses[0].backward()  # a second use of the graph: every saved tensor is copied back again
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_micro_batches_prefetch_within_their_own_forward_and_a_second_use_copies_again():
    plain, offloaded = stack(2), stack(2)
    offloads = apply_offload(offloaded, ["0", "1"])
    xs = [torch.randn(4, 16) for _ in range(2)]
    torch.testing.assert_close(run_two_micro_batches(offloaded, xs), run_two_micro_batches(plain, xs), rtol=0, atol=0)
    first, second = offloads["0"].stats, offloads["1"].stats
    assert first.unpacked == 3 * first.packed // 2  # 2 forwards packed; 3 backwards unpacked
    assert first.prefetched == first.packed  # each forward's block 0 prefetched by its own block 1's backward
    # The second forward's block 0 ran after the first's block 1, whose backward here runs next: prefetched by it.
    assert second.prefetched == second.packed // 2


def test_tensors_saved_outside_the_block_are_not_offloaded():
    model = stack(2)
    offloads = apply_offload(model, ["0"])
    out = model(torch.randn(2, 16))
    packed = offloads["0"].stats.packed
    (out.exp() * out).sum().backward()  # saved outside any offloaded block: the hooks have left
    assert offloads["0"].stats.packed == packed and offloads["0"].stats.unpacked == packed
