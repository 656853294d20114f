"""What Tessera's ring attention (``runtime.context_parallel``) costs on this machine's CPU ranks.

Run: ``.venv/bin/python benchmarks/ring_attention.py [--baseline REV]`` (about a minute).

**Blocks.** One process, one thread, a ring of one rank (its two zig-zag chunks: every kind of block, no
exchange): forward + backward of ``RingAttention`` against one causal SDPA call on the same tensors, by sequence
length; with ``--baseline REV`` also the ring of ``runtime/context_parallel.py`` at that git revision (``abee709``:
the ring that materialised fp32 score blocks). Median of 3 calls after a warm-up.

**Ring.** Four gloo ranks, one thread each, at the attention shapes of ``benchmarks/local_truth.py``'s small models
(2 sequences of 256 tokens, 8 heads, 4 key/value heads, head dim 32): a ring call (forward + backward) at cp 2 (two
rings) and cp 4, against the ``1/cp`` share of the whole sequence's SDPA on one rank: what a ring adds per attention
layer and micro-batch when ranks share cores (slowest rank, median of 40 calls); and the same ring call with its
exchange replaced by a local copy (every rank computes the same blocks on its own keys and values, no rank waits for
another), which splits what the ring adds into its blocks' own overhead and the exchange's waits.

Writes ``benchmarks/results/ring-attention-<hardware>-<date>.md``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tessera.runtime import context_parallel
from tessera.runtime.launch import spawn

HERE = Path(__file__).resolve().parent
BLOCK_SHAPES = dict(batch=1, heads=8, kv_heads=2, head_dim=64)
BLOCK_LENGTHS = (1024, 4096)
RING_SHAPES = dict(batch=2, heads=8, kv_heads=4, head_dim=32, seq_len=256)


def _tensors(batch: int, heads: int, kv_heads: int, head_dim: int, tokens: int):
    torch.manual_seed(0)
    q = torch.randn(batch, heads, tokens, head_dim, requires_grad=True)
    k, v = (torch.randn(batch, kv_heads, tokens, head_dim, requires_grad=True) for _ in range(2))
    return q, k, v, torch.randn(batch, heads, tokens, head_dim)


def _median_s(run, calls: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def one_rank_ring(module, seq_len: int):
    """A ring of one rank of ``module``'s ``_Ring`` (no process group: it never sends)."""

    class OneRank(module._Ring):
        def __init__(self) -> None:
            self.group, self.seq_len, self.size, self.rank = None, seq_len, 1, 0

        def start_shift(self, tensor):
            return tensor, []

    return OneRank()


def block_seconds(module, tokens: int) -> float:
    q, k, v, grad = _tensors(**BLOCK_SHAPES, tokens=tokens)
    ring = one_rank_ring(module, tokens)

    def run() -> None:
        out = module.RingAttention.apply(q, k, v, ring, BLOCK_SHAPES["head_dim"] ** -0.5)
        torch.autograd.grad(out, (q, k, v), grad)

    return _median_s(run, calls=3)


def sdpa_seconds(tokens: int) -> float:
    q, k, v, grad = _tensors(**BLOCK_SHAPES, tokens=tokens)

    def run() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.autograd.grad(out, (q, k, v), grad)

    return _median_s(run, calls=3)


