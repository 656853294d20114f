"""Cluster presets (``dgx-h100:nodes=8``, ``cpu:ranks=4``) and cluster YAML files.

A preset is a YAML file in ``topology/presets/``; its ``size_key`` (``nodes`` or ``ranks``) is the one
argument the spec takes. Every malformed field is reported by name.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from tessera.errors import ClusterSpecError
from tessera.topology.cluster import Cluster, LinkLevel
from tessera.topology.hardware import device, local_cpu_device

REQUIRED_FIELDS = ("device", "devices_per_node", "size_key", "levels")


def preset_names() -> list[str]:
    """Names of the built-in presets."""
    folder = resources.files("tessera.topology") / "presets"
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


def load_cluster(spec: str | Path | Cluster) -> Cluster:
    """Build a Cluster from a preset spec (``dgx-h100:nodes=2``) or a cluster YAML path."""
    if isinstance(spec, Cluster):
        return spec
    text = str(spec)
    if text.endswith((".yaml", ".yml")):
        return _cluster_from_file(Path(text))
    name, _, args = text.partition(":")
    if name not in preset_names():
        raise ClusterSpecError(f"unknown cluster preset {name!r}; known presets: {', '.join(preset_names())}")
    raw = yaml.safe_load((resources.files("tessera.topology") / "presets" / f"{name}.yaml").read_text())
    return _cluster_from_raw(raw, name=text, size=_parse_size(args, raw["size_key"], name))


def _cluster_from_file(path: Path) -> Cluster:
    if not path.exists():
        raise ClusterSpecError(f"cluster file {path} does not exist; pass a preset ({', '.join(preset_names())}) or a path")
    raw = yaml.safe_load(path.read_text())
    if not isinstance(raw, dict) or "size" not in raw:
        raise ClusterSpecError(f"{path}: field 'size' is missing (number of nodes or ranks)")
    return _cluster_from_raw(raw, name=str(path), size=_positive_int(raw["size"], f"{path}: field 'size'"))


def _parse_size(args: str, size_key: str, name: str) -> int:
    if not args:
        return 1
    key, sep, value = args.partition("=")
    if not sep or key != size_key:
        raise ClusterSpecError(f"cluster preset {name!r} takes '{size_key}=N' (e.g. '{name}:{size_key}=2'), got {args!r}")
    return _positive_int(value, f"'{size_key}' in {name}:{args}")


def _positive_int(value: Any, what: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number <= 0 or str(number) != str(value).strip():
        raise ClusterSpecError(f"{what} must be a positive integer, got {value!r}")
    return number


def _cluster_from_raw(raw: dict[str, Any], *, name: str, size: int) -> Cluster:
    missing = [f for f in REQUIRED_FIELDS if f not in raw]
    if missing:
        raise ClusterSpecError(f"cluster {name}: missing field(s) {', '.join(missing)}")
    per_node = size if raw["devices_per_node"] == "world" else _positive_int(raw["devices_per_node"], f"cluster {name}: field 'devices_per_node'")
    world = size if raw["size_key"] == "ranks" else size * per_node
    spec = local_cpu_device(world) if raw["device"] == "local-cpu" else device(raw["device"])
    levels = tuple(_link_level(level, i, name=name, per_node=per_node, world=world) for i, level in enumerate(raw["levels"]))
    return Cluster(name=name, device=spec, num_devices=world, levels=levels)


def _link_level(raw: dict[str, Any], index: int, *, name: str, per_node: int, world: int) -> LinkLevel:
    where = f"cluster {name}: levels[{index}]"
    missing = [f for f in ("name", "group_size", "bandwidth_gb_per_s", "latency_us") if f not in raw]
    if missing:
        raise ClusterSpecError(f"{where}: missing field(s) {', '.join(missing)}")
    group = {"node": per_node, "world": world}.get(raw["group_size"], raw["group_size"])
    try:
        return LinkLevel(
            name=raw["name"],
            group_size=group,
            bandwidth_bytes_per_s=_number(raw["bandwidth_gb_per_s"], f"{where}: field 'bandwidth_gb_per_s'") * 1e9,
            latency_s=_number(raw["latency_us"], f"{where}: field 'latency_us'") * 1e-6,
            efficiency=raw.get("efficiency", 1.0),
            source=raw.get("source", "not given"),
        )
    except ValidationError as exc:
        error = exc.errors()[0]
        raise ClusterSpecError(f"{where}: field {error['loc'][0]!r}: {error['msg']}") from None


def _number(value: Any, what: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ClusterSpecError(f"{what} must be a number, got {value!r}") from None
