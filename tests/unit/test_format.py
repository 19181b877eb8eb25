"""Manifests: round trips, a golden document, and validation of untrusted input."""

from __future__ import annotations

import base64
import dataclasses
import json
import re

import ml_dtypes
import numpy as np
import pytest

from mtc.shared import format as fmt
from mtc.shared.errors import ManifestError
from mtc.shared.format.base import doc_digest
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


GOLDEN_V2 = (
    '{"arrays":[{"dtype":"bfloat16","key":"[\'w\']","kind":"jax","shape":[4,2],"sharding":{"axis_names":["x"],'
    '"device_ids":[0,1],"mesh_shape":[2],"spec":["x"],"type":"named"},"shards":[{"blob":"00000000000000000000000000000000",'
    '"box":[[0,2],[0,2]],"devices":[0],"nbytes":8},{"blob":"ffffffffffffffffffffffffffffffff","box":[[2,4],[0,2]],'
    '"devices":[1],"nbytes":8}]},{"key":"[\'step\']","kind":"scalar","value":{"type":"int","v":3}}],"created":1.5,'
    '"digest":"e25c9809c5b5d07c80e04a99c3560af43ff1dc4acece50495a00ce6c5030bd3a","fingerprint":{"mtc":"0.1.0"},'
    '"format":"mtc/2","hash":"xxh3_128","step":3,"topology":{"hosts":["h0"]},"tree":{"t":"dict"}}')


def test_golden_documents_of_older_formats_keep_parsing():
    # The on-disk format is a contract: documents written by mtc/1 and mtc/2 must keep parsing.
    golden = (
        '{"arrays":[{"dtype":"float32","key":"[\'a\']","kind":"jax","shape":[2],'
        '"sharding":{"device_ids":[0],"type":"single"},'
        '"shards":[{"blob":"00000000000000000000000000000000","box":[[0,2]],"devices":[0],"nbytes":8}]}],'
        '"created":0.0,"fingerprint":{},"format":"mtc/1","hash":"xxh3_128","step":1,"topology":{},'
        '"tree":{"k":["a"],"t":"dict","v":[{"i":0,"t":"leaf"}]}}')
    m = fmt.StepManifest.from_json(golden)
    assert m.step == 1 and m.arrays[0].shards[0].box == ((0, 2),) and m.arrays[0].np_dtype == np.float32
    # mtc/1 had no digest: it is written anew as mtc/3, with the same content.
    assert json.loads(m.to_json().split(b"\n")[0])["format"] == "mtc/3"
    assert fmt.StepManifest.from_json(m.to_json()) == m
    v2 = fmt.StepManifest.from_json(GOLDEN_V2)
    assert v2 == sample() and v2.digest == "e25c9809c5b5d07c80e04a99c3560af43ff1dc4acece50495a00ce6c5030bd3a"
    assert v2.to_json() == GOLDEN_V2.encode()  # read bytes are kept as they are (their digest is compared)
    bad = json.loads(GOLDEN_V2)
    bad["arrays"][0]["shards"][0]["blob"], bad["arrays"][0]["shards"][1]["blob"] = B2, B1
    with pytest.raises(ManifestError, match="does not match its digest"):
        fmt.StepManifest.from_json(json.dumps(bad))


def test_mtc3_is_a_header_line_and_one_line_per_host_part():
    """A named sharding is described once for all arrays that use it; no per-shard device lists."""
    m = sample()
    data = m.to_json()
    header, *parts = data.split(b"\n")
    doc = json.loads(header)
    assert doc["format"] == "mtc/3" and doc["digest"] == m.digest and len(parts) == len(doc["parts"]) == 1
    assert doc["shardings"] == [m.arrays[0].sharding] and doc["arrays"][0]["sharding"] == 0
    assert "boxes" not in doc["arrays"][0] and b"devices" not in data
    again = fmt.StepManifest.from_json(data)
    assert again == m and [s.devices for s in again.arrays[0].shards] == [(0,), (1,)]


def _parts(step=3):
    w = fmt.ArrayRecord(key="['w']", kind="jax", dtype="bfloat16", shape=(4, 2),
                        sharding={"type": "named", "mesh_shape": [2, 2], "axis_names": ["data", "fsdp"],
                                  "device_ids": [0, 1, 2, 3], "spec": ["fsdp"]})
    s = fmt.ArrayRecord(key="['step']", kind="scalar", value={"type": "int", "v": 3})
    # Two hosts, each with one data-parallel replica of both fsdp shards.
    rows = (fmt.HostShard(0, ((0, 2), (0, 2)), B1, 8), fmt.HostShard(0, ((2, 4), (0, 2)), B2, 8))
    parts = [(h, fmt.HostManifest(step, h, rows, 16, 0.1).to_json()) for h in ("h0", "h1")]
    return dict(step=step, arrays=[w, s], tree={"t": "dict"}, created=1.0, topology={"hosts": ["h0", "h1"]},
                fingerprint={}), parts


