"""FP8 training (``precision="fp8"``): the blocks' linears run their matmuls in FP8 through torchao's float8
training (``torchao.float8.convert_to_float8_training``), as torchtitan does; everything else stays in bf16 mixed
precision (attention cores, norms, the embedding and the head), which is what ``cost_models.fp8`` prices.

Each converted ``nn.Linear`` becomes a ``Float8Linear``: in every forward and backward it casts its input, its
weight and its output gradient to FP8 with a scale from the tensor's own absolute maximum (``current`` scaling:
torchao's ``tensorwise`` recipe; ``rowwise``: one scale per row) and multiplies them with ``torch._scaled_mm``.
Its weights stay bf16/fp32 as the mixed-precision policy holds them, and autograd saves the bf16 input, as the
``TESSERA`` implementation profile's FP8 memory assumes (no FP8 weight copies, no FP8 saved inputs).
``torch._scaled_mm`` runs on CPU too (torch 2.13: FP8 storage and rounding, products in higher precision), so FP8
plans run on the gloo ranks here with FP8's numerics, at CPU speed.

Converted: the ``nn.Linear`` modules inside the plan's blocks whose two dimensions are multiples of 16 (FP8
GEMM kernels tile by 16; torchao's own rule). The cost model prices all of the blocks' matmuls but the attention
cores as FP8, so the runtime refuses a model whose blocks keep more than ``MAX_BF16_SHARE`` of their matrix
weights out of FP8 (:func:`check_float8_model`, before anything is sharded): routed experts held as stacked
weights (Hugging Face's Mixtral/Qwen MoE blocks: torchao's grouped FP8 GEMMs are not wired in; Tessera's own
``MoELayer`` holds its experts as linears, which run FP8), GPT-2's ``Conv1D``. Below that share (a MoE router's few
outputs, say) they stay bf16 with a warning naming them.

Under ZeRO-3 at current scaling without tensor parallelism (``Plan.gathers_fp8``, what the cost model prices),
FSDP2 all-gathers the converted weights in FP8, 1 byte per element instead of bf16's 2 (torchao's
``enable_fsdp_float8_all_gather``): each rank casts its fp32 shard with the scale of the whole weight, computed for
all of them with one all-reduce per mesh at the start of each ``train_step`` (:func:`refresh_float8_scales`) and
dropped once it ends (:func:`forget_float8_scales`). gloo refuses FP8 dtypes, so on CPU ranks the gathers move bytes
(:class:`ByteAllGather`). Elsewhere FSDP2 gathers bf16 weights.

Under the splits: data parallelism and pipelining cast exactly the tensors one process would; FSDP2 casts a weight
with the scale of its fp32 master (FP8 gathers) or its gathered bf16 copy; tensor parallelism's row-parallel linears
receive their input as each rank's local shard, which is cast with its own scale (torchao's
``Float8RowwiseParallel`` would cast before the split; Tessera's tensor parallelism keeps its own styles). Both are
valid FP8 training with other roundings (``tests/distributed/test_float8.py`` measures the spread).

A converted linear is a new module (torchao's ``Float8Linear.from_float``) holding the same parameters, so state
dicts, checkpoints and snapshots keep their keys, but hooks registered on the ``nn.Linear`` before ``apply_plan``
stay behind on it: register them on the converted module.

Refused in one line: ``delayed`` scaling (torchao dropped it; use ``current``), ``block`` and ``mx`` scaling
(MX formats need Blackwell's kernels; torchao's MX training is not wired in), and a missing torchao.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather  # the interface set_custom_all_gather takes

from tessera.cost_models.types import Fp8Scaling
from tessera.errors import ConfigError, NotModelledError
from tessera.quiet import muted

TORCHAO_RECIPES: dict[str, str] = {"current": "tensorwise", "rowwise": "rowwise"}
"""Tessera's ``fp8_scaling`` -> torchao's ``Float8LinearRecipeName``."""


def runtime_scaling(scaling: Fp8Scaling) -> Fp8Scaling:
    """``scaling`` where torchao runs it, else current scaling, which it does (another framework's delayed, block or
    MX scaling, for Tessera's own plan beside that framework's run)."""
    return scaling if scaling in TORCHAO_RECIPES else "current"
GEMM_MULTIPLE = 16
"""Both dimensions of a converted linear's weight must be multiples of this (FP8 GEMM tiles)."""
TORCHAO_INSTALL = "pip install torchao==0.18.0"
MAX_BF16_SHARE = 0.01
"""Largest share of the blocks' matrix weights (parameters of two or more dimensions) that may stay out of FP8
while the plan prices them as FP8: beyond it the prediction would miss by about that share of the matmul time."""


