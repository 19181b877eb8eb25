"""The head <-> daemon wire format (mtc.shared.protocol): framing, limits, messages, cluster spec."""

from __future__ import annotations

import json
import socket
import struct
import threading

import ml_dtypes
import numpy as np
import pytest

from mtc.shared import protocol
from mtc.shared.errors import ConfigError, ProtocolError
from mtc.shared.protocol import ClusterSpec, HostSpec, RemoteError, Reply, Request
from mtc.shared.version import PROTOCOL_VERSION

pytestmark = pytest.mark.unit


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    a.settimeout(30)
    b.settimeout(30)
    yield a, b
    a.close()
    b.close()


def raw_frame(header: dict | bytes, payload: bytes = b"") -> bytes:
    data = header if isinstance(header, bytes) else json.dumps(header).encode()
    return protocol.MAGIC + struct.pack("!I", len(data)) + data + payload


def test_request_round_trip_keeps_every_payload_byte(pair):
    a, b = pair
    rng = np.random.default_rng(0)
    payloads = [b"abc", rng.standard_normal((3, 5)).astype(np.float32),
                rng.standard_normal(7).astype(ml_dtypes.bfloat16), b"", bytearray(b"\x00\xff")]
    req = Request("write", 7, {"step": 3, "shards": [[0, [[0, 3], [0, 5]]]]}, tuple(payloads))
    protocol.send_request(a, req)
    got = protocol.recv_request(b)
    assert (got.op, got.id, got.args) == ("write", 7, {"step": 3, "shards": [[0, [[0, 3], [0, 5]]]]})
    assert [bytes(protocol.byte_view(p)) for p in got.payloads] == [bytes(protocol.byte_view(p)) for p in payloads]
    # Received into 64-byte aligned buffers, so the head can hand them to JAX without a copy.
    assert all(p.ctypes.data % 64 == 0 for p in got.payloads if p.nbytes)


def test_reply_round_trip_with_result_and_with_error(pair):
    a, b = pair
    protocol.send_reply(a, Reply(3, {"host": "s0-h0", "steps": [1, 2]}, None, (b"xyz",)))
    protocol.send_reply(a, Reply(4, error=RemoteError("CorruptBlobError", "blob abc is corrupt")))
    r1, r2 = protocol.recv_reply(b), protocol.recv_reply(b)
    assert (r1.id, r1.result, r1.error, bytes(r1.payloads[0])) == (3, {"host": "s0-h0", "steps": [1, 2]}, None, b"xyz")
    assert (r2.id, r2.error) == (4, RemoteError("CorruptBlobError", "blob abc is corrupt"))


def test_golden_frame_bytes(pair):
    """The exact bytes of one request: changing them needs a PROTOCOL_VERSION bump."""
    a, b = pair
    protocol.send_request(a, Request("ping", 1, {}, (b"\x01\x02",)))
    header = b'{"args":{},"id":1,"kind":"request","op":"ping","payloads":[2],"v":1}'
    expected = b"MTCF" + struct.pack("!I", len(header)) + header + b"\x01\x02"
    assert PROTOCOL_VERSION == 1
    assert b.recv(1000) == expected


def test_large_payload_crosses_partial_sends(pair):
    a, b = pair
    big = np.random.default_rng(1).integers(0, 256, 64 << 20, dtype=np.uint8)
    t = threading.Thread(target=protocol.send_request, args=(a, Request("write", 1, {}, (big, b"tail"))))
    t.start()
    got = protocol.recv_request(b)
    t.join()
    assert np.array_equal(got.payloads[0], big) and bytes(got.payloads[1]) == b"tail"


def test_digesting_buffer_hashes_exactly_what_arrives(pair):
    """A Digesting buffer is filled and its hasher fed exactly the bytes received, in pieces (the
    payload crosses several sends), and it comes back as given, between plain payloads."""
    from mtc.shared.hashing import blob_name, new_hasher

    a, b = pair
    data = np.random.default_rng(2).integers(0, 256, (3 << 20) + 5, dtype=np.uint8)
    t = threading.Thread(target=protocol.send_reply, args=(a, Reply(9, {"ok": 1}, None, (b"head", data, b"tail"))))
    t.start()
    hasher = new_hasher()

    def alloc(header, sizes):
        assert sizes == [4, data.nbytes, 4]
        return [bytearray(4), protocol.Digesting(protocol.aligned_buffer(sizes[1]), hasher), bytearray(4)]

    got = protocol.recv_reply(b, alloc=alloc)
    t.join()
    assert bytes(got.payloads[0]) == b"head" and bytes(got.payloads[2]) == b"tail"
    assert isinstance(got.payloads[1], protocol.Digesting)
    assert np.array_equal(got.payloads[1].buffer, data)
    assert hasher.hexdigest() == blob_name(data) != blob_name(data[:-1])


