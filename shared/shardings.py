"""Sharding descriptions: how a jax Sharding is written into manifests and requests.

Both sides need this: the head describes the sharding of what it saves and of the restore
target; the sidecar rebuilds the target sharding on its colocated CPU devices.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from mtc.shared.errors import ManifestError, TargetMismatchError


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


def check_desc(desc: Any, where: str) -> None:
    if desc is None:
        return
    if not isinstance(desc, dict) or desc.get("type") not in ("named", "single", "other"):
        raise ManifestError(f"{where}: sharding description {desc!r} is malformed")


def device_boxes(sharding: Any, shape: tuple[int, ...]) -> dict[int, tuple[tuple[int, int], ...]]:
    """device id -> the box of the global array that the device holds."""
    from mtc.shared.format import box_from_index

    return {d.id: box_from_index(idx, shape) for d, idx in sharding.devices_indices_map(tuple(shape)).items()}
