"""Local saves come before incoming peer copies.

A peer ``put`` that declares most of a 128 MiB huge-page ramdisk and then sends one byte (an
attacker with the token, or just a slow network) must not hold the room of the bytes it has not
sent: a local save beside it succeeds and restores bit for bit. A copy that has arrived in part
gives its room back when a local save needs it. A transfer that makes no progress is dropped
after the receive deadline: its partial copy is removed, its room is free again, and one line
names the peer and the blob.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from helpers import assert_trees_bitwise_equal
from mtc.head import CheckpointManager, MTCConfig
from mtc.shared import protocol, version
from mtc.shared.hashing import blob_name
from mtc.shared.protocol import Request
from mtc.sidecar.daemon import SidecarDaemon
from mtc.sidecar.peer import PeerServer
from mtc.sidecar.service import SidecarService

pytestmark = pytest.mark.integration

MIB = 1 << 20
TOKEN = "stalled-peer-put-test-token"
SAVE_BYTES = 32 * MIB  # one host's part of the save: 8 shards of 4 MiB


@pytest.fixture
def ramdisk128(tmp_path):
    """A real 128 MiB tmpfs with 2 MiB pages (the recommended ramdisk), unmounted afterwards; needs root."""
    mnt = tmp_path / "ramdisk128"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128m,huge=within_size", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a 128 MiB huge-page tmpfs (needs root): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def host(ramdisk128, tmp_path, monkeypatch):
    """A sidecar daemon on the 128 MiB ramdisk (the local saves go through it, driven by the real
    head) and a one-host cluster spec: ``make(receive_timeout_s) -> (service, peer server, config)``.
    The peer server is a real ``PeerServer`` on the daemon's store, with the receive deadline the
    test sets."""
    monkeypatch.setenv("MTC_PEER_TOKEN", TOKEN)
    made = []

    def make(receive_timeout_s: float):
        svc = SidecarService(ramdisk128 / "mtc", host_id="s0-h0", max_to_keep=1)
        if not svc.store.huge_pages:
            pytest.skip("this kernel's tmpfs has no huge pages")
        daemon = SidecarDaemon(svc, TOKEN)
        daemon.start()
        made.append(daemon)
        server = PeerServer(svc.store, TOKEN, host_id="s0-h0", receive_timeout_s=receive_timeout_s)
        server.start()
        made.append(server)
        spec = tmp_path / "cluster.json"
        protocol.ClusterSpec((protocol.HostSpec("s0-h0", 0, daemon.address, len(jax.devices())),)).write(spec)
        cfg = MTCConfig(local_checkpoint_directory=str(tmp_path / "head"), cluster_spec=str(spec),
                        local_checkpoint_period=1, local_max_to_keep=1)
        return svc, server, cfg

    yield make
    for x in reversed(made):
        x.close()


def _state(seed: int) -> dict:
    sh = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
    data = np.random.default_rng(seed).standard_normal(SAVE_BYTES // 4, dtype=np.float32)
    return {"w": jax.device_put(data, sh)}


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _temp_files(svc) -> list[Path]:
    """Blob files being written (received copies, landings): never committed data."""
    return [p for p in (svc.store.root / "blobs").iterdir() if p.name.startswith(".tmp-")]


def _poll(what: str, cond, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.02)


def _start_put(server: PeerServer, name: str, declared: int, first: bytes) -> socket.socket:
    """A raw peer client: authenticate with a ``put`` of ``declared`` bytes, send ``first``, then nothing."""
    sock = socket.create_connection(protocol.parse_address(server.address), timeout=30)
    req = Request("put", 1, {"blob": name, "token": TOKEN, "mtc": version.MTC_VERSION,
                             "protocol": version.PROTOCOL_VERSION})
    sock.sendall(protocol.frame_head(req.header(), [declared]))
    sock.sendall(first)
    return sock


def _reply_error(sock: socket.socket) -> protocol.RemoteError | None:
    """The error the server answered before closing the connection (None: it closed without one)."""
    try:
        header = protocol.recv_header(sock)
    except OSError:
        return None
    if header is None:
        return None
    return protocol.Reply.from_frame(header, ()).error


def test_a_stalled_put_holds_no_room_a_local_save_needs(host):
    svc, server, cfg = host(receive_timeout_s=60.0)
    root = svc.store.root
    name = blob_name(b"the bytes of this blob never come")
    with CheckpointManager(cfg) as m:
        free0 = _free(root)
        declared = free0 - 20 * MIB  # most of the ramdisk: the put is accepted, the save then fits only
        assert svc.store.space.fits([declared]) and declared + SAVE_BYTES > free0  # beside the room it declared
        sock = _start_put(server, name, declared, b"\x01")
        try:
            _poll("the stalled copy's temp file", lambda: _temp_files(svc))
            held = sum(p.stat().st_blocks * 512 for p in _temp_files(svc))  # the stalled copy's only
            state = _state(1)
            m.save(1, state)
            m.wait_until_finished()  # on a ramdisk held by the stalled copy: SaveError (no room)
            assert held <= 4 * MIB, f"a copy that sent 1 byte held {held / MIB:.0f} MiB of the ramdisk"
            # The save needed no copy to give its room back: the stalled one simply held none.
            assert server.stats["yielded_puts"] == 0 and server.stats["stalled_puts"] == 0, server.stats
            assert len(_temp_files(svc)) == 1, "the stalled copy is still being received"
            assert_trees_bitwise_equal(state, m.restore(1))
        finally:
            sock.close()
        # The sender goes away: its partial copy goes too.
        _poll("the partial copy's removal", lambda: not _temp_files(svc))
    assert not svc.store.blobs.has(name)


def test_a_put_without_progress_is_dropped_after_the_receive_deadline(host, caplog):
    svc, server, cfg = host(receive_timeout_s=1.0)
    root = svc.store.root
    name = blob_name(b"a blob whose bytes stop after the first")
    free0 = _free(root)
    declared = free0 - 20 * MIB
    caplog.set_level(logging.WARNING, logger="mtc.sidecar.peer.server")
    sock = _start_put(server, name, declared, b"\x01")
    port = sock.getsockname()[1]
    with sock:
        t0 = time.monotonic()
        _poll("the stalled copy's temp file", lambda: _temp_files(svc) or server.stats.get("stalled_puts"))
        _poll("the stalled put to be dropped", lambda: server.stats.get("stalled_puts") == 1)
        waited = time.monotonic() - t0
        assert 0.5 <= waited < 15, f"dropped after {waited:.1f} s with a 1 s receive deadline"
        err = _reply_error(sock)  # the sender is told why, then the connection is closed
        assert err is not None and name in err.message and "no byte arrived for 1.0 s" in err.message, err
        assert "removed the partial copy" in err.message, err
        assert sock.recv(1) == b""
    _poll("the partial copy's removal", lambda: not _temp_files(svc))
    assert _free(root) >= free0 - MIB, f"{(free0 - _free(root)) / MIB:.1f} MiB still held after the drop"
    assert not svc.store.blobs.has(name)
    lines = [r.getMessage() for r in caplog.records if "dropped a put" in r.getMessage()]
    assert len(lines) == 1, lines  # logged once, with the peer and the blob
    assert name in lines[0] and str(port) in lines[0] and "after 1 of" in lines[0], lines[0]
    # The ramdisk takes a save of its whole room again.
    with CheckpointManager(cfg) as m:
        state = _state(2)
        m.save(1, state)
        m.wait_until_finished()
        assert_trees_bitwise_equal(state, m.restore(1))


def test_a_copy_that_arrived_in_part_gives_its_room_back_to_a_local_save(host):
    svc, server, cfg = host(receive_timeout_s=60.0)
    root = svc.store.root
    name = blob_name(b"a blob that is most of the way here")
    with CheckpointManager(cfg) as m:
        free0 = _free(root)
        declared = free0 - 4 * MIB
        sent = declared - 16 * MIB  # what arrived holds its room: the save cannot fit beside it
        sock = _start_put(server, name, declared, os.urandom(1 << 16) * (sent >> 16))
        try:
            _poll("the copy's bytes to arrive", lambda: free0 - _free(root) >= sent)
            assert _free(root) < SAVE_BYTES
            state = _state(3)
            m.save(1, state)
            m.wait_until_finished()  # the copy gives its room back
            assert server.stats["yielded_puts"] == 1, server.stats
            err = _reply_error(sock)
            assert err is None or (err.type == "InsufficientSpaceError" and "local save" in err.message), err
            assert_trees_bitwise_equal(state, m.restore(1))
        finally:
            sock.close()
        assert not _temp_files(svc) and not svc.store.blobs.has(name)