def test_the_head_builds_a_step_from_parts_it_does_not_parse():
    meta, parts = _parts()
    data, digest = fmt.encode_step(**meta, parts=parts)
    assert data.endswith(b"\n".join(p for _, p in parts))  # the parts, byte for byte
    m = fmt.StepManifest.from_json(data)
    assert m.digest == digest and [h for h, _ in m.parts] == ["h0", "h1"]
    w = m.arrays[0]
    assert [(s.box, s.blob, s.devices) for s in w.shards] == [(((0, 2), (0, 2)), B1, (0, 2)),
                                                              (((2, 4), (0, 2)), B2, (1, 3))]
    assert m.blob_names() == {B1, B2} and m.to_json() == data


def test_the_header_alone_gives_the_arrays_without_reading_a_part():
    meta, parts = _parts()
    meta["topology"] = {**meta["topology"], "devices": {"h0": [0, 1], "h1": [2, 3]}}
    data, digest = fmt.encode_step(**meta, parts=parts)
    whole = fmt.StepManifest.from_json(data)
    header = fmt.StepHeader.from_line(data)  # the first line; the parts are not looked at
    assert header.digest == digest and header.step == 3 and [h for h, _ in header.parts] == ["h0", "h1"]
    assert header.parts == whole.parts and header.devices == {"h0": (0, 1), "h1": (2, 3)}
    assert [dataclasses.replace(a, shards=()) for a in whole.arrays] == list(header.arrays)
    assert all(not a.shards for a in header.arrays)
    view = header.as_manifest()
    assert view.digest == digest and [a.key for a in view.arrays] == ["['w']", "['step']"]
    with pytest.raises(ManifestError, match="never written"):
        view.to_json()
    # A changed header is refused; an older step (no devices) reads, without them; mtc/2 is not a header.
    doc = json.loads(data.split(b"\n")[0])
    doc["arrays"][0]["shape"] = [2, 4]
    with pytest.raises(ManifestError, match="does not match its digest"):
        fmt.StepHeader.from_line(json.dumps(doc).encode())
    old, _ = fmt.encode_step(**{**meta, "topology": {"hosts": ["h0", "h1"]}}, parts=parts)
    assert fmt.StepHeader.from_line(old).devices is None
    with pytest.raises(ManifestError, match="expected 'mtc/3'"):
        fmt.StepHeader.from_line(GOLDEN_V2.encode() if isinstance(GOLDEN_V2, str) else GOLDEN_V2)


@pytest.mark.parametrize("change, message", [
    (lambda parts: parts[1].__setitem__(1, parts[1][1].replace(b'"written_bytes":16', b'"written_bytes":17')),
     "does not match its hash"),
    (lambda parts: parts.pop(), "1 host parts, its header lists 2"),
])
def test_a_changed_part_is_refused(change, message):
    meta, parts = _parts()
    data, _ = fmt.encode_step(**meta, parts=parts)
    lines = data.split(b"\n")
    rows = [[lines[0]], *[[h, line] for (h, _), line in zip(parts, lines[1:])]]
    body = [rows[1], rows[2]]
    change(body)
    with pytest.raises(ManifestError, match=message):
        fmt.StepManifest.from_json(b"\n".join([lines[0], *[r[1] for r in body]]))


def test_replicas_that_disagree_are_refused_and_an_uncovered_array_too():
    meta, parts = _parts()
    other = fmt.HostManifest(3, "h1", (fmt.HostShard(0, ((0, 2), (0, 2)), "1" * 32, 8),
                                       fmt.HostShard(0, ((2, 4), (0, 2)), B2, 8))).to_json()
    data, _ = fmt.encode_step(**meta, parts=[parts[0], ("h1", other)])
    with pytest.raises(ManifestError, match="different contents on hosts h0 and h1"):
        fmt.StepManifest.from_json(data)
    half = fmt.HostManifest(3, "h0", (fmt.HostShard(0, ((0, 2), (0, 2)), B1, 8),)).to_json()
    data, _ = fmt.encode_step(**meta, parts=[("h0", half)])
    with pytest.raises(ManifestError, match="do not cover"):
        fmt.StepManifest.from_json(data)


