"""What one block saves for its backward under ``torch.autocast`` against the same block run in bf16.

Run: ``.venv/bin/python benchmarks/autocast_saved.py [--model SPEC] [--micro-batch N]`` (seconds, one process).

Capture measures a model run in bf16; the runtime's DDP, and its TP or PP without data parallelism, run fp32
weights under autocast, which keeps the residual stream in fp32 (a norm saves a 4-byte input) and casts a shared
input once per linear. This prints the block's saved bytes both ways, autocast's weight copies apart (the cost model
prices those as ``memory.autocast_copy_bytes``), from a ``saved_tensors_hooks`` count of distinct storages.
"""

from __future__ import annotations

import argparse
import copy

import torch

from tessera.models import build_model, model_config


def saved_storages(block: torch.nn.Module, x: torch.Tensor, *, autocast: bool) -> dict[int, tuple]:
    """The storages autograd saves in one forward of ``block``, the parameters' own excluded: address -> (bytes,
    dtype, shape)."""
    saved: dict[int, tuple[int, torch.dtype, tuple]] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = (storage.nbytes(), tensor.dtype, tuple(tensor.shape))
        return tensor

    parameters = {p.untyped_storage().data_ptr() for p in block.parameters()}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    return {key: value for key, value in saved.items() if key not in parameters}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt:layers=4,hidden=256,heads=8,vocab=4096,seq=256",
                        help="a Tessera GPT spec (default: local_truth's small GPT)")
    parser.add_argument("--micro-batch", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = build_model(args.model, device="cpu")
    block = model.blocks[len(model.blocks) // 2]
    config = model_config(args.model)
    x = torch.randn(args.micro_batch, config.seq_len, config.hidden)
    in_bf16 = saved_storages(copy.deepcopy(block).to(torch.bfloat16), x.to(torch.bfloat16), autocast=False)
    under_autocast = saved_storages(block, x, autocast=True)
    weight_shapes = {tuple(p.shape) for p in block.parameters() if p.dim() == 2}  # autocast's bf16 weight copies
    copies = sum(n for n, dtype, shape in under_autocast.values() if dtype == torch.bfloat16 and shape in weight_shapes)
    mib = 2**20
    bf16_bytes = sum(n for n, _, _ in in_bf16.values())
    autocast_bytes = sum(n for n, _, _ in under_autocast.values()) - copies
    print(f"{args.model}, one block, micro-batch {args.micro_batch}: saved {bf16_bytes / mib:.2f} MiB in bf16; "
          f"{autocast_bytes / mib:.2f} MiB under autocast beside {copies / mib:.2f} MiB of weight copies")


if __name__ == "__main__":
    main()
