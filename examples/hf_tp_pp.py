"""A Hugging Face model trained with tensor and pipeline parallelism by ``tessera.auto_parallelize``, no adapter.

    torchrun --nproc-per-node 4 examples/hf_tp_pp.py      # 4 CPU ranks over gloo: tp=2 x pp=2

The model is transformers' LlamaForCausalLM at a tiny random-initialised size (no download). Tessera reads
its declared tensor-parallel plan, cuts the pipeline stages from a ``torch.export`` trace, and trains on the
default loss (cross-entropy on ``outputs.logits``); every rank prints the same losses a single process would.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import tessera

GLOBAL_BATCH, SEQ_LEN, STEPS, VOCAB = 8, 32, 3, 256


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)  # every rank builds the same weights (rank 0's are broadcast anyway)
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                        max_position_embeddings=SEQ_LEN, use_cache=False))


def train(strategy: str = "tp=2,pp=2", tp_plan: dict[str, str] | None = None) -> list[float]:
    """Train ``STEPS`` steps on every rank of the running process group; returns the global mean losses.
    ``tp_plan`` (module glob -> Hugging Face style) replaces the tensor-parallel plan the model declares."""
    pm = tessera.auto_parallelize(tiny_llama(), f"cpu:ranks={dist.get_world_size()}", global_batch=GLOBAL_BATCH,
                                  seq_len=SEQ_LEN, strategy=strategy, tp_plan=tp_plan)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        tokens = torch.randint(VOCAB, (GLOBAL_BATCH, SEQ_LEN + 1), generator=generator)
        losses.append(pm.train_step((tokens[:, :-1], tokens[:, 1:])))  # next-token targets
    return losses


if __name__ == "__main__":
    dist.init_process_group("gloo")
    print(f"rank {dist.get_rank()}: strategy {train.__defaults__[0]}, losses {train()}")
    dist.destroy_process_group()
