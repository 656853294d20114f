"""Runtime: apply a ``Plan`` to a real model with torch.distributed and train it.

Implemented so far: the data-parallel axis (DDP for zero=0, FSDP2 for zero=3), full activation
recomputation per block, bf16 mixed precision, and a local multi-process launcher for tests.
"""

from tessera.runtime.apply import ParallelModel, apply_plan, default_loss_fn, default_optimizer_factory
from tessera.runtime.data_parallel import apply_ddp, apply_fsdp
from tessera.runtime.launch import WorkerError, WorkerTimeoutError, spawn
from tessera.runtime.mesh import build_mesh
from tessera.runtime.recompute import apply_recompute

__all__ = [
    "ParallelModel",
    "WorkerError",
    "WorkerTimeoutError",
    "apply_ddp",
    "apply_fsdp",
    "apply_plan",
    "apply_recompute",
    "build_mesh",
    "default_loss_fn",
    "default_optimizer_factory",
    "spawn",
]
