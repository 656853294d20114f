"""Cluster presets (``dgx-h100:nodes=8``, ``cpu:ranks=4``) and cluster YAML files.

A preset is a YAML file in ``topology/presets/`` in the format ``tessera.topology.clusterfile`` documents;
its ``size_key`` (``nodes`` or ``ranks``) is the spec's main argument. Device variants come from the spec too,
without writing a cluster file: ``gpu=NAME`` puts any catalog device (``topology/catalog.yaml``) on the
preset's fabric and ``gpus_per_node=N`` changes the node (the NVLink level follows the node), e.g.
``dgx-a100:nodes=4,gpu=A100-SXM-40GB,gpus_per_node=4``; the preset's link levels are kept as they are. Every
malformed field is reported by name. Cluster files are read with ``topology.validation``'s strict YAML loader (no anchors,
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
    if not isinstance(spec, (str, Path)):
        raise ClusterSpecError(f"cluster must be a preset spec (str, e.g. 'dgx-h100:nodes=2'), a cluster file path or "
                               f"a Cluster, got {type(spec).__name__} {spec!r:.40}")
    text = str(spec)
    if text.endswith((".yaml", ".yml")):
        return _cluster_from_file(Path(text))
    if text and text.partition(":")[0] not in preset_names() and _is_folder(text):
        raise ClusterSpecError(f"cluster {text} is a folder; pass a cluster file (.yaml) in it or a preset "
                               f"({', '.join(preset_names())})")
    name, _, args = text.partition(":")
    raw = _preset_raw(name)
    values = _parse_args(args, raw["size_key"], name)
    if "gpu" in values:
        raw = {**raw, "device": values["gpu"]}  # a catalog name (an unknown one is refused with the known ones)
    if "gpus_per_node" in values:
        per_node = positive_int(values["gpus_per_node"], f"'gpus_per_node' in cluster preset {name}")
        if raw["levels"][0]["group_size"] not in ("node", per_node):  # its innermost link fixes the node (TPU: 4)
            raise ClusterSpecError(f"cluster preset {name}'s node is its innermost link level of "
                                   f"{raw['levels'][0]['group_size']} devices; gpus_per_node does not apply to it: "
                                   "leave it out")
        host = raw.get("devices_per_host", 1)
        if per_node % host and host % per_node:  # a node is whole hosts (GB200 NVL72: trays of 4), or within one
            raise ClusterSpecError(f"cluster preset {name}'s hosts hold {raw['devices_per_host']} GPUs each; give "
                                   f"gpus_per_node as a multiple of {raw['devices_per_host']}, got {per_node}")
        raw = {**raw, "devices_per_node": per_node}
    size = positive_int(values[raw["size_key"]], f"'{raw['size_key']}' in cluster preset {name}") if raw["size_key"] in values else 1
    return cluster_from_raw(raw, name=text, size=size)


def _is_folder(text: str) -> bool:
    try:
        return Path(text).is_dir()
    except (OSError, ValueError):  # a name too long for a path, or with a NUL: not a folder, and not a preset
        return False


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
    if raw is None:
        raise ClusterSpecError(f"cluster file {path} is empty; write its fields (device, devices_per_node, size_key, "
                               "size, levels) or pass a preset")
    if not isinstance(raw, dict):
        raise ClusterSpecError(f"cluster file {path} holds a {type(raw).__name__}, not a mapping of fields (device, "
                               "devices_per_node, size_key, size, levels)")
    if "size" not in raw:
        raise ClusterSpecError(f"{path}: field 'size' is missing (number of nodes or ranks)")
    return cluster_from_raw(raw, name=str(path), size=positive_int(raw["size"], f"{path}: field 'size'"))


def _one_line(exc: yaml.YAMLError) -> str:
    """A YAML error in one bounded line (PyYAML's own spans several, with a snippet of the file)."""
    text = " ".join(str(exc).split())
    return text if len(text) <= 200 else text[:197] + "..."


def _parse_args(args: str, size_key: str, name: str) -> dict[str, str]:
    """``"nodes=4,gpu=A100-SXM-40GB"`` -> ``{"nodes": "4", "gpu": "A100-SXM-40GB"}``: each key once, each known."""
    known = (size_key, "gpu", "gpus_per_node")
    values: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in args.split(","))):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or key not in known or key in values:
            problem = f"{key} is given twice" if key in values else f"got {quoted(item)}"
            raise ClusterSpecError(f"cluster preset {name!r} takes '{size_key}=N' and optionally 'gpu=NAME' (a catalog "
                                   f"device) and 'gpus_per_node=N' (e.g. '{name}:{size_key}=2,gpu=H100-SXM-80GB'), {problem}")
        values[key] = value
    return values
