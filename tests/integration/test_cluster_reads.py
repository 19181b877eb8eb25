"""Restore reads in cluster mode, with real daemons: a saved shard is streamed from its blob's
file unverified and hashed by the head as it arrives; a stream that fails its hash is read again
from the same host, which then checks its own copy (and removes it when it is the bad one)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import assert_trees_bitwise_equal, control_connection, random_array
from mtc.head import CheckpointManager, MTCConfig
from mtc.shared import protocol
from mtc.shared.hashing import blob_name

pytestmark = pytest.mark.integration

KEY = "['w']"


def save_state(cluster) -> tuple[CheckpointManager, dict]:
    # 2 slices x 2 hosts x 2 devices; "w" is split over "model", so s0-h0 and s1-h0 (the twins of
    # data rows 0 and 1) hold the same two shards of 1 MiB (above the size that is mapped).
    rng = np.random.default_rng(7)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    state = {"w": jax.device_put(random_array(rng, (256, 4096), np.float32), NamedSharding(mesh, P(None, "model"))),
             "b": jax.device_put(random_array(rng, (64,), np.int8), NamedSharding(mesh, P()))}
    m = CheckpointManager(MTCConfig(local_checkpoint_directory=str(cluster.root), cluster_spec=str(cluster.spec_path),
                                    local_checkpoint_period=1))
    m.save(1, state)
    m.wait_until_finished()
    return m, state


def first_shard(m: CheckpointManager):
    rec = next(a for a in m._dispatch.manifest(1).arrays if a.key == KEY)
    return next(s for s in rec.shards if 0 in s.devices)  # device 0: on s0-h0 (and its twin s1-h0 has it too)


def flip(path, at: int = 4321) -> bytes:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))
    return bytes(data)


def test_daemon_streams_a_saved_shard_as_it_is_only_when_asked(local_cluster):
    m, _ = save_state(local_cluster)
    with m:
        shard = first_shard(m)
    path = local_cluster.store_root("s0-h0") / "blobs" / shard.blob
    bad = flip(path)
    box = [list(p) for p in shard.box]
    with control_connection(local_cluster.address("s0-h0"), local_cluster.peer_token) as s:
        # Asked to stream: the file's bytes as they are, listed as unverified for the head to hash.
        protocol.send_request(s, protocol.Request("read", 3, {"step": 1, "reads": [[KEY, box], ["['b']", None]],
                                                              "stream": [0]}))
        reply = protocol.recv_reply(s)
        assert reply.error is None and reply.result["errors"] == [] and reply.result["streamed"] == [0]
        assert bytes(reply.payloads[0]) == bad and blob_name(reply.payloads[0]) != shard.blob
        # Not asked: the host hashes its copy, refuses it and removes it.
        protocol.send_request(s, protocol.Request("read", 4, {"step": 1, "reads": [[KEY, box]]}))
        reply = protocol.recv_reply(s)
        assert reply.result["streamed"] == [] and reply.result["errors"][0][1] == "CorruptBlobError"
        assert not path.exists()
        protocol.send_request(s, protocol.Request("read", 5, {"step": 1, "reads": [[KEY, box]], "stream": [3]}))
        assert protocol.recv_reply(s).error.type == "ProtocolError"


def test_corrupt_stream_is_caught_by_the_head_and_read_from_the_twin(local_cluster):
    m, state = save_state(local_cluster)
    with m:
        shard = first_shard(m)
        own = local_cluster.store_root("s0-h0") / "blobs" / shard.blob
        twin = local_cluster.store_root("s1-h0") / "blobs" / shard.blob
        flip(own)
        target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state.items()}
        assert_trees_bitwise_equal(state, m.restore(1, target=target), check_sharding=True)
    # The head hashed the stream, found it bad and asked s0-h0 again, which then checked its copy and
    # dropped it; the read came from the twin, whose copy is untouched. The corrupt bytes are gone from
    # s0-h0 for good: the restore's repair may already have pulled a good copy back from the twin.
    assert blob_name(twin.read_bytes()) == shard.blob
    assert not own.exists() or blob_name(own.read_bytes()) == shard.blob