def test_the_header_is_covered_by_its_digest():
    m = sample()
    header, *parts = m.to_json().split(b"\n")
    doc = json.loads(header)
    doc["arrays"][0]["shape"] = [2, 4]
    with pytest.raises(ManifestError, match="does not match its digest"):
        fmt.StepManifest.from_json(b"\n".join([json.dumps(doc).encode(), *parts]))
    doc = json.loads(header)
    del doc["digest"]
    with pytest.raises(ManifestError, match="does not match its digest"):
        fmt.StepManifest.from_json(b"\n".join([json.dumps(doc).encode(), *parts]))


def _v2(**changes):
    d = json.loads(GOLDEN_V2)
    d.update(changes)
    return d


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
    d = _v2()
    mutate(d)
    with pytest.raises(ManifestError, match=message.replace("(", r"\(").replace("[", r"\[")):
        fmt.StepManifest.from_json(json.dumps(d), source="test manifest")


@pytest.mark.parametrize("mutate, message", [
    (lambda h, p: h.update(step=-1), "step -1"),
    (lambda h, p: h["arrays"][0].update(kind="torch"), "kind 'torch'"),
    (lambda h, p: h["arrays"][0].update(sharding=7), "sharding 7 is not an index"),
    (lambda h, p: h["arrays"][0].update(dtype="float3"), "unknown dtype"),
    (lambda h, p: p["shards"][0].__setitem__(2, "../../etc/passwd"), "blob name '../../etc/passwd'"),
    (lambda h, p: p["shards"][0].__setitem__(3, 9), "nbytes 9 does not match"),
    (lambda h, p: p["shards"].pop(), "do not cover"),
    (lambda h, p: p["shards"][0].__setitem__(1, [[0, 9], [0, 2]]), "does not fit shape"),
    (lambda h, p: p["shards"][0].__setitem__(0, 1), "not an array of this step"),
    (lambda h, p: p.update(host="h9"), "the header says host"),
])
@pytest.mark.parametrize("version", ["mtc-host/1", "mtc-host/2"])
def test_malformed_mtc3_manifests_say_what_is_wrong(mutate, message, version):
    """Each change is re-hashed and re-digested, so only the validation can catch it; the part is
    written in either format (a name that is not hex cannot be written as mtc-host/2's bytes)."""
    header, part = sample().to_json().split(b"\n")
    h, p = json.loads(header), _rows_doc(part)
    mutate(h, p)
    if version == "mtc-host/2" and not all(_hex(r[2]) for r in p["shards"]):
        pytest.skip("mtc-host/2 holds a blob name as its 16 bytes")
    line = _encode_part(p, version)
    h.pop("digest")
    h["parts"][0].update(bytes=len(line), digest=blob_name(line))
    h["digest"] = doc_digest(h)
    with pytest.raises(ManifestError, match=re.escape(message)):
        fmt.StepManifest.from_json(b"\n".join([json.dumps(h).encode(), line]), source="test manifest")


def test_a_box_whose_start_is_past_its_stop_is_named_with_its_part():
    """A whole step's parts are read without their own box checks; its distinct boxes are checked once,
    and the message names the part and the box as the part's own check would."""
    meta, parts = _parts()
    doc = json.loads(parts[1][1])
    doc["boxes"][1] = [[4, 2], [0, 2]]
    parts[1] = ("h1", json.dumps(doc, separators=(",", ":")).encode())
    data, _ = fmt.encode_step(**meta, parts=parts)
    message = "test manifest: part 1 (host h1) is invalid: boxes[1] [4:2, 0:2] has a start past its stop"
    with pytest.raises(ManifestError, match=re.escape(message)):
        fmt.StepManifest.from_json(data, source="test manifest")
    with pytest.raises(ManifestError, match=re.escape("(host h1) is invalid: boxes[1] [4:2, 0:2] has a start")):
        fmt.StepManifest.parts_view(data.split(b"\n")[0], {"h1": parts[1][1]}, source="test manifest")


def _hex(name: str) -> bool:
    return len(name) == 32 and all(c in "0123456789abcdef" for c in name)


def _rows_doc(part: bytes) -> dict:
    """A part as an mtc-host/1 document (rows of lists), whatever format it was written in."""
    m = fmt.HostManifest.from_json(part)
    return {"format": "mtc-host/1", "step": m.step, "host": m.host, "written_bytes": m.written_bytes,
            "seconds": m.seconds, "shards": [[s.array, [list(d) for d in s.box], s.blob, s.nbytes] for s in m.shards]}


