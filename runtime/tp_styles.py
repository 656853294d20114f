"""DTensor styles for the linears torch's own ``ColwiseParallel``/``RowwiseParallel`` do not split, and the local
view an attention module needs once its heads are split.

- :class:`ColumnSplit`: column-parallel ``nn.Linear`` or Hugging Face ``Conv1D`` (weight stored ``(in, out)``, so
  its output features are dim 1), optionally *packed*: the output holds ``parts`` equal blocks (GPT-2's
  ``q|k|v``, a ``gate|up`` projection) and each rank holds the same slice of every block (DTensor's
  ``_StridedShard``), so a forward that splits or chunks its local output into ``parts`` gets matching q, k and v
  heads. The parameter keeps its true global layout: ``full_tensor()``, checkpoints and the optimizer see the
  unsplit matrix. A packed bias is kept whole on every rank (``Replicate``): DTensor's ``addmm`` slices the
  rank's part of it in the forward and gathers its gradient, and FSDP2 can then shard it on ``dp`` (a strided shard
  of a 1-D tensor it could not: :func:`fsdp_shard_placement`). Optionally the output is all-gathered
  (``colwise_gather_output``).
- :class:`RowSplit`: row-parallel ``nn.Linear`` or ``Conv1D`` (input features are the weight's dim 0 there).
- :func:`fsdp_shard_placement` (FSDP2's ``shard_placement_fn``) and :func:`unstrided` (a checkpoint's view): a
  packed split composes with FSDP2 on ``dp`` and with DCP.
- ``tp_rules.localise_attention``: attention modules that split heads with an absolute count (OPT's
  ``view(B, -1, self.num_heads, d)``) or width (GPT-2's ``split(self.split_size)``) get the local count; one that
  reads head counts from the shared ``config`` in its forward is refused (Phi-3 declares a gathered plan instead).
"""

from __future__ import annotations

from functools import partial

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.placement_types import _StridedShard

from tessera.cost_models.tp_rules import config_head_read, is_conv1d
from tessera.errors import NotModelledError

def _supported(module: nn.Module, style: str) -> None:
    if not (isinstance(module, nn.Linear) or is_conv1d(module)):
        raise NotModelledError(f"{style} splits nn.Linear and Conv1D modules, not {type(module).__name__}")


def _distribute(module: nn.Module, mesh: DeviceMesh, placements: dict[str, Placement], src_data_rank) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        placement = placements.get(name, Replicate())
        module.register_parameter(name, nn.Parameter(
            distribute_tensor(param, mesh, [placement], src_data_rank=src_data_rank), requires_grad=param.requires_grad))


class ColumnSplit(ColwiseParallel):
    """Column-parallel linear (``nn.Linear`` or ``Conv1D``), ``parts`` packed blocks, output local or gathered."""

    def __init__(self, *, parts: int = 1, input_layouts: Placement | None = None, gather_output: bool = False) -> None:
        super().__init__(input_layouts=input_layouts, output_layouts=Replicate() if gather_output else None)
        self.parts, self.gather_output = parts, gather_output

    def _placement(self, dim: int) -> Placement:
        return Shard(dim) if self.parts == 1 else _StridedShard(dim, split_factor=self.parts)

    def _partition_linear_fn(self, name, module, device_mesh) -> None:
        features = 1 if is_conv1d(module) else 0  # dim of the output features in the weight
        bias = Replicate() if self.parts > 1 else Shard(0)  # see the module docstring: sliced per rank in forward
        _distribute(module, device_mesh, {"weight": self._placement(features), "bias": bias}, self.src_data_rank)

    def _output(self, mod, outputs, device_mesh):
        if self.gather_output:  # (..., N) on every rank
            return outputs.redistribute(placements=[Replicate()]).to_local()
        return outputs.to_local()  # (..., N / tp): this rank's slice of each packed block

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _supported(module, "ColumnSplit")
        prepare_input = partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts)
        return distribute_module(module, device_mesh, self._partition_linear_fn, prepare_input, self._output)


def fsdp_shard_placement(param: nn.Parameter) -> Shard | None:
    """Where FSDP2 shards ``param`` on the data-parallel axis (its ``shard_placement_fn``): a weight tensor
    parallelism splits as a strided shard on dim 0 (an ``nn.Linear`` packing ``q|k|v`` or ``gate|up``) on dim 1, its
    input features; any other parameter where FSDP2 puts it (None: dim 0).

    FSDP2 cuts the tensor-parallel shard in contiguous pieces along its dim: on the strided dim those are not
    pieces of the true matrix, so ``full_tensor()`` and a checkpoint would read them in the wrong order."""
    if not (isinstance(param, DTensor) and any(isinstance(p, _StridedShard) and p.dim == 0 for p in param.placements)):
        return None
    if param.dim() < 2:
        raise NotModelledError(f"a 1-D parameter of shape {tuple(param.shape)} is a strided tensor-parallel shard, "
                               "which FSDP2 cannot shard again; keep it replicated on tp or plan with zero=0")
    return Shard(1)


def unstrided(tensor):
    """``tensor`` with each strided tensor-parallel split (a packed ``q|k|v``) gathered (``Replicate``), else itself.

    DCP writes one chunk per rank per tensor, and a rank's slice of every packed block is ``parts`` chunks, so a
    checkpoint writes and reads the gathered form. FSDP2's own ``_StridedShard`` (dp, ahead of a tp ``Shard`` of the
    same dim: shard order, one chunk) is kept."""
    if not isinstance(tensor, DTensor):
        return tensor
    placements = list(tensor.placements)
    gathered = [Replicate() if _is_strided_split(placements, axis) else p for axis, p in enumerate(placements)]
    return tensor if gathered == placements else tensor.redistribute(placements=gathered)


def has_strided_split(tensor) -> bool:
    """Whether ``unstrided`` would gather ``tensor`` (a packed ``q|k|v`` split under tp); no collective."""
    return isinstance(tensor, DTensor) and any(_is_strided_split(list(tensor.placements), axis)
                                               for axis in range(len(tensor.placements)))


def _is_strided_split(placements: list[Placement], axis: int) -> bool:
    placement = placements[axis]
    return isinstance(placement, _StridedShard) and not any(
        isinstance(later, (Shard, _StridedShard)) and later.dim == placement.dim for later in placements[axis + 1:])


class RowSplit(RowwiseParallel):
    """Row-parallel linear (``nn.Linear`` or ``Conv1D``): input features sharded, the bias added once."""

    def _partition_linear_fn(self, name, module, device_mesh) -> None:
        features = 0 if is_conv1d(module) else 1  # dim of the input features in the weight
        _distribute(module, device_mesh, {"weight": Shard(features), "bias": Replicate()}, self.src_data_rank)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _supported(module, "RowSplit")
        self.desired_input_layouts = (Shard(-1),)
        prepare_input = partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts)
        prepare_output = partial(self._prepare_output_fn, self.output_layouts, self.use_local_output)
        return distribute_module(module, device_mesh, self._partition_linear_fn, prepare_input, prepare_output)


# ------------------------------------------------------------------------------------------- local attention


def check_local_heads(fqn: str, attention: nn.Module) -> None:
    """Raise ``NotModelledError`` if ``attention``'s forward reads head counts from the model's shared config."""
    problem = config_head_read(fqn, attention)
    if problem is not None:
        raise NotModelledError(problem)