def test_clean_close_between_frames_is_none(pair):
    a, b = pair
    a.close()
    assert protocol.recv_request(b) is None
    with pytest.raises(ProtocolError, match="closed before the reply"):
        protocol.recv_reply(b)


@pytest.mark.parametrize("cut", [3, 8, 20])
def test_truncated_frame_is_an_error(pair, cut):
    a, b = pair
    header = {"v": PROTOCOL_VERSION, "kind": "request", "op": "ping", "id": 1, "args": {}, "payloads": [10]}
    a.sendall(raw_frame(header, b"0123456789")[:cut] if cut < 20 else raw_frame(header, b"01234"))
    a.close()
    with pytest.raises(ProtocolError, match="connection closed after"):
        protocol.recv_request(b)


def test_oversized_header_is_refused_before_reading_it(pair):
    a, b = pair
    a.sendall(protocol.MAGIC + struct.pack("!I", protocol.MAX_HEADER_BYTES + 1))
    with pytest.raises(ProtocolError, match="over the limit"):
        protocol.recv_request(b)
    # The sender refuses to build one too.
    with pytest.raises(ProtocolError, match="over the limit"):
        protocol.send_request(a, Request("write", 1, {"x": "y" * protocol.MAX_HEADER_BYTES}))


def test_payload_over_the_declared_limit_is_refused(pair):
    a, b = pair
    header = {"v": PROTOCOL_VERSION, "kind": "request", "op": "write", "id": 1, "args": {}, "payloads": [1 << 40, 1]}
    a.sendall(raw_frame(header))
    with pytest.raises(ProtocolError, match="over the limit"):
        protocol.recv_frame(b, max_payload=1 << 30)


def test_too_many_payloads_are_refused(pair):
    a, b = pair
    header = {"v": PROTOCOL_VERSION, "kind": "request", "op": "write", "id": 1, "args": {},
              "payloads": [0] * (protocol.MAX_PAYLOADS + 1)}
    sender = threading.Thread(target=a.sendall, args=(raw_frame(header),), daemon=True)
    sender.start()
    with pytest.raises(ProtocolError, match="payloads, over the limit"):
        protocol.recv_request(b)
    sender.join(timeout=30)


@pytest.mark.parametrize("data, match", [
    (b"GET / HTTP/1.1\r\n\r\n", "not an mtc frame"),
    (raw_frame(b"{not json"), "not valid JSON"),
    (raw_frame(b"[1, 2]"), "expected an object"),
    (raw_frame({"v": 99, "kind": "request", "op": "ping", "id": 1}), "protocol version 99"),
    (raw_frame({"v": PROTOCOL_VERSION, "kind": "request", "op": "ping", "id": 1, "payloads": [-1]}), "byte counts"),
    (raw_frame({"v": PROTOCOL_VERSION, "kind": "request", "op": "ping", "id": 1, "payloads": ["1"]}), "byte counts"),
    (raw_frame({"v": PROTOCOL_VERSION, "kind": "request", "op": 5, "id": 1}), "string 'op'"),
    (raw_frame({"v": PROTOCOL_VERSION, "kind": "reply", "id": 1}), "expected a request"),
    (raw_frame({"v": PROTOCOL_VERSION, "kind": "request", "op": "x", "id": 1, "args": []}), "'args'"),
    (raw_frame(b"[" * 100000 + b"]" * 100000), "not valid JSON|expected an object"),
])
def test_garbage_is_a_protocol_error(pair, data, match):
    a, b = pair
    a.sendall(data)
    a.close()
    with pytest.raises(ProtocolError, match=match):
        protocol.recv_request(b)