def _encode_part(doc: dict, version: str) -> bytes:
    """``doc`` (an mtc-host/1 document, perhaps broken) written as ``version``, without any check."""
    if version == "mtc-host/1":
        return json.dumps(doc, separators=(",", ":")).encode()
    rows = doc["shards"]
    boxes: dict = {}
    index = [boxes.setdefault(json.dumps(r[1]), len(boxes)) for r in rows]
    packed = (np.array([r[0] for r in rows], "<u4").tobytes() + np.array(index, "<u4").tobytes()
              + np.array([r[3] for r in rows], "<i8").tobytes() + bytes.fromhex("".join(r[2] for r in rows)))
    out = {k: v for k, v in doc.items() if k != "shards"}
    out.update(format="mtc-host/2", rows=len(rows), boxes=[json.loads(b) for b in boxes],
               columns=base64.b64encode(packed).decode())
    return json.dumps(out, separators=(",", ":")).encode()


def test_not_json():
    with pytest.raises(ManifestError, match="not valid JSON"):
        fmt.StepManifest.from_json(b"\x00garbage")


def test_host_manifest_round_trip_and_validation():
    h = fmt.HostManifest(3, "s0-h1", (fmt.HostShard(0, ((0, 2),), blob_name(b"ab"), 2),
                                      fmt.HostShard(1, ((0, 4), (2, 3)), blob_name(b"cd"), 8),
                                      fmt.HostShard(0, ((2, 4),), blob_name(b"ef"), 2)), 2, 0.5)
    line = h.to_json()
    assert json.loads(line)["format"] == "mtc-host/2" and b"\n" not in line
    assert fmt.HostManifest.from_json(line) == h
    assert fmt.collect_blob_names(line) == {blob_name(b"ab"), blob_name(b"cd"), blob_name(b"ef")}
    old = _encode_part(_rows_doc(line), "mtc-host/1")
    assert fmt.HostManifest.from_json(old) == h and fmt.collect_blob_names(old) == fmt.collect_blob_names(line)
    bad = json.loads(old)
    bad["shards"][0][2] = "ZZ"
    with pytest.raises(ManifestError, match="blob name 'ZZ'"):
        fmt.HostManifest.from_json(json.dumps(bad))
    with pytest.raises(ManifestError, match="blob name 'ZZ'"):
        fmt.HostManifest(3, "h", (fmt.HostShard(0, ((0, 2),), "ZZ", 2),)).to_json()


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(rows=4), "'columns' holds 96 bytes, 4 rows take 128"),
    (lambda d: d.update(columns=d["columns"][:-4] + "!!!!"), "'columns' is not base64"),
    (lambda d: d.update(columns=d["columns"][:-1]), "'columns' is not base64"),  # (its length not a multiple of 4)
    (lambda d: d.update(columns=12), "'columns' is not base64"),
    (lambda d: d.update(columns=None), "'columns' is not base64"),
    (lambda d: d.update(step=-3), "step"),
    (lambda d: d["boxes"][0].__setitem__(0, [5, 4]), "boxes[0] [5:4] has a start past its stop"),
    (lambda d: d.update(boxes=d["boxes"][:1]), "row 1 is invalid: box index 1 is not an index of its 1 boxes"),
    (lambda d: d.pop("columns"), "columns"),
    (lambda d: d.update(format="mtc-host/9"), "format is 'mtc-host/9', expected 'mtc-host/2' or 'mtc-host/1'"),
])
def test_a_broken_columnar_part_says_what_is_wrong(change, message):
    h = fmt.HostManifest(3, "s0-h1", (fmt.HostShard(0, ((0, 2),), blob_name(b"ab"), 2),
                                      fmt.HostShard(1, ((0, 4), (2, 3)), blob_name(b"cd"), 8),
                                      fmt.HostShard(0, ((2, 4),), blob_name(b"ef"), 2)), 2, 0.5)
    doc = json.loads(h.to_json())
    change(doc)
    with pytest.raises(ManifestError, match=re.escape(message)):
        fmt.HostManifest.from_json(json.dumps(doc), source="the part")


def test_columns_written_with_json_escapes_read_the_same():
    """Valid JSON that mtc never writes: the columns' base64 with its characters escaped (``\\/``,
    ``\\u0041``) is the same part as the plain string."""
    h = fmt.HostManifest(3, "s0-h1", tuple(fmt.HostShard(i % 2, ((i, i + 1),), blob_name(bytes([i])), 1)
                                           for i in range(40)))
    line = h.to_json()
    columns = json.loads(line)["columns"]
    assert "/" in columns or "A" in columns
    escaped = columns.replace("/", "\\/").replace("A", "\\u0041")
    doc = line.replace(f'"{columns}"'.encode(), f'"{escaped}"'.encode())
    assert doc != line and json.loads(doc) == json.loads(line)
    assert fmt.HostManifest.from_json(doc) == h


