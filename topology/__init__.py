"""What the cluster is: devices, link hierarchy, presets, collective costs, and a profiler for the live world.

``profile_world`` / ``profile_local`` live in ``tessera.topology.profiler`` and are imported on first use
here, so ``import tessera.topology`` does not import torch.distributed.
"""

from importlib import import_module

from tessera.topology.cluster import Cluster, DeviceGroup, DeviceSpec, LinkLevel
from tessera.topology.presets import load_cluster, preset_names

__all__ = [
    "Cluster", "DeviceGroup", "DeviceSpec", "LinkLevel", "load_cluster", "preset_names", "profile_local", "profile_world",
]


def __getattr__(name: str):
    if name in ("profile_world", "profile_local"):
        return getattr(import_module("tessera.topology.profiler"), name)
    raise AttributeError(f"module 'tessera.topology' has no attribute {name!r}")
