"""The data operations through both transports: one write header, one list of bad headers.

``write`` and ``read`` (colocated: ``load``) are driven as each head drives them: the colocated
``ColocatedSidecar`` in this process with its arrays as arguments, and a real daemon process
(``LocalCluster``) on a socket, with its shards as payloads. The same bad headers get a
``ProtocolError`` naming the bad field from both, and leave the host's ramdisk as it was; a good
write, committed, reads back bit for bit in both.
"""

from __future__ import annotations

import json
import re

import jax
import numpy as np
import pytest

from helpers import control_connection
from mtc.head.dispatch.interface import WriteResult
from mtc.head.save import build_step, flatten
from mtc.shared import format as fmt
from mtc.shared import protocol, shardings
from mtc.shared.colocated_codec import decode_request, encode_request
from mtc.shared.errors import ProtocolError
from mtc.shared.hashing import blob_name
from mtc.sidecar.colocated import ColocatedSidecar
from mtc.sidecar.local_cluster import LocalCluster

pytestmark = pytest.mark.unit

SETTINGS = {"local_max_to_keep": 3, "backup_url": None, "backup_max_to_keep": 2, "backup_scrub_bytes_per_s": 2**20}
DATA = np.arange(4, dtype=np.float32) * 1.5  # one array of shape [4]: leaf 0, one shard
GOOD = {"step": 1, "part": 0, "arrays": [{"index": 0, "shape": [4]}]}
SHARDS = [[0, [[0, 4]]]]  # cluster mode: one [position in "arrays", box] per payload

# (what changes in the good header, the field the error must name): bad in both modes.
BAD_WRITES = [
    ({"step": "one"}, "'step'"),
    ({"step": 10**13}, "'step'"),
    ({"gen": 0}, "'gen'"),
    ({"part": -1}, "'part'"),
    ({"part": 2**40}, "'part'"),
    ({"arrays": "all"}, "'arrays'"),
    ({"arrays": None}, "'arrays'"),
    ({"arrays": []}, "'arrays'"),
    ({"arrays": [[0, [4]]]}, r"arrays\[0\]: 'index'"),
    ({"arrays": [{"shape": [4]}]}, r"arrays\[0\]: 'index'"),
    ({"arrays": [{"index": -1, "shape": [4]}]}, r"arrays\[0\]: 'index'"),
    ({"arrays": [{"index": "0", "shape": [4]}]}, r"arrays\[0\]: 'index'"),
    ({"arrays": [{"index": 0}]}, r"arrays\[0\]: 'shape'"),
    ({"arrays": [{"index": 0, "shape": "4"}]}, r"arrays\[0\]: 'shape'"),
    ({"arrays": [{"index": 0, "shape": [-4]}]}, r"arrays\[0\]: 'shape'"),
    ({"arrays": [{"index": 0, "shape": [3]}]}, "'shape'"),  # the array sent, or its shard's box, does not fit
    ({"arrays": [{"index": 0, "shape": [4], "as_bytes": 1}]}, r"arrays\[0\]: 'as_bytes'"),
    ({"arrays": [{"index": 0, "shape": [4]}, {"index": 0, "shape": [4]}]}, r"'arrays'|'index' 0 is listed twice"),
]
# Bad in one mode only: the shards are the colocated arrays' own, a daemon's are listed.
BAD_COLOCATED_WRITES = [
    ({"shards": SHARDS}, "'shards'"),
    ({"arrays": [{"index": 0, "shape": [4], "as_bytes": True}]}, "'as_bytes'"),  # a float32 array is not flat bytes
]
BAD_CLUSTER_WRITES = [
    ({"shards": None}, "'shards'"),
    ({"shards": []}, "'shards'"),
    ({"shards": "all"}, "'shards'"),
    ({"shards": [[1, [[0, 4]]]]}, r"shards\[0\]"),
    ({"shards": [[0, [[0, 4]], 3]]}, r"shards\[0\]"),
    ({"shards": [[0, [[2, 1]]]]}, r"shards\[0\]"),
    ({"shards": [[0, [[0, 5]]]]}, r"shards\[0\].*'shape'"),
    ({"shards": [[0, [[0, 4], [0, 1]]]]}, r"shards\[0\].*'shape'"),
    ({"shards": [[0, [[0, 2]]]], "arrays": [{"index": 0, "shape": [4], "as_bytes": True}]}, r"shards\[0\].*'as_bytes'"),
]
# Bad reads: the fields both headers have, then each mode's own (the colocated ``load`` names
# the arrays to build, tests/unit/test_transports.py has its other fields).
BAD_READS = [({"step": "one"}, "'step'"), ({"step": -1}, "'step'"), ({"gen": "me"}, "'gen'"),
             ({"manifest": 5}, "'manifest'"), ({"manifest": "d" * 200}, "'manifest'")]
