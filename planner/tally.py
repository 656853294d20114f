"""What measuring one layer records (``planner.measure``), and which layer is running in the forward."""

from __future__ import annotations

from dataclasses import dataclass, field

LOSS = "loss"
"""FQN of the loss layer (computed outside the model)."""
LINEARS_SEEN = 0.99
"""Share of a layer's forward FLOPs outside its attention cores its linears must account for: the rest (an
einsum, a gating product) is too small to change what the casts read."""


@dataclass
class Tally:
    """Raw measurements of one layer for the measured inputs."""

    forward_flops: int = 0
    backward_flops: int = 0
    saved_bytes: int = 0
    saved_bytes_selective: int | None = None
    core_flops: int = 0
    mm_calls: list[tuple[int, int]] = field(default_factory=list)
    """(FLOPs, output bytes) of each ``aten.mm`` the layer's forward ran, in call order (empty: not measured)."""
    core_output_bytes: int = 0
    addmm_output_bytes: int = 0
    """Output bytes of the layer's ``aten.addmm`` calls (biased linears), summed."""
    linear_input_bytes: int = 0
    """Bytes of the distinct activations the layer's linears read (``aten.mm``, ``addmm``, ``bmm`` against a weight):
    what an FP8 recipe casts; q, k and v reading one tensor count it once."""
    linear_call_input_bytes: int = 0
    """The same counted at every linear call (q, k and v reading one tensor count it three times): what a recipe
    that casts each linear's input on its own (torchao's eager ``Float8Linear``) casts."""
    linear_flops: int = 0
    """Forward FLOPs of those linears: with the attention cores', all the layer's FLOPs when every linear was seen."""
    input_bytes: int = 0
    output_bytes: int = 0
    output_width: int = 0
    heads: int = 0
    kv_heads: int = 0
    kv_head_width: int = 0
    query_head_width: int = 0
    expert_forward_flops: int = 0
    expert_backward_flops: int = 0
    fused_norm_saving_bytes: int = 0
    """What the layer's ``torch.rms_norm`` calls save here beyond what CUDA's fused kernel saves
    (``kernels.FusedKernels``, ``saved_bytes.Ledger.rms_norm``)."""
    declared_norm_saving_bytes: int = 0
    """The same for the layer's modules that declare themselves RMSNorm kernel layers (``kernels.FusedKernels``)."""
    fused_gate_saving_bytes: int = 0
    """What the layer's gated activations (``act(gate) * up``) save here beyond what a fused gated-MLP kernel saves:
    the activations' outputs (``kernels.FusedKernels``, ``saved_bytes.Ledger.gated_activation``)."""
    region_saved_bytes: dict[str, int] = field(default_factory=dict)
    """Of ``saved_bytes``, what each recomputable piece of the layer made (``recompute_regions.REGIONS``)."""
    region_linear_input_bytes: dict[str, int] = field(default_factory=dict)
    """Of ``linear_input_bytes``, what each recomputable piece of the layer made (``recompute_regions``)."""
    region_flops: dict[str, int] = field(default_factory=dict)
    """Forward FLOPs of each recomputable piece's modules (``recompute_regions``)."""
    under_autocast: Tally | None = None
    """The same layer measured with fp32 weights under ``torch.autocast`` (``measure_at_lengths(autocast=True)``)."""

    @property
    def linears_seen(self) -> bool:
        """Whether the linears seen account for the layer's forward FLOPs outside its attention cores."""
        return self.linear_flops >= LINEARS_SEEN * (self.forward_flops - self.core_flops)

    @property
    def op_selective_recompute_flops(self) -> int:
        """What an op-level policy saving every other matmul re-runs: the second, fourth, ... matmuls."""
        return sum(flops for flops, _ in self.mm_calls[1::2])

    @property
    def saved_bytes_op_selective(self) -> int | None:
        """What it keeps: the layer's inputs, the first, third, ... matmuls' outputs and the attention cores'
        (``None`` without matmuls measured)."""
        if not self.mm_calls:
            return None
        return self.input_bytes + sum(nbytes for _, nbytes in self.mm_calls[0::2]) + self.core_output_bytes

    @property
    def saved_bytes_matmul_selective(self) -> int | None:
        """What a policy saving every matmul's output keeps (Tessera's runtime's selective recomputation): the
        layer's inputs and the outputs of its ``aten.mm`` and ``aten.addmm`` calls (``None`` without either)."""
        if not self.mm_calls and not self.addmm_output_bytes:
            return None
        return self.input_bytes + sum(nbytes for _, nbytes in self.mm_calls) + self.addmm_output_bytes


@dataclass
class Scope:
    """Which layer is running in the forward; glue goes to the first layer, after the model to the loss."""

    first: str
    stack: list[str] = field(default_factory=list)
    model_done: bool = False

    def current(self) -> str:
        if self.stack:
            return self.stack[-1]
        return LOSS if self.model_done else self.first
