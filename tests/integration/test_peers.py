"""The peer tier with real sidecar daemons: replication after saves, restore after a host is lost.

Clusters: 2 slices x 2 hosts x 2 devices (data-parallel twins across slices), and 1 slice x 4
hosts x 2 devices (no twins: every shard lives on one host until it is replicated). Every
restore is compared bit for bit with what was saved.
"""

from __future__ import annotations

import socket
import struct

import jax
import ml_dtypes
import numpy as np
import psutil
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import assert_trees_bitwise_equal, random_array
from mtc.head import CheckpointManager, MTCConfig
from mtc.shared import protocol, version
from mtc.shared.errors import ConfigError, CorruptBlobError, StepNotFoundError
from mtc.shared.hashing import blob_name
from mtc.sidecar.local_cluster import LocalCluster
from mtc.sidecar.peer import ENV_TOKEN, PeerClient

pytestmark = pytest.mark.integration


def mesh() -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))


def put(a: np.ndarray, spec: P) -> jax.Array:
    return jax.device_put(a, NamedSharding(mesh(), spec))


def split_state(seed: int) -> dict:
    """Every array split over all 8 devices: no shard has a twin anywhere."""
    rng = np.random.default_rng(seed)
    return {
        "w": put(random_array(rng, (64, 96), np.float32), P("data", "model")),
        "emb": put(random_array(rng, (128, 8), ml_dtypes.bfloat16), P(("data", "model"))),
        "step": seed,
    }


def mixed_state(seed: int) -> dict:
    """Split over "data" (unique per host) and replicated over it (twins in the other slice)."""
    rng = np.random.default_rng(seed)
    return {
        "w": put(random_array(rng, (64, 48), np.float32), P("data", "model")),
        "v": put(random_array(rng, (32, 48), np.float32), P(None, "model")),
        "b": put(random_array(rng, (24,), np.int8), P()),
        "rng": random_array(rng, (4,), np.uint32),
        "step": seed,
    }


def data_parallel_state(seed: int) -> dict:
    """Replicated over "data": host h of slice 0 and host h of slice 1 hold the same shards."""
    rng = np.random.default_rng(seed)
    return {
        "w": put(random_array(rng, (64, 48), np.float32), P(None, "model")),
        "m": put(random_array(rng, (16, 8), ml_dtypes.bfloat16), P("model")),
        "b": put(random_array(rng, (24,), np.int8), P()),
        "rng": random_array(rng, (4,), np.uint32),
        "lr": np.float32(seed / 8),
        "step": seed,
    }


def manager(cluster: LocalCluster, **kw) -> CheckpointManager:
    return CheckpointManager(MTCConfig(local_checkpoint_directory=str(cluster.root),
                                       cluster_spec=str(cluster.spec_path), local_checkpoint_period=1, **kw))


