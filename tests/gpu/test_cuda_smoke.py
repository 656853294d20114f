"""GPU checks: skipped with a reason on machines without CUDA (CI has none)."""

import pytest
import torch

from tessera.models import build_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none is present"),
]


def test_tiny_gpt_gives_the_same_loss_on_cuda_as_on_cpu():
    torch.manual_seed(0)
    model = build_model("gpt-tiny", device="cpu")
    ids = torch.randint(0, model.config.vocab, (4, 32))
    cpu_loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
    cuda_model = model.to("cuda")
    cuda_loss = torch.nn.functional.cross_entropy(cuda_model(ids.cuda()).flatten(0, 1), ids.cuda().flatten())
    # TF32 is off by default for matmuls in fp32; kernels differ in summation order only.
    torch.testing.assert_close(cuda_loss.cpu(), cpu_loss, rtol=1e-4, atol=1e-4)


def test_sdpa_runs_the_kernel_tesseras_cost_model_prices():
    """``cost_models.profiles.TESSERA`` prices Tessera's attention on cuDNN where torch prefers it (sm90 and sm100
    parts with a cuDNN past 9.15.0) and on FlashAttention-2 elsewhere: the backend torch chooses here must agree."""
    from torch.nn.attention import SDPBackend

    major, minor = torch.cuda.get_device_capability()
    prefers_cudnn = major in (9, 10) and minor in (0, 3) and torch.backends.cudnn.version() > 91500
    q = torch.randn(1, 8, 2048, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 2, 2048, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    chosen = SDPBackend(torch._fused_sdp_choice(q, k, k, is_causal=True, enable_gqa=True))
    assert chosen == (SDPBackend.CUDNN_ATTENTION if prefers_cudnn else SDPBackend.FLASH_ATTENTION)
