"""Captured block statistics against independent measurements of the same block.

- Saved-for-backward bytes under each recompute policy against ``torch.distributed._tools.MemTracker`` on fake
  CPU tensors: the activation bytes still alive after the block's forward (the backward's residue), minus its
  output. Selective recomputation is run as ``torch.utils.checkpoint`` around each SDPA call, full
  recomputation as a checkpoint around the whole block.
- Forward FLOPs against ``FlopCounterMode`` on a plain forward of the block, and against the analytic count of
  Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
  eq. 3): 24 b s h^2 (1 + s / (6h)) per layer.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from tessera.models import model_config
from tessera.models.gpt import GPTBlock
from tessera.models.llama import LlamaBlock, rope_tables
from tessera.models.moe import MoEBlock
from tessera.planner.capture import capture_preset

T, H = 48, 96
SPECS = {
    "gpt": f"gpt:layers=3,hidden={H},heads=4,vocab=128,seq={T}",
    "llama": f"llama:layers=3,hidden={H},heads=4,kv_heads=4,ffn=256,vocab=128,seq={T}",
    "llama-gqa": f"llama:layers=3,hidden={H},heads=4,kv_heads=2,ffn=256,vocab=128,seq={T}",
    "moe": f"moe:layers=3,hidden={H},heads=4,kv_heads=4,ffn=128,vocab=128,seq={T},experts=4,top_k=2,shared=64",
}
BLOCKS: dict[str, type[nn.Module]] = {"gpt": GPTBlock, "llama": LlamaBlock, "llama-gqa": LlamaBlock, "moe": MoEBlock}


class _CheckpointedSDPA(TorchFunctionMode):
    """Selective recomputation as a user writes it: checkpoint around every attention core."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func is F.scaled_dot_product_attention:
            return checkpoint(func, *args, use_reentrant=False, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def _block_and_extras(name: str) -> tuple[nn.Module, tuple]:
    config = model_config(SPECS[name])
    block = BLOCKS[name](config)
    extras = () if name == "gpt" else tuple(t.to(torch.bfloat16) for t in rope_tables(config))
    return block, extras


def _retained_activation_bytes(name: str, policy: str) -> int:
    """MemTracker's live activation bytes after one bf16 forward of a fresh block, minus its output."""
    with FakeTensorMode():
        torch.set_default_dtype(torch.bfloat16)
        try:
            block, extras = _block_and_extras(name)  # extras (RoPE tables) live outside the tracker, like buffers
        finally:
            torch.set_default_dtype(torch.float32)
        leaf = torch.empty(1, T, H, dtype=torch.bfloat16, requires_grad=True)
        with MemTracker() as tracker:
            # A non-leaf input, as a block's input is in a model: alive after the forward only if something keeps it.
            x = leaf * 1.0
            if policy == "full":
                out = checkpoint(block, x, *extras, use_reentrant=False)
            elif policy == "selective":
                with _CheckpointedSDPA():
                    out = block(x, *extras)
            else:
                out = block(x, *extras)
            del x
            snapshot = tracker.get_tracker_snapshot("current")
    activations = sum(per_device.get("Activation", 0) for per_device in snapshot.values())
    return activations - out.numel() * out.element_size()


@pytest.mark.parametrize("name", ["gpt", "llama", "moe", "llama-gqa"])
def test_saved_bytes_agree_with_mem_tracker_for_each_policy(name: str) -> None:
    block = capture_preset(SPECS[name], seq_len=T).blocks[1]
    captured = {
        "none": block.saved_bytes_no_recompute,
        "selective": block.saved_bytes_selective,
        "full": block.saved_bytes_full_recompute,
    }
    for policy, ours in captured.items():
        independent = _retained_activation_bytes(name, policy)
        # The goal is 5%; the gap is 0.3% or less, from kernel choices: capture measures what CUDA keeps (the
        # flash kernel's 24 bytes of RNG state; LayerNorm mean/rstd in fp32) where fake CPU tensors run the CPU
        # kernels (no RNG state; LayerNorm statistics in bf16).
        assert ours == pytest.approx(independent, rel=0.005), policy


def _counted_forward_flops(name: str) -> int:
    """FlopCounterMode over a plain meta forward of the block (stock SDPA: the unfused math path)."""
    with torch.device("meta"):
        block, extras = _block_and_extras(name)
        x = torch.empty(1, T, H)
        with FlopCounterMode(display=False) as counter:
            block(x, *(e.to("meta") for e in extras))
    return counter.get_total_flops()


@pytest.mark.parametrize("name", ["gpt", "llama", "llama-gqa", "moe"])
def test_forward_flops_agree_with_flop_counter(name: str) -> None:
    block = capture_preset(SPECS[name], seq_len=T).blocks[1]
    assert block.forward_flops == _counted_forward_flops(name)


@pytest.mark.parametrize(
    ("spec", "seq"), [("gpt3-175b:layers=2", 2048), ("gpt:layers=2,hidden=256,heads=4,vocab=64,seq=512", 512)]
)
def test_gpt_layer_flops_match_narayanan_eq3(spec: str, seq: int) -> None:
    graph = capture_preset(spec, seq_len=seq, fit_seq_scaling=True)
    h = model_config(spec).hidden
    analytic: Callable[[int], float] = lambda s: 24 * s * h * h * (1 + s / (6 * h))  # noqa: E731
    for block in graph.blocks:
        assert block.forward_flops == pytest.approx(analytic(seq), rel=0.02)
        assert block.forward_flops == pytest.approx(analytic(seq), rel=1e-12)  # in fact exact
    long = graph.at_seq_len(8 * seq)  # and at other lengths, from the fitted polynomial
    assert long.blocks[0].forward_flops == pytest.approx(analytic(8 * seq), rel=1e-12)
