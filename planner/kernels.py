"""Kernels during measurement: the fused ones GPU training runs, and the attention core selective recompute re-runs.

On meta and CPU some functions take composite paths whose saved tensors differ from the fused CUDA kernels a
training run uses; ``FusedKernels`` (a TorchFunctionMode) routes them to the fused ops, which have meta kernels:

**Dropout** in training (``F.dropout``, p > 0) runs ``aten.native_dropout``, which saves a boolean mask (1 byte per
element), as CUDA does; the CPU/meta composite path saves the mask in the input dtype.

**Attention.** ``F.scaled_dot_product_attention`` on 4-D inputs is routed to
``aten._scaled_dot_product_flash_attention``, which is what CUDA dispatches to on the A100 (and CPU, as
``..._flash_attention_for_cpu``; the cuDNN kernel torch prefers on Hopper and Blackwell keeps the same output and
per-row log-sum-exp): it has meta kernels and a FlopCounterMode formula, and it saves O(T) per head --
without the routing, SDPA on meta takes the unfused math path that saves the (T, T) score matrix and overstates
memory by orders of magnitude at long context. Values narrower than the queries and keys (Multi-head Latent
Attention's), which the flash kernel refuses, go to the memory-efficient kernel, which saves the same.

A call with ``attn_mask`` is measured the same way, with the mask kept for backward as the masked fused kernels
(memory-efficient attention; CPU flash) keep it: an additive mask as passed, its storage charged once, to the first
layer that uses it; a boolean one as SDPA turns it into an additive bias of the query's dtype, anew at every call
(so charged to every layer, and re-made by a recomputed core).
On meta only shapes exist, so the kernel choice changes costs, never results. (Hugging Face models build an
explicit boolean causal mask where they cannot tell that a row holds one sequence: their packed-sequence detection
reads the position ids, which fake tensors do not have, so it assumes packing. In eager GPU training of unpacked
rows they pass ``is_causal=True`` and no mask, so while the mode is entered the detection reports one sequence a row
(``transformers.masking_utils.find_packed_sequence_indices``): no ``T x T`` byte mask, 16 GiB at 128K tokens, and
no grouped keys and values repeated to every query head, which transformers' SDPA path does under a mask (a GPU run
passes them grouped, ``enable_gqa``). A sliding-window layer still builds its mask and repeats them, as it does on a
GPU. Packed rows, whose block-diagonal mask a GPU run does build, are not measured: capture's input is one sequence
a row.)

**RMSNorm.** ``torch.rms_norm`` (``nn.RMSNorm``, ``F.rms_norm``) runs on CUDA as one fused kernel,
``aten._fused_rms_norm``, wherever its input and weight share a dtype (and under CUDA autocast, which casts both to
fp32): it saves its input and one fp32 reciprocal RMS per row. On meta and CPU it is the composite, which saves up to
two fp32 tensors of the input's size (the upcast input, and the normalised one where the weight needs a gradient).
The measurement keeps the composite (CPU ranks train with it) and tells ``observer.rms_norm`` what the fused kernel
would save instead; the observer charges the difference from what the call did save (``saved_bytes.Ledger``), for
the cost model to take off on GPUs (``LayerStats.fused_norm_saving_bytes``). Norms written out by hand (Hugging
Face's ``LlamaRMSNorm``) are not ``torch.rms_norm`` and run as written wherever the model's own code runs (Tessera's
runtime, torchtitan on a user's model). They are measured all the same where the model declares them an RMSNorm
kernel layer (transformers' ``@use_kernel_forward_from_hub("RMSNorm")``: ``kernel_layer_name == "RMSNorm"`` on the
class): the module as a whole, as if it were one ``torch.rms_norm`` call, reported with ``declared=True``
(``LayerStats.declared_norm_saving_bytes``), for the cost model to take off where the framework builds the model from
its own modules and so runs its own fused norm whatever the stand-in's code (Megatron-Core's Transformer Engine
RMSNorm: ``profiles.fused_declared_norms``). A ``torch.rms_norm`` call inside such a module is reported as itself, and
the module as what it saves beyond (``saved_bytes.Ledger.rms_norm``), so a profile that fuses ``torch.rms_norm`` alone
takes the call off. transformers marks the modules through its hub-kernel decorator, which transformers 5 applies (it
requires the ``kernels`` package); where nothing is marked, nothing is taken off (the composite: the safe side).

**Gated activations.** A gated MLP (SwiGLU, GeGLU) written out, ``act(gate(x)) * up(x)``, saves three tensors of
its inner width: the gate's output (for the activation's backward), the activation's output and the up projection's
(for the product's). A fused kernel of the pair (Megatron-Core's ``bias_swiglu`` / ``bias_geglu``, Transformer
Engine's ``LayerNormMLP``) keeps its input, the gate's and up's outputs, alone: the activation's output is what the
composite saves beyond it. ``FusedKernels`` marks each ``silu`` / ``gelu`` output and tells
``observer.gated_activation`` when a product saves one (``LayerStats.fused_gate_saving_bytes``), for the cost model to
take off where the framework runs the fused kernel (``profiles.fused_gated_activation``). What it does not see: an
in-place product (``act.mul_(up)``) and activations written out by hand (Hugging Face's ``gelu_new``), both priced as
the composite (more memory, the safe side); and it cannot tell a gated MLP from another gate of the same form (a
Mamba mixer's ``y * silu(z)``), which a fused-kernel framework is then priced without.

**Selective recomputation** (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", Section 4.2) re-runs the *core attention* -- QK^T, softmax, dropout, attention over V -- in backward and
keeps every other activation. Here the core is each SDPA call. What stays saved is what
``torch.utils.checkpoint`` around that call keeps: every tensor saved outside it, plus its inputs (q, k, v and the
mask), which the checkpoint holds to re-run it. Measured attention that is not an SDPA call (a hand-written
``softmax(q @ k.T) @ v``) is not recognised as a core: such a layer reports no selective figure.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

GATE_ACTIVATIONS = (F.silu, F.gelu)
"""The activations a fused gated-MLP kernel applies to the gate (SwiGLU, GeGLU)."""
PRODUCTS = (torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__)
"""How a gated MLP multiplies the activated gate by the up projection."""
CORE_OPS = (
    torch.ops.aten._scaled_dot_product_flash_attention,
    torch.ops.aten._scaled_dot_product_efficient_attention,
    torch.ops.aten._scaled_dot_product_cudnn_attention,
)
"""Aten ops whose forward FLOPs are the attention core (what selective recomputation re-runs)."""


class KernelObserver(Protocol):
    """What the measurement learns about each attention call and each ``torch.rms_norm`` call."""

    def attention_started(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          inputs: tuple[torch.Tensor, ...]) -> None:
        """An SDPA call begins: its query/key/value shapes and the tensors a checkpoint of it would hold."""

    def keep_for_backward(self, tensor: torch.Tensor) -> None:
        """The kernel keeps ``tensor`` for backward outside autograd's view (the mask)."""

    def attention_finished(self) -> None:
        """The SDPA call returned."""

    def mark(self) -> int:
        """A point to count what is saved from (before a ``torch.rms_norm`` call)."""

    def rms_norm(self, mark: int, fused_bytes: int | None, *, declared: bool = False) -> None:
        """A ``torch.rms_norm`` call since ``mark`` ran (``declared``: a module the model declares an RMSNorm kernel
        layer); CUDA's fused kernel would have saved ``fused_bytes`` (``None``: CUDA runs the same composite)."""

    def gated_activation(self, mark: int, activation: torch.Tensor) -> None:
        """A product since ``mark`` multiplied the output of ``silu`` / ``gelu``, ``activation``, by another tensor: a
        gated MLP's, whose fused kernel would not have saved ``activation``."""


