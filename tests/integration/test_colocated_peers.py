"""Colocated mode (Pathways) reaches the peer tier too: a sidecar pulls missing blobs from a
peer sidecar's real peer server, verified, as a job the head polls."""

from __future__ import annotations

import socket

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from helpers import assert_trees_bitwise_equal
from mtc.head import CheckpointManager, MTCConfig
from mtc.sidecar.peer import PeerServer
from mtc.sidecar.ram import RamStore

pytestmark = pytest.mark.integration

TOKEN = "c0ffee" * 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_colocated_sidecar_pulls_lost_blobs_from_a_peer(ramdisk, tmp_path):
    sh = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
    state = {"w": jax.device_put(np.random.default_rng(0).standard_normal((64, 16), dtype=np.float32), sh)}
    other = RamStore(tmp_path / "other" / "mtc")
    server = PeerServer(other, TOKEN, host_id="other", listen=("127.0.0.1", 0))
    server.start()
    try:
        cfg = MTCConfig(local_checkpoint_directory=str(ramdisk), enable_multi_tier_checkpointing=True,
                        local_checkpoint_period=1, peer_port=free_port(), peer_token=TOKEN)
        with CheckpointManager(cfg) as m:
            m.save(1, state)
            m.wait_until_finished()
            (host,) = m._dispatch.hosts()
            assert m._dispatch.fingerprints()[host]["peer"]  # its own peer service is up
            manifest = m._dispatch.manifest(1)
            sizes = manifest.blob_sizes()
            local = RamStore(ramdisk / "mtc")
            for b in sizes:  # the peer holds a copy of every blob
                other.blobs.write(local.read_blob(b))
            lost = sorted(sizes)[:3]
            for b in lost:  # this host loses three blobs
                local.blobs.path(b).unlink()
            assert m._cluster_steps() == []
            rows = [(b, sizes[b], ["ghost", "other"]) for b in lost]  # the first holder is unreachable
            out = m._dispatch.peer_pull(1, {host: rows}, peers={"other": server.address,
                                                                 "ghost": f"127.0.0.1:{free_port()}"})
            res = out[host]
            assert res.error is None and not res.failed, res
            assert res.pulled_bytes == sum(sizes[b] for b in lost)
            assert m._cluster_steps() == [1]
            assert_trees_bitwise_equal(state, m.restore(1))
    finally:
        server.close()
