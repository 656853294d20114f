"""CUDA's fused RMSNorm against the composite capture measures: what capture records and what the GPU cost model takes
off (``planner.kernels``, ``stage_views.with_fused_norms``)."""

from dataclasses import replace
from functools import partial

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from tessera.cost_models import Strategy, TrainingConfig, estimate
from tessera.cost_models.compute import GPU_CALIBRATION, stage_compute_s
from tessera.cost_models.partition import stage_totals
from tessera.cost_models.stage_views import with_fused_norms
from tessera.cost_models.profiles import MEGATRON, TESSERA
from tessera.planner.capture import capture_preset
from tessera.planner.kernels import FusedKernels
from tessera.planner.saved_bytes import Ledger
from tessera.planner.tally import Scope, Tally
from tessera.topology import load_cluster

H, S = 64, 32
LLAMA = f"llama:layers=2,hidden={H},heads=4,kv_heads=2,ffn=176,vocab=256,seq={S}"
HF_LLAMA = ("hf:llama:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,"
            "intermediate_size=128,vocab_size=256,max_position_embeddings=64")


def _saving(dtype: torch.dtype, *, weight: str, checkpointed: bool = False) -> int:
    """What the measurement charges for one ``rms_norm`` of a (16, H) input (``weight``: trained, frozen or none)."""
    x = torch.randn(16, H, dtype=dtype, requires_grad=True)
    w = None if weight == "none" else torch.ones(H, dtype=dtype, requires_grad=weight == "trained")
    resident = {} if w is None else {id(w.untyped_storage()): w.untyped_storage()}  # parameters are never charged
    tallies = {"layer": Tally()}
    ledger = Ledger(tallies, Scope(first="layer"), resident)
    norm = partial(torch.nn.functional.rms_norm, normalized_shape=(H,), weight=w, eps=1e-5)
    with FusedKernels(ledger), torch.autograd.graph.saved_tensors_hooks(ledger.pack, lambda tensor: tensor):
        checkpoint(norm, x, use_reentrant=False) if checkpointed else norm(x)
    return tallies["layer"].fused_norm_saving_bytes


@pytest.mark.parametrize(("dtype", "weight", "per_element"), [
    (torch.bfloat16, "trained", 8 - 2),  # the composite keeps the fp32 input and the normalised one; fused: the input
    (torch.bfloat16, "frozen", 4 - 2),  # no weight gradient: the composite keeps the fp32 input alone
    (torch.bfloat16, "none", 4 - 2),
    (torch.float32, "trained", 8 - 4),
    (torch.float32, "none", 0),  # both keep the fp32 input
])
def test_the_saving_is_what_the_composite_saved_beyond_the_fused_kernel(dtype, weight, per_element):
    assert _saving(dtype, weight=weight) == per_element * 16 * H


def test_nothing_is_charged_for_what_the_measurement_did_not_see_saved():
    assert _saving(torch.bfloat16, weight="trained", checkpointed=True) == 0  # a model's own checkpoint hides it


def test_capture_records_what_the_fused_kernel_saves_less():
    layers = {layer.fqn: layer for layer in capture_preset(LLAMA, seq_len=S).layers}
    # two norms a block: 8 bytes per element against the fused kernel's 2 (bf16 input), 4 under autocast (fp32)
    assert layers["blocks.0"].fused_norm_saving_bytes == 2 * (8 - 2) * S * H
    assert layers["blocks.0"].autocast_fused_norm_saving_bytes == 2 * (8 - 4) * S * H
    assert layers["norm"].fused_norm_saving_bytes == (8 - 2) * S * H
    assert layers["head"].fused_norm_saving_bytes == 0
    gpt = capture_preset("gpt:layers=2,hidden=64,heads=4,vocab=256,seq=32", seq_len=S).layers  # LayerNorm: native
    assert all(layer.fused_norm_saving_bytes == 0 for layer in gpt)
    hf = capture_preset(HF_LLAMA, seq_len=S).layers  # LlamaRMSNorm is written out: not torch.rms_norm
    assert all(layer.fused_norm_saving_bytes == 0 for layer in hf)


def test_norms_a_model_declares_rmsnorm_layers_are_measured_apart():
    """transformers' LlamaRMSNorm (declared an RMSNorm kernel layer) keeps an fp32 upcast (4 bytes) and the bf16
    normalised input (2) where a fused kernel keeps the bf16 input (2): 4 bytes per element, in its own field."""
    hf = {layer.fqn: layer for layer in capture_preset(HF_LLAMA, seq_len=S).layers}
    assert hf["model.layers.0"].declared_norm_saving_bytes == 2 * 4 * S * H  # input and post-attention norms
    assert hf["model.norm"].declared_norm_saving_bytes == 4 * S * H
    assert hf["lm_head"].declared_norm_saving_bytes == 0
    assert all(layer.declared_norm_saving_bytes == 0 for layer in capture_preset(LLAMA, seq_len=S).layers)


