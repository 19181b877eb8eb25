"""The save path's two pure steps: the state as leaves, and the step manifest.

``flatten`` validates a pytree and turns it into ``Leaf`` values (a typed PRNG key array is
stored as its key data, its impl named); ``build_step`` turns phase 1's answers into the
step manifest that phase 2 commits, once the hosts' copies of every replicated box are found
equal (``mtc.head.twin_check``). The manager runs them; neither touches a sidecar.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np

from mtc.head import tree as tree_lib
from mtc.head.dispatch.interface import Leaf, WriteResult
from mtc.head.twin_check import check as check_twins, hash_replicas
from mtc.shared import format as fmt
from mtc.shared import protocol, shardings, version
from mtc.shared.errors import TargetMismatchError


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


@dataclasses.dataclass
class SavedLeaf(Leaf):
    """A leaf being saved, with the names of its replicas that no host writes (``twin_check_hash``)."""

    replica_blobs: dict = dataclasses.field(default_factory=dict)  # box -> {device id: blob name}


def flatten(state: Any, config: Any = None) -> tuple[list[Leaf], Any]:
    """(the leaves of ``state``, its tree document for the manifest).

    With ``config.twin_check_hash`` (and the twin check on), the replicas no host writes are
    hashed now, while the caller waits: once ``save`` returns, the training step may overwrite them.
    """
    keys, values, _ = tree_lib.flatten(state)
    leaves = []
    for i, (key, value) in enumerate(zip(keys, values)):
        kind = classify(key, value)
        leaf = SavedLeaf(index=i, key=key, kind=kind, value=value)
        if kind == "jax":
            if tree_lib.is_prng_key(value):
                # The format stores a key array as its key data and names the impl.
                leaf.prng_impl = str(jax.random.key_impl(value))
                value = leaf.value = jax.random.key_data(value)
                leaf.prng_key_shape = tree_lib.prng_key_shape(leaf.prng_impl)
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
    if config is not None and config.twin_check != "off" and config.twin_check_hash:
        for index, boxes in hash_replicas(leaves).items():
            leaves[index].replica_blobs = boxes
    return leaves, tree_lib.encode(state)


def build_step(step: int, leaves: list[Leaf], tree_doc: Any, result: WriteResult,
               dispatch: Any = None, twin_check: str = "off") -> tuple[protocol.Gathered, str]:
    """The step manifest (its buffers, unjoined: ``fmt.encode_step_segments``; and its digest) from the
    leaves and phase 1's host parts.

    First the twin check (``twin_check``: "warn", "fail" or "off"): where the hosts' parts (or the
    hash pass of ``flatten``) name more than one blob for one box, ``TwinMismatchError`` (the step
    must not be committed). ``dispatch`` says which host holds each device and is in which slice.

    The head's work here grows with arrays and hosts, not shards: the parts are hashed and
    appended as the hosts wrote them; which devices held each shard follows from the named
    sharding, which is described once. Only an array whose boxes do not follow from its
    sharding description (an unusual sharding) lists them. The hosts that keep the whole
    manifest check, before they commit, that the parts cover every array (``fmt.StepManifest``).
    """
    slice_of = dispatch.slice_of if dispatch is not None else None
    if twin_check != "off":
        hashed = {leaf.index: leaf.replica_blobs for leaf in leaves if getattr(leaf, "replica_blobs", None)}
        check_twins(step, twin_check, leaves, result.parts, hashed,
                    dispatch.host_of_device if dispatch is not None else str)
    records = []
    listed: dict[int, list] = {}
    derived: dict[tuple, bool] = {}
    described: dict[Any, dict] = {}  # one description per sharding, shared by the arrays that use it
    for leaf in leaves:
        if leaf.kind == "scalar":
            records.append(fmt.ArrayRecord(key=leaf.key, kind="scalar", value=scalar_doc(leaf.value)))
            continue
        sharding = None
        if leaf.kind == "jax":
            sharding = described.get(leaf.sharding)
            if sharding is None:
                sharding = described[leaf.sharding] = shardings.describe(leaf.sharding)
            key = (leaf.sharding, leaf.shape)
            ok = derived.get(key)
            if ok is None:
                ok = derived[key] = shardings.described_device_boxes(sharding, leaf.shape) == leaf.device_boxes
            if not ok:
                by_box: dict = {}
                for dev, box in leaf.device_boxes.items():
                    by_box.setdefault(box, []).append(dev)
                listed[leaf.index] = sorted(by_box.items())
        records.append(fmt.ArrayRecord(key=leaf.key, kind=leaf.kind, dtype=leaf.dtype, shape=leaf.shape,
                                       sharding=sharding, prng_impl=leaf.prng_impl,
                                       prng_key_shape=leaf.prng_key_shape))
    topology: dict = {"hosts": sorted(result.hosts)}
    slices = {h: slice_of(h) for h in topology["hosts"]} if slice_of is not None else {}
    if any(slices.values()):  # more than one slice: which host is in which (tools reading a stopped job)
        topology["slices"] = slices
    if dispatch is not None and described:
        # Which host wrote the shards of which devices: a restore onto the same hosts and shardings
        # reads the header alone (fmt.StepHeader), each host its own part.
        topology["devices"] = shardings.devices_by_host(described.values(), dispatch.host_of_device)
    segments, digest = fmt.encode_step_segments(step=step, arrays=records, tree=tree_doc, created=time.time(),
                                                topology=topology, fingerprint=version.fingerprint(),
                                                parts=result.parts, listed_boxes=listed)
    return protocol.Gathered(tuple(segments)), digest