class FusedKernels(TorchFunctionMode):
    """Route 4-D SDPA to the flash kernel (reporting each call to ``observer``) and dropout to native_dropout; report
    what each ``rms_norm`` would save less as CUDA's fused kernel (and each RMSNorm kernel layer ``model`` declares,
    while the mode is entered), and each product of a ``silu`` / ``gelu`` output (a gated MLP's, which a fused kernel
    would not save)."""

    def __init__(self, observer: KernelObserver, model: nn.Module | None = None) -> None:
        super().__init__()
        self.observer = observer
        self.activations: dict[int, torch.Tensor] = {}  # silu / gelu outputs by storage (refs keep the ids unique)
        self.declared = [m for m in (model.modules() if model is not None else ()) if declares_rms_norm(m)]
        self.open_declared: list[int] = []  # marks of the declared norms running now, innermost last
        self.handles: list = []
        self.masking, self.packed_detection = None, None

    def __enter__(self) -> "FusedKernels":
        if self.handles or self.packed_detection is not None:
            raise RuntimeError("FusedKernels is entered already; use a new one")
        self.open_declared = []
        for module in self.declared:
            self.handles += [module.register_forward_pre_hook(self._declared_started),
                             module.register_forward_hook(self._declared_finished, always_call=True)]
        self.masking = sys.modules.get("transformers.masking_utils")  # loaded with any transformers model
        self.packed_detection = getattr(self.masking, "find_packed_sequence_indices", None)
        if self.packed_detection is not None:  # one sequence a row, as capture's input is (module docstring)
            self.masking.find_packed_sequence_indices = _one_sequence_a_row
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        if self.packed_detection is not None:
            self.masking.find_packed_sequence_indices = self.packed_detection
            self.packed_detection = None
        return super().__exit__(*exc)

    def _declared_started(self, module: nn.Module, args: tuple) -> None:
        self.open_declared.append(self.observer.mark())

    def _declared_finished(self, module: nn.Module, args: tuple, output: object) -> None:
        mark = self.open_declared.pop()
        if self.open_declared or not args or not isinstance(args[0], torch.Tensor) or output is None:
            return  # nested in another declared norm (reported as that one), no input to size the kernel by, or raised
        weight = getattr(module, "weight", None)
        weight = weight if isinstance(weight, torch.Tensor) else None
        shape = tuple(weight.shape) if weight is not None else (args[0].shape[-1],)
        self.observer.rms_norm(mark, _fused_rms_norm_bytes(args[0], shape, weight), declared=True)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch protocol
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return _fused_sdpa(self.observer, func, *args, **kwargs)
        if func is F.dropout:
            return _fused_dropout(func, *args, **kwargs)
        if func is F.rms_norm or func is torch.rms_norm:
            mark = self.observer.mark()
            output = func(*args, **kwargs)
            self.observer.rms_norm(mark, _fused_rms_norm_bytes(*args, **kwargs))
            return output
        if func in GATE_ACTIVATIONS:
            output = func(*args, **kwargs)
            self.activations[id(output.untyped_storage())] = output
            return output
        if func in PRODUCTS:
            return self._product(func, args, kwargs)
        return func(*args, **kwargs)

    def _product(self, func, args: tuple, kwargs: dict) -> torch.Tensor:  # noqa: ANN001 - a torch callable
        """A product: each factor that is a marked activation's output is reported as a gate."""
        gated = [a for a in args[:2] if isinstance(a, torch.Tensor) and id(a.untyped_storage()) in self.activations]
        mark = self.observer.mark()
        output = func(*args, **kwargs)
        for activation in gated:
            self.observer.gated_activation(mark, activation)
        return output


