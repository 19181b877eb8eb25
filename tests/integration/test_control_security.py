"""The control plane against a local attacker (loopback only), with real daemons (docs/architecture.md, "Who may talk to a sidecar").

Nobody but the job's head can read, change or stall a checkpoint: every control operation is
refused without the job token and changes nothing; floods of memory-pinning frames, idle
connections and descriptor exhaustion leave the daemon serving the head; what the sidecars
write is readable by their user only.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import socket
import stat
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from helpers import assert_trees_bitwise_equal, control_connection, random_array
from mtc.head import CheckpointManager, MTCConfig
from mtc.shared import auth, protocol
from mtc.sidecar.local_cluster import LocalCluster

pytestmark = pytest.mark.integration

# Every operation with arguments that would change or reveal something if it were served.
ATTACKS = {
    "fingerprint": {}, "inventory": {}, "manifest": {"step": 1}, "lease": {}, "verify": {"step": 1},
    "read": {"step": 1, "reads": [["['w']", None]]},
    "write": {"step": 9, "part": 0, "shards": []},
    "commit": {"step": 1},
    "abort": {"step": 1},
    "claim": {"generation": 1 << 62, "head": {"host": "evil", "pid": 1}},
    "peer_pull": {"step": 1, "pulls": [], "peers": {"x": "127.0.0.1:9"}},
    "configure": {"settings": {"local_max_to_keep": 1, "backup_url": "/tmp/evil", "backup_max_to_keep": 1}},
    "backup_upload": {"blobs": []},
    "backup_finalize": {"name": "x"},
    "backup_listing": {},
    "backup_manifest": {"name": "x"},
    "backup_fetch": {"name": "x", "blobs": []},
    "job": {"job": "0" * 32},
}


def _state(seed: int) -> dict:
    devices = sorted(jax.devices(), key=lambda d: d.id)
    mesh = Mesh(np.array(devices).reshape(2, 4), ("data", "model"))
    rng = np.random.default_rng(seed)
    return {"w": jax.device_put(random_array(rng, (16, 8), np.float32), NamedSharding(mesh, P("data", "model")))}


def _snapshot(cluster: LocalCluster) -> dict:
    """Every file under every host's ramdisk, with its size and mtime: what a request could change."""
    out = {}
    for h in cluster.hosts:
        for p in sorted(cluster.ramdisk(h).rglob("*")):
            if p.is_file():
                st = p.stat()
                out[str(p)] = (st.st_size, st.st_mtime_ns)
    return out


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture
def cluster(ramdisk):
    with LocalCluster(ramdisk / "cluster", 2, 2, devices_per_host=2) as c:
        yield c


def _manager(cluster: LocalCluster, **kw) -> CheckpointManager:
    return CheckpointManager(MTCConfig(local_checkpoint_directory=str(cluster.root), cluster_spec=str(cluster.spec_path),
                                       local_checkpoint_period=1, prefetch_on_start=False, **kw))


def test_every_control_operation_without_the_token_is_refused_and_changes_nothing(cluster):
    state = _state(1)
    with _manager(cluster) as m:
        m.save(1, state)
        m.wait_until_finished()
    before = _snapshot(cluster)
    addr = protocol.parse_address(cluster.address("s0-h0"))
    for op, args in ATTACKS.items():
        # No handshake at all: refused, and the connection closed.
        with socket.create_connection(addr, timeout=10) as s:
            protocol.send_request(s, protocol.Request(op, 1, args))
            reply = protocol.recv_reply(s)
            assert reply.error is not None and "authenticate" in reply.error.message, (op, reply)
            assert s.recv(1) == b""
        # A wrong token: the proof fails, the operation never runs.
        with socket.create_connection(addr, timeout=10) as s:
            c = auth.new_nonce()
            protocol.send_request(s, protocol.Request("hello", 1, {"nonce": c}))
            n = protocol.recv_reply(s).result["nonce"]
            wrong = auth.control_key("not-the-job-token-0123456789")
            protocol.send_request(s, protocol.Request("auth", 2, {"proof": auth.proof(wrong, "client", n, c)}))
            reply = protocol.recv_reply(s)
            assert reply.error is not None and reply.error.type == "AuthenticationError", (op, reply)
            assert s.recv(1) == b""
        # A replayed proof from another exchange does not work either (fresh server nonce).
    assert _snapshot(cluster) == before, "an unauthenticated request changed a ramdisk"
    with _manager(cluster) as m:  # the real head still restores the saved state
        assert m.all_steps() == [1]
        assert_trees_bitwise_equal(state, m.restore())


