"""Sharding descriptions: how a jax Sharding is written into manifests and requests.

Both sides need this: the head describes the sharding of what it saves and of the restore
target; the sidecar rebuilds the target sharding on its colocated CPU devices.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import numpy as np

from mtc.shared.errors import ManifestError, TargetMismatchError
from mtc.shared.format.base import box_from_index


def describe(sharding: Any) -> dict:
    """A JSON description of a jax Sharding (NamedSharding or SingleDeviceSharding)."""
    import jax

    if isinstance(sharding, jax.sharding.NamedSharding):
        mesh = sharding.mesh
        spec = []
        for entry in sharding.spec:
            if entry is None or isinstance(entry, str):
                spec.append(entry)
            else:
                spec.append(list(entry))
        return {
            "type": "named",
            "mesh_shape": list(mesh.devices.shape),
            "axis_names": list(mesh.axis_names),
            "device_ids": [int(d.id) for d in mesh.devices.flat],
            "spec": spec,
        }
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        (dev,) = sharding.device_set
        return {"type": "single", "device_ids": [int(dev.id)]}
    ids = sorted(int(d.id) for d in sharding.device_set)
    return {"type": "other", "device_ids": ids, "repr": repr(sharding)[:200]}


def pack(desc: Mapping) -> dict:
    """``desc`` for the wire: its ``device_ids`` as runs of consecutive ids (``device_runs``: [[first,
    count], ...]), so that a mesh over every device of a job (0..N-1: one run) is a few bytes, not N
    numbers, in a request every host gets. ``unpack`` gives the description back."""
    ids = desc.get("device_ids")
    if not isinstance(ids, list) or len(ids) < 4:
        return dict(desc)
    runs: list[list[int]] = []
    for i in ids:
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1][1] += 1
        else:
            runs.append([i, 1])
    if 2 * len(runs) >= len(ids):
        return dict(desc)
    return {**{k: v for k, v in desc.items() if k != "device_ids"}, "device_runs": runs}


def unpack(desc: Any, where: str, limit: int = 1 << 24) -> Any:
    """A description from the wire (``pack``): ``device_runs`` expanded, checked; others as they are."""
    if not isinstance(desc, dict) or "device_runs" not in desc:
        return desc
    runs = desc["device_runs"]
    if not (isinstance(runs, list) and all(isinstance(r, list) and len(r) == 2 and all(type(x) is int and x >= 0
                                                                                        for x in r) for r in runs)
            and sum(r[1] for r in runs) <= limit):
        raise ManifestError(f"{where}: 'device_runs' is not a list of [first id, count] (at most {limit} ids)")
    out = {k: v for k, v in desc.items() if k != "device_runs"}
    out["device_ids"] = [first + k for first, count in runs for k in range(count)]
    return out


def rebuild(desc: Mapping, devices_by_id: Mapping[int, Any] | None = None):
    """The jax Sharding that ``describe`` described, on the devices of this process."""
    import jax

    if devices_by_id is None:
        devices_by_id = {d.id: d for d in jax.devices()}
    try:
        devs = [devices_by_id[i] for i in desc["device_ids"]]
    except KeyError as e:
        raise TargetMismatchError(
            f"sharding refers to device {e.args[0]}, which this process does not have; "
            "pass a restore target with shardings on the current devices") from None
    kind = desc.get("type")
    if kind == "named":
        mesh = jax.sharding.Mesh(np.array(devs, dtype=object).reshape(desc["mesh_shape"]),
                                 tuple(desc["axis_names"]))
        spec = [tuple(e) if isinstance(e, list) else e for e in desc["spec"]]
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
    if kind == "single":
        return jax.sharding.SingleDeviceSharding(devs[0])
    raise TargetMismatchError(
        f"cannot rebuild a sharding of type {kind!r} ({desc.get('repr', '')}); "
        "pass a restore target whose leaves carry a NamedSharding")


def devices_by_host(descs: Iterable[Mapping], host_of_device: Callable[[int], str]) -> dict[str, list[int]]:
    """host -> the ids, ascending, of the devices of ``descs`` (sharding descriptions) it holds: what a
    step's header records as ``topology.devices`` (which host wrote the shards of which devices).
    O(distinct devices)."""
    out: dict[str, list[int]] = {}
    for dev_id in sorted({int(i) for d in descs for i in d.get("device_ids") or ()}):
        out.setdefault(host_of_device(dev_id), []).append(dev_id)
    return dict(sorted(out.items()))


def check_desc(desc: Any, where: str) -> None:
    if desc is None:
        return
    if not isinstance(desc, dict) or desc.get("type") not in ("named", "single", "other"):
        raise ManifestError(f"{where}: sharding description {desc!r} is malformed")


def device_boxes(sharding: Any, shape: tuple[int, ...]) -> dict[int, tuple[tuple[int, int], ...]]:
    """device id -> the box of the global array that the device holds."""
    return {d.id: box_from_index(idx, shape) for d, idx in sharding.devices_indices_map(tuple(shape)).items()}


def described_device_boxes(desc: Mapping | None, shape: tuple[int, ...]) -> dict[int, tuple] | None:
    """device id -> box, computed from a sharding *description* alone (no jax devices needed).

    This is what lets a manifest describe a named sharding once (mesh and spec) instead of
    listing, for every shard of every array, the devices that held it. Works for ``named``
    descriptions whose sharded dimensions divide evenly (what jax's NamedSharding requires)
    and for ``single``; None when the boxes cannot be derived (other shardings), in which case
    the manifest lists them explicitly.
    """
    if not desc:
        return None
    shape = tuple(int(n) for n in shape)
    kind = desc.get("type")
    if kind == "single":
        return {int(desc["device_ids"][0]): tuple((0, n) for n in shape)}
    if kind != "named":
        return None
    mesh_shape = [int(n) for n in desc["mesh_shape"]]
    names = list(desc["axis_names"])
    ids = [int(i) for i in desc["device_ids"]]
    spec = list(desc.get("spec") or [])
    if len(spec) > len(shape) or int(np.prod(mesh_shape, dtype=np.int64)) != len(ids):
        return None
    coords = np.unravel_index(np.arange(len(ids)), mesh_shape) if ids else ()
    starts, stops = [], []
    for d, n in enumerate(shape):
        entry = spec[d] if d < len(spec) else None
        axes = [] if entry is None else [entry] if isinstance(entry, str) else list(entry)
        index = np.zeros(len(ids), np.int64)
        parts = 1
        for a in axes:
            if a not in names:
                return None
            k = names.index(a)
            index = index * mesh_shape[k] + coords[k]
            parts *= mesh_shape[k]
        if n % parts:
            return None  # uneven: let the manifest list the boxes
        chunk = n // parts
        starts.append(index * chunk)
        stops.append(index * chunk + chunk)
    return {dev: tuple((int(starts[d][i]), int(stops[d][i])) for d in range(len(shape)))
            for i, dev in enumerate(ids)}
