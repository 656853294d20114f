"""What the cluster is: devices, link hierarchy, presets and collective costs."""

from tessera.topology.cluster import Cluster, DeviceSpec, LinkLevel
from tessera.topology.presets import load_cluster, preset_names

__all__ = ["Cluster", "DeviceSpec", "LinkLevel", "load_cluster", "preset_names"]