def test_a_negative_size_in_the_columns_is_refused():
    h = fmt.HostManifest(3, "h", (fmt.HostShard(0, ((0, 2),), blob_name(b"ab"), 2),))
    doc = json.loads(h.to_json())
    packed = bytearray(base64.b64decode(doc["columns"]))
    packed[8:16] = (-2).to_bytes(8, "little", signed=True)
    doc["columns"] = base64.b64encode(bytes(packed)).decode()
    with pytest.raises(ManifestError, match="row 0 is invalid: nbytes -2 is negative"):
        fmt.HostManifest.from_json(json.dumps(doc))


def test_boxes():
    assert fmt.box_intersect(((0, 4), (0, 4)), ((2, 6), (3, 8))) == ((2, 4), (3, 4))
    assert fmt.box_intersect(((0, 2),), ((2, 4),)) is None
    assert fmt.box_from_index((slice(None), slice(2, 4)), (3, 8)) == ((0, 3), (2, 4))


def test_the_cheap_check_a_keeper_runs_before_it_commits():
    meta, parts = _parts()
    data, digest = fmt.encode_step(**meta, parts=parts)
    step, got, hosts = fmt.check_step_bytes(data)
    assert (step, got) == (3, digest) and hosts == {h: blob_name(p) for h, p in parts}
    header, *lines = data.split(b"\n")
    changed = b"\n".join([header, lines[0], lines[1].replace(b'"written_bytes":16', b'"written_bytes":17')])
    with pytest.raises(ManifestError, match="part of host h1 does not match its hash"):
        fmt.check_step_bytes(changed)
    with pytest.raises(ManifestError, match="does not match its digest"):
        fmt.check_step_bytes(b"\n".join([header.replace(b'"step":3', b'"step":4'), *lines]))


def _mutated_parts():
    """A good part and the same part broken (or merely odd) in every field the readers check."""
    good = {"format": "mtc-host/1", "step": 3, "host": "s0-h1", "written_bytes": 24, "seconds": 0.5,
            "shards": [[0, [[0, 2], [0, 2]], B1, 8], [1, [[0, 2]], B2, 4], [0, [[2, 4], [0, 2]], "0" * 32, 8]]}

    def with_row(i, j, value):
        doc = json.loads(json.dumps(good))
        doc["shards"][i][j] = value
        return doc

    def with_field(key, value):
        return {**json.loads(json.dumps(good)), key: value}

    docs = [good, with_row(0, 2, "A" * 32), with_row(0, 2, "a" * 31), with_row(0, 2, 7), with_row(0, 1, [[2, 1], [0, 2]]),
            with_row(0, 1, [[-1, 2], [0, 2]]), with_row(0, 1, [[0, 2, 3]]), with_row(0, 1, []), with_row(0, 1, "all"),
            with_row(0, 0, -1), with_row(0, 0, True), with_row(0, 0, 1.0), with_row(0, 3, -5), with_row(0, 3, 8.0),
            with_field("shards", None), with_field("shards", [[0, [[0, 2]], B1]]), with_field("written_bytes", 1.5),
            with_field("format", "mtc-host/9"), with_field("step", -1), with_field("step", "3"), with_field("host", 5),
            with_field("extra", {"x": 1}), with_field("seconds", 2)]
    out = [json.dumps(d).encode() for d in docs]
    return out + [b"[1, 2]", b"{not json", json.dumps(good).replace('"s0-h1"', '"\\ud800"').encode()]


@pytest.mark.parametrize("data", _mutated_parts())
def test_the_fast_part_reader_agrees_with_the_precise_one(data):
    """``HostManifest.from_json`` decodes a part's rows with msgspec and checks names and boxes once per
    part; whatever it accepts, the field-by-field reader accepts the same, and what it refuses gets the
    field-by-field reader's own message."""
    def read(how):
        try:
            return how(data, source="part")
        except ManifestError as e:
            return str(e)

    fast, precise = read(fmt.HostManifest.from_json), read(fmt.HostManifest._read_precisely)
    assert fast == precise
    assert type(fast) is type(precise)


def test_the_fast_reader_is_the_one_that_reads_a_good_part(monkeypatch):
    """The control of the test above: a good part never reaches the precise reader (so the two are not
    the same code), and a bad one does."""
    calls = []
    precise = fmt.HostManifest._read_precisely.__func__
    monkeypatch.setattr(fmt.HostManifest, "_read_precisely",
                        classmethod(lambda cls, data, source: calls.append(source) or precise(cls, data, source)))
    good, upper = _mutated_parts()[:2]
    fmt.HostManifest.from_json(good, source="good")
    with pytest.raises(ManifestError, match="is malformed"):
        fmt.HostManifest.from_json(upper, source="upper")
    assert calls == ["upper"]


