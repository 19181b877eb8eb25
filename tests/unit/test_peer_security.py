"""The peer service (mtc.sidecar.peer) on loopback: transfers, verification, and what it refuses.

Each refusal is checked from the outside (the error reply, the closed connection, nothing written
to the ramdisk) and followed by a good request on another connection: the server keeps serving.
"""

from __future__ import annotations

import logging
import socket
import struct
import time

import numpy as np
import pytest

from mtc.shared import protocol, version
from mtc.shared.errors import ConfigError, CorruptBlobError, HostUnreachableError
from mtc.shared.hashing import blob_name
from mtc.shared.version import PROTOCOL_VERSION
from mtc.sidecar.peer import ENV_TOKEN, HAVE_BATCH, MAX_PEER_HEADER, BadCopyError, PeerClient, PeerServer, resolve_token
from mtc.sidecar.ram import RamStore

pytestmark = pytest.mark.unit

TOKEN = "7" * 64
# What a current sidecar sends besides the token: its mtc and protocol versions.
V = {"mtc": version.MTC_VERSION, "protocol": version.PROTOCOL_VERSION}


@pytest.fixture
def stores(ramdisk):
    return RamStore(ramdisk / "a"), RamStore(ramdisk / "b")


@pytest.fixture
def server(stores):
    srv = PeerServer(stores[0], TOKEN, host_id="a", max_blob_bytes=64 << 20, idle_timeout_s=5)
    srv.start()
    yield srv
    srv.close()


