"""TLS in transit with real daemons: a cluster whose control and peer ports speak mutual TLS only.

The head and the daemons use the folder ``mtc tls generate`` wrote. Saves and restores (from
RAM, from peers after a host is wiped, from the backup after every host is) come back bit for
bit; a client without a certificate of the job's CA, or one speaking clear text, is refused
before any request is read and changes nothing; a head without TLS cannot reach the hosts.
"""

from __future__ import annotations

import contextlib
import socket
import ssl

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from helpers import assert_trees_bitwise_equal, random_array
from mtc.head import CheckpointManager, MTCConfig
from mtc.head.tools.cli.tls import generate
from mtc.shared import protocol, version
from mtc.shared.errors import ProtocolError
from mtc.shared.tls import TLSFiles
from mtc.sidecar.local_cluster import LocalCluster

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tls_dirs(tmp_path_factory):
    """The job's TLS folder, and another job's (same file names, another CA)."""
    job, other = tmp_path_factory.mktemp("tls-job"), tmp_path_factory.mktemp("tls-other")
    generate(job)
    generate(other)
    return job, other


@pytest.fixture
def cluster(ramdisk, tls_dirs):
    with LocalCluster(ramdisk / "cluster", 2, 2, devices_per_host=2, tls_dir=tls_dirs[0]) as c:
        yield c


def _state(seed: int) -> dict:
    mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: d.id)).reshape(2, 4), ("data", "model"))
    rng = np.random.default_rng(seed)
    return {"w": jax.device_put(random_array(rng, (64, 96), np.float32), NamedSharding(mesh, P("data", "model"))),
            "v": jax.device_put(random_array(rng, (32, 48), np.float32), NamedSharding(mesh, P(None, "model"))),
            "rng": random_array(rng, (4,), np.uint32), "step": seed}


def _manager(cluster: LocalCluster, tls_dir, **kw) -> CheckpointManager:
    return CheckpointManager(MTCConfig(local_checkpoint_directory=str(cluster.root),
                                       cluster_spec=str(cluster.spec_path), local_checkpoint_period=1,
                                       tls_dir=str(tls_dir) if tls_dir else "", **kw))


def _snapshot(cluster: LocalCluster) -> dict:
    out = {}
    for h in cluster.hosts:
        for p in sorted(cluster.ramdisk(h).rglob("*")):
            if p.is_file():
                st = p.stat()
                out[str(p)] = (st.st_size, st.st_mtime_ns)
    return out


def test_save_restore_peer_restore_and_backup_restore_over_tls_are_bit_for_bit(cluster, tls_dirs, ramdisk):
    states = {s: _state(s) for s in (1, 2)}
    with _manager(cluster, tls_dirs[0], base_output_directory=str(ramdisk / "bucket"), run_name="run",
                  multi_tier_checkpointing_backup_interval_steps=1) as m:
        for s, st in states.items():
            m.save(s, st)
            m.wait_until_finished()
            rep = m.wait_for_replication()
            assert rep.complete and rep.replicated and rep.moved_bytes > 0, rep  # peer puts, over TLS
            # Each step's backup before the next save: a save while one still runs skips its own backup
            # (by design), and the restore below is to find step 2 in the backup.
            assert m.wait_for_backup().error is None
        assert_trees_bitwise_equal(states[2], m.restore())
        assert m.last_restore_report.bytes_by_tier["ram"] > 0

        cluster.wipe("s0-h1")  # a replaced node: its share comes from its peers, over TLS
        cluster.restart("s0-h1")
        assert_trees_bitwise_equal(states[2], m.restore())
        rep = m.last_restore_report
        assert rep.bytes_by_tier["peer"] > 0 and rep.bytes_by_tier["backup"] == 0, rep.bytes_by_tier

        for h in cluster.hosts:  # every ramdisk gone: the backup it is
            cluster.wipe(h)
            cluster.restart(h)
        assert_trees_bitwise_equal(states[2], m.restore())
        rep = m.last_restore_report
        assert rep.bytes_by_tier["backup"] > 0 and rep.bytes_by_tier["ram"] == 0, rep.bytes_by_tier
    for h in cluster.hosts:  # the daemons served TLS (a head without it is refused: see below)
        assert "peer service on" in cluster.log_path(h).read_text() and "(TLS)" in cluster.log_path(h).read_text()


def _client_context(ca: str, cert: TLSFiles | None) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.load_verify_locations(cafile=ca)
    if cert is not None:
        ctx.load_cert_chain(cert.cert, cert.key)
    return ctx


def _send(sock: socket.socket, request: protocol.Request) -> None:
    sock.sendall(protocol.frame_head(request.header(), []))  # a plain SSLSocket has no sendmsg


def _no_reply(sock: socket.socket, request: protocol.Request) -> None:
    """Send ``request``; the server must close the connection without a reply that parses."""
    with pytest.raises((OSError, ProtocolError)):
        _send(sock, request)
        protocol.recv_reply(sock)


