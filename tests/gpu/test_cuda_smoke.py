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