def blobs(store: RamStore, n: int = 3, size: int = 1 << 20, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [store.blobs.write(rng.integers(0, 256, size + i, dtype=np.uint8))[0] for i in range(n)]


def connect(server: PeerServer) -> socket.socket:
    s = socket.create_connection(protocol.parse_address(server.address), timeout=10)
    return s


def request(op: str, args: dict, rid: int = 1) -> bytes:
    return protocol.frame_head(protocol.Request(op, rid, args).header(), [])


def refused(sock: socket.socket, match: str, kind: str = "ProtocolError") -> None:
    """The server answered with an error of ``kind`` matching ``match`` and closed the connection."""
    reply = protocol.recv_reply(sock)
    assert reply.error is not None and reply.error.type == kind, reply
    assert match in reply.error.message, reply.error.message
    try:
        assert sock.recv(1) == b""
    except ConnectionResetError:  # closed with our unread bytes still queued
        pass


def still_serves(server: PeerServer, store: RamStore, names: list[str]) -> None:
    with PeerClient(server.address, TOKEN, peer="a") as c:
        assert c.have(names) == set(names)


def tree(store: RamStore) -> set[str]:
    return {str(p.relative_to(store.root)) for p in store.root.rglob("*")}


# --- transfers ---------------------------------------------------------------------------------------


def test_get_put_and_have_move_blobs_bit_for_bit(server, stores):
    a, b = stores
    names = blobs(a) + [a.blobs.write(b"")[0]]
    with PeerClient(server.address, TOKEN, peer="a") as c:
        assert c.have(names + [blob_name(b"absent")]) == set(names)
        for n in names:
            assert c.get(b, n, size=a.blobs.size(n)) == a.blobs.size(n)
            assert b.read_blob(n) == a.read_blob(n)
        mine = b.blobs.write(b"pushed by b" * 1000)[0]
        assert c.put(b, mine) is True
        assert a.read_blob(mine) == b.read_blob(mine)
        assert c.put(b, mine) is False  # already there: nothing added
    assert server.stats["sent_blobs"] == len(names) and server.stats["received_blobs"] == 2
    assert not [p for p in (a.root / "blobs").iterdir() if p.name.startswith(".tmp-")]


def test_have_is_batched_for_long_lists(server, stores):
    a, _ = stores
    names = blobs(a, 2, 1000)
    absent = [f"{i:032x}" for i in range(HAVE_BATCH + 5)]
    with PeerClient(server.address, TOKEN) as c:
        assert c.have(absent + names) == set(names)
    assert server.stats["have_requests"] == 2


def test_a_corrupt_copy_on_the_server_is_detected_and_not_kept(server, stores):
    a, b = stores
    (name,) = blobs(a, 1)
    path = a.blobs.path(name)
    data = bytearray(path.read_bytes())
    data[12345] ^= 0x40
    path.write_bytes(bytes(data))
    with PeerClient(server.address, TOKEN, peer="a") as c:
        with pytest.raises(BadCopyError, match="corrupt"):
            c.get(b, name, size=len(data))
        assert not b.blobs.has(name)
        assert c.have([name]) == {name}  # the same connection still serves
        with pytest.raises(BadCopyError, match="sizes"):
            c.get(b, name, size=len(data) + 1)  # not the size the manifest says
        with pytest.raises(CorruptBlobError, match="does not hold"):
            c.get(b, blob_name(b"absent"))
    assert not [p for p in (b.root / "blobs").iterdir() if p.name.startswith(".tmp-")]


def test_verify_removes_a_corrupt_copy_at_its_holder_and_never_a_good_one(server, stores):
    a, b = stores
    bad, good = blobs(a, 2)
    flipped = bytearray(a.blobs.path(bad).read_bytes())
    flipped[999] ^= 0x01
    a.blobs.path(bad).write_bytes(bytes(flipped))
    with PeerClient(server.address, TOKEN, peer="a") as c:
        assert c.verify(good) == "ok"  # a request alone removes nothing
        assert c.verify(bad) == "removed"
        assert c.verify(bad) == "missing"
        assert c.have([bad, good]) == {good}
        with pytest.raises(CorruptBlobError, match="does not hold"):
            c.get(b, bad)
        assert c.get(b, good) == a.blobs.size(good)
    assert a.blobs.verify(good) and not a.blobs.path(bad).exists()
    assert (server.stats["verify_requests"], server.stats["removed_corrupt"]) == (3, 1)
    with connect(server) as s:  # like every op: a token first, a valid name
        s.sendall(request("verify", {"blob": good}))
        refused(s, "without a peer token", "PermissionError")
    with connect(server) as s:
        s.sendall(request("verify", {"blob": "../steps/000000000001.json", "token": TOKEN, **V}))
        refused(s, "blob name")
    assert a.blobs.verify(good)


def test_a_put_whose_bytes_do_not_match_its_name_is_not_kept(server, stores):
    a, _ = stores
    name = blob_name(b"the real bytes")
    with connect(server) as s:
        s.sendall(protocol.frame_head(protocol.Request("put", 1, {"blob": name, "token": TOKEN, **V}).header(), [5])
                  + b"wrong")
        reply = protocol.recv_reply(s)
        assert reply.error.type == "CorruptBlobError"
        protocol.send_request(s, protocol.Request("have", 2, {"blobs": [name], "token": TOKEN, **V}))
        assert protocol.recv_reply(s).result == {"have": []}  # same connection, nothing kept
    assert not a.blobs.has(name)


def test_a_put_cut_short_leaves_no_blob_and_no_temp_file(server, stores):
    a, _ = stores
    name = blob_name(b"x" * 100_000)
    with connect(server) as s:
        s.sendall(protocol.frame_head(protocol.Request("put", 1, {"blob": name, "token": TOKEN, **V}).header(), [100_000])
                  + b"x" * 50_000)
    deadline = time.monotonic() + 10
    while [p for p in (a.root / "blobs").iterdir() if p.name.startswith(".tmp-")]:
        assert time.monotonic() < deadline, "the partial temp file was not removed"
        time.sleep(0.01)
    assert not a.blobs.has(name)


# --- refusals ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("token", [None, "", "0" * 64, TOKEN[:-1], TOKEN + "x", 12345, "\ud800" * 64])
def test_requests_without_the_right_token_are_refused_and_logged(server, stores, token, caplog):
    a, b = stores
    names = blobs(a, 1)
    args = {"blob": names[0]} if token is None else {"blob": names[0], "token": token, **V}
    with caplog.at_level(logging.WARNING, logger="mtc.sidecar.peer"), connect(server) as s:
        s.sendall(request("get", args))
        if token == "\ud800" * 64:  # not text: refused with the frame, before any token is compared
            refused(s, "lone UTF-16 surrogate")
        else:
            refused(s, "token", kind="PermissionError")
    assert "refused a peer request" in caplog.text and ("token" in caplog.text or "surrogate" in caplog.text)
    assert server.stats["sent_blobs"] == 0 and server.stats["refused"] == 1
    with pytest.raises(ConfigError, match=ENV_TOKEN):
        PeerClient(server.address, "x" * 32).get(b, names[0])
    still_serves(server, a, names)


@pytest.mark.parametrize("name", [
    "../../../../etc/passwd", "../steps/000000000001.json", "/etc/passwd", "", "A" * 32, "0" * 31,
    "0" * 32 + "\n", "0" * 31 + "/", ".tmp-0123456789abcdef", None, ["0" * 32], "0" * 33,
])
@pytest.mark.parametrize("op", ["get", "have", "put"])
def test_malformed_blob_names_are_refused_before_any_file_is_touched(server, stores, ramdisk, op, name):
    a, _ = stores
    names = blobs(a, 1)
    before = tree(a)
    args = {"blobs": [name]} if op == "have" else {"blob": name}
    with connect(server) as s:
        s.sendall(protocol.frame_head(protocol.Request(op, 1, {**args, "token": TOKEN, **V}).header(),
                                      [4] if op == "put" else []) + (b"data" if op == "put" else b""))
        refused(s, "blob name")
    assert tree(a) == before
    assert not (ramdisk / "etc").exists()
    still_serves(server, a, names)


@pytest.mark.parametrize("what, data, match", [
    ("garbage", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "not an mtc frame"),
    ("huge header", protocol.MAGIC + struct.pack("!I", MAX_PEER_HEADER + 1), "over the limit"),
    ("not json", protocol.MAGIC + struct.pack("!I", 5) + b"{{{{{", "not valid JSON"),
    ("other version", protocol.MAGIC + struct.pack("!I", 11) + b'{"v": 9999}', "protocol version"),
    ("huge payload", protocol.frame_head({"v": PROTOCOL_VERSION, "kind": "request", "op": "put", "id": 1,
                                          "args": {"blob": "0" * 32, "token": TOKEN, **V}}, [1 << 40]), "over the limit"),
    ("payload on get", protocol.frame_head({"v": PROTOCOL_VERSION, "kind": "request", "op": "get", "id": 1,
                                            "args": {"blob": "0" * 32, "token": TOKEN, **V}}, [3]) + b"abc", "no payload"),
    ("two payloads on put", protocol.frame_head({"v": PROTOCOL_VERSION, "kind": "request", "op": "put", "id": 1,
                                                 "args": {"blob": "0" * 32, "token": TOKEN, **V}}, [1, 1]) + b"ab",
     "exactly one payload"),
    ("unknown op", request("rm -rf", {"token": TOKEN, **V}), "unknown peer op"),
    ("a reply, not a request", protocol.frame_head({"v": PROTOCOL_VERSION, "kind": "reply", "id": 1}, []),
     "expected a request"),
    ("too many names", request("have", {"blobs": ["0" * 32] * (HAVE_BATCH + 1), "token": TOKEN, **V}), "at most"),
])
def test_oversized_or_garbage_frames_are_refused(server, stores, what, data, match):
    a, _ = stores
    names = blobs(a, 1)
    before = tree(a)
    with connect(server) as s:
        s.sendall(data)
        refused(s, match)
    assert tree(a) == before
    still_serves(server, a, names)


def test_an_idle_connection_is_closed_and_others_are_served(stores):
    a, _ = stores
    names = blobs(a, 1)
    with PeerServer(a, TOKEN, host_id="a", idle_timeout_s=0.2) as srv:
        srv.start()
        with connect(srv) as idle:
            idle.sendall(protocol.MAGIC)  # a frame that never finishes
            still_serves(srv, a, names)
            idle.settimeout(10)
            assert idle.recv(1) == b""


def test_a_server_needs_a_token_and_a_short_one_is_refused(stores, monkeypatch):
    with pytest.raises(ConfigError, match=ENV_TOKEN):
        PeerServer(stores[0], "")
    monkeypatch.delenv(ENV_TOKEN, raising=False)
    assert resolve_token() == ""
    monkeypatch.setenv(ENV_TOKEN, " " + TOKEN + "\n")
    assert resolve_token() == TOKEN
    assert resolve_token("c" * 20) == "c" * 20  # the config wins
    with pytest.raises(ConfigError, match="at least 16"):
        resolve_token("short")


def test_an_unreachable_peer_is_reported_as_such(server, stores):
    _, b = stores
    addr = server.address
    server.close()
    with pytest.raises(HostUnreachableError, match="cannot connect"):
        PeerClient(addr, TOKEN, peer="a", connect_timeout_s=2).have(["0" * 32])
    with pytest.raises(HostUnreachableError, match="peer a .*cannot connect"):
        PeerClient(addr, TOKEN, peer="a", connect_timeout_s=2).get(b, "0" * 32)


def test_nothing_from_the_network_is_unpickled():
    import ast
    from pathlib import Path

    import mtc.sidecar.peer as peer
    import mtc.sidecar.replication as replication

    for mod in (peer, replication, protocol):
        src = Path(mod.__file__).read_text()
        imported = {a.name for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ImportFrom) and n.module}
        assert not imported & {"pickle", "cloudpickle", "marshal", "shelve"}, mod.__name__


