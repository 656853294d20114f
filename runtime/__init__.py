"""Runtime: apply a ``Plan`` to a real model with torch.distributed and train it.

``apply_plan(model, plan) -> ParallelModel`` builds the ``("edp", "pp", "ep", "cp", "tp")`` mesh (``runtime.mesh``) and applies, in order:
expert parallelism (MoE experts split over ``ep`` ranks carved out of ``dp``, tokens exchanged by
all-to-all), tensor (+ sequence) parallelism from the model's structure, per-layer recomputation (full or selective),
optional ``torch.compile`` per block, the pipeline split and schedule, and the data-parallel axis (DDP,
ZeRO-1/2/3 with FSDP2); a model on the meta device is materialised shard by shard; context parallelism (ring
attention over ``cp`` ranks, zig-zag sequence shards) comes last. ``spawn`` starts local
gloo ranks for tests; ``launch_commands`` prints torchrun / SLURM command lines for a plan.
``ParallelModel.save``/``load`` write and read sharded checkpoints that load under any plan
(``runtime.checkpoint``; elastic restarts: ``runtime.elastic``).
"""

from tessera.runtime.apply import apply_plan, default_loss_fn, default_optimizer_factory
from tessera.runtime.checkpoint import CheckpointInfo, PendingSave, export_model_state_dict
from tessera.runtime.context_parallel import apply_context_parallel, ring_attention
from tessera.runtime.data_parallel import apply_data_parallel, apply_ddp, apply_fsdp
from tessera.runtime.expert_parallel import ExpertParallelMoE, apply_expert_parallel
from tessera.runtime.launch import WorkerError, WorkerTimeoutError, launch_commands, spawn
from tessera.runtime.materialize import check_plan_agrees, materialize_shards
from tessera.runtime.mesh import build_mesh
from tessera.runtime.parallel_model import ParallelModel
from tessera.runtime.recompute import apply_recompute
from tessera.runtime.tensor_parallel import apply_tensor_parallel, find_linear_pairs

__all__ = [
    "CheckpointInfo",
    "ExpertParallelMoE",
    "PendingSave",
    "ParallelModel",
    "WorkerError",
    "WorkerTimeoutError",
    "apply_context_parallel",
    "apply_data_parallel",
    "apply_ddp",
    "apply_expert_parallel",
    "apply_fsdp",
    "apply_plan",
    "apply_recompute",
    "apply_tensor_parallel",
    "build_mesh",
    "check_plan_agrees",
    "default_loss_fn",
    "default_optimizer_factory",
    "export_model_state_dict",
    "find_linear_pairs",
    "launch_commands",
    "materialize_shards",
    "ring_attention",
    "spawn",
]