def test_a_whole_manifest_read_leaves_the_garbage_collector_as_it_found_it():
    import gc

    meta, parts = _parts()
    data, _ = fmt.encode_step(**meta, parts=parts)
    assert gc.isenabled()
    fmt.StepManifest.from_json(data)
    assert gc.isenabled()
    gc.disable()
    try:
        fmt.StepManifest.from_json(data)
        assert not gc.isenabled()
        with pytest.raises(ManifestError):
            fmt.StepManifest.from_json(data.replace(b'"step":', b'"step":1', 1))
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_part_of_an_unknown_format_keeps_every_blob_by_refusing_to_say():
    """Garbage collection deletes what no manifest names: a part it cannot read must stop it, not
    name nothing (a part written by a newer version, read after a downgrade)."""
    header, part = sample().to_json().split(b"\n")
    newer = part.replace(b'"format":"mtc-host/2"', b'"format":"mtc-host/3"')
    assert newer != part
    with pytest.raises(ManifestError, match="mtc-host/3.*cannot tell which blobs it uses"):
        fmt.collect_blob_names(header + b"\n" + newer)
    assert fmt.collect_blob_names(header + b"\n" + part) == sample().blob_names()


def test_a_manifest_reads_the_same_whatever_format_each_part_is_in():
    """A step saved before the columns (mtc-host/1 parts), after, or by a mix of hosts reads as one
    manifest: the same shards, devices and blobs of each host's part."""
    meta, parts = _parts()
    new, _ = fmt.encode_step(**meta, parts=parts)
    mixed, _ = fmt.encode_step(**meta, parts=[parts[0], (parts[1][0], _encode_part(_rows_doc(parts[1][1]),
                                                                                      "mtc-host/1"))])
    old, _ = fmt.encode_step(**meta, parts=[(h, _encode_part(_rows_doc(p), "mtc-host/1")) for h, p in parts])
    read = [fmt.StepManifest.from_json(d) for d in (new, mixed, old)]
    assert len({d for d in (new, mixed, old)}) == 3
    for m in read:
        assert m.arrays == read[0].arrays and [s.devices for s in m.arrays[0].shards] == [(0, 2), (1, 3)]
        assert dict(m.part_blobs) == {"h0": {B1, B2}, "h1": {B1, B2}} and m.blob_sizes() == {B1: 8, B2: 8}