def test_a_head_with_the_wrong_token_is_refused_and_the_real_head_is_unaffected(cluster):
    state = _state(2)
    with _manager(cluster) as m:
        m.save(1, state)
        m.wait_until_finished()
    rogue = _manager(cluster, peer_token="a-rogue-head-token-0123456789")
    with pytest.raises(Exception, match="AuthenticationError|not from this job's head"):
        rogue.save(2, _state(3))
        rogue.wait_until_finished()
    rogue.close()
    with _manager(cluster) as m:
        assert m.all_steps() == [1]
        assert_trees_bitwise_equal(state, m.restore())


def test_a_listener_without_the_token_is_not_taken_for_a_sidecar(tmp_path):
    """Mutual: the head checks the daemon's proof too, so a stray listener on a sidecar's address
    (a stale spec, another job) never receives the head's shards."""
    import threading

    srv = socket.create_server(("127.0.0.1", 0))
    got = []

    def impostor():
        conn, _ = srv.accept()
        with conn:
            hello = protocol.recv_request(conn)
            protocol.send_reply(conn, protocol.Reply(hello.id, {"nonce": auth.new_nonce(), "host": "s0-h0"}))
            req = protocol.recv_request(conn)
            protocol.send_reply(conn, protocol.Reply(req.id, {"proof": "0" * 64}))  # it cannot make the real one
            try:
                got.append(protocol.recv_request(conn))
            except Exception:
                got.append(None)

    t = threading.Thread(target=impostor, daemon=True)
    t.start()
    spec = tmp_path / "cluster.json"
    protocol.ClusterSpec((protocol.HostSpec("s0-h0", 0, "127.0.0.1:%d" % srv.getsockname()[1], 8),)).write(spec)
    cfg = MTCConfig(local_checkpoint_directory=str(tmp_path), cluster_spec=str(spec), local_checkpoint_period=1,
                    prefetch_on_start=False, peer_token="the-real-job-token-0123456789")
    with CheckpointManager(cfg) as m:
        with pytest.raises(Exception, match="does not hold this job's token"):
            m.save(1, _state(4))
    t.join(10)
    srv.close()
    assert got in ([], [None]), f"the head sent a request to an impostor: {got}"


def test_frames_that_declare_huge_headers_pin_no_memory_and_the_head_is_served(cluster):
    pid = cluster.pid("s0-h0")
    addr = protocol.parse_address(cluster.address("s0-h0"))
    rss0 = _rss(pid)
    socks = []
    try:
        for _ in range(64):  # 64 x 16 MiB declared: 1 GiB if the daemon allocated what frames claim
            s = socket.create_connection(addr, timeout=10)
            s.sendall(protocol.MAGIC + (protocol.MAX_HEADER_BYTES).to_bytes(4, "big") + b"{" * 100)
            socks.append(s)
        time.sleep(0.5)
        grown = _rss(pid) - rss0
        assert grown < 64 << 20, f"the daemon grew by {grown >> 20} MiB for {len(socks)} 8-byte frame prefixes"
        state = _state(5)
        t0 = time.monotonic()
        with _manager(cluster) as m:  # served at once: the flood holds only the waiting pool
            m.save(1, state)
            m.wait_until_finished()
            assert_trees_bitwise_equal(state, m.restore())
        assert time.monotonic() - t0 < 30
    finally:
        for s in socks:
            s.close()


def test_idle_connections_never_lock_the_head_out(cluster):
    addr = protocol.parse_address(cluster.address("s1-h1"))
    socks = [socket.create_connection(addr, timeout=10) for _ in range(100)]
    try:
        state = _state(6)
        with _manager(cluster) as m:
            m.save(1, state)
            m.wait_until_finished()
            assert_trees_bitwise_equal(state, m.restore())
    finally:
        for s in socks:
            s.close()


def test_the_daemon_serves_again_after_running_out_of_descriptors(cluster):
    pid = cluster.pid("s0-h1")
    addr = protocol.parse_address(cluster.address("s0-h1"))
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    used = len(os.listdir(f"/proc/{pid}/fd"))
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (used + 8, hard))
    socks = []
    try:
        for _ in range(40):  # far past its descriptors: accept() fails with EMFILE
            socks.append(socket.create_connection(addr, timeout=10))
        time.sleep(0.5)
    finally:
        for s in socks:
            s.close()
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
    time.sleep(0.3)
    assert cluster.pid("s0-h1") == pid, "the daemon died"
    with control_connection(cluster.address("s0-h1"), cluster.peer_token) as s:  # and it serves again
        protocol.send_request(s, protocol.Request("ping", 3))
        assert protocol.recv_reply(s).result["host"] == "s0-h1"
    assert "waiting for descriptors" in cluster.log_path("s0-h1").read_text()