def check_float8(scaling: Fp8Scaling) -> None:
    """Raise unless the runtime can train with FP8 ``scaling`` here (before any process group is made)."""
    check_float8_scaling(scaling)
    torchao_float8()


def check_float8_scaling(scaling: Fp8Scaling) -> None:
    """Raise unless torchao runs FP8 ``scaling`` (no import: the planner asks it too)."""
    if scaling not in TORCHAO_RECIPES:
        why = ("torchao removed delayed scaling; current scaling (a scale from each tensor's own maximum) replaces it"
               if scaling == "delayed" else
               f"{scaling} scaling needs MX/blockwise FP8 kernels (Blackwell) that the runtime does not wire in")
        raise NotModelledError(f"fp8_scaling={scaling}: {why}; run fp8_scaling=current or rowwise")


def torchao_float8():
    """``torchao.float8``, imported with torchao's import-time warnings muted (``tessera.quiet``)."""
    try:
        with muted():
            import torchao.float8 as float8
    except ImportError as error:
        raise ConfigError(f"precision fp8 trains through torchao's float8 linears and torchao is not installed "
                          f"({error}); {TORCHAO_INSTALL}, or train with precision bf16") from None
    except Exception as error:  # a torchao built for another torch fails in many ways at import
        raise ConfigError(f"precision fp8: torchao failed to import with torch {torch.__version__} "
                          f"({type(error).__name__}: {str(error).splitlines()[0][:200]}); install the torchao "
                          f"release made for this torch, or train with precision bf16") from None
    return float8


def convertible(module: nn.Module) -> bool:
    """Whether ``module`` is a linear whose matmuls the FP8 kernels can run."""
    return (type(module) is nn.Linear and module.in_features % GEMM_MULTIPLE == 0
            and module.out_features % GEMM_MULTIPLE == 0)


def bf16_matrices(model: nn.Module, block_fqns: Iterable[str]) -> tuple[dict[str, int], int]:
    """The blocks' matrix weights (two or more dimensions) FP8 would not cover, as element counts by FQN, and the
    element count of all the blocks' matrix weights."""
    blocks = tuple(block_fqns)
    covered = {id(module.weight) for fqn, module in model.named_modules()
               if _inside(fqn, blocks) and convertible(module)}
    matrices = [(fqn, param) for fqn, param in model.named_parameters(remove_duplicate=False)
                if _inside(fqn, blocks) and param.dim() >= 2]
    left = {fqn: param.numel() for fqn, param in matrices if id(param) not in covered}
    return left, sum(param.numel() for _, param in matrices)


def check_float8_model(model: nn.Module, block_fqns: Iterable[str]) -> dict[str, int]:
    """Raise if FP8 would leave more than ``MAX_BF16_SHARE`` of the blocks' matrix weights in bf16; else return
    the ones it leaves (``bf16_matrices``)."""
    left, total = bf16_matrices(model, block_fqns)
    if total and sum(left.values()) > MAX_BF16_SHARE * total:
        largest = sorted(left, key=left.get, reverse=True)[:3]
        raise NotModelledError(
            f"precision fp8: {sum(left.values()) / total:.0%} of the blocks' matrix weights are not nn.Linear "
            f"layers FP8 can run (e.g. {', '.join(largest)}: stacked experts, Conv1D or dimensions not multiples of "
            f"{GEMM_MULTIPLE}), so they would run bf16 while the plan prices them FP8; train with precision bf16, or price a framework "
            "that runs them in FP8 with 'tessera evaluate --strategy ... --runs-on megatron'")
    return left


