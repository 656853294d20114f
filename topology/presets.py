"""Cluster presets (``dgx-h100:nodes=8``, ``cpu:ranks=4``) and cluster YAML files.

A preset is a YAML file in ``topology/presets/`` in the format ``tessera.topology.clusterfile`` documents;
its ``size_key`` (``nodes`` or ``ranks``) is the one argument the spec takes. Every malformed field is
reported by name. Cluster files are read with ``topology.validation``'s strict YAML loader (no anchors,
aliases or duplicate keys; at most ``MAX_YAML_BYTES``).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import yaml

from tessera.errors import ClusterSpecError
from tessera.topology.cluster import Cluster
from tessera.topology.clusterfile import cluster_from_raw, positive_int
from tessera.topology.validation import YamlRefused, load_yaml_text, quoted, read_bounded_text


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
        raise ClusterSpecError(f"unknown cluster preset {quoted(name)}; known presets: {', '.join(preset_names())}")
    return yaml.safe_load((resources.files("tessera.topology") / "presets" / f"{name}.yaml").read_text())


def _cluster_from_file(path: Path) -> Cluster:
    if not path.is_file():
        what = "is not a file" if path.exists() else "does not exist"
        raise ClusterSpecError(f"cluster file {path} {what}; pass a preset ({', '.join(preset_names())}) or a path")
    try:
        raw = load_yaml_text(read_bounded_text(path))
    except OSError as exc:
        raise ClusterSpecError(f"cannot read cluster file {path}: {exc.strerror or exc}; check its permissions") from None
    except ValueError as exc:
        raise ClusterSpecError(f"cluster file {path} {exc}; pass a cluster file in the documented format") from None
    except YamlRefused as exc:
        raise ClusterSpecError(f"cluster file {path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ClusterSpecError(f"{path}: not valid YAML ({_one_line(exc)}); fix the file") from None
    except RecursionError:
        raise ClusterSpecError(f"cluster file {path} nests too deeply to be a cluster file; fix the file") from None
    if not isinstance(raw, dict) or "size" not in raw:
        raise ClusterSpecError(f"{path}: field 'size' is missing (number of nodes or ranks)")
    return cluster_from_raw(raw, name=str(path), size=positive_int(raw["size"], f"{path}: field 'size'"))


def _one_line(exc: yaml.YAMLError) -> str:
    """A YAML error in one bounded line (PyYAML's own spans several, with a snippet of the file)."""
    text = " ".join(str(exc).split())
    return text if len(text) <= 200 else text[:197] + "..."


def _parse_size(args: str, size_key: str, name: str) -> int:
    if not args:
        return 1
    key, sep, value = args.partition("=")
    if not sep or key != size_key:
        raise ClusterSpecError(f"cluster preset {name!r} takes '{size_key}=N' (e.g. '{name}:{size_key}=2'), got {quoted(args)}")
    return positive_int(value, f"'{size_key}' in cluster preset {name}")