def test_idle_unauthenticated_connections_never_lock_a_peer_out(server, stores):
    """A flood of connections that send nothing holds only the waiting pool (the oldest go first)."""
    a, b = stores
    names = blobs(a, 2)
    idle = [connect(server) for _ in range(100)]
    try:
        with PeerClient(server.address, TOKEN, peer="a") as c:
            for n in names:
                assert c.get(b, n) > 0
        assert all(b.blobs.verify(n) for n in names)
        assert server.refused_connections >= 100 - 16
    finally:
        for s in idle:
            s.close()


def test_a_put_larger_than_the_free_space_reserves_nothing(ramdisk):
    import subprocess

    mnt = ramdisk / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], check=True)
    try:
        store = RamStore(mnt / "mtc")
        with PeerServer(store, TOKEN, host_id="a", max_blob_bytes=1 << 30) as srv:
            srv.start()
            free = store.space.usage()["free_bytes"]
            with connect(srv) as s:  # claims 1 GiB, sends 10 bytes
                args = {"token": TOKEN, "blob": "ab" * 16, "mtc": version.MTC_VERSION, "protocol": version.PROTOCOL_VERSION}
                s.sendall(protocol.frame_head(protocol.Request("put", 1, args).header(), [1 << 30]) + b"x" * 10)
                refused(s, "no room for blob", kind="InsufficientSpaceError")
            assert store.space.usage()["free_bytes"] == free  # nothing reserved
            assert not [p for p in (store.root / "blobs").iterdir()]
            fits = blobs(RamStore(ramdisk / "src"), 1, size=1 << 20)[0]
            with PeerClient(srv.address, TOKEN, peer="a") as c:  # a blob that fits still goes in
                assert c.put(RamStore(ramdisk / "src"), fits)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