def convert_blocks(model: nn.Module, block_fqns: Iterable[str], scaling: Fp8Scaling,
                   *, gather_fp8: bool = False) -> dict[str, int]:
    """Swap the FP8-capable linears inside the blocks ``block_fqns`` of ``model`` for torchao ``Float8Linear``s
    (in place, before any sharding); with ``gather_fp8`` their weights are cast to FP8 before FSDP2 all-gathers
    them (torchao's ``enable_fsdp_float8_all_gather``). Returns the blocks' matrix weights left in bf16
    (``check_float8_model``)."""
    float8 = torchao_float8()
    config = float8.Float8LinearConfig.from_recipe_name(TORCHAO_RECIPES[scaling])
    if gather_fp8:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    blocks = tuple(block_fqns)
    kept = check_float8_model(model, blocks)
    float8.convert_to_float8_training(model, config=config,
                                      module_filter_fn=lambda module, fqn: _inside(fqn, blocks) and convertible(module))
    for module in model.modules():
        if isinstance(module, float8.float8_linear.Float8Linear):
            module.register_forward_pre_hook(_cast_input_under_cpu_autocast)
    return kept


def _cast_input_under_cpu_autocast(module: nn.Module, args: tuple) -> tuple | None:
    """Under CPU autocast, the input in the autocast dtype, as ``Float8Linear`` itself does under CUDA autocast
    (torchao 0.18 checks CUDA's autocast only): else a CPU rank casts, saves and returns fp32 where a GPU has bf16."""
    if not torch.is_autocast_enabled("cpu") or not args or args[0].dtype == torch.get_autocast_dtype("cpu"):
        return None
    return (args[0].to(torch.get_autocast_dtype("cpu")), *args[1:])


def _inside(fqn: str, blocks: tuple[str, ...]) -> bool:
    return any(fqn.startswith(block + ".") for block in blocks)


class ByteAllGather(AllGather):
    """FSDP2's all-gather on byte views of its buffers: gloo refuses FP8 dtypes ("Invalid scalar type"), and an
    all-gather moves bytes whatever they encode. FSDP2 gathers each unit's parameters in one flat buffer, of FP8
    when the unit holds only FP8-gathered weights (uint8 when it mixes them with others)."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)  # as FSDP2's default; the interface requires it

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        return dist.all_gather_single(output_tensor.view(torch.uint8), input_tensor.view(torch.uint8), group=group,
                                      async_op=async_op)


def gather_bytes_on_gloo(modules: Iterable[nn.Module]) -> None:
    """Every FSDP2 unit inside ``modules`` all-gathers through :class:`ByteAllGather` (CPU ranks, under FP8
    all-gathers: NCCL gathers FP8 itself). Every unit, not only those whose buffer is FP8: which ones are is FSDP2's
    choice per gather, and bytes are the same gather for the others."""
    for module in modules:
        for unit in module.modules():
            if isinstance(unit, FSDPModule):
                unit.set_custom_all_gather(ByteAllGather())


def refresh_float8_scales(modules: Iterable[nn.Module]) -> None:
    """Compute the FP8 scale of every FP8-gathered weight in ``modules`` for this step's all-gathers, with one
    all-reduce per mesh the weights are sharded over (torchao's ``precompute_float8_dynamic_scale_for_fsdp``, which
    takes one mesh at a time: expert parallelism shards experts over their own), instead of one all-reduce per
    weight and all-gather."""
    float8 = torchao_float8()
    by_mesh: dict[object, list[nn.Module]] = {}
    for module in modules:
        for linear in module.modules():
            if isinstance(linear, float8.float8_linear.Float8Linear) and hasattr(linear.weight, "device_mesh"):
                by_mesh.setdefault(linear.weight.device_mesh, []).append(linear)
    for linears in by_mesh.values():
        float8.precompute_float8_dynamic_scale_for_fsdp(nn.ModuleList(linears))


def forget_float8_scales(modules: Iterable[nn.Module]) -> None:
    """Drop the scales :func:`refresh_float8_scales` computed, once the step's optimizer has changed the weights: a
    forward outside ``train_step`` (an evaluation, after a checkpoint load) then computes fresh ones. torchao keeps
    them on the weight's local tensor (``WeightWithDynamicFloat8CastTensor._precomputed_scale``)."""
    for module in modules:
        for param in module.parameters():
            local = getattr(param, "_local_tensor", param)  # a DTensor's own local tensor, as torchao sets it
            if getattr(local, "_precomputed_scale", None) is not None:
                local._precomputed_scale = None
