"""CUDA's fused RMSNorm against the composite capture measures: what capture records and what the GPU cost model takes
off (``planner.kernels``, ``partition.with_fused_norms``)."""

from dataclasses import replace

import pytest
import torch

from tessera.cost_models import Strategy, TrainingConfig, estimate
from tessera.cost_models.partition import stage_totals, with_fused_norms
from tessera.cost_models.profiles import TESSERA
from tessera.planner.capture import capture_preset
from tessera.planner.kernels import COMPOSITE_RMS_NORM_BYTES
from tessera.topology import load_cluster

H, S = 64, 32
LLAMA = f"llama:layers=2,hidden={H},heads=4,kv_heads=2,ffn=176,vocab=256,seq={S}"
HF_LLAMA = ("hf:llama:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,"
            "intermediate_size=128,vocab_size=256,max_position_embeddings=64")


def _saved_bytes(fn, *tensors: torch.Tensor) -> int:
    storages = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn(*tensors)
    return sum(storages.values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_composite_rms_norm_saves_two_fp32_copies_of_its_input(dtype):
    x = torch.randn(16, H, dtype=dtype, requires_grad=True)
    weight = torch.ones(H, dtype=dtype, requires_grad=True)
    saved = _saved_bytes(lambda x, w: torch.nn.functional.rms_norm(x, (H,), w, 1e-5), x, weight)
    rstd = 4 * 16  # one fp32 value per row, which the fused kernel keeps too
    assert saved - weight.nbytes - rstd == COMPOSITE_RMS_NORM_BYTES * x.numel()


def test_capture_records_what_the_fused_kernel_saves_less():
    layers = {layer.fqn: layer for layer in capture_preset(LLAMA, seq_len=S).layers}
    # two norms a block: 8 bytes per element against the fused kernel's 2 (bf16 input), 4 under autocast (fp32)
    assert layers["blocks.0"].fused_norm_saving_bytes == 2 * (8 - 2) * S * H
    assert layers["blocks.0"].autocast_fused_norm_saving_bytes == 2 * (8 - 4) * S * H
    assert layers["norm"].fused_norm_saving_bytes == (8 - 2) * S * H
    assert layers["head"].fused_norm_saving_bytes == 0
    gpt = capture_preset("gpt:layers=2,hidden=64,heads=4,vocab=256,seq=32", seq_len=S).layers  # LayerNorm: native
    assert all(layer.fused_norm_saving_bytes == 0 for layer in gpt)
    hf = capture_preset(HF_LLAMA, seq_len=S).layers  # LlamaRMSNorm is written out: it runs as written everywhere
    assert all(layer.fused_norm_saving_bytes == 0 for layer in hf)


def test_the_fused_norms_come_off_what_is_kept_where_the_policy_keeps_them():
    layers = capture_preset(LLAMA, seq_len=S).layers
    blocks = [layer.fqn for layer in layers if layer.kind == "block"]
    plain = stage_totals(layers, 0, {})
    per_block, final = 2 * 6 * S * H, 6 * S * H
    assert with_fused_norms(plain, "matmuls").saved_bytes == plain.saved_bytes - 2 * per_block - final
    selective = stage_totals(layers, 0, dict.fromkeys(blocks, "selective"))
    assert with_fused_norms(selective, "attention").saved_bytes == selective.saved_bytes - 2 * per_block - final
    assert with_fused_norms(selective, "matmuls").saved_bytes == selective.saved_bytes - final  # norms re-run
    full = stage_totals(layers, 0, dict.fromkeys(blocks, "full"))
    assert with_fused_norms(full, "attention").saved_bytes == full.saved_bytes - final


def test_gpu_plans_hold_less_cpu_ranks_the_composite():
    layers = capture_preset(LLAMA, seq_len=S).layers
    training, strategy = TrainingConfig(global_batch=16, seq_len=S), Strategy.parse("dp=8,zero=3,mbs=2,recompute=none")
    composite = replace(TESSERA, fused_rms_norm=False)
    gpu = load_cluster("dgx-h100:nodes=1")
    held = (estimate(layers, gpu, training, strategy, profile=composite).memory_by_category_bytes["activations"]
            - estimate(layers, gpu, training, strategy).memory_by_category_bytes["activations"])
    assert held == 2 * (2 * 2 * 6 + 6) * S * H  # two sequences: two blocks' norms and the final one
    cpu, cpu_training = load_cluster("cpu:ranks=2"), TrainingConfig(global_batch=4, seq_len=S, precision="bf16")
    cpu_strategy = Strategy.parse("dp=2,zero=3,mbs=2,recompute=none")
    assert (estimate(layers, cpu, cpu_training, cpu_strategy).peak_memory_bytes
            == estimate(layers, cpu, cpu_training, cpu_strategy, profile=composite).peak_memory_bytes)
