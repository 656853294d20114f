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
    """``cost_models.profiles.TESSERA`` prices Tessera's attention on the first of its kernels this part has a
    published rate for (cuDNN on Hopper and Blackwell, FlashAttention-2 on the A100), assuming torch's SDPA chooses
    it: the backend torch chooses here, for a causal grouped-query call with grads, must be that one."""
    import sys
    from pathlib import Path

    from torch.nn.attention import SDPBackend

    from tessera.cost_models.compute import priced_attention_kernel
    from tessera.cost_models.profiles import TESSERA
    from tessera.topology import load_cluster

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from gpu_check import catalog_cluster

    part = load_cluster(catalog_cluster(torch.cuda.get_device_name())).device.name
    priced = priced_attention_kernel(part, "bf16", TESSERA.attention_kernels)
    if priced is None:
        pytest.skip(f"no published attention rate for {part}: the calibrated fallback prices it")
    q = torch.randn(1, 8, 2048, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 2, 2048, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    chosen = SDPBackend(torch._fused_sdp_choice(q, k, k, is_causal=True, enable_gqa=True))
    expected = {"cudnn": SDPBackend.CUDNN_ATTENTION, "fa2": SDPBackend.FLASH_ATTENTION}[priced]
    assert chosen == expected, (
        f"torch {torch.__version__} with cuDNN {torch.backends.cudnn.version()} runs {chosen.name} on {part}, where "
        f"Tessera prices {priced}: profiles.TESSERA.attention_kernels does not hold for this build")
