"""A gated MLP's fused kernel against the composite capture measures: what capture records and what a framework that
runs the kernel (Megatron-Core's ``bias_activation_fusion``) is charged (``planner.kernels``,
``stage_views.with_fused_gates``, ``compute.fused_traffic_saving_bytes``)."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tessera.cost_models import Strategy, TrainingConfig, estimate
from tessera.cost_models.compute import GPU_CALIBRATION, stage_compute_s
from tessera.cost_models.partition import stage_totals
from tessera.cost_models.profiles import MEGATRON
from tessera.planner.capture import capture_preset
from tessera.planner.kernels import FusedKernels
from tessera.planner.saved_bytes import Ledger
from tessera.planner.tally import Scope, Tally
from tessera.topology import load_cluster

H, FFN, S = 64, 176, 32
LLAMA = f"llama:layers=2,hidden={H},heads=4,kv_heads=2,ffn={FFN},vocab=256,seq={S}"
HF_LLAMA = ("hf:llama:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,"
            f"intermediate_size={FFN},vocab_size=256,max_position_embeddings=64")
COMPOSITE = replace(MEGATRON, name="megatron-composite-gates", fused_gated_activation=False)


def _saving(mlp, *, checkpointed: bool = False) -> int:  # noqa: ANN001 - a function of (gate, up)
    """What the measurement charges for ``mlp(gate, up)`` on (16, FFN) inputs."""
    gate, up = (torch.randn(16, FFN, requires_grad=True) for _ in range(2))
    tallies = {"layer": Tally()}
    ledger = Ledger(tallies, Scope(first="layer"), {})
    with FusedKernels(ledger), torch.autograd.graph.saved_tensors_hooks(ledger.pack, lambda tensor: tensor):
        checkpoint(mlp, gate, up, use_reentrant=False) if checkpointed else mlp(gate, up)
    return tallies["layer"].fused_gate_saving_bytes


def test_the_activations_output_is_what_the_composite_saves_beyond_the_fused_kernel():
    activated = 16 * FFN * 4  # fp32 here
    assert _saving(lambda g, u: F.silu(g) * u) == activated  # SwiGLU
    assert _saving(lambda g, u: u * F.gelu(g, approximate="tanh")) == activated  # GeGLU, either order
    assert _saving(lambda g, u: torch.mul(torch.nn.SiLU()(g), u)) == activated  # as a module, as torch.mul
    assert _saving(lambda g, u: F.silu(g) + u) == 0  # no product: nothing a gated kernel fuses
    assert _saving(lambda g, u: F.silu(g) * u, checkpointed=True) == 0  # the model's own checkpoint saves nothing


@pytest.mark.parametrize("spec", [LLAMA, HF_LLAMA])
def test_capture_records_one_activated_gate_per_token_in_each_gated_block(spec: str):
    if spec.startswith("hf:"):
        pytest.importorskip("transformers")
    layers = {layer.fqn: layer for layer in capture_preset(spec, seq_len=S).layers}
    blocks = [layer for layer in layers.values() if layer.kind == "block"]
    assert {block.fused_gate_saving_bytes for block in blocks} == {2 * S * FFN}  # bf16
    assert sum(layer.fused_gate_saving_bytes for layer in layers.values()) == 2 * 2 * S * FFN
    gpt = capture_preset("gpt:layers=2,hidden=64,heads=4,vocab=256,seq=32", seq_len=S).layers  # GELU, ungated
    assert all(layer.fused_gate_saving_bytes == 0 for layer in gpt)


def test_a_framework_with_the_fused_kernel_keeps_less_where_the_blocks_keep_their_activations():
    layers = capture_preset(LLAMA, seq_len=S).layers
    gpu, training = load_cluster("dgx-h100:nodes=1"), TrainingConfig(global_batch=16, seq_len=S)

    def held(recompute: str) -> int:
        strategy = Strategy.parse(f"dp=8,zero=1,mbs=2,recompute={recompute}")
        return (estimate(layers, gpu, training, strategy, profile=COMPOSITE).memory_by_category_bytes["activations"]
                - estimate(layers, gpu, training, strategy, profile=MEGATRON).memory_by_category_bytes["activations"])

    assert held("none") == 2 * 2 * 2 * S * FFN  # two sequences a micro-batch, two blocks
    assert held("selective") == held("none")  # Megatron's selective policy re-runs the attention core alone
    assert held("full") == 0  # a fully recomputed block keeps its input alone


def test_the_fused_kernel_writes_no_activation_output_on_gpus():
    layers = capture_preset(LLAMA, seq_len=S).layers
    training, strategy = TrainingConfig(global_batch=16, seq_len=S), Strategy.parse("dp=8,zero=1,mbs=2,recompute=none")
    stage = stage_totals(layers, 0, {})
    gpu = load_cluster("dgx-h100:nodes=1").device
    fused, written = (stage_compute_s(stage, gpu, training, strategy, profile=p) for p in (MEGATRON, COMPOSITE))
    per_byte = 2 * GPU_CALIBRATION.traffic_factor / gpu.memory_bandwidth_bytes_per_s  # two sequences a micro-batch
    assert written[0] - fused[0] == pytest.approx(per_byte * 2 * 2 * S * FFN)  # forward: one pass
    assert written[1] - fused[1] == pytest.approx(2 * per_byte * 2 * 2 * S * FFN)  # backward: two
    cpu = load_cluster("cpu:ranks=2").device
    assert stage_compute_s(stage, cpu, training, strategy, profile=MEGATRON) == stage_compute_s(
        stage, cpu, training, strategy, profile=COMPOSITE)
