"""Typed PRNG key arrays (``jax.random.key``) round-trip bit for bit, with their impl.

MaxText's TrainState holds them (dtype ``key<urbg>`` under its default ``unsafe_rbg``); the
manifest stores a key array as its key data and names the impl, so restore gives back a key
array of the same impl, in the target's sharding.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from helpers import assert_trees_bitwise_equal
from mtc.head import CheckpointManager, MTCConfig
from mtc.shared.errors import TargetMismatchError

pytestmark = pytest.mark.unit

IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")


def _mesh():
    return Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))


def _keys(seed: int, impl: str):
    mesh = _mesh()
    base = jax.random.key(seed, impl=impl)
    return {
        "sharded": jax.device_put(jax.random.split(base, 8), NamedSharding(mesh, P("data"))),
        "grid": jax.device_put(jax.random.split(base, (4, 2)), NamedSharding(mesh, P("data", "model"))),
        "replicated": jax.device_put(jax.random.fold_in(base, 7), NamedSharding(mesh, P())),
        "w": jax.device_put(np.arange(16, dtype=np.float32), NamedSharding(mesh, P("data"))),
    }


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _mgr(ramdisk, **kw):
    return CheckpointManager(MTCConfig(local_checkpoint_directory=str(ramdisk), local_checkpoint_period=1, **kw))


@pytest.mark.parametrize("impl", IMPLS)
def test_key_arrays_round_trip_with_their_impl(ramdisk, impl):
    state = _keys(1, impl)
    with _mgr(ramdisk) as m:
        m.save(3, state)
        m.wait_until_finished()
        restored = m.restore(3, target=_abstract(state))
        untargeted = m.restore(3)
    for got in (restored, untargeted):
        assert_trees_bitwise_equal(state, got)
        for k in ("sharded", "grid", "replicated"):
            assert str(jax.random.key_impl(got[k])) == impl
            assert got[k].dtype == state[k].dtype
    # The restored keys draw the same numbers as the saved ones.
    np.testing.assert_array_equal(np.asarray(jax.random.uniform(restored["replicated"], (5,))),
                                  np.asarray(jax.random.uniform(state["replicated"], (5,))))


def test_manifest_names_the_impl_and_key_shape(ramdisk):
    with _mgr(ramdisk) as m:
        m.save(0, _keys(2, "rbg"), force=True)
        m.wait_until_finished()
    path = ramdisk / "mtc" / "steps" / f"{0:012d}.json"
    doc = json.loads(path.read_bytes().split(b"\n")[0])  # the manifest's header line
    recs = {a["key"]: a for a in doc["arrays"]}
    assert recs["['grid']"]["prng_impl"] == "rbg"
    assert recs["['grid']"]["prng_key_shape"] == [4]
    assert recs["['grid']"]["shape"] == [4, 2, 4] and recs["['grid']"]["dtype"] == "uint32"
    assert "prng_impl" not in recs["['w']"]


def test_key_array_restores_into_another_sharding(ramdisk):
    state = _keys(3, "threefry2x32")
    other = Mesh(np.array(jax.devices()), ("x",))
    target = _abstract(state)
    target["sharded"] = jax.ShapeDtypeStruct((8,), state["sharded"].dtype, sharding=NamedSharding(other, P()))
    with _mgr(ramdisk) as m:
        m.save(1, state, force=True)
        m.wait_until_finished()
        got = m.restore(1, target=target)
    assert got["sharded"].sharding.is_equivalent_to(NamedSharding(other, P()), 1)
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(got["sharded"])),
                                  np.asarray(jax.random.key_data(state["sharded"])))


def test_key_target_mismatches_are_named(ramdisk):
    state = _keys(4, "unsafe_rbg")
    with _mgr(ramdisk) as m:
        m.save(1, state, force=True)
        m.wait_until_finished()
        wrong_impl = _abstract(state)
        wrong_impl["grid"] = jax.ShapeDtypeStruct((4, 2), jax.random.key(0, impl="rbg").dtype,
                                                  sharding=state["grid"].sharding)
        with pytest.raises(TargetMismatchError, match=r"\['grid'\].*unsafe_rbg"):
            m.restore(1, target=wrong_impl)
        as_data = _abstract(state)
        as_data["sharded"] = jax.ShapeDtypeStruct((8, 4), np.uint32, sharding=state["sharded"].sharding)
        with pytest.raises(TargetMismatchError, match=r"\['sharded'\].*key-typed target"):
            m.restore(1, target=as_data)
        key_for_plain = _abstract(state)
        key_for_plain["w"] = jax.ShapeDtypeStruct((16,), state["sharded"].dtype, sharding=state["w"].sharding)
        with pytest.raises(TargetMismatchError, match=r"\['w'\].*float32"):
            m.restore(1, target=key_for_plain)


def test_manifest_with_inconsistent_key_fields_is_refused(ramdisk):
    from mtc.shared import format as fmt
    from mtc.shared.errors import ManifestError
    from mtc.shared.format.base import doc_digest

    with _mgr(ramdisk) as m:
        m.save(0, _keys(5, "rbg"), force=True)
        m.wait_until_finished()
    raw = (ramdisk / "mtc" / "steps" / f"{0:012d}.json").read_bytes()
    assert fmt.StepManifest.from_json(raw).arrays[0].prng_impl == "rbg"
    header, *parts = raw.split(b"\n")
    for bad, why in (([3], "trailing part"), ([0], "trailing part"), ("4", "trailing part")):
        doc = json.loads(header)
        for a in doc["arrays"]:
            if a.get("prng_impl"):
                a["prng_key_shape"] = bad
        doc.pop("digest")
        doc["digest"] = doc_digest(doc)  # a consistent digest: the field check must catch it
        with pytest.raises(ManifestError, match=why):
            fmt.StepManifest.from_json(b"\n".join([json.dumps(doc).encode(), *parts]))