BAD_CLUSTER_READS = [({"reads": "all"}, "'reads'"), ({"reads": [["w"]]}, r"reads\[0\]"),
                     ({"reads": [["w", [[0, -1]]]]}, r"reads\[0\]"), ({"stream": [5]}, "'stream'")]
BAD_COLOCATED_READS = [({"arrays": "all"}, "'arrays'"), ({"arrays": [{"key": 3}]}, r"arrays\[0\]"),
                       ({"shardings": None}, "'shardings'"), ({"shardings": [{"device_runs": [[0, -1]]}]}, "device_runs")]


def _with(header: dict, change: dict) -> dict:
    """``header`` with ``change`` (a key changed to None is left out)."""
    return {k: v for k, v in {**header, **change}.items() if v is not None}


def _snapshot(root) -> dict:
    """Every file under a host's ramdisk, with its size and mtime: what a request could change."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))
            if p.is_file()}


def _request(args: dict) -> jax.Array:
    return jax.device_put(np.ascontiguousarray(encode_request(args)[None, :]), jax.devices()[0])


class Colocated:
    """The colocated transport's worker side, in this process, as the colocated head calls it."""

    def __init__(self, root):
        self.root = root
        self.col = ColocatedSidecar(json.dumps({"ramdisk_root": str(root), "host_id": "h0"}))
        self.control("ping", {})  # the service starts, with its layout

    def control(self, op: str, args: dict, payloads: tuple[bytes, ...] = ()):
        return self.col._dispatch(decode_request(encode_request({"op": op, **args}, payloads)))

    def write(self, header: dict, arrays: list) -> bytes:
        """Phase 1 of ``arrays`` under ``header``; the host's part (``part``, a second call)."""
        self.col.write(_request(header), *arrays)
        _, (part,) = self.control("part", {"step": header["step"]})
        return part

    def close(self) -> None:
        self.col._dispatch({"op": "close"})


class Cluster:
    """A real daemon process, reached over its control socket as the cluster head reaches it."""

    def __init__(self, root):
        self.cluster = LocalCluster(root, 1, 1).start()
        self.root = self.cluster.ramdisk("s0-h0")
        self.conn = control_connection(self.cluster.address("s0-h0"), self.cluster.peer_token)
        self.ids = iter(range(10, 10**6))

    def call(self, op: str, args: dict, payloads=()) -> protocol.Reply:
        protocol.send_request(self.conn, protocol.Request(op, next(self.ids), args, tuple(payloads)))
        reply = protocol.recv_reply(self.conn)
        if reply.error is not None:
            raise (ProtocolError if reply.error.type == "ProtocolError" else RuntimeError)(
                f"{reply.error.type}: {reply.error.message}")
        return reply

    def control(self, op: str, args: dict, payloads: tuple[bytes, ...] = ()):
        reply = self.call(op, args, payloads)
        return reply.result, [bytes(p) for p in reply.payloads]

    def close(self) -> None:
        self.conn.close()
        self.cluster.stop()


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    host = Colocated(tmp_path_factory.mktemp("colocated") / "ram")
    yield host
    host.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    host = Cluster(tmp_path_factory.mktemp("cluster"))
    yield host
    host.close()


def _refused(send, match: str, root) -> None:
    before = _snapshot(root)
    with pytest.raises(ProtocolError) as e:
        send()
    assert re.search(match, str(e.value)), (match, str(e.value))
    assert _snapshot(root) == before, "a refused request changed the host's ramdisk"


@pytest.mark.parametrize("change,match", BAD_WRITES + BAD_COLOCATED_WRITES)
def test_a_bad_write_header_is_refused_by_the_colocated_transport_and_writes_nothing(colocated, change, match):
    _refused(lambda: colocated.col.write(_request(_with(GOOD, change)), jax.device_put(DATA)), match, colocated.root)


@pytest.mark.parametrize("change,match", BAD_WRITES + BAD_CLUSTER_WRITES)
def test_a_bad_write_header_is_refused_by_a_daemon_and_writes_nothing(cluster, change, match):
    _refused(lambda: cluster.call("write", _with({**GOOD, "shards": SHARDS}, change), [DATA.tobytes()]), match,
             cluster.root)


