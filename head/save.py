"""The save path's two pure steps (DESIGN section 13): the state as leaves, and the step manifest.

``flatten`` validates a pytree and turns it into ``Leaf`` values (a typed PRNG key array is
stored as its key data, its impl named); ``build_manifest`` turns phase 1's answers into the
step manifest that phase 2 commits on every host. The manager runs them; neither touches a
sidecar.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np

from mtc.head import tree as tree_lib
from mtc.head.dispatch import Leaf, WriteResult
from mtc.head.restore_plan import is_prng_key, prng_key_shape
from mtc.shared import format as fmt
from mtc.shared import shardings, version
from mtc.shared.errors import SaveError, TargetMismatchError


def classify(key: str, leaf: Any) -> str:
    if isinstance(leaf, jax.Array):
        return "jax"
    if isinstance(leaf, (np.ndarray, np.generic)):
        return "numpy"
    if isinstance(leaf, (bool, int, float, str)):
        return "scalar"
    raise TargetMismatchError(
        f"leaf {key!r} is a {type(leaf).__name__}; mtc saves jax.Array, numpy arrays and Python "
        "scalars (bool, int, float, str): convert it or leave it out of the state")


def scalar_doc(v: Any) -> dict:
    if isinstance(v, bool):
        return {"type": "bool", "v": v}
    if isinstance(v, int):
        return {"type": "int", "v": v}
    if isinstance(v, float):
        return {"type": "float", "v": v.hex()}
    return {"type": "str", "v": v}


def flatten(state: Any) -> tuple[list[Leaf], Any]:
    """(the leaves of ``state``, its tree document for the manifest)."""
    keys, values, _ = tree_lib.flatten(state)
    leaves = []
    for i, (key, value) in enumerate(zip(keys, values)):
        kind = classify(key, value)
        leaf = Leaf(index=i, key=key, kind=kind, value=value)
        if kind == "jax":
            if is_prng_key(value):
                # The format stores a key array as its key data and names the impl.
                leaf.prng_impl = str(jax.random.key_impl(value))
                value = leaf.value = jax.random.key_data(value)
                leaf.prng_key_shape = prng_key_shape(leaf.prng_impl)
            leaf.dtype = fmt.dtype_name(value.dtype)
            leaf.shape = tuple(value.shape)
            leaf.sharding = value.sharding
            if not value.is_fully_addressable:
                raise TargetMismatchError(f"leaf {key!r} is not fully addressable from this process")
            leaf.device_boxes = shardings.device_boxes(value.sharding, leaf.shape)
        elif kind == "numpy":
            value = np.asarray(value)
            leaf.value = value
            leaf.dtype = fmt.dtype_name(value.dtype)
            leaf.shape = tuple(value.shape)
        leaves.append(leaf)
    return leaves, tree_lib.encode(state)


def build_manifest(step: int, leaves: list[Leaf], tree_doc: Any, result: WriteResult) -> fmt.StepManifest:
    """The step manifest from the leaves and phase 1's answer (SaveError if a shard is missing)."""
    records = []
    for leaf in leaves:
        if leaf.kind == "scalar":
            records.append(fmt.ArrayRecord(key=leaf.key, kind="scalar", value=scalar_doc(leaf.value)))
            continue
        dt = fmt.dtype_from_name(leaf.dtype)
        if leaf.kind == "numpy":
            boxes = [tuple((0, n) for n in leaf.shape)]
            sharding = None
        else:
            boxes = sorted(set(leaf.device_boxes.values()))
            sharding = shardings.describe(leaf.sharding)
        shards = []
        for box in boxes:
            blob = result.blobs.get((leaf.index, box))
            if blob is None:
                raise SaveError(f"step {step}: no host wrote array {leaf.key!r} shard {fmt.box_str(box)}", step=step)
            nbytes = int(np.prod(fmt.box_shape(box), dtype=np.int64)) * dt.itemsize
            shards.append(fmt.ShardRecord(box, blob, nbytes, tuple(result.box_devices.get((leaf.index, box), ()))))
        records.append(fmt.ArrayRecord(key=leaf.key, kind=leaf.kind, dtype=leaf.dtype, shape=leaf.shape,
                                       sharding=sharding, shards=tuple(shards), prng_impl=leaf.prng_impl,
                                       prng_key_shape=leaf.prng_key_shape))
    return fmt.StepManifest(step=step, arrays=tuple(records), tree=tree_doc, created=time.time(),
                            topology={"hosts": sorted(result.hosts)}, fingerprint=version.fingerprint())
