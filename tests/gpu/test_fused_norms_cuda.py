"""What CUDA's ``torch.rms_norm`` keeps for the backward, which the GPU cost model assumes (``planner.kernels``,
``stage_views.with_fused_norms``): its input alone (and one fp32 value per row). Skipped without CUDA (CI has none)."""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none is present"),
]

ROWS, WIDTH = 64, 512


def _saved_bytes(x: torch.Tensor, weight: torch.Tensor) -> int:
    storages = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        torch.nn.functional.rms_norm(x, (WIDTH,), weight, 1e-5)
    return sum(storages.values()) - weight.nbytes - 4 * ROWS


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_rms_norm_keeps_its_input_alone(dtype):
    x = torch.randn(ROWS, WIDTH, device="cuda", dtype=dtype, requires_grad=True)
    weight = torch.ones(WIDTH, device="cuda", dtype=dtype, requires_grad=True)
    assert _saved_bytes(x, weight) == x.element_size() * x.numel()


def test_cuda_rms_norm_under_autocast_keeps_an_fp32_input():
    x = torch.randn(ROWS, WIDTH, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.ones(WIDTH, device="cuda", requires_grad=True)  # fp32, as autocast trains
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert _saved_bytes(x, weight) == 4 * x.numel()