def module_at(revision: str):
    """``runtime/context_parallel.py`` as it was at ``revision``, loaded under another name."""
    source = subprocess.run(["git", "show", f"{revision}:runtime/context_parallel.py"], cwd=HERE.parent,
                            capture_output=True, text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "context_parallel_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("context_parallel_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ring_call(cp: int, calls: int = 40) -> dict[str, float]:
    """On every rank: the median seconds of a ring call and of the whole sequence's SDPA (slowest rank after)."""
    torch.set_num_threads(1)
    shapes = dict(RING_SHAPES)
    seq_len = shapes.pop("seq_len")
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group(list(range(first, first + cp))) for first in range(0, world, cp)]
    ring = context_parallel._Ring(groups[rank // cp], seq_len)
    q, k, v, grad = _tensors(**shapes, tokens=seq_len // cp)
    whole = _tensors(**shapes, tokens=seq_len)
    scale = shapes["head_dim"] ** -0.5

    class Unconnected(context_parallel._Ring):
        def start_shift(self, tensor):  # the same blocks, no exchange: a copy stands in for the received buffer
            return tensor.clone(), []

    unconnected = Unconnected(groups[rank // cp], seq_len)

    def ring_run(ring=ring) -> None:
        out = context_parallel.RingAttention.apply(q, k, v, ring, scale)
        torch.autograd.grad(out, (q, k, v), grad)

    def whole_run() -> None:
        out = F.scaled_dot_product_attention(*whole[:3], is_causal=True, enable_gqa=True)
        torch.autograd.grad(out, whole[:3], whole[3])

    result = {}
    for name, run in (("ring", ring_run), ("unconnected", lambda: ring_run(unconnected)), ("whole", whole_run)):
        dist.barrier()
        result[name] = _median_s(run, calls=calls)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", help="also time the ring of runtime/context_parallel.py at this git revision")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    baseline = module_at(args.baseline) if args.baseline else None
    lines = ["| tokens | SDPA s | ring s | ring / SDPA |" + (f" ring at {args.baseline} s |" if baseline else ""),
             "|---|---|---|---|" + ("---|" if baseline else "")]
    for tokens in BLOCK_LENGTHS:
        sdpa, ring = sdpa_seconds(tokens), block_seconds(context_parallel, tokens)
        row = f"| {tokens} | {sdpa:.3f} | {ring:.3f} | {ring / sdpa:.2f} |"
        lines.append(row + (f" {block_seconds(baseline, tokens):.3f} |" if baseline else ""))
        print(lines[-1], flush=True)
    lines += ["", "| cp | rings on 4 ranks | ring call ms | 1/cp of the whole sequence's SDPA ms | added ms | of it, the "
              "blocks' overhead (no exchange) ms | of it, the exchange ms |", "|---|---|---|---|---|---|---|"]
    for cp in (2, 4):
        per_rank = spawn(ring_call, nprocs=4, args=(cp,))
        ring, unconnected, whole = (max(r[key] for r in per_rank) for key in ("ring", "unconnected", "whole"))
        share = whole / cp
        lines.append(f"| {cp} | {4 // cp} | {ring * 1e3:.1f} | {share * 1e3:.1f} | {(ring - share) * 1e3:.1f} | "
                     f"{(unconnected - share) * 1e3:.1f} | {(ring - unconnected) * 1e3:.1f} |")
        print(lines[-1], flush=True)
    command = "`.venv/bin/python benchmarks/ring_attention.py" + (f" --baseline {args.baseline}" if baseline else "") + "`"
    text = "\n".join([
        f"# Ring attention on CPU ranks ({datetime.date.today().isoformat()})", "",
        f"Command: {command}. Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
        f"1-minute load {load_before:.2f} before, {os.getloadavg()[0]:.2f} after. What each table measures: the "
        "module docstring of `benchmarks/ring_attention.py`.", "",
        f"Blocks: one thread, a ring of one rank, {BLOCK_SHAPES}, forward + backward, median of 3.", "", *lines[:2 + len(BLOCK_LENGTHS)],
        "", f"Ring: 4 gloo ranks, one thread each, {RING_SHAPES}, forward + backward, slowest rank, median of 40.", "",
        *lines[2 + len(BLOCK_LENGTHS) + 1:], "",
    ])
    out = HERE / "results" / f"ring-attention-{platform.machine()}-cpu-{datetime.date.today().isoformat()}.md"
    out.write_text(text)
    print(f"written {out.relative_to(HERE.parent)}")


if __name__ == "__main__":
    sys.exit(main())