def _one_sequence_a_row(*args: object, **kwargs: object) -> None:
    """transformers' packed-sequence detection for capture's input, one sequence a row: none packed."""
    return None


def declares_rms_norm(module: nn.Module) -> bool:
    """Whether ``module``'s class declares itself an RMSNorm kernel layer (transformers' hub-kernel mark)."""
    return getattr(type(module), "kernel_layer_name", None) == "RMSNorm"


def _fused_rms_norm_bytes(
    input: torch.Tensor, normalized_shape: Sequence[int] | int = (), weight: torch.Tensor | None = None,
    eps: float | None = None,
) -> int | None:
    """Bytes CUDA's fused ``rms_norm`` saves for ``input``: its input in the dtype it runs in (fp32 under autocast)
    and one fp32 value per row, whenever any gradient is needed; ``None`` where the dtypes differ (CUDA runs the
    composite then)."""
    if not torch.is_grad_enabled() or not (input.requires_grad or (weight is not None and weight.requires_grad)):
        return 0
    if _autocasting(input):
        run_bytes = 4
    elif weight is None or weight.dtype == input.dtype:
        run_bytes = input.element_size()
    else:
        return None
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    rows = input.numel() // max(1, math.prod(shape))
    return run_bytes * input.numel() + 4 * rows


