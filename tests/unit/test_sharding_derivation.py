"""A manifest describes a named sharding once; which device held which box is derived from the
description. The derivation must agree with jax's own ``devices_indices_map`` for every layout."""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mtc.shared import shardings

pytestmark = pytest.mark.unit

MESHES = [((8,), ("x",)), ((2, 4), ("data", "fsdp")), ((4, 2), ("fsdp", "tensor")), ((2, 2, 2), ("a", "b", "c"))]


def _specs(names):
    entries = [None, *names, *(tuple(p) for p in itertools.permutations(names, 2))]
    for d0 in entries:
        for d1 in entries:
            used = [a for e in (d0, d1) if e is not None for a in ((e,) if isinstance(e, str) else e)]
            if len(used) == len(set(used)):
                yield P(d0, d1)


@pytest.mark.parametrize("mesh_shape, names", MESHES)
def test_derived_boxes_match_jax_for_every_spec(mesh_shape, names):
    devices = np.array(jax.devices()[:8])
    # Also a mesh whose device order is not the id order (as a Pathways mesh often is).
    for order in (devices, devices[::-1]):
        mesh = Mesh(order.reshape(mesh_shape), names)
        for spec in _specs(names):
            sharding = NamedSharding(mesh, spec)
            shape = (16, 24)
            want = shardings.device_boxes(sharding, shape)
            assert shardings.described_device_boxes(shardings.describe(sharding), shape) == want, spec


def test_what_cannot_be_derived_says_so():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "fsdp"))
    desc = shardings.describe(NamedSharding(mesh, P("fsdp")))
    assert shardings.described_device_boxes(desc, (6, 3)) is None  # 6 rows over 4: uneven
    assert shardings.described_device_boxes({**desc, "spec": ["nope"]}, (8,)) is None
    assert shardings.described_device_boxes({"type": "other", "device_ids": [0]}, (8,)) is None
    single = shardings.describe(jax.sharding.SingleDeviceSharding(jax.devices()[3]))
    assert shardings.described_device_boxes(single, (2, 5)) == {3: ((0, 2), (0, 5))}
