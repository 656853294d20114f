"""Runtime: apply a ``Plan`` to a real model with torch.distributed and train it.

``apply_plan(model, plan) -> ParallelModel`` builds the ``("edp", "pp", "ep", "cp", "tp")`` mesh (``runtime.mesh``) and applies, in order:
expert parallelism (MoE experts split over ``ep`` ranks carved out of ``dp``, tokens exchanged by
all-to-all), tensor (+ sequence) parallelism from the model's structure, per-layer recomputation (full or selective)
or activation offload to host memory (``runtime.offload``), optional ``torch.compile`` per block, the pipeline split
and schedule, and the data-parallel axis (DDP, ZeRO-1/2/3 with FSDP2; under ZeRO-3 ``reshard_after_forward`` per
block); a model on the meta device is materialised shard by shard; context parallelism (ring
attention over ``cp`` ranks, zig-zag sequence shards) comes last. ``spawn`` starts local
gloo ranks for tests; ``launch_commands`` prints torchrun / SLURM command lines for a plan.
``ParallelModel.save``/``load`` write and read sharded checkpoints that load under any plan
(``runtime.checkpoint``; elastic restarts: ``runtime.elastic``).
"""

from importlib import import_module

# Names are imported on first use: the pipelining and compile machinery takes seconds to import, and a command
# that only reads a checkpoint's files (``tessera resume``, ``tessera launch``) should not wait for it.
_EXPORTS = {
    **dict.fromkeys(("apply_plan", "default_loss_fn", "default_optimizer_factory"), "apply"),
    **dict.fromkeys(("CheckpointInfo", "PendingSave", "export_model_state_dict"), "checkpoint"),
    **dict.fromkeys(("apply_context_parallel", "ring_attention"), "context_parallel"),
    **dict.fromkeys(("apply_data_parallel", "apply_ddp", "apply_fsdp"), "data_parallel"),
    **dict.fromkeys(("ExpertParallelMoE", "apply_expert_parallel"), "expert_parallel"),
    **dict.fromkeys(("WorkerError", "WorkerTimeoutError", "launch_commands", "spawn"), "launch"),
    **dict.fromkeys(("check_plan_agrees", "materialize_shards"), "materialize"),
    "build_mesh": "mesh",
    "apply_offload": "offload",
    "ParallelModel": "parallel_model",
    "apply_recompute": "recompute",
    **dict.fromkeys(("apply_tensor_parallel", "find_linear_pairs"), "tensor_parallel"),
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tessera.runtime' has no attribute {name!r}")
    return getattr(import_module(f"tessera.runtime.{_EXPORTS[name]}"), name)