def test_what_the_sidecars_write_is_readable_by_their_user_only(cluster):
    with _manager(cluster) as m:
        m.save(1, _state(7))
        m.wait_until_finished()
    checked = 0
    for p in [cluster.root, *cluster.root.rglob("*")]:
        mode = stat.S_IMODE(p.lstat().st_mode)
        if p.is_dir():
            assert mode & 0o077 == 0, f"{p} is {oct(mode)}: others can list it"
        else:
            assert mode & 0o077 == 0, f"{p} is {oct(mode)}: others can read it"
        checked += 1
    blobs = list((cluster.store_root("s0-h0") / "blobs").iterdir())
    assert blobs and checked > 20


def _swap_two_blobs(path: Path, recompute: bool) -> None:
    """Swap the blob names of two same-size shards in a step manifest: valid JSON, every blob still
    hashes right. With ``recompute``, the attacker also rewrites the parts' hashes and the digest."""
    import json

    from mtc.shared.format.base import doc_digest
    from mtc.shared.hashing import blob_name

    from mtc.shared import format as fmt

    header, *lines = path.read_bytes().split(b"\n")
    doc, parts = json.loads(header), [fmt.HostManifest.from_json(line) for line in lines]
    rows = [[p, i, s] for p in parts for i, s in enumerate(p.shards)]
    a, b = next((x, y) for x in rows for y in rows if x[2] is not y[2] and x[2].nbytes == y[2].nbytes
                and x[2].blob != y[2].blob)
    a[2], b[2] = (fmt.HostShard(a[2].array, a[2].box, b[2].blob, a[2].nbytes),
                  fmt.HostShard(b[2].array, b[2].box, a[2].blob, b[2].nbytes))
    parts = [dataclasses.replace(p, shards=tuple(r[2] for r in rows if r[0] is p)) for p in parts]
    lines = [p.to_json() for p in parts]
    if recompute:
        doc.pop("digest")
        for meta, line in zip(doc["parts"], lines):
            meta.update(bytes=len(line), digest=blob_name(line))
        doc["digest"] = doc_digest(doc)
    path.write_bytes(b"\n".join([json.dumps(doc, separators=(",", ":"), sort_keys=True).encode(), *lines]))


@pytest.mark.parametrize("recompute", [False, True], ids=["digest-kept", "digest-recomputed"])
def test_a_tampered_step_manifest_is_never_restored_as_data(cluster, recompute):
    state = _state(8)
    with _manager(cluster) as m:
        m.save(1, state)
        m.wait_until_finished()
    victim = "s0-h0"
    _swap_two_blobs(cluster.store_root(victim) / "steps" / f"{1:012d}.json", recompute)
    cluster.kill(victim)
    cluster.restart(victim)  # no cached manifest: it reads the tampered file
    with _manager(cluster) as m:
        assert m.all_steps() == [1]  # the other slice holds every blob: still restorable
        assert_trees_bitwise_equal(state, m.restore())
        rep = m.last_restore_report
        assert rep.step == 1


def test_a_damaged_manifest_copy_on_the_only_holder_of_some_blobs_is_given_back(cluster):
    """Found by the soak: with its manifest copy damaged, a host listed no step, so its (good) blobs
    did not count and restore fell back to an older step. The head now gives it the version the
    others agree on, and the newest step is restored from its blobs, bit for bit."""
    old, new = _state(9), _state(10)
    with _manager(cluster, replication_factor=1) as m:  # no peer copies: s0-h0 alone holds its shards
        m.save(1, old)
        m.save(2, new)
        m.wait_until_finished()
    path = cluster.store_root("s0-h0") / "steps" / f"{2:012d}.json"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    cluster.kill("s0-h0")
    cluster.restart("s0-h0")
    with _manager(cluster, replication_factor=1) as m:
        assert_trees_bitwise_equal(new, m.restore())
        assert m.last_restore_report.step == 2
        assert m.all_steps() == [1, 2]
    assert fmt_digest_ok(path)


def fmt_digest_ok(path: Path) -> bool:
    from mtc.shared import format as fmt

    return fmt.StepManifest.from_json(path.read_bytes()).step == 2