def test_allocator_sees_sizes_and_can_refuse_them(pair):
    a, b = pair
    protocol.send_reply(a, Reply(1, {}, None, (b"12345678",)))
    dest = np.zeros(8, np.uint8)
    reply = protocol.recv_reply(b, alloc=lambda header, sizes: [dest])
    assert reply.payloads[0] is dest and dest.tobytes() == b"12345678"
    protocol.send_reply(a, Reply(2, {}, None, (b"123",)))

    def refuse(header, sizes):
        raise ProtocolError(f"unexpected sizes {sizes}")

    with pytest.raises(ProtocolError, match=r"unexpected sizes \[3\]"):
        protocol.recv_reply(b, alloc=refuse)


def test_header_must_be_json_values_only(pair):
    a, _ = pair
    with pytest.raises(ProtocolError, match="cannot be encoded"):
        protocol.send_request(a, Request("ping", 1, {"obj": object()}))
    with pytest.raises(ProtocolError, match="cannot be encoded"):
        protocol.send_request(a, Request("ping", 1, {"nan": float("nan")}))


def test_every_op_of_the_table_is_served_by_the_daemon():
    from mtc.sidecar import ops

    served = {n for n, op in ops.OPS.items() if "cluster" in op.spec.modes} | set(ops.DATA_OPS)
    assert {"ping", "write", "read", "commit", "configure"} <= served and "close" not in served


# --- cluster spec --------------------------------------------------------------------------------


def test_cluster_spec_round_trip(tmp_path):
    spec = ClusterSpec((HostSpec("s0-h0", 0, "127.0.0.1:7000", 2), HostSpec("s1-h0", 1, "127.0.0.1:7001", 2)))
    spec.write(tmp_path / "c.json")
    assert ClusterSpec.read(tmp_path / "c.json") == spec
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.parametrize("doc, match", [
    ({"format": "other"}, "format"),
    ({"format": "mtc-cluster/1", "hosts": []}, "non-empty"),
    ({"format": "mtc-cluster/1", "hosts": [{"id": "../x", "slice": 0, "address": "h:1", "devices": 1}]}, "host id"),
    ({"format": "mtc-cluster/1", "hosts": [{"id": "a", "slice": 0, "address": "nohost", "devices": 1}]}, "host:port"),
    ({"format": "mtc-cluster/1", "hosts": [{"id": "a", "slice": -1, "address": "h:1", "devices": 1}]}, "slice"),
    ({"format": "mtc-cluster/1", "hosts": [{"id": "a", "slice": 0, "address": "h:1", "devices": 0}]}, "devices"),
    ({"format": "mtc-cluster/1", "hosts": [{"id": "a", "slice": 0, "address": "h:1", "devices": 1}] * 2}, "more than once"),
])
def test_cluster_spec_validation_names_the_problem(doc, match):
    with pytest.raises(ConfigError, match=match):
        ClusterSpec.from_json(json.dumps(doc), source="spec x")


def test_missing_spec_file_says_what_to_set(tmp_path):
    with pytest.raises(ConfigError, match="MTC_CLUSTER_SPEC"):
        ClusterSpec.read(tmp_path / "nope.json")


def test_a_gathered_payload_arrives_as_one_payload_of_its_buffers_back_to_back(pair):
    """A step manifest goes to its keepers as its header and parts, never joined on the head: the
    receiver gets one payload, byte for byte the join (more buffers than one sendmsg takes, and a large
    one that crosses partial sends)."""
    a, b = pair
    rng = np.random.default_rng(2)
    buffers = [bytes(rng.integers(0, 256, int(n), dtype=np.uint8)) for n in rng.integers(0, 40, 1500)]
    buffers.append(rng.integers(0, 256, 32 << 20, dtype=np.uint8))
    gathered = protocol.Gathered(tuple(buffers))
    joined = b"".join(bytes(protocol.byte_view(x)) for x in buffers)
    assert protocol.payload_nbytes(gathered) == len(joined) and gathered.join() == joined
    t = threading.Thread(target=protocol.send_request, args=(a, Request("commit", 2, {"step": 1},
                                                                        (b"first", gathered, b"last"))))
    t.start()
    got = protocol.recv_request(b)
    t.join()
    assert [bytes(p) for p in got.payloads] == [b"first", joined, b"last"]
