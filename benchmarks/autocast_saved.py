"""What a model saves for its backward under ``torch.autocast`` against the same model run in bf16, beside what
capture measured for it.

Run: ``.venv/bin/python benchmarks/autocast_saved.py [--model SPEC] [--micro-batch N]`` (seconds, one process).

The runtime's DDP, and its TP or PP without data parallelism, run fp32 weights under autocast, which keeps the
residual stream in fp32 (a norm saves a 4-byte input) and casts a shared input once per linear. Capture measures
both ways on fake tensors (``LayerStats.saved_bytes_no_recompute`` and ``autocast_saved_bytes_no_recompute``); this
counts the bytes one real forward of the model saves (a ``saved_tensors_hooks`` count of distinct storages; the
loss aside), autocast's copies of the weights apart (the cost model prices those as ``memory.autocast_copy_bytes``),
and prints both beside capture's sum over the model's layers.
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tessera.models import build_model, model_config
from tessera.planner.capture import capture


class _WeightCasts(TorchDispatchMode):
    """Records the storages of the copies made of the given storages (autocast's casts of the weights)."""

    def __init__(self, weights: set[int]) -> None:
        super().__init__()
        self.weights, self.copies = weights, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch protocol
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and args[0].untyped_storage().data_ptr() in self.weights:
            self.copies.add(out.untyped_storage().data_ptr())
        return out


def saved_bytes(module: torch.nn.Module, *inputs: torch.Tensor, autocast: bool) -> tuple[int, int]:
    """(activations, weight copies): bytes of the distinct storages autograd saves in one forward of ``module``,
    its parameters' own left out, autocast's copies of them counted apart."""
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
    casts = _WeightCasts(weights)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), casts:
        module(*inputs)
    copies = sum(nbytes for key, nbytes in saved.items() if key in casts.copies)
    return sum(nbytes for key, nbytes in saved.items() if key not in weights) - copies, copies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt:layers=4,hidden=256,heads=8,vocab=4096,seq=256",
                        help="a Tessera model spec (default: local_truth's small GPT)")
    parser.add_argument("--micro-batch", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = build_model(args.model, device="cpu")
    config = model_config(args.model)
    ids = torch.randint(0, config.vocab, (args.micro_batch, config.seq_len))
    in_bf16, _ = saved_bytes(copy.deepcopy(model).to(torch.bfloat16), ids, autocast=False)
    under_autocast, copies = saved_bytes(model, ids, autocast=True)
    layers = [layer for layer in capture(model, seq_len=config.seq_len).layers if layer.kind != "loss"]
    mib = 2**20 / args.micro_batch  # capture's figures are per sequence
    captured = sum(layer.saved_bytes_no_recompute for layer in layers) / mib
    captured_autocast = sum(layer.autocast_saved_bytes_no_recompute for layer in layers) / mib
    print(f"{args.model}, micro-batch {args.micro_batch}, the forward without the loss: saved "
          f"{in_bf16 / 2**20:.2f} MiB in bf16 (capture: {captured:.2f}); {under_autocast / 2**20:.2f} MiB under "
          f"autocast (capture: {captured_autocast:.2f}) beside {copies / 2**20:.2f} MiB of weight copies")


if __name__ == "__main__":
    main()