class _DeclaredFused(torch.nn.Module):
    """A norm that declares itself an RMSNorm kernel layer and calls torch.rms_norm inside."""

    kernel_layer_name = "RMSNorm"

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(H, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.rms_norm(x, (H,), self.weight, 1e-5)


def test_a_torch_rms_norm_inside_a_declared_norm_is_reported_as_itself():
    """The call counts as ``torch.rms_norm`` (a profile fusing that alone takes it off); the module adds only what it
    saves beyond, nothing here. A mode is entered once; its hooks go with it."""
    norm = _DeclaredFused()
    tallies = {"layer": Tally()}
    ledger = Ledger(tallies, Scope(first="layer"), {id(norm.weight.untyped_storage()): norm.weight.untyped_storage()})
    x = torch.randn(16, H, dtype=torch.bfloat16, requires_grad=True)
    kernels = FusedKernels(ledger, norm)
    with kernels, torch.autograd.graph.saved_tensors_hooks(ledger.pack, lambda tensor: tensor):
        norm(x)
        with pytest.raises(RuntimeError, match="entered already"):
            kernels.__enter__()
    assert tallies["layer"].fused_norm_saving_bytes == (8 - 2) * 16 * H  # the composite: two fp32 copies
    assert tallies["layer"].declared_norm_saving_bytes == 0
    norm(x)  # the hooks are gone with the mode
    assert tallies["layer"].fused_norm_saving_bytes == (8 - 2) * 16 * H


def test_declared_norms_come_off_where_the_framework_builds_its_own_model():
    """Megatron-Core runs its own fused RMSNorm whatever a stand-in model writes (``profiles.fused_declared_norms``):
    less memory and less elementwise time than the same profile running the model's own norms, on GPUs only."""
    layers = capture_preset(HF_LLAMA, seq_len=S).layers
    training, strategy = TrainingConfig(global_batch=16, seq_len=S), Strategy.parse("dp=8,zero=1,mbs=2,recompute=none")
    fused, written = MEGATRON, replace(MEGATRON, fused_declared_norms=False)
    gpu = load_cluster("dgx-h100:nodes=1")
    by = {p.name: estimate(layers, gpu, training, strategy, profile=p) for p in (fused, replace(written, name="own"))}
    held = by["own"].memory_by_category_bytes["activations"] - by["megatron"].memory_by_category_bytes["activations"]
    assert held == 2 * (2 * 2 * 4 + 4) * S * H  # two sequences: two blocks' two norms and the final one
    assert by["megatron"].step_time_s < by["own"].step_time_s
    assert not TESSERA.fused_declared_norms  # Tessera's runtime runs the model's own code
    cpu, cpu_training = load_cluster("cpu:ranks=2"), TrainingConfig(global_batch=4, seq_len=S, precision="bf16")
    cpu_strategy = Strategy.parse("dp=2,zero=1,mbs=2,recompute=none")
    assert (estimate(layers, cpu, cpu_training, cpu_strategy, profile=fused).peak_memory_bytes
            == estimate(layers, cpu, cpu_training, cpu_strategy, profile=written).peak_memory_bytes)


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


def test_the_fused_norms_write_no_elementwise_traffic_on_gpus_in_every_layer():
    """A framework that runs the fused kernel (``profiles.fused_rms_norm``) is charged no elementwise time for the fp32
    copies the composite keeps, in every layer, fully recomputed ones too (their forward runs the kernel as well); the
    composite's framework and CPU ranks are charged them."""
    layers = capture_preset(LLAMA, seq_len=S).layers
    blocks = [layer.fqn for layer in layers if layer.kind == "block"]
    training, strategy = TrainingConfig(global_batch=16, seq_len=S), Strategy.parse("dp=8,zero=3,mbs=2,recompute=full")
    composite = replace(TESSERA, fused_rms_norm=False)
    stage = stage_totals(layers, 0, dict.fromkeys(blocks, "full"))
    assert stage.norm_traffic_saving_bytes == (2 * 2 * 6 + 6) * S * H and stage.norm_saving_bytes == 6 * S * H
    gpu = load_cluster("dgx-h100:nodes=1").device
    fused, written = (stage_compute_s(stage, gpu, training, strategy, profile=p) for p in (TESSERA, composite))
    per_byte = 2 * GPU_CALIBRATION.traffic_factor / gpu.memory_bandwidth_bytes_per_s  # two sequences a micro-batch
    assert written[0] - fused[0] == pytest.approx(per_byte * stage.norm_traffic_saving_bytes)  # forward: one pass
    assert written[1] - fused[1] == pytest.approx(2 * per_byte * stage.norm_traffic_saving_bytes)  # backward: two
    cpu = load_cluster("cpu:ranks=2").device
    assert stage_compute_s(stage, cpu, training, strategy) == stage_compute_s(stage, cpu, training, strategy,
                                                                               profile=composite)


def test_a_graph_captured_before_the_figure_existed_still_plans():
    old = [layer.model_copy(update={"autocast_fused_norm_saving_bytes": None})
           for layer in capture_preset(LLAMA, seq_len=S).layers]  # as read back from an older graph's JSON
    strategy = Strategy.parse("dp=8,zero=0,mbs=2,recompute=none")  # DDP: the autocast figures are read
    assert estimate(old, load_cluster("dgx-h100:nodes=1"), TrainingConfig(global_batch=16, seq_len=S), strategy).fits
