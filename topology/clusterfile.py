"""The cluster YAML format, read by ``load_cluster`` and written by ``tessera profile``.

Presets (``topology/presets/*.yaml``) and cluster files share it; a file also carries ``size``, a preset
takes it from its spec (``dgx-h100:nodes=8``). Every malformed field is reported by name.

.. code-block:: yaml

    description: free text
    device: H100-SXM-80GB            # a catalog name, 'local-cpu', or an inline device (below)
    devices_per_node: 8              # or 'world' (one host: every rank on it)
    devices_per_host: 4              # optional: hosts smaller than a node (GB200 NVL72: 72-GPU node, hosts of 4)
    size_key: nodes                  # what 'size' / the spec's N counts: 'nodes' or 'ranks'
    size: 16                         # files only
    levels:                          # innermost first
      - name: nvlink
        group_size: node             # devices: an integer, 'node', 'world', or 'K nodes'
        bandwidth_gb_per_s: 450      # per device, per direction, 10^9 bytes/s
        latency_us: 3                # per algorithm step
        efficiency: 0.8              # optional, default 1.0: bus-bandwidth efficiency
        oversubscription: 1.0        # optional, default 1.0: divides bandwidth of groups crossing the level
        collective_efficiency: {all_to_all: 0.6}     # optional per-collective overrides
        collective_latency_us: {broadcast: 5}        # optional
        collective_local_ns_per_byte: {all_reduce: 0.2}  # optional: per-byte cost on the device itself
        collective_measured: {all_reduce: {4: [660, 0.5]}}  # optional: p -> [latency_us, bandwidth_gb_per_s]
        collective_measured_by_layout: {all_reduce: {2: {1: [310, 0.6], 2: [290, 0.7]}}}  # optional: p -> stride -> same
        collective_algorithm: {broadcast: flat}      # optional: ring | tree | flat | direct
        source: where the numbers come from
    extra_devices:                   # optional: other device kinds on the fabric (not planned on)
      - {device: A100-SXM-80GB, count: 16, note: older pod on the same spine}
    profile: {...}                   # optional: what 'tessera profile' measured (date, hardware, raw data)

An inline device has ``name``, ``peak_tflops`` (dtype -> TFLOP/s), ``memory_gb`` or ``memory_gib``,
``memory_bandwidth_tb_per_s`` or ``memory_bandwidth_gb_per_s``, optional ``scale_up_gb_per_s`` and ``host_gb_per_s`` (device-host link, per direction), and
``source`` (see ``topology/catalog.yaml``). Devices the profiler measured on ranks that share CPU cores also
carry ``solo_speedup``, ``linear_overhead_ms`` (tensor-parallel degree -> ms per linear),
``fsdp_comm_slowdown``, ``tp_compute_slowdown`` (degree -> factor), ``snapshot_fixed_ms``,
``snapshot_gb_per_s`` and ``snapshot_swap_gb_per_s`` (``topology.cluster.DeviceSpec``).

Levels whose group is at least the world are cut to the world, and the levels outside it dropped, so
``dgx-h100:nodes=1`` has only its NVLink level and ``dgx-h100:nodes=8`` no spine.

Every count (``size``, ``devices_per_node``, ``devices_per_host``, group sizes, the world they make) is at most
``topology.validation.MAX_DEVICES``; every number is finite, and bandwidths, memory and FLOP/s are positive.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from tessera.errors import ClusterSpecError
from tessera.topology.cluster import Cluster, DeviceGroup, DeviceSpec, LinkLevel
from tessera.topology.hardware import LOCAL_CPU, device, device_from_raw, device_to_raw, local_cpu_device
from tessera.topology.validation import MAX_DEVICES, file_number, file_value, first_problem, quoted, short

TOP_FIELDS = ("description", "device", "devices_per_node", "devices_per_host", "size_key", "size", "levels", "extra_devices",
              "profile")
REQUIRED_FIELDS = ("device", "devices_per_node", "size_key", "levels")
LEVEL_FIELDS = (
    "name", "group_size", "bandwidth_gb_per_s", "latency_us", "efficiency", "oversubscription",
    "collective_efficiency", "collective_latency_us", "collective_local_ns_per_byte", "collective_measured",
    "collective_measured_by_layout", "collective_algorithm", "source",
)
LEVEL_REQUIRED = ("name", "group_size", "bandwidth_gb_per_s", "latency_us")
LEVEL_RENAMES = {"latency_s": "latency_us", "bandwidth_bytes_per_s": "bandwidth_gb_per_s",
                 "local_s_per_byte": "local_ns_per_byte"}
"""``LinkLevel`` field names -> the file's names, for error messages."""


