"""Tessera: plan how to split a PyTorch training run across devices, explain it, and run it.

    import tessera
    pm = tessera.auto_parallelize(model, "cpu:ranks=2", global_batch=8, seq_len=64)
    print(pm.plan.summary())
    loss = pm.train_step((inputs, targets))

Names are imported on first use, so ``import tessera.topology`` does not pull in the runtime.
"""

from importlib import import_module

_EXPORTS = {
    "auto_parallelize": "tessera.api",
    "plan": "tessera.api",
    "evaluate": "tessera.api",
    "compare": "tessera.api",
    "resume": "tessera.api",
    "Estimate": "tessera.cost_models",
    "Strategy": "tessera.cost_models",
    "TrainingConfig": "tessera.cost_models",
    "Plan": "tessera.planner.plan",
    "Cluster": "tessera.topology",
    "load_cluster": "tessera.topology",
    **{
        name: "tessera.errors"
        for name in (
            "TesseraError", "CaptureError", "ClusterSpecError", "ConfigError", "InfeasiblePlanError",
            "ModelSpecError", "NotModelledError", "RuntimeSetupError", "CheckpointError",
        )
    },
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tessera' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