def host_of_device(cluster: LocalCluster) -> dict[int, str]:
    per = cluster.devices_per_host
    return {d: cluster.hosts[d // per] for d in range(len(cluster.hosts) * per)}


def own_blobs(cluster: LocalCluster, state: dict) -> dict[str, dict[str, int]]:
    """host -> {blob: nbytes} it writes when saving ``state`` (its devices' shards, every numpy leaf)."""
    where = host_of_device(cluster)
    out: dict[str, dict[str, int]] = {h: {} for h in cluster.hosts}
    for leaf in jax.tree_util.tree_leaves(state):
        if isinstance(leaf, jax.Array):
            for sh in leaf.addressable_shards:
                data = np.ascontiguousarray(np.asarray(sh.data)).tobytes()
                out[where[sh.device.id]][blob_name(data)] = len(data)
        elif isinstance(leaf, (np.ndarray, np.generic)):
            data = np.ascontiguousarray(leaf).tobytes()
            for h in out:
                out[h][blob_name(data)] = len(data)
    return out


def blobs_on_disk(cluster: LocalCluster, host: str) -> set[str]:
    return {p.name for p in (cluster.store_root(host) / "blobs").iterdir() if not p.name.startswith(".")}


def assert_every_blob_verifies(cluster: LocalCluster) -> None:
    """No host holds a file under a blob name whose bytes do not hash to it (no partial copy counted)."""
    for h in cluster.hosts:
        for p in (cluster.store_root(h) / "blobs").iterdir():
            if not p.name.startswith("."):
                assert blob_name(p.read_bytes()) == p.name, f"{h}: {p.name} does not verify"


def flip_byte(path, at: int = 7) -> None:
    data = bytearray(path.read_bytes())
    data[at % len(data)] ^= 0x10
    path.write_bytes(bytes(data))


# --- restore after a host or a slice is lost ----------------------------------------------------------


def test_wiped_host_restores_from_peers_bit_for_bit_and_none_from_the_backup(local_cluster, ramdisk):
    states = {s: mixed_state(s) for s in (1, 2)}
    with manager(local_cluster, base_output_directory=str(ramdisk / "bucket"), run_name="run",
                 multi_tier_checkpointing_backup_interval_steps=1) as m:
        for s, st in states.items():
            m.save(s, st)
            m.wait_until_finished()
            rep = m.wait_for_replication()
            assert rep.step == s and rep.complete and rep.replicated and rep.moved_bytes > 0, rep
        assert m.wait_for_backup().error is None  # a backup exists, and must not be needed
        assert all(st.replicated and st.min_copies == 2 for st in m.step_status())

        local_cluster.wipe("s0-h1")  # a replaced node: an empty ramdisk
        local_cluster.restart("s0-h1")
        assert not blobs_on_disk(local_cluster, "s0-h1")
        assert m.all_steps() == [1, 2]
        assert_trees_bitwise_equal(states[2], m.restore())
        rep = m.last_restore_report
        need = own_blobs(local_cluster, states[2])["s0-h1"]
        assert rep.source == "cluster"
        assert rep.bytes_by_tier["backup"] == 0 and rep.blobs_by_tier["backup"] == 0
        assert rep.bytes_by_tier["peer"] == sum(need.values()) and rep.blobs_by_tier["peer"] == len(need)
        assert rep.bytes_by_tier["ram"] > 0 and not rep.skipped_copies
        # The host holds its share again and has the step committed: it is whole.
        assert set(need) <= blobs_on_disk(local_cluster, "s0-h1")
        assert (local_cluster.store_root("s0-h1") / "steps" / f"{2:012d}.json").is_file()
        # The copies the wiped host held for its peers are made again in the background.
        assert m.wait_for_replication().replicated
        assert [st.replicated for st in m.step_status() if st.step == 2] == [True]
        # An older step too.
        assert_trees_bitwise_equal(states[1], m.restore(1))
        assert m.last_restore_report.bytes_by_tier["peer"] > 0
        assert m.last_restore_report.bytes_by_tier["backup"] == 0
    assert_every_blob_verifies(local_cluster)


def test_a_whole_slice_wiped_restores_from_the_other_slice(local_cluster):
    state = mixed_state(7)
    with manager(local_cluster) as m:
        m.save(7, state)
        m.wait_until_finished()
        assert m.wait_for_replication().replicated
        for h in ("s1-h0", "s1-h1"):
            local_cluster.wipe(h)
            local_cluster.restart(h)
        assert m.latest_step() == 7
        assert_trees_bitwise_equal(state, m.restore())
        rep = m.last_restore_report
        need = own_blobs(local_cluster, state)
        assert rep.bytes_by_tier["peer"] == sum(sum(need[h].values()) for h in ("s1-h0", "s1-h1"))
        assert rep.bytes_by_tier["backup"] == 0
        for h in ("s1-h0", "s1-h1"):
            assert set(need[h]) <= blobs_on_disk(local_cluster, h)


def test_one_slice_of_four_hosts_copies_every_blob_to_a_neighbour(ramdisk):
    with LocalCluster(ramdisk / "c", 1, 4, devices_per_host=2) as cluster:
        states = {1: split_state(1)}
        own = own_blobs(cluster, states[1])
        with manager(cluster) as m:
            m.save(1, states[1])
            m.wait_until_finished()
            rep = m.wait_for_replication()
            sizes = {b: n for share in own.values() for b, n in share.items()}
            # No twins: every blob is copied once, to another host.
            assert rep.complete and rep.replicated
            assert (rep.moved_blobs, rep.moved_bytes) == (len(sizes), sum(sizes.values()))
            writer = {b: h for h, share in own.items() for b in share}
            for b in sizes:
                holders = {h for h in cluster.hosts if b in blobs_on_disk(cluster, h)}
                assert len(holders) == 2 and writer[b] in holders, (b, holders)
            received = [sum(sizes[b] for b in blobs_on_disk(cluster, h) - set(own[h])) for h in cluster.hosts]
            assert max(received) - min(received) <= max(sizes.values()), received  # spread evenly
            # Wipe each host in turn; each time the step comes back bit for bit from the peers.
            for i, victim in enumerate(cluster.hosts):
                cluster.wipe(victim)
                cluster.restart(victim)
                assert m.latest_step() == 1
                assert_trees_bitwise_equal(states[1], m.restore())
                rep = m.last_restore_report
                assert rep.bytes_by_tier["peer"] == sum(own[victim].values()), victim
                assert rep.bytes_by_tier["backup"] == 0
                assert m.wait_for_replication().replicated, victim  # before the next host is lost
        assert_every_blob_verifies(cluster)


def test_replication_that_reads_a_rotten_sole_copy_removes_it_and_says_the_step_lost_it(ramdisk):
    with LocalCluster(ramdisk / "c", 1, 4, devices_per_host=2) as cluster:
        state = split_state(9)
        own = own_blobs(cluster, state)
        with manager(cluster) as m:
            m.save(9, state)
            m.wait_until_finished()
            assert m.wait_for_replication().replicated
            receiver = "s0-h2"
            blob = sorted(blobs_on_disk(cluster, receiver) - set(own[receiver]))[0]  # a copy it holds for a peer
            writer = next(h for h, share in own.items() if blob in share)
            cluster.wipe(receiver)
            cluster.restart(receiver)
            flip_byte(cluster.store_root(writer) / "blobs" / blob)  # the only copy left rots
            m.save(10, state)  # unchanged: the writer keeps its (rotten) blob, nothing is rewritten
            m.wait_until_finished()
            rrep = m.wait_for_replication()  # copying it to a second host reads it, finds it bad
            assert rrep.step == 10 and rrep.removed_bad_copies == 1 and rrep.bad_copies == 1, rrep
            assert rrep.attempts >= 2 and not rrep.replicated, rrep  # looked again after the removal
            assert blob not in blobs_on_disk(cluster, writer)
            assert_every_blob_verifies(cluster)
            assert [(s.step, s.restorable, s.min_copies) for s in m.step_status()] == [(9, False, 0), (10, False, 0)]
            with pytest.raises(StepNotFoundError, match="not every blob of it has a copy on some host"):
                m.restore(10)  # said before a byte is read: no other tier holds it (no backup here)


def test_two_slices_data_parallel_replication_moves_no_blob_bytes(local_cluster):
    with manager(local_cluster) as m:
        for step in (1, 2, 3):
            state = data_parallel_state(step)
            m.save(step, state)
            m.wait_until_finished()
            rep = m.wait_for_replication()
            assert rep.step == step
            assert (rep.planned_blobs, rep.moved_blobs, rep.moved_bytes) == (0, 0, 0), rep
            assert rep.complete and rep.replicated
            # Each host holds exactly what it wrote (the kept steps'), nothing copied in.
            own = own_blobs(local_cluster, state)
            for h in local_cluster.hosts:
                assert set(own[h]) <= blobs_on_disk(local_cluster, h)
        kept = [own_blobs(local_cluster, data_parallel_state(s)) for s in (2, 3)]
        for h in local_cluster.hosts:
            assert blobs_on_disk(local_cluster, h) == set(kept[0][h]) | set(kept[1][h]), h
        assert_trees_bitwise_equal(data_parallel_state(3), m.restore())


def test_a_bad_peer_copy_is_skipped_for_another_holder_repaired_and_no_good_copy_fails_clearly(ramdisk):
    with LocalCluster(ramdisk / "c", 1, 4, devices_per_host=2) as cluster:
        state = split_state(5)
        need = own_blobs(cluster, state)["s0-h0"]
        with manager(cluster, replication_factor=3) as m:
            m.save(5, state)
            m.wait_until_finished()
            assert m.wait_for_replication().replicated
            others = {b: sorted(h for h in cluster.hosts[1:] if b in blobs_on_disk(cluster, h)) for b in need}
            assert all(len(hs) == 2 for hs in others.values()), others
            cluster.wipe("s0-h0")
            cluster.restart("s0-h0")
            # Corrupt every copy on one holder. The pulls start with the least loaded holder (ties by
            # name), so the first blob is asked of the first holder by name: make that one bad.
            bad_holder = min(hs[0] for hs in others.values())
            for b, hs in others.items():
                if bad_holder in hs:
                    flip_byte(cluster.store_root(bad_holder) / "blobs" / b)
            assert_trees_bitwise_equal(state, m.restore())
            rep = m.last_restore_report
            assert rep.skipped_copies and all(f"s0-h0 <- {bad_holder}" in s and "corrupt" in s
                                              for s in rep.skipped_copies), rep.skipped_copies
            assert all(f"{bad_holder} found its copy corrupt and removed it" in s for s in rep.skipped_copies)
            assert rep.bytes_by_tier["peer"] == sum(need.values())
            assert not any(b.startswith(".tmp-") for b in blobs_on_disk(cluster, "s0-h0"))
            # Repaired: the holder dropped the corrupt copies it was asked for (a copy nobody reads
            # stays undetected until someone does), and the replication that follows a refill
            # copied good ones back: three copies of every blob again, the repaired ones good.
            asked = {b for b, hs in others.items() if bad_holder in hs and any(b in s for s in rep.skipped_copies)}
            assert asked
            rrep = m.wait_for_replication()
            assert rrep.replicated and rrep.moved_blobs >= len(asked), rrep
            # Three good copies of each repaired blob again (on the repaired holder or on another: the
            # plan spreads the copies it makes), and no corrupt copy left anywhere.
            for b in asked:
                holders = [h for h in cluster.hosts if b in blobs_on_disk(cluster, h)]
                assert len(holders) == 3, (b, holders)
                assert all(blob_name((cluster.store_root(h) / "blobs" / b).read_bytes()) == b for h in holders)
            assert all(s.replicated and s.min_copies == 3 for s in m.step_status())

            # Now no good copy is left of one shard of "w" anywhere but on the host that is lost.
            victim = next(b for b in sorted(need) if bad_holder in others[b])
            holding = [h for h in cluster.hosts[1:] if victim in blobs_on_disk(cluster, h)]  # as re-replicated
            for h in holding:
                flip_byte(cluster.store_root(h) / "blobs" / victim)
            cluster.wipe("s0-h0")
            cluster.restart("s0-h0")
            with pytest.raises(CorruptBlobError) as err:
                m.restore()
            msg = str(err.value)
            manifest = m._dispatch.manifest(5)
            rec, shard = next((r, s) for r in manifest.arrays for s in r.shards if s.blob == victim)
            for part in (f"array {rec.key!r}", "[" + ", ".join(f"{a}:{b}" for a, b in shard.box) + "]", victim,
                         "tiers tried: ram", "peer (", "backup (", *holding, "corrupt"):
                assert part in msg, (part, msg)


# --- the peer port ---------------------------------------------------------------------------------


def test_daemon_peer_port_refuses_bad_requests_and_keeps_serving(local_cluster):
    with manager(local_cluster) as m:
        m.save(1, mixed_state(1))
        m.wait_until_finished()
    held = sorted(blobs_on_disk(local_cluster, "s0-h0"))
    addr = protocol.parse_address(local_cluster.peer_address("s0-h0"))

    def refused(data: bytes, match: str) -> None:
        with socket.create_connection(addr, timeout=10) as s:
            s.sendall(data)
            reply = protocol.recv_reply(s)
            assert reply.error is not None and match in reply.error.message, reply
            try:
                assert s.recv(1) == b""  # and the connection is closed
            except ConnectionResetError:
                pass

    def req(op: str, args: dict) -> bytes:
        # A peer of this mtc version (what a current sidecar sends besides its own arguments).
        args = {"mtc": version.MTC_VERSION, "protocol": version.PROTOCOL_VERSION, **args}
        return protocol.frame_head(protocol.Request(op, 1, args).header(), [])

    refused(req("get", {"blob": held[0]}), "without a peer token")
    refused(req("get", {"blob": held[0], "token": "f" * 64}), "wrong peer token")
    refused(req("get", {"blob": held[0], "token": local_cluster.peer_token, "mtc": "0.0.9"}),
            f"peer runs mtc 0.0.9 protocol {version.PROTOCOL_VERSION}, this sidecar mtc {version.MTC_VERSION}")
    refused(req("get", {"blob": held[0], "token": local_cluster.peer_token, "protocol": 0}), "protocol 0")
    refused(req("get", {"blob": "../../../etc/passwd", "token": local_cluster.peer_token}), "invalid blob name")
    refused(req("have", {"blobs": ["../steps/000000000001.json"], "token": local_cluster.peer_token}),
            "invalid blob name")
    refused(protocol.MAGIC + struct.pack("!I", 1 << 30), "over the limit")
    refused(b"\x00" * 64, "not an mtc frame")
    with pytest.raises(ConfigError, match=ENV_TOKEN):
        PeerClient(local_cluster.peer_address("s0-h0"), "e" * 64).have(held)
    with PeerClient(local_cluster.peer_address("s0-h0"), local_cluster.peer_token) as c:
        assert c.have(held) == set(held)
    assert "refused a peer request" in local_cluster.log_path("s0-h0").read_text()
    # The token reaches the daemons in their environment, never on a command line that ps shows.
    for pid in local_cluster.pids().values():
        assert local_cluster.peer_token not in " ".join(psutil.Process(pid).cmdline())


def test_colocated_sidecar_runs_a_peer_service_while_the_manager_is_open(ramdisk):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = "c0ffee" * 8
    state = {"x": put(random_array(np.random.default_rng(0), (16, 8), np.float32), P("data", "model")), "step": 1}
    with CheckpointManager(MTCConfig(local_checkpoint_directory=str(ramdisk), local_checkpoint_period=1,
                                     peer_port=port, peer_token=token)) as m:
        m.save(1, state)
        m.wait_until_finished()
        (fp,) = m._dispatch.fingerprints().values()
        assert fp["peer"].endswith(f":{port}")
        names = {p.name for p in (ramdisk / "mtc" / "blobs").iterdir()}
        with PeerClient(f"127.0.0.1:{port}", token) as c:
            assert c.have(names) == names
        assert m.wait_for_replication() is None  # one host: nowhere to copy to
        assert_trees_bitwise_equal(state, m.restore())
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
