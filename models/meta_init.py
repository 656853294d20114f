"""Build models on the meta device without running their weight initialisers.

A meta tensor has a shape and no values, so ``nn.init.normal_`` and friends have nothing to do there; yet torch
runs them through its Python reference kernels (``torch._refs``), which costs time per parameter and imports
``torch._dynamo`` on the first call. ``skipping_init_on_meta()`` turns every ``torch.nn.init`` function and every
in-place random fill (``Tensor.normal_``, ``uniform_``...) applied to a meta tensor into a no-op returning that
tensor; on real tensors they run as usual. Shapes, dtypes and parameters are the same as without it.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

RANDOM_FILLS = frozenset({
    torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.bernoulli_, torch.Tensor.exponential_,
    torch.Tensor.geometric_, torch.Tensor.log_normal_, torch.Tensor.cauchy_, torch.Tensor.random_,
})
"""In-place random fills: what initialisers (``nn.init``, Hugging Face's ``_init_weights``) call on a weight."""


class _SkipInitOnMeta(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch protocol
        kwargs = kwargs or {}
        if func in RANDOM_FILLS or getattr(func, "__module__", None) == "torch.nn.init":
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


def skipping_init_on_meta() -> TorchFunctionMode:
    """A context in which initialising a meta tensor does nothing (see the module docstring)."""
    return _SkipInitOnMeta()