def test_a_write_with_other_payloads_than_its_shards_is_refused_by_a_daemon(cluster):
    _refused(lambda: cluster.call("write", {**GOOD, "shards": SHARDS}, [DATA.tobytes()] * 2), "'shards'",
             cluster.root)


@pytest.mark.parametrize("change,match", BAD_READS + BAD_COLOCATED_READS)
def test_a_bad_load_header_is_refused_by_the_colocated_transport(colocated, change, match):
    good = {"step": 1, "arrays": [], "shardings": []}
    _refused(lambda: colocated.col.load(_request(_with(good, change))), match, colocated.root)


@pytest.mark.parametrize("change,match", BAD_READS + BAD_CLUSTER_READS)
def test_a_bad_read_header_is_refused_by_a_daemon(cluster, change, match):
    good = {"step": 1, "reads": [["w", [[0, 4]]]]}
    _refused(lambda: cluster.call("read", _with(good, change)), match, cluster.root)


def test_a_read_with_payloads_is_refused_by_a_daemon(cluster):
    _refused(lambda: cluster.call("read", {"step": 1, "reads": []}, [b"x"]), "payloads", cluster.root)


@pytest.mark.parametrize("op", ["write", "read"])
def test_a_data_operation_sent_as_a_control_request_names_its_data_path(colocated, op):
    """The colocated control path (``call``) serves the table's control operations only."""
    _refused(lambda: colocated.control(op, {**GOOD, "reads": []}), "carries arrays", colocated.root)


def _state() -> dict:
    rng = np.random.default_rng(7)
    return {"n": rng.integers(0, 2**31, (3, 2), dtype=np.int64),
            "w": jax.device_put(rng.standard_normal((6, 4)).astype(np.float32))}


def test_a_write_reads_back_bit_for_bit_in_both_transports(colocated, cluster):
    """The same state, written with the one header by each transport, committed, read back: the
    same bytes, and the same blobs (named by the hash of what was sent)."""
    state = _state()
    leaves, tree = flatten(state)
    rows = [{"index": leaf.index, "shape": list(leaf.shape), **({"as_bytes": True} if leaf.kind == "numpy" else {})}
            for leaf in leaves]
    header = {"step": 2, "part": 0, "arrays": rows}
    flat = [np.ascontiguousarray(leaf.value).reshape(-1).view(np.uint8) if leaf.kind == "numpy"
            else np.asarray(leaf.value) for leaf in leaves]
    parts = {
        "colocated": colocated.write(header, [jax.device_put(a) for a in flat]),
        "cluster": bytes(cluster.call("write", {**header, "shards": [[k, [[0, n] for n in leaf.shape]]
                                                                     for k, leaf in enumerate(leaves)]},
                                      [a.tobytes() for a in flat]).payloads[0]),
    }
    blobs = {}
    for mode, host in (("colocated", colocated), ("cluster", cluster)):
        part = fmt.HostManifest.from_json(parts[mode])
        blobs[mode] = {(s.array, s.box): s.blob for s in part.shards}
        assert blobs[mode] == {(leaf.index, tuple((0, n) for n in leaf.shape)): blob_name(a.tobytes())
                               for leaf, a in zip(leaves, flat)}, mode
        data, digest = build_step(2, leaves, tree, WriteResult([(part.host, parts[mode])], {part.host: {}}))
        host.control("configure", {"settings": SETTINGS})
        host.control("commit", {"step": 2, "digest": digest}, (data,))
        if mode == "colocated":
            cpu = shardings.describe(jax.sharding.SingleDeviceSharding(jax.devices()[0]))
            specs = [{"key": leaf.key, "shape": [leaf.value.nbytes], "dtype": "uint8", "as_bytes": True}
                     if leaf.kind == "numpy" else {"key": leaf.key, "shape": list(leaf.shape), "dtype": leaf.dtype}
                     for leaf in leaves]
            got = host.col.load(_request({"step": 2, "manifest": digest, "shardings": [cpu],
                                          "arrays": [{**s, "sharding": 0} for s in specs]}))
            back = [np.asarray(a).tobytes() for a in got]
        else:
            reply = host.call("read", {"step": 2, "manifest": digest,
                                       "reads": [[leaf.key, [[0, n] for n in leaf.shape]] for leaf in leaves]})
            assert reply.result["errors"] == [], reply.result
            back = [bytes(p) for p in reply.payloads]
        assert back == [np.asarray(leaf.value).tobytes() for leaf in leaves], mode
    assert blobs["colocated"] == blobs["cluster"]
    assert {leaf.kind for leaf in leaves} == {"numpy", "jax"}