def cluster_from_raw(raw: Any, *, name: str, size: int) -> Cluster:
    """Build a Cluster from parsed YAML of ``size`` nodes or ranks; errors name the field."""
    if not isinstance(raw, dict):
        raise ClusterSpecError(f"cluster {name}: expected a mapping of fields ({', '.join(REQUIRED_FIELDS)})")
    _check_fields(raw, known=TOP_FIELDS, required=REQUIRED_FIELDS, where=f"cluster {name}")
    if raw["size_key"] not in ("nodes", "ranks"):
        raise ClusterSpecError(f"cluster {name}: field 'size_key' must be 'nodes' or 'ranks', got {quoted(raw['size_key'])}")
    per_node = size if raw["devices_per_node"] == "world" else positive_int(
        raw["devices_per_node"], f"cluster {name}: field 'devices_per_node'"
    )
    world = size if raw["size_key"] == "ranks" else size * per_node
    check_device_count(world, f"cluster {name}")
    if not isinstance(raw["levels"], list) or not raw["levels"]:
        raise ClusterSpecError(f"cluster {name}: field 'levels' must be a non-empty list of link levels")
    levels = _levels_within_world(
        [_link_level(level, i, name=name, per_node=per_node, world=world) for i, level in enumerate(raw["levels"])],
        world=world,
    )
    device_spec = _device(raw["device"], world=world, where=f"cluster {name}: field 'device'")
    extra = _extra_devices(raw.get("extra_devices") or [], name=name)
    if levels[0].group_size != min(per_node, world):  # Cluster.devices_per_node is the innermost level's size
        raise ClusterSpecError(f"cluster {name}: the innermost level {quoted(levels[0].name)} groups "
                               f"{levels[0].group_size} devices but devices_per_node is {per_node}; Tessera takes a "
                               "node to be the innermost link level: give it group_size: node (hosts smaller than that: "
                               "devices_per_host)")
    per_host = (positive_int(raw["devices_per_host"], f"cluster {name}: field 'devices_per_host'")
                if raw.get("devices_per_host") is not None else None)
    try:
        return Cluster(name=name, device=device_spec, num_devices=world, levels=levels, extra_devices=extra,
                       devices_per_host=per_host)
    except ValidationError as exc:
        raise ClusterSpecError(f"cluster {name}: {first_problem(exc)}; fix the value") from None


def cluster_to_raw(cluster: Cluster, *, description: str = "", profile: dict[str, Any] | None = None) -> dict[str, Any]:
    """The file form of ``cluster`` (``size_key: ranks``, explicit group sizes); ``cluster_from_raw`` inverts it."""
    raw: dict[str, Any] = {"description": description} if description else {}
    raw |= {
        "device": device_to_raw(cluster.device),
        "devices_per_node": cluster.devices_per_node,
        **({"devices_per_host": cluster.devices_per_host} if cluster.devices_per_host else {}),
        "size_key": "ranks",
        "size": cluster.num_devices,
        "levels": [_level_to_raw(level) for level in cluster.levels],
    }
    if cluster.extra_devices:
        raw["extra_devices"] = [
            {"device": device_to_raw(group.device), "count": group.num_devices, "note": group.note}
            for group in cluster.extra_devices
        ]
    if profile is not None:
        raw["profile"] = profile
    return raw


def positive_int(value: Any, what: str, *, at_most: int = MAX_DEVICES) -> int:
    """``value`` as an int in ``[1, at_most]``, or an error saying ``what`` was wrong (every count in a cluster
    spec is a number of devices, so at most ``MAX_DEVICES`` by default)."""
    text = str(value).strip() if isinstance(value, (int, str)) and not isinstance(value, bool) else ""
    digits = text.lstrip("0") if text.isascii() and text.isdigit() else ""
    if not digits:
        raise ClusterSpecError(f"{what} must be a positive integer, got {quoted(value)}")
    if len(digits) > len(str(at_most)) or int(digits) > at_most:  # the length first: int() of 5,000 digits raises
        raise ClusterSpecError(f"{what} must be at most {at_most:,} (Tessera plans up to {MAX_DEVICES:,} devices), "
                               f"got {quoted(value)}")
    return int(digits)


def check_device_count(world: int, where: str) -> None:
    """Raise unless ``world`` devices is within ``MAX_DEVICES``."""
    if world > MAX_DEVICES:
        raise ClusterSpecError(f"{where} has {world:,} devices, more than the {MAX_DEVICES:,} Tessera plans for; "
                               "use fewer nodes or ranks")