def _fused_dropout(
    stock: object, input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
) -> torch.Tensor:
    if not training or p == 0.0 or inplace:
        return stock(input, p, training, inplace)
    return torch.native_dropout(input, p, True)[0]


def _fused_sdpa(
    observer: KernelObserver,
    stock: object,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    if query.dim() != 4:  # not (B, heads, T, head_dim): measure the stock path
        return stock(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    inputs = (query, key, value) if attn_mask is None else (query, key, value, attn_mask)
    boolean = attn_mask is not None and attn_mask.dtype == torch.bool
    if attn_mask is not None and not boolean:
        observer.keep_for_backward(attn_mask)
    observer.attention_started(query, key, value, inputs)
    try:
        query, key, value = _as_autocast_runs_sdpa(query, key, value)
        if boolean:  # the additive bias SDPA makes of it for this call (module docstring)
            observer.keep_for_backward(torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device))
        if value.shape[-1] != query.shape[-1]:
            return _narrower_values_sdpa(query, key, value, dropout_p, is_causal, scale)
        # The flash kernel broadcasts fewer key/value heads itself (GQA), so enable_gqa needs no handling.
        flash = torch.ops.aten._scaled_dot_product_flash_attention
        return flash(query, key, value, dropout_p, is_causal, False, scale=scale)[0]  # (B, nh, T, hd)
    finally:
        observer.attention_finished()


def _narrower_values_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float,
                          is_causal: bool, scale: float | None) -> torch.Tensor:
    """SDPA whose values are not as wide as its queries and keys (Multi-head Latent Attention: DeepSeek-V3's 192-wide
    queries and keys, 128-wide values), which the flash kernel refuses: the memory-efficient kernel, which takes them
    (as cuDNN's does on Hopper) and saves the same O(T) log-sum-exp per row; its output is as wide as the values.
    It does not broadcast fewer key/value heads, so grouped ones are repeated to every query head first."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    efficient = torch.ops.aten._scaled_dot_product_efficient_attention
    return efficient(query, key, value, None, True, dropout_p, is_causal, scale=scale)[0]


def _as_autocast_runs_sdpa(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Under autocast, SDPA's inputs in its lower-precision dtype, as autocast casts them for the public op (CPU's
    and CUDA's policies both list it); the aten kernel called directly would get them as they come (fp32 after
    rotary embeddings in fp32)."""
    if not _autocasting(tensors[0]):
        return tensors
    dtype = torch.get_autocast_dtype(tensors[0].device.type)
    return tuple(t.to(dtype) if t.dtype == torch.float32 else t for t in tensors)  # autocast leaves fp64 alone


def _autocasting(tensor: torch.Tensor) -> bool:
    """Whether autocast is on for ``tensor``'s device (meta tensors have none)."""
    device = tensor.device.type
    return device in ("cpu", "cuda") and torch.is_autocast_enabled(device)
