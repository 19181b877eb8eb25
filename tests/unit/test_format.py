"""Manifests: round trips, a golden document, and validation of untrusted input."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from mtc.shared import format as fmt
from mtc.shared.errors import ManifestError
from mtc.shared.hashing import blob_name

pytestmark = pytest.mark.unit

B1, B2 = "0" * 32, "f" * 32


def sample() -> fmt.StepManifest:
    w = fmt.ArrayRecord(
        key="['w']", kind="jax", dtype="bfloat16", shape=(4, 2),
        sharding={"type": "named", "mesh_shape": [2], "axis_names": ["x"], "device_ids": [0, 1], "spec": ["x"]},
        shards=(fmt.ShardRecord(((0, 2), (0, 2)), B1, 8, (0,)), fmt.ShardRecord(((2, 4), (0, 2)), B2, 8, (1,))))
    s = fmt.ArrayRecord(key="['step']", kind="scalar", value={"type": "int", "v": 3})
    return fmt.StepManifest(step=3, arrays=(w, s), tree={"t": "dict"}, created=1.5, topology={"hosts": ["h0"]},
                            fingerprint={"mtc": "0.1.0"})


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int8, np.uint32, np.bool_, np.complex64, np.int64,
                                   np.float64, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2,
                                   ml_dtypes.int4, ml_dtypes.uint4])
def test_dtype_names_round_trip(dtype):
    name = fmt.dtype_name(dtype)
    assert fmt.dtype_from_name(name) == np.dtype(dtype)
    assert name == np.dtype(dtype).name or name in ("bfloat16", "float8_e4m3fn", "float8_e5m2", "int4", "uint4")


def test_unknown_dtype_is_a_clear_error():
    with pytest.raises(ManifestError, match="unknown dtype name 'float3'"):
        fmt.dtype_from_name("float3")
    with pytest.raises(ManifestError, match="cannot be checkpointed"):
        fmt.dtype_name(np.dtype("U3"))


def test_step_manifest_round_trip():
    m = sample()
    assert fmt.StepManifest.from_json(m.to_json()) == m
    assert m.blob_sizes() == {B1: 8, B2: 8} and m.nbytes == 16


def test_golden_document():
    # The on-disk format is a contract: a document written by mtc/1 must keep parsing.
    golden = (
        '{"arrays":[{"dtype":"float32","key":"[\'a\']","kind":"jax","shape":[2],'
        '"sharding":{"device_ids":[0],"type":"single"},'
        '"shards":[{"blob":"00000000000000000000000000000000","box":[[0,2]],"devices":[0],"nbytes":8}]}],'
        '"created":0.0,"fingerprint":{},"format":"mtc/1","hash":"xxh3_128","step":1,"topology":{},'
        '"tree":{"k":["a"],"t":"dict","v":[{"i":0,"t":"leaf"}]}}')
    m = fmt.StepManifest.from_json(golden)
    assert m.step == 1 and m.arrays[0].shards[0].box == ((0, 2),) and m.arrays[0].np_dtype == np.float32
    # Written today as mtc/2: the same content, and a digest over it.
    doc = json.loads(m.to_json())
    assert doc.pop("format") == "mtc/2" and doc.pop("digest") == m.digest
    assert {k: v for k, v in json.loads(golden).items() if k != "format"} == doc
    assert fmt.StepManifest.from_json(m.to_json()) == m


def test_a_manifest_whose_content_does_not_match_its_digest_is_refused():
    """Valid JSON, every field well-formed, two same-size blob names swapped: not used."""
    m = sample()
    doc = json.loads(m.to_json())
    shards = doc["arrays"][0]["shards"]
    a, b = shards[0]["blob"], shards[1]["blob"]
    shards[0]["blob"], shards[1]["blob"] = b, a
    with pytest.raises(ManifestError, match="does not match its digest"):
        fmt.StepManifest.from_json(json.dumps(doc))
    doc = json.loads(m.to_json())
    del doc["digest"]  # stripping it does not help: mtc/2 requires it
    with pytest.raises(ManifestError, match="does not match its digest"):
        fmt.StepManifest.from_json(json.dumps(doc))


def _doc(**changes):
    d = json.loads(sample().to_json())
    d.update(changes)
    return json.dumps(d)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(format="mtc/9"), "format is 'mtc/9'"),
    (lambda d: d.update(step=-1), "step -1"),
    (lambda d: d.update(arrays="x"), "'arrays' is missing"),
    (lambda d: d["arrays"][0].update(kind="torch"), "kind 'torch'"),
    (lambda d: d["arrays"][0]["shards"][0].update(blob="../../etc/passwd"), "blob name '../../etc/passwd'"),
    (lambda d: d["arrays"][0]["shards"][0].update(nbytes=9), "nbytes 9 does not match"),
    (lambda d: d["arrays"][0]["shards"].pop(), "do not cover"),
    (lambda d: d["arrays"][0]["shards"][0].update(box=[[0, 9], [0, 2]]), "does not fit shape"),
    (lambda d: d["arrays"][0].update(dtype="float3"), "unknown dtype"),
    (lambda d: d["arrays"].append(d["arrays"][0]), "duplicate array keys"),
])
def test_malformed_manifests_say_what_is_wrong(mutate, message):
    d = json.loads(sample().to_json())
    mutate(d)
    with pytest.raises(ManifestError, match=message.replace("(", r"\(").replace("[", r"\[")):
        fmt.StepManifest.from_json(json.dumps(d), source="test manifest")


def test_not_json():
    with pytest.raises(ManifestError, match="not valid JSON"):
        fmt.StepManifest.from_json(b"\x00garbage")


def test_host_manifest_round_trip_and_validation():
    h = fmt.HostManifest(3, "s0-h1", (fmt.HostShard(0, ((0, 2),), blob_name(b"ab"), 2),), 2, 0.5)
    assert fmt.HostManifest.from_json(h.to_json()) == h
    assert fmt.collect_blob_names(h.to_json()) == {blob_name(b"ab")}
    bad = json.loads(h.to_json())
    bad["shards"][0][2] = "ZZ"
    with pytest.raises(ManifestError, match="blob name 'ZZ'"):
        fmt.HostManifest.from_json(json.dumps(bad))


def test_boxes():
    assert fmt.box_intersect(((0, 4), (0, 4)), ((2, 6), (3, 8))) == ((2, 4), (3, 4))
    assert fmt.box_intersect(((0, 2),), ((2, 4),)) is None
    assert fmt.box_from_index((slice(None), slice(2, 4)), (3, 8)) == ((0, 3), (2, 4))