def _check_fields(raw: dict, *, known: tuple[str, ...], required: tuple[str, ...], where: str) -> None:
    unknown = sorted(short(key) for key in raw if key not in known)
    if unknown:
        more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        raise ClusterSpecError(f"{where}: unknown field(s) {', '.join(unknown[:3])}{more}; known fields: {', '.join(known)}")
    missing = [field for field in required if field not in raw]
    if missing:
        raise ClusterSpecError(f"{where}: missing field(s) {', '.join(missing)}")


def _device(raw: Any, *, world: int, where: str) -> DeviceSpec:
    if raw == LOCAL_CPU:
        return local_cpu_device(world)
    if isinstance(raw, str):
        try:
            return device(raw)
        except ClusterSpecError as exc:
            raise ClusterSpecError(f"{where}: {exc}") from None
    return device_from_raw(raw, where=where)


def _extra_devices(raw: Any, *, name: str) -> tuple[DeviceGroup, ...]:
    if not isinstance(raw, list):
        raise ClusterSpecError(f"cluster {name}: field 'extra_devices' must be a list of {{device, count, note}}")
    groups = []
    for i, entry in enumerate(raw):
        where = f"cluster {name}: extra_devices[{i}]"
        if not isinstance(entry, dict):
            raise ClusterSpecError(f"{where}: expected a mapping with fields device, count, note")
        _check_fields(entry, known=("device", "count", "note"), required=("device", "count"), where=where)
        count = positive_int(entry["count"], f"{where}: field 'count'")
        spec = _device(entry["device"], world=count, where=f"{where}: field 'device'")
        groups.append(DeviceGroup(device=spec, num_devices=count, note=str(entry.get("note", ""))))
    return tuple(groups)