def test_clients_without_the_jobs_certificate_or_in_clear_text_are_refused_before_any_request(cluster, tls_dirs):
    job, other = TLSFiles.in_dir(tls_dirs[0]), TLSFiles.in_dir(tls_dirs[1])
    state = _state(3)
    with _manager(cluster, tls_dirs[0]) as m:
        m.save(1, state)
        m.wait_until_finished()
        m.wait_for_replication()
    before = _snapshot(cluster)
    ping = protocol.Request("ping", 1)
    get = protocol.Request("have", 1, {"blobs": [], "token": cluster.peer_token, "mtc": version.MTC_VERSION,
                                       "protocol": version.PROTOCOL_VERSION})
    for address, request in ((cluster.address("s0-h0"), ping), (cluster.peer_address("s1-h0"), get)):
        addr = protocol.parse_address(address)
        # No client certificate, and one of another job's CA: the handshake fails, nothing is served.
        for cert in (None, other):
            with socket.create_connection(addr, timeout=10) as raw:
                with _client_context(job.ca, cert).wrap_socket(raw) as s:
                    _no_reply(s, request)
        # A client that does not trust the job's CA refuses the server (the check is mutual).
        with socket.create_connection(addr, timeout=10) as raw:
            with pytest.raises(ssl.SSLError):
                _client_context(other.ca, other).wrap_socket(raw)
        # Clear text: the request is taken for a bad handshake; no reply comes back.
        with socket.create_connection(addr, timeout=10) as s:
            _send(s, request)
            data = b""
            try:
                while chunk := s.recv(65536):
                    data += chunk
            except ConnectionResetError:  # closed with our bytes unread: the same refusal
                pass
            assert not data.startswith(protocol.MAGIC), data[:40]
        # The job's own certificate works on the same port.
        with socket.create_connection(addr, timeout=10) as raw, _client_context(job.ca, job).wrap_socket(raw) as s:
            _send(s, request)
            assert protocol.recv_reply(s).error is None
    assert _snapshot(cluster) == before, "a refused connection changed a ramdisk"
    with _manager(cluster, tls_dirs[0]) as m:
        assert_trees_bitwise_equal(state, m.restore())


def test_a_head_without_tls_cannot_reach_tls_sidecars(cluster, tls_dirs, monkeypatch):
    monkeypatch.delenv("MTC_TLS_DIR", raising=False)
    for tls_dir, why in ((None, "give the head the job's TLS folder"), (tls_dirs[1], "TLS handshake failed")):
        m = _manager(cluster, tls_dir, prefetch_on_start=False)  # clear text; another job's CA
        try:
            with pytest.raises(Exception, match=why):
                m.save(1, _state(4))
                m.wait_until_finished()
        finally:
            with contextlib.suppress(Exception):
                m.close()
    assert not any(list((cluster.store_root(h) / "steps").glob("*.json")) for h in cluster.hosts)


def test_a_colocated_sidecar_serves_and_pulls_over_tls_from_mtc_tls_dir(ramdisk, tmp_path, tls_dirs, monkeypatch):
    """Colocated mode (Pathways): the sidecar's peer port reads MTC_TLS_DIR, and its pulls dial with it."""
    from mtc.sidecar.peer import PeerServer
    from mtc.sidecar.ram import RamStore

    monkeypatch.setenv("MTC_TLS_DIR", str(tls_dirs[0]))
    token = "c0ffee" * 8
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mesh = Mesh(np.array(jax.devices()), ("x",))
    state = {"w": jax.device_put(random_array(np.random.default_rng(5), (64, 16), np.float32),
                                 NamedSharding(mesh, P("x")))}
    other = RamStore(tmp_path / "other" / "mtc")
    with PeerServer(other, token, host_id="other", tls=TLSFiles.in_dir(tls_dirs[0])) as server:
        server.start()
        cfg = MTCConfig(local_checkpoint_directory=str(ramdisk), local_checkpoint_period=1, peer_port=port,
                        peer_token=token)
        with CheckpointManager(cfg) as m:
            m.save(1, state)
            m.wait_until_finished()
            (host,) = m._dispatch.hosts()
            sizes = m._dispatch.manifest(1).blob_sizes()
            local = RamStore(ramdisk / "mtc")
            for b in sizes:
                other.blobs.write(local.read_blob(b))
            lost = sorted(sizes)[:2]
            for b in lost:
                local.blobs.path(b).unlink()
            res = m._dispatch.peer_pull(1, {host: [(b, sizes[b], ["other"]) for b in lost]},
                                        peers={"other": server.address})[host]
            assert res.error is None and not res.failed and res.pulled_bytes == sum(sizes[b] for b in lost), res
            assert server.stats["sent_blobs"] == len(lost)
            assert_trees_bitwise_equal(state, m.restore(1))
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:  # its own port: TLS only
                _no_reply(s, protocol.Request("have", 1, {"blobs": [], "token": token, "mtc": version.MTC_VERSION,
                                                          "protocol": version.PROTOCOL_VERSION}))
