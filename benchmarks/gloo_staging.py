"""What gloo allocates inside a collective beyond its input and output, on 4 CPU ranks: the CPU allocator's peak
during one ``reduce_scatter_tensor`` and one ``all_gather_into_tensor`` of 16 MiB, as a multiple of that size
(``memory_meter.AllocatorMeter``). The memory model charges it on CPU ranks (``cost_models.memory.gloo_staging_bytes``,
and the root's re-gather in ``zero3_gathered_bytes``).

Run: ``.venv/bin/python benchmarks/gloo_staging.py`` (seconds; torch 2.13 printed 1.0 and 1.0 on every rank).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

SIZE = 16 * 2**20


def staged_multiples() -> tuple[float, float]:
    """(reduce-scatter's peak, all-gather's peak), each over the full-size tensor's bytes, on this rank."""
    from memory_meter import AllocatorMeter

    world = dist.get_world_size()
    full, shard = torch.ones(SIZE // 4), torch.ones(SIZE // 4 // world)
    scattered, gathered = torch.empty_like(shard), torch.empty_like(full)  # outputs made outside the meters
    with AllocatorMeter(0) as scatter:
        dist.reduce_scatter_tensor(scattered, full)
    with AllocatorMeter(0) as gather:
        dist.all_gather_into_tensor(gathered, shard)
    return scatter.peak_bytes / SIZE, gather.peak_bytes / SIZE


if __name__ == "__main__":
    from tessera.runtime.launch import spawn

    for rank, (scatter, gather) in enumerate(spawn(staged_multiples, nprocs=4, timeout_s=120)):
        print(f"rank {rank}: reduce_scatter_tensor staged {scatter:.2f}x its input, "
              f"all_gather_into_tensor {gather:.2f}x its output (beyond the tensors passed in)")
