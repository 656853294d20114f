"""Cluster presets (``dgx-h100:nodes=8``, ``cpu:ranks=4``) and cluster YAML files.

A preset is a YAML file in ``topology/presets/`` in the format ``tessera.topology.clusterfile`` documents;
its ``size_key`` (``nodes`` or ``ranks``) is the one argument the spec takes. Every malformed field is
reported by name.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import yaml

from tessera.errors import ClusterSpecError
from tessera.topology.cluster import Cluster
from tessera.topology.clusterfile import cluster_from_raw, positive_int


def preset_names() -> list[str]:
    """Names of the built-in presets."""
    folder = resources.files("tessera.topology") / "presets"
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


def preset_size_key(name: str) -> str:
    """``nodes`` or ``ranks``: what ``N`` in ``name:KEY=N`` counts."""
    return _preset_raw(name)["size_key"]


def load_cluster(spec: str | Path | Cluster) -> Cluster:
    """Build a Cluster from a preset spec (``dgx-h100:nodes=2``) or a cluster YAML path."""
    if isinstance(spec, Cluster):
        return spec
    text = str(spec)
    if text.endswith((".yaml", ".yml")):
        return _cluster_from_file(Path(text))
    name, _, args = text.partition(":")
    raw = _preset_raw(name)
    return cluster_from_raw(raw, name=text, size=_parse_size(args, raw["size_key"], name))


def _preset_raw(name: str) -> dict:
    if name not in preset_names():
        raise ClusterSpecError(f"unknown cluster preset {name!r}; known presets: {', '.join(preset_names())}")
    return yaml.safe_load((resources.files("tessera.topology") / "presets" / f"{name}.yaml").read_text())


def _cluster_from_file(path: Path) -> Cluster:
    if not path.exists():
        raise ClusterSpecError(f"cluster file {path} does not exist; pass a preset ({', '.join(preset_names())}) or a path")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ClusterSpecError(f"{path}: not valid YAML ({exc})") from None
    if not isinstance(raw, dict) or "size" not in raw:
        raise ClusterSpecError(f"{path}: field 'size' is missing (number of nodes or ranks)")
    return cluster_from_raw(raw, name=str(path), size=positive_int(raw["size"], f"{path}: field 'size'"))


def _parse_size(args: str, size_key: str, name: str) -> int:
    if not args:
        return 1
    key, sep, value = args.partition("=")
    if not sep or key != size_key:
        raise ClusterSpecError(f"cluster preset {name!r} takes '{size_key}=N' (e.g. '{name}:{size_key}=2'), got {args!r}")
    return positive_int(value, f"'{size_key}' in {name}:{args}")