def test_sorted_blob_names_from_the_columns_are_the_strings_sorted():
    """The columns sort names as 16-byte keys; the inventories' bitmaps are over the names sorted as
    strings: the two orders must be one (names that differ in any byte, high and low halves)."""
    rng = np.random.default_rng(7)
    names = sorted({bytes(rng.integers(0, 256, 16, dtype=np.uint8)).hex() for _ in range(300)}
                   | {"f" * 31 + "0", "0" * 32, "0" * 16 + "f" * 16, "f" * 16 + "0" * 16, "80" + "0" * 30})
    rng.shuffle(names)
    w = fmt.ArrayRecord(key="['w']", kind="jax", dtype="uint8", shape=(len(names) // 2 * 2,),
                        sharding={"type": "named", "mesh_shape": [len(names) // 2 * 2], "axis_names": ["d"],
                                  "device_ids": list(range(len(names) // 2 * 2)), "spec": ["d"]})
    half = len(names) // 2
    rows = {h: tuple(fmt.HostShard(0, ((i, i + 1),), names[i], 1) for i in range(k * half, (k + 1) * half))
            for k, h in enumerate(("h0", "h1"))}
    parts = [(h, fmt.HostManifest(1, h, r).to_json()) for h, r in rows.items()]
    data, _ = fmt.encode_step(step=1, arrays=[w], tree={"t": "leaf", "i": 0}, created=0.0, topology={},
                              fingerprint={}, parts=parts)
    m = fmt.StepManifest.from_json(data)
    assert m.sorted_blob_names() == sorted(m.blob_names()) == sorted(names[:2 * half])
    for h, r in rows.items():
        assert m.part_blob_names(h) == sorted(s.blob for s in r)
    assert m.part_blob_names("h9") == []
    in_memory = fmt.StepManifest(step=1, arrays=m.arrays, tree=m.tree)  # no columns: the strings sorted
    assert in_memory.sorted_blob_names() == m.sorted_blob_names()


def test_the_names_alone_are_the_whole_reads_and_a_changed_part_is_refused():
    """``step_blob_names`` (what `mtc status --verify` maps the hosts' bitmaps with) reads the parts' columns
    without a shard record: the same sorted names as the whole read, for every format; a part changed after
    it was written is refused as the whole read refuses it."""
    meta, parts = _parts()
    new, digest = fmt.encode_step(**meta, parts=parts)
    old, _ = fmt.encode_step(**meta, parts=[(h, _encode_part(_rows_doc(p), "mtc-host/1")) for h, p in parts])
    for data in (new, old, GOLDEN_V2.encode(), sample().to_json()):
        got = fmt.step_blob_names(data)
        whole = fmt.StepManifest.from_json(data)
        assert (got.step, got.digest, got.names) == (whole.step, whole.digest, whole.sorted_blob_names())
        assert got.names == sorted(whole.blob_names()) and got.names
    assert fmt.step_blob_names(new).digest == digest
    i = new.rindex(b'"columns":"') + 15
    changed = new[:i] + (b"A" if new[i:i + 1] != b"A" else b"B") + new[i + 1:]
    with pytest.raises(ManifestError, match="does not match its hash in the header"):
        fmt.step_blob_names(changed)
    with pytest.raises(ManifestError, match="does not match its hash in the header"):
        fmt.StepManifest.from_json(changed)


def test_the_blobs_among_some_names_are_those_the_whole_read_holds():
    """``step_blobs_among`` (how a host answers which of a few blobs a backup lists) finds the names the
    whole read holds and no other: not a name whose first 8 bytes are a held one's, for every format; a
    changed part is refused as the whole read refuses it, and a malformed name is named."""
    meta, parts = _parts()
    new, _ = fmt.encode_step(**meta, parts=parts)
    old, _ = fmt.encode_step(**meta, parts=[(h, _encode_part(_rows_doc(p), "mtc-host/1")) for h, p in parts])
    for data in (new, old, GOLDEN_V2.encode(), sample().to_json()):
        held = sorted(fmt.StepManifest.from_json(data).blob_names())
        # Names not held: one whose first 8 bytes are a held one's, and another.
        near = next(held[0][:16] + c * 16 for c in "0123" if held[0][:16] + c * 16 not in held)
        other = next(c * 32 for c in "abcdef" if c * 32 not in held)
        asked = set(held[::2]) | {near, other}
        assert fmt.step_blobs_among(data, asked) == set(held[::2])
        assert fmt.step_blobs_among(data, []) == set()
    i = new.rindex(b'"columns":"') + 15
    changed = new[:i] + (b"A" if new[i:i + 1] != b"A" else b"B") + new[i + 1:]
    with pytest.raises(ManifestError, match="does not match its hash in the header"):
        fmt.step_blobs_among(changed, held)
    with pytest.raises(ManifestError, match="'XYZ' is not a blob name"):
        fmt.step_blobs_among(new, ["XYZ"])


def test_a_whole_read_makes_the_shards_of_an_array_only_when_they_are_read(monkeypatch):
    """A whole manifest is read into columns: its blob names and sizes come from them, and an array's
    shard records are made the first time its shards are read (a spy on ``ShardRecord``), equal to the
    records a manifest made in memory holds, and pickled as that tuple."""
    import pickle

    from mtc.shared.format import step as step_module

    made = []
    real = step_module.ShardRecord
    monkeypatch.setattr(step_module, "ShardRecord", lambda *a: made.append(a) or real(*a))
    names = [f"{i:032x}" for i in range(1, 9)]
    arrays = [fmt.ArrayRecord(key=f"['a{k}']", kind="jax", dtype="float32", shape=(4,),
                              sharding={"type": "named", "mesh_shape": [4], "axis_names": ["d"],
                                        "device_ids": [0, 1, 2, 3], "spec": ["d"]}) for k in range(2)]
    rows = {h: tuple(fmt.HostShard(k, ((d, d + 1),), names[4 * k + d], 4) for k in range(2) for d in (2 * j, 2 * j + 1))
            for j, h in enumerate(("h0", "h1"))}
    data, _ = fmt.encode_step(step=1, arrays=arrays, tree={"t": "leaf", "i": 0}, created=0.0, topology={},
                              fingerprint={}, parts=[(h, fmt.HostManifest(1, h, r).to_json()) for h, r in rows.items()])
    m = fmt.StepManifest.from_json(data)
    assert m.blob_sizes() == {n: 4 for n in names} and m.sorted_blob_names() == names and m.nbytes == 32
    assert [len(a.shards) for a in m.arrays] == [4, 4] and made == []
    first = m.arrays[0].shards
    assert [(s.box, s.blob, s.devices) for s in first] == [(((d, d + 1),), names[d], (d,)) for d in range(4)]
    assert len(made) == 4  # the first array's alone, once
    assert first[1:3] == tuple(first)[1:3] and first + () == tuple(first) and len(made) == 4
    monkeypatch.undo()  # (pickle finds the class by its name)
    eager = [dataclasses.replace(a, shards=tuple(a.shards)) for a in m.arrays]
    assert list(m.arrays) == eager and eager == list(m.arrays)
    assert pickle.loads(pickle.dumps(m.arrays[1].shards)) == eager[1].shards
    assert type(pickle.loads(pickle.dumps(m.arrays[1]))).__name__ == "ArrayRecord"


def test_the_fit_check_by_shape_and_box_agrees_with_the_check_of_every_row():
    """A box fits its array when it has the array's rank and lies in its shape: checked once per
    distinct shape and box and looked up per row; when that table would outgrow the rows, row by row.
    Both ways must agree, on boxes that fit, that overhang and that have another rank."""
    from mtc.shared.format.step import _fits

    rng = np.random.default_rng(3)
    for n_shapes, n_boxes, n_rows in ((3, 20, 500), (400, 300, 50)):
        arr_nd = rng.integers(1, 4, n_shapes)
        shapes = np.where(np.arange(3)[None, :] < arr_nd[:, None], rng.integers(1, 9, (n_shapes, 3)), 0)
        box_nd = rng.integers(1, 4, n_boxes)
        stops = np.where(np.arange(3)[None, :] < box_nd[:, None], rng.integers(1, 9, (n_boxes, 3)), 0)
        ua, ug = rng.integers(0, n_shapes, n_rows), rng.integers(0, n_boxes, n_rows)
        want = np.array([box_nd[g] == arr_nd[a] and bool((stops[g] <= shapes[a]).all()) for a, g in zip(ua, ug)])
        got = _fits(box_nd, stops, arr_nd, shapes, ua, ug)
        assert got.tolist() == want.tolist() and 0 < want.sum() < n_rows


def test_first_rows_streamed_by_part_are_the_sorts_and_a_differing_replica_goes_to_the_sort():
    """The whole read's replica check: the parts streamed against a table of each (array, box)'s first
    row where the keys allow one (a part may hold a key twice), the stable sort otherwise and to name a
    replica that differs (the first in the parts' order, against the first row of its box)."""
    from mtc.shared.format import step as step_lib

    rng = np.random.default_rng(3)
    key = rng.integers(0, 700, 5000)
    blob = np.stack([key * 7 + 1, key * 11 + 2], axis=1).astype(np.uint64)
    nbytes = key * 3
    cuts = [0, 1, 700, 701, 2500, 5000]  # parts of 1, 699, 1, 1,799 and 2,500 rows

    def parts(b, n):
        return ([key[i:j] for i, j in zip(cuts, cuts[1:])], [b[i:j] for i, j in zip(cuts, cuts[1:])],
                [n[i:j] for i, j in zip(cuts, cuts[1:])])

    def never(i: int, j: int) -> None:
        raise AssertionError((i, j))

    firsts = step_lib._first_rows(*parts(blob, nbytes), 700)
    by_table = np.concatenate([r + i for r, i in zip(firsts, cuts)])
    by_sort = step_lib._one_row_per_box_sorted(key, blob, nbytes, never)
    assert sorted(by_table.tolist()) == sorted(by_sort.tolist())  # the same rows: the first of each key
    assert len(set(key[by_table].tolist())) == len(by_table) == len(set(key.tolist()))
    assert step_lib._first_rows(*parts(blob, nbytes), 10**9) is None  # too many keys for a table
    rows = np.flatnonzero(key == key[4000])
    assert len(rows) >= 2
    twice = np.flatnonzero(np.bincount(key[2500:]) >= 2)[0]  # a key the last part holds twice, or more
    again = 2500 + np.flatnonzero(key[2500:] == twice)
    for col, row in ((0, rows[-1]), (1, rows[-1]), (None, rows[-1]), (0, again[-1]), (None, again[-1])):
        bad_blob, bad_nbytes = blob.copy(), nbytes.copy()
        if col is None:
            bad_nbytes[row] += 1
        else:
            bad_blob[row, col] += 1
        assert step_lib._first_rows(*parts(bad_blob, bad_nbytes), 700) is None
        said = []
        step_lib._one_row_per_box_sorted(key, bad_blob, bad_nbytes, lambda i, j: said.append((i, j)))
        first = np.flatnonzero(key == key[row])[0]
        assert said == [(row, first)]