def _group_size(value: Any, *, where: str, per_node: int, world: int) -> int:
    if value == "node":
        return per_node
    if value == "world":
        return world
    match = re.fullmatch(r"\s*(\d+)\s+nodes?\s*", value) if isinstance(value, str) else None
    if match:
        return positive_int(match.group(1), f"{where}: field 'group_size'", at_most=max(MAX_DEVICES // per_node, 1)) * per_node
    try:
        return positive_int(value, f"{where}: field 'group_size'")
    except ClusterSpecError:
        raise ClusterSpecError(
            f"{where}: field 'group_size' must be a device count up to {MAX_DEVICES:,}, 'node', 'world' or 'K nodes', "
            f"got {quoted(value)}"
        ) from None


def _link_level(raw: Any, index: int, *, name: str, per_node: int, world: int) -> LinkLevel:
    where = f"cluster {name}: levels[{index}]"
    if not isinstance(raw, dict):
        raise ClusterSpecError(f"{where}: expected a mapping with fields {', '.join(LEVEL_REQUIRED)}")
    _check_fields(raw, known=LEVEL_FIELDS, required=LEVEL_REQUIRED, where=where)
    latencies = _mapping(raw, "collective_latency_us", where=where)
    local = _mapping(raw, "collective_local_ns_per_byte", where=where)
    measured = _measured(_mapping(raw, "collective_measured", where=where), where=where)
    by_layout = _measured_by_layout(_mapping(raw, "collective_measured_by_layout", where=where), where=where)
    try:
        return LinkLevel(
            name=raw["name"],
            group_size=_group_size(raw["group_size"], where=where, per_node=per_node, world=world),
            bandwidth_bytes_per_s=file_number(raw["bandwidth_gb_per_s"], f"{where}: field 'bandwidth_gb_per_s'", positive=True) * 1e9,
            latency_s=file_number(raw["latency_us"], f"{where}: field 'latency_us'") * 1e-6,
            efficiency=file_number(raw.get("efficiency", 1.0), f"{where}: field 'efficiency'", positive=True),
            oversubscription=file_number(raw.get("oversubscription", 1.0), f"{where}: field 'oversubscription'", positive=True),
            collective_efficiency={
                key: file_number(value, f"{where}: field 'collective_efficiency.{key}'", positive=True)
                for key, value in _mapping(raw, "collective_efficiency", where=where).items()
            },
            collective_latency_s={
                key: file_number(value, f"{where}: field 'collective_latency_us.{key}'") * 1e-6 for key, value in latencies.items()
            },
            collective_local_s_per_byte={
                key: file_number(value, f"{where}: field 'collective_local_ns_per_byte.{key}'") * 1e-9 for key, value in local.items()
            },
            collective_measured=measured,
            collective_measured_by_layout=by_layout,
            collective_algorithm=raw.get("collective_algorithm") or {},
            source=raw.get("source", "not given"),
        )
    except ValidationError as exc:
        raise ClusterSpecError(f"{where}: {first_problem(exc, renames=LEVEL_RENAMES)}; fix the value") from None


def _mapping(raw: dict, field: str, *, where: str) -> dict:
    value = raw.get(field) or {}
    if not isinstance(value, dict):
        raise ClusterSpecError(f"{where}: field '{field}' must map collective names to numbers")
    return value


def _measured(raw: dict, *, where: str) -> dict:
    """``{collective: {p: [latency_us, bandwidth_gb_per_s]}}`` in seconds and bytes/s."""
    return {
        collective: _links_by_key(table, what=f"{where}: field 'collective_measured.{collective}'", key="group sizes")
        for collective, table in raw.items()
    }


def _measured_by_layout(raw: dict, *, where: str) -> dict:
    """``{collective: {p: {stride: [latency_us, bandwidth_gb_per_s]}}}`` in seconds and bytes/s."""
    out: dict = {}
    for collective, table in raw.items():
        what = f"{where}: field 'collective_measured_by_layout.{collective}'"
        if not isinstance(table, dict):
            raise ClusterSpecError(f"{what} must map group sizes to {{stride: [latency_us, bandwidth_gb_per_s]}}")
        out[collective] = {
            positive_int(p, f"{what} key"): _links_by_key(row, what=f"{what}.{p}", key="strides") for p, row in table.items()
        }
    return out


def _links_by_key(table: Any, *, what: str, key: str) -> dict[int, tuple[float, float]]:
    """``{int: [latency_us, bandwidth_gb_per_s]}`` in seconds and bytes/s; ``key`` names what the ints are."""
    if not isinstance(table, dict):
        raise ClusterSpecError(f"{what} must map {key} to [latency_us, bandwidth_gb_per_s]")
    out = {}
    for k, pair in table.items():
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ClusterSpecError(f"{what}.{k} must be [latency_us, bandwidth_gb_per_s], got {quoted(pair)}")
        out[positive_int(k, f"{what} key")] = (file_number(pair[0], f"{what}.{k}[0]") * 1e-6, file_number(pair[1], f"{what}.{k}[1]", positive=True) * 1e9)
    return out


def _levels_within_world(levels: list[LinkLevel], *, world: int) -> tuple[LinkLevel, ...]:
    """Cut the first level that spans the world down to it and drop the levels outside it."""
    kept = []
    for level in levels:
        if level.group_size >= world:
            kept.append(level.model_copy(update={"group_size": world}))
            break
        kept.append(level)
    return tuple(kept)


def _level_to_raw(level: LinkLevel) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "name": level.name,
        "group_size": level.group_size,
        "bandwidth_gb_per_s": file_value(level.bandwidth_bytes_per_s / 1e9, positive=True),
        "latency_us": file_value(level.latency_s * 1e6),
        "efficiency": file_value(level.efficiency, positive=True),
        "oversubscription": file_value(level.oversubscription, positive=True),
    }
    if level.collective_efficiency:
        raw["collective_efficiency"] = {key: file_value(value, positive=True) for key, value in level.collective_efficiency.items()}
    if level.collective_latency_s:
        raw["collective_latency_us"] = {key: file_value(value * 1e6) for key, value in level.collective_latency_s.items()}
    if level.collective_local_s_per_byte:
        raw["collective_local_ns_per_byte"] = {
            key: file_value(value * 1e9) for key, value in level.collective_local_s_per_byte.items()
        }
    if level.collective_measured:
        raw["collective_measured"] = {key: _links_to_raw(table) for key, table in level.collective_measured.items()}
    if level.collective_measured_by_layout:
        raw["collective_measured_by_layout"] = {
            key: {p: _links_to_raw(row) for p, row in sorted(table.items())}
            for key, table in level.collective_measured_by_layout.items()
        }
    if level.collective_algorithm:
        raw["collective_algorithm"] = dict(level.collective_algorithm)
    raw["source"] = level.source
    return raw


def _links_to_raw(table: dict[int, tuple[float, float]]) -> dict[int, list[float]]:
    """``{int: (latency_s, bandwidth_bytes_per_s)}`` as ``{int: [latency_us, bandwidth_gb_per_s]}``."""
    return {k: [file_value(latency * 1e6), file_value(bandwidth / 1e9, positive=True)] for k, (latency, bandwidth) in sorted(table.items())}
