"""What one block saves for its backward under ``torch.autocast`` against the same block run in bf16, beside what
capture measured for it.

Run: ``.venv/bin/python benchmarks/autocast_saved.py [--model SPEC] [--micro-batch N]`` (seconds, one process).

The runtime's DDP, and its TP or PP without data parallelism, run fp32 weights under autocast, which keeps the
residual stream in fp32 (a norm saves a 4-byte input) and casts a shared input once per linear. Capture measures
both ways on fake tensors (``LayerStats.saved_bytes_no_recompute`` and ``autocast_saved_bytes_no_recompute``); this
counts the bytes a real run saves, from a ``saved_tensors_hooks`` count of distinct storages, autocast's weight
copies apart (the cost model prices those as ``memory.autocast_copy_bytes``), and prints the two side by side.
"""

from __future__ import annotations

import argparse
import copy

import torch

from tessera.models import build_model, model_config
from tessera.planner.capture import capture


def saved_bytes(block: torch.nn.Module, x: torch.Tensor, *, autocast: bool) -> tuple[int, int]:
    """(activations, weight copies): bytes of the distinct storages autograd saves in one forward of ``block``,
    the parameters' own left out, autocast's bf16 copies of the matrices counted apart."""
    saved: dict[int, tuple[int, torch.dtype, tuple]] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = (storage.nbytes(), tensor.dtype, tuple(tensor.shape))
        return tensor

    parameters = {p.untyped_storage().data_ptr() for p in block.parameters()}
    weight_shapes = {tuple(p.shape) for p in block.parameters() if p.dim() == 2}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    kept = [value for key, value in saved.items() if key not in parameters]
    copies = sum(n for n, dtype, shape in kept if autocast and dtype == torch.bfloat16 and shape in weight_shapes)
    return sum(n for n, _, _ in kept) - copies, copies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt:layers=4,hidden=256,heads=8,vocab=4096,seq=256",
                        help="a Tessera GPT spec (default: local_truth's small GPT)")
    parser.add_argument("--micro-batch", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = build_model(args.model, device="cpu")
    middle = len(model.blocks) // 2
    block = model.blocks[middle]
    config = model_config(args.model)
    x = torch.randn(args.micro_batch, config.seq_len, config.hidden)
    in_bf16, _ = saved_bytes(copy.deepcopy(block).to(torch.bfloat16), x.to(torch.bfloat16), autocast=False)
    under_autocast, copies = saved_bytes(block, x, autocast=True)
    captured = capture(model, seq_len=config.seq_len).blocks[middle]
    mib = 2**20 / args.micro_batch  # capture's figures are per sequence
    print(f"{args.model}, one block, micro-batch {args.micro_batch}: saved {in_bf16 / 2**20:.2f} MiB in bf16 "
          f"(capture: {captured.saved_bytes_no_recompute / mib:.2f}); {under_autocast / 2**20:.2f} MiB under autocast "
          f"(capture: {captured.autocast_saved_bytes_no_recompute / mib:.2f}) beside {copies / 2**20:.2f} MiB of "
          "weight copies")

if __name__ == "__main__":
    main()
