"""What capture measures of one layer (``LayerStats``) and the linear pairs tensor parallelism splits in it: the
record every cost model reads instead of a torch module (imports run one way, ``cost_models <- planner``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from tessera.cost_models.types import BlockKind, FROZEN, LayerKind


class LinearPair(BaseModel):
    """Linears that tensor parallelism splits together: column-parallel inputs feeding one row-parallel output."""

    model_config = FROZEN

    column: tuple[str, ...]
    """FQNs (relative to the layer) of the column-parallel linears, e.g. ``("attn.q", "attn.k", "attn.v")``."""
    row: str
    """FQN (relative to the layer) of the row-parallel linear that consumes them, e.g. ``"attn.o"``."""
    role: Literal["attention", "mlp", "expert"]
    """What the pair computes; attention pairs split by heads."""


class LayerStats(BaseModel):
    """Measured statistics of one layer (a module FQN) for ONE sequence of ``seq_len`` tokens."""

    model_config = FROZEN

    fqn: str
    """Stable module FQN (``blocks.3``); ``loss`` for the loss computed outside the model."""
    kind: LayerKind
    """Role of the layer in the model."""
    signature: str
    """Identical repeated layers (same class, shapes and measured numbers) share this key."""
    param_count: int = Field(ge=0)
    """Parameters owned by this layer (a tied weight is counted once, at its first owner)."""
    forward_flops: float = Field(ge=0)
    """FLOPs of the forward pass for one sequence (FlopCounterMode)."""
    backward_flops: float = Field(ge=0)
    """FLOPs of the backward pass for one sequence (FlopCounterMode)."""
    saved_bytes_no_recompute: int = Field(ge=0)
    """Bytes autograd saves for backward for one sequence when nothing is recomputed."""
    saved_bytes_full_recompute: int = Field(ge=0)
    """Bytes kept for one sequence under full recomputation (the layer's inputs)."""
    output_bytes: int = Field(ge=0)
    """Bytes of the layer's output for one sequence."""
    saved_bytes_selective: int | None = Field(default=None, ge=0)
    """Bytes kept for one sequence under selective recomputation (attention core recomputed);
    ``None`` when not measured (treated as no saving)."""
    selective_recompute_flops: float = Field(default=0.0, ge=0)
    """Forward FLOPs re-run for one sequence under selective recomputation (the attention core)."""
    mla_up_proj_saved_bytes: int = Field(default=0, ge=0)
    """Of ``saved_bytes_no_recompute``, what latent attention's up-projections and the rotary embedding after them
    make for one sequence: what recomputing them frees (Megatron-Core's ``mla_up_proj``,
    ``planner.recompute_regions``); 0 where the block has none, or not measured."""
    mla_up_proj_flops: float = Field(default=0.0, ge=0)
    """Forward FLOPs of those up-projections for one sequence: what recomputing them re-runs."""
    mlp_saved_bytes: int = Field(default=0, ge=0)
    """Of ``saved_bytes_no_recompute``, what the block's MLP child makes for one sequence, less its output and its gated
    activations' outputs (``fused_gate_saving_bytes`` has those): what recomputing it as a checkpoint frees
    (Megatron-Core's ``mlp`` where ``experts`` is 0, its ``moe`` where not); 0 where not measured."""
    mlp_flops: float = Field(default=0.0, ge=0)
    """Forward FLOPs of the block's MLP child for one sequence."""
    mlp_linear_input_bytes: int = Field(default=0, ge=0)
    """Of ``mlp_saved_bytes``, what linears read (``linear_input_bytes``' part), which an FP8 recipe saves at half
    its size (``cost_models.fp8.saved_input_reduction_bytes``)."""
    input_norm_saved_bytes: int = Field(default=0, ge=0)
    """Of ``saved_bytes_no_recompute``, the output of the norm in front of the block's attention for one sequence (all
    of it linears' input): what re-making it frees (part of Megatron-Core's ``layernorm``); 0 where not measured."""
    mlp_norm_saved_bytes: int = Field(default=0, ge=0)
    """The same for the norm in front of the block's MLP."""
    moe_act_saved_bytes: int = Field(default=0, ge=0)
    """Of ``saved_bytes_no_recompute``, what the routed experts' activation makes for one sequence at the measured
    load (the product of a gated one; its own output is ``fused_gate_saving_bytes``'): what re-making it frees
    (Megatron-Core's ``moe_act``); 0 where not measured."""
    shared_experts_saved_bytes: int = Field(default=0, ge=0)
    """The same as ``mlp_saved_bytes`` for a MoE block's shared experts (Megatron-Core's ``shared_experts``)."""
    shared_experts_flops: float = Field(default=0.0, ge=0)
    """Forward FLOPs of those shared experts for one sequence."""
    shared_experts_linear_input_bytes: int = Field(default=0, ge=0)
    """Of ``shared_experts_saved_bytes``, what linears read (as ``mlp_linear_input_bytes``)."""
    module_recompute_saving_bytes: int = Field(default=0, ge=0)
    """What the pieces a strategy recomputes free of this block for one sequence (``Strategy.recompute_modules``; set
    by ``cost_models.module_recompute``, never by capture)."""
    module_recompute_flops: float = Field(default=0.0, ge=0)
    """What they re-run, forward FLOPs for one sequence (set likewise)."""
    module_recompute_linear_input_bytes: int = Field(default=0, ge=0)
    """Of ``module_recompute_saving_bytes``, what linears read (set likewise)."""
    module_recompute_exchanges: bool = False
    """Whether they re-run the block's expert all-to-alls (Megatron-Core's ``moe``; set likewise)."""
    op_selective_recompute_flops: float = Field(default=0.0, ge=0)
    """Forward FLOPs re-run for one sequence under op-level selective recomputation as torchtitan runs it: every
    second matrix multiplication (``aten.mm``) of the layer in the order they run (``cost_models.profiles``); 0
    when not measured."""
    saved_bytes_op_selective: int | None = Field(default=None, ge=0)
    """Bytes kept for one sequence under that op-level policy: the layer's inputs and the outputs of its other
    matmuls and of its attention cores; ``None`` when not measured (priced as ``saved_bytes_selective``)."""
    saved_bytes_matmul_selective: int | None = Field(default=None, ge=0)
    """Bytes kept for one sequence when selective recomputation keeps every matmul's output and re-runs the rest
    (Tessera's runtime: ``runtime.recompute``): the layer's inputs and the outputs of its ``aten.mm`` and
    ``aten.addmm`` calls; ``None`` when not measured (priced as ``saved_bytes_selective``)."""
    autocast_saved_bytes_no_recompute: int | None = Field(default=None, ge=0)
    """``saved_bytes_no_recompute`` with fp32 weights under ``torch.autocast`` to the measured dtype, as the runtime
    trains where no FSDP unit casts the weights: the residual stream stays fp32 and each linear saves its own cast
    input; autocast's weight copies not counted. ``None`` when not measured (priced as the plain figure). The three
    ``autocast_saved_bytes_*`` fields below are the other policies' figures under autocast, likewise."""
    autocast_saved_bytes_full_recompute: int | None = Field(default=None, ge=0)
    autocast_saved_bytes_selective: int | None = Field(default=None, ge=0)
    autocast_saved_bytes_op_selective: int | None = Field(default=None, ge=0)
    autocast_saved_bytes_matmul_selective: int | None = Field(default=None, ge=0)
    fused_norm_saving_bytes: int = Field(default=0, ge=0)
    """Bytes per sequence the layer's ``torch.rms_norm`` calls save beyond what CUDA's fused kernel saves, when the
    layer is not recomputed (``planner.kernels``: the composite measured here keeps two fp32 copies of the input, the
    fused kernel the input alone): what the cost model takes off on GPUs where the framework's norm is that kernel
    (``profiles.fused_rms_norm``)."""
    autocast_fused_norm_saving_bytes: int | None = Field(default=None, ge=0)
    """The same under autocast (the fused kernel runs in fp32 there); ``None`` when not measured."""
    declared_norm_saving_bytes: int = Field(default=0, ge=0)
    """The same for the norms written out by hand that the model declares RMSNorm kernel layers (transformers'
    ``LlamaRMSNorm``, ``Qwen3MoeRMSNorm``: ``planner.kernels``), each module measured as one norm: what a framework
    that builds the model from its own modules takes off (``profiles.fused_declared_norms``); the model's own code,
    which Tessera's runtime runs, keeps the composite. Measured without autocast only: no framework that autocasts
    swaps a model's norms for its own."""
    fused_gate_saving_bytes: int = Field(default=0, ge=0)
    """Bytes per sequence the layer's gated activations (SwiGLU, GeGLU: ``act(gate) * up``) save beyond what a fused
    gated-MLP kernel saves, when the layer is not recomputed: the activations' outputs (``planner.kernels``). What
    the cost model takes off where the framework runs that kernel (``profiles.fused_gated_activation``); the same
    under autocast, which runs the activation in the linears' dtype. 0 where none was seen (or its experts were
    replayed)."""
    autocast_output_bytes: int | None = Field(default=None, ge=0)
    """``output_bytes`` under autocast (a block's output is the fp32 residual stream): what a pipeline stage
    boundary holds there; ``None`` when not measured."""
    hidden_size: int = Field(default=0, ge=0)
    """Width of the layer's output activations (0 when not a transformer layer)."""
    attention_heads: int = Field(default=0, ge=0)
    """Query heads of the layer's attention (0 if none); tensor parallelism must divide it."""
    kv_heads: int = Field(default=0, ge=0)
    """Key/value heads (grouped-query attention); equal to ``attention_heads`` for multi-head attention."""
    kv_head_width: int = Field(default=0, ge=0)
    """A key head's width plus a value head's, as the layer's SDPA call reads them: what one key/value head holds
    per token (context parallelism's ring moves ``kv_heads`` of them). 0 where not measured: ``2 * hidden / heads``,
    which misses a head wider than that (Qwen3's 128 at hidden 2048 and 32 heads) and latent attention's (DeepSeek-V3:
    keys of 192, values of 128)."""
    query_head_width: int = Field(default=0, ge=0)
    """A query head's width (a key head's too), as the layer's SDPA call reads it; 0 where not measured (half of
    ``kv_head_width``). With ``kv_head_width``, what a fused attention kernel's rate depends on
    (``topology.head_dims``)."""
    experts: int = Field(default=0, ge=0)
    """Routed experts in the layer (0 for dense layers); expert parallelism must divide it."""
    top_k: int = Field(default=0, ge=0)
    """Routed experts each token is sent to (0 for dense layers, or when the model does not declare it)."""
    linear_input_bytes: int | None = Field(default=None, ge=0)
    """Bytes of the distinct activations the layer's linears read for one sequence (q, k and v reading one
    tensor count it once; batched experts, each token's copy for each expert): what an FP8 recipe casts
    (``cost_models.fp8``). ``None`` where capture did not see every linear (a replayed element, a grouped GEMM): the
    cost model falls back to a share of the saved activations."""
    linear_call_input_bytes: int | None = Field(default=None, ge=0)
    """The same counted at every linear call (q, k and v reading one tensor: three times): what a recipe that casts
    each linear's input on its own casts (``profiles.fp8_casts_per_linear``); ``None`` where ``linear_input_bytes``
    is."""
    widest_matrix_dim: int = Field(default=0, ge=0)
    """Largest dimension of the block's matrix weights (its MLP's inner width, typically): per token, the widest
    matmul operand an FP8 cast reads (0 outside blocks)."""
    largest_matrix_params: int = Field(default=0, ge=0)
    """Elements of the block's largest matrix weight (one expert's, for stacked experts; 0 outside blocks)."""
    expert_param_count: int = Field(default=0, ge=0)
    """Parameters of the routed experts, all of them (a part of ``param_count``): what expert parallelism
    divides. The router and a shared expert are dense and not included."""
    expert_width: int = Field(default=0, ge=0)
    """The narrowest dimension of one routed expert's weight matrices (its inner width where that is narrower than
    the hidden size; 0 for dense layers, or where capture did not see it): the width of the experts' matmuls on the
    efficiency curve (``cost_models.compute``), as the hidden size over tp is the dense block's."""
    expert_forward_flops: float = Field(default=0.0, ge=0)
    """Forward FLOPs of the routed experts for one sequence at the measured load (a part of ``forward_flops``)."""
    expert_backward_flops: float = Field(default=0.0, ge=0)
    """Backward FLOPs of the routed experts for one sequence at the measured load (a part of ``backward_flops``)."""
    expert_capacity_factor: float = Field(default=1.0, gt=0)
    """Load factor the experts were measured at: each expert processes ``top_k * tokens / experts`` times this
    many token slots (1.0 = perfectly balanced routing; more = headroom for the busiest expert). The expert
    all-to-alls carry the same factor."""
    mtp_embedding_params: int = Field(default=0, ge=0)
    """A multi-token-prediction module's (``planner.layer_graph.with_mtp_modules``): parameters of the embedding table
    it looks the next tokens up in, shared with the model's. A pipeline stage that runs the module without the
    embedding holds a copy, with its gradients and optimizer state (Megatron-Core builds the embedding wherever
    ``pre_process or mtp_process``, ``gpt_model.py``); not a part of ``param_count``."""
    vocab_size: int = Field(default=0, ge=0)
    """Vocabulary dimension of an embedding or LM head (0 otherwise); vocabulary parallelism splits it."""
    tp_pairs: tuple[LinearPair, ...] = ()
    """Column/row-parallel linear pairs: each costs one activation all-reduce forward and one backward."""
    block_kind: BlockKind = ""
    """What the block is (``BlockKind``; ``""`` for other layers). Blocks of one kind may still differ in
    size: ``signature`` says which are alike."""
    attention_window: int = Field(default=0, ge=0)
    """Tokens each query of a ``local-attention`` / ``local-moe`` block attends to (its sliding window or chunk,
    as the model declares it; ``tessera.planner.block_kinds``); 0 for global attention and other layers. The
    measured FLOPs count the attention core whole (FlopCounterMode prices the SDPA call, not the mask): a cost
    model that prices local attention scales the core by the window."""

    @property
    def params_per_expert(self) -> float:
        """Parameters of one routed expert (0 for a dense layer)."""
        return self.expert_param_count / self.experts if self.experts else 0.0

    def expert_flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs one routed expert spends on one token (``2 * 3 * hidden * ffn`` for a SwiGLU expert);
        ``seq_len`` is the length the layer's statistics are for."""
        slots = self.top_k * seq_len * self.expert_capacity_factor
        return self.expert_forward_flops / slots if slots else 0.0

    def expected_tokens_per_expert(self, tokens: int) -> float:
        """Token slots each expert processes when ``tokens`` tokens are routed: ``top_k * tokens / experts``
        times the capacity (imbalance) factor, as GShard / Switch Transformer size their expert buffers."""
        return self.top_k * tokens / self.experts * self.expert_capacity_factor if self.experts else 0.0
