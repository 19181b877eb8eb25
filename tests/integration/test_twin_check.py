"""The twin check: data-parallel replicas of one box that hold different bytes are named at save.

An array is built from per-device buffers (``jax.make_array_from_single_device_arrays``) with one
replica's copy one flipped bit away from the others: silent data corruption on one device. Cluster
mode runs real sidecar daemons (2 slices x 2 hosts x 2 devices), where the replicas of a box live on
hosts of both slices; colocated mode runs in this process (one host holding all 8 devices).
"""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import assert_trees_bitwise_equal, random_array
from mtc.head import CheckpointManager, MTCConfig
from mtc.head.dispatch.cluster.dispatcher import ClusterDispatcher
from mtc.head.twin_check import TwinMismatchError
from mtc.shared.buffers import byte_view
from mtc.shared.hashing import blob_name

pytestmark = pytest.mark.integration

# Device ids -> host, as the cluster topology assigns them (devices sorted by id, 2 per host).
HOST_OF_DEVICE = {0: "s0-h0", 1: "s0-h0", 2: "s0-h1", 3: "s0-h1", 4: "s1-h0", 5: "s1-h0", 6: "s1-h1", 7: "s1-h1"}
W_KEY = "['params']['w']"


def mesh() -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))


def flip_bit(a: np.ndarray) -> np.ndarray:
    out = np.array(a, copy=True)
    out.reshape(-1).view(np.uint8)[out.nbytes // 2] ^= 0x10
    return out


def build(value: np.ndarray, sharding: NamedSharding, bad_device: int | None = None) -> jax.Array:
    """``value`` sharded by ``sharding`` from per-device buffers; ``bad_device``'s copy has one bit flipped."""
    arrays = []
    for dev, idx in sharding.addressable_devices_indices_map(value.shape).items():
        part = np.ascontiguousarray(value[idx])
        arrays.append(jax.device_put(flip_bit(part) if dev.id == bad_device else part, dev))
    return jax.make_array_from_single_device_arrays(value.shape, sharding, arrays)


def make_state(seed: int, bad_device: int | None = None, spec: P = P("model")) -> dict:
    rng = np.random.default_rng(seed)
    m = mesh()
    return {
        "params": {
            # P("model"): rows in 4 boxes, each held by device j (slice 0) and device 4 + j (slice 1)
            "w": build(random_array(rng, (8, 16), np.float32), NamedSharding(m, spec), bad_device),
            "b": jax.device_put(random_array(rng, (16,), np.int8), NamedSharding(m, P())),
            "e": jax.device_put(random_array(rng, (4, 8), np.float32), NamedSharding(m, P("data", "model"))),
        },
        "lr": np.float32(seed / 8),
        "step": seed,
    }


class OwnCopies(ClusterDispatcher):
    """Sends each host its own devices' copies of its boxes, as a Pathways host copies its own
    devices' shards. (Cluster mode's staging copies each box once and sends that copy to every
    host that holds it, so a differing replica on another host would never reach a sidecar.)"""

    def stage(self, leaves):
        staged = super().stage(leaves)
        for leaf in leaves:
            if leaf.kind != "jax":
                continue
            own = {}
            for shard in leaf.value.addressable_shards:
                key = (self.topology.host_of(shard.device.id), leaf.device_boxes[shard.device.id])
                if key not in own:
                    own[key] = np.array(shard.data, copy=True)
            for h, items in staged.shards.items():
                staged.shards[h] = [(a, box, own.get((h, box), buf) if a == leaf.index else buf)
                                    for a, box, buf in items]
        return staged


def cluster_config(cluster, **kw) -> MTCConfig:
    return MTCConfig(local_checkpoint_directory=str(cluster.root), cluster_spec=str(cluster.spec_path),
                     local_checkpoint_period=1, prefetch_on_start=False, **kw)


def committed_on_disk(root, step: int) -> list:
    return sorted(root.rglob(f"steps/{step:012d}.json")) + sorted(root.rglob(f"pending/{step:012d}"))


def shard_blob(arr: jax.Array, device_id: int) -> str:
    (shard,) = [s for s in arr.addressable_shards if s.device.id == device_id]
    return blob_name(byte_view(np.ascontiguousarray(np.asarray(shard.data))))


def test_cross_host_mismatch_warn_names_it_and_skips_the_step(local_cluster, caplog):
    cfg = cluster_config(local_cluster)
    assert cfg.twin_check == "warn"
    with CheckpointManager(cfg, dispatcher=OwnCopies(cfg)) as m:
        m.save(1, make_state(1))
        m.wait_until_finished()
        assert m.last_save_report.committed and m.last_save_report.twin_mismatches == ()
        bad = make_state(2, bad_device=5)
        with caplog.at_level(logging.WARNING, logger="mtc.head.twin_check"):
            m.save(2, bad)
            m.wait_until_finished()  # warn: the save is skipped, not failed
        report = m.last_save_report
        assert report.step == 2 and not report.committed
        (mm,) = report.twin_mismatches
        assert mm.array == W_KEY and mm.box == ((2, 4), (0, 16)) and mm.hosts == ("s0-h0", "s1-h0")
        by_blob = {c.blob: c for c in mm.copies}
        good, flipped = by_blob[shard_blob(bad["params"]["w"], 1)], by_blob[shard_blob(bad["params"]["w"], 5)]
        assert (good.hosts, good.devices) == (("s0-h0",), (1,))
        assert (flipped.hosts, flipped.devices) == (("s1-h0",), (5,))
        (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
        for word in (W_KEY, "[2:4, 0:16]", "s0-h0", "s1-h0", "devices 5", "not committed"):
            assert word in warning.getMessage()
        assert m.latest_step() == 1 and committed_on_disk(local_cluster.root, 2) == []
        m.save(3, make_state(3))  # training goes on; the next good step commits
        m.wait_until_finished()
        assert m.last_save_report.committed and m.all_steps() == [1, 3]
        assert_trees_bitwise_equal(m.restore(3), make_state(3))


def test_cross_host_mismatch_fail_aborts_the_save(local_cluster):
    cfg = cluster_config(local_cluster, twin_check="fail")
    with CheckpointManager(cfg, dispatcher=OwnCopies(cfg)) as m:
        m.save(1, make_state(1))
        m.wait_until_finished()
        m.save(2, make_state(2, bad_device=6))  # box [4:6] of w: devices 2 (s0-h1) and 6 (s1-h1)
        with pytest.raises(TwinMismatchError) as info:
            m.wait_until_finished()
        text = str(info.value)
        for word in ("save of step 2 failed", W_KEY, "[4:6, 0:16]", "s0-h1 (devices 2)", "s1-h1 (devices 6)",
                     "twin_check=fail"):
            assert word in text
        assert sorted(info.value.hosts) == ["s0-h1", "s1-h1"] and info.value.step == 2
        assert m.last_save_report.step == 1
        assert m.latest_step() == 1 and committed_on_disk(local_cluster.root, 2) == []
        assert_trees_bitwise_equal(m.restore(), make_state(1))


def test_unsent_replica_found_by_the_hash_pass(local_cluster):
    """Stock cluster staging sends one copy per box; ``twin_check_hash`` hashes the others on the head."""
    cfg = cluster_config(local_cluster, twin_check="fail", twin_check_hash=True)
    with CheckpointManager(cfg) as m:
        bad = make_state(1, bad_device=7)  # box [6:8]: device 3 (s0-h1) is sent to both hosts; 7 differs
        m.save(1, bad)
        with pytest.raises(TwinMismatchError) as info:
            m.wait_until_finished()
        (mm,) = info.value.mismatches
        assert mm.array == W_KEY and mm.box == ((6, 8), (0, 16))
        flipped = [c for c in mm.copies if c.blob == shard_blob(bad["params"]["w"], 7)]
        assert [(c.hosts, c.devices) for c in flipped] == [(("s1-h1",), (7,))]
        assert m.latest_step() is None and committed_on_disk(local_cluster.root, 1) == []


SPECS = [P(), P("model"), P("data"), P(None, "model"), P(("data", "model")), P("model", "data")]


def test_identical_replicas_never_trip_it_in_cluster_mode(local_cluster):
    cfg = cluster_config(local_cluster, twin_check="fail", twin_check_hash=True, local_max_to_keep=len(SPECS))
    with CheckpointManager(cfg, dispatcher=OwnCopies(cfg)) as m:
        for step, spec in enumerate(SPECS, start=1):
            m.save(step, make_state(step, spec=spec))
            m.wait_until_finished()
            assert m.last_save_report.committed and m.last_save_report.twin_mismatches == ()
        assert m.all_steps() == list(range(1, len(SPECS) + 1))
        for step, spec in enumerate(SPECS, start=1):
            assert_trees_bitwise_equal(m.restore(step), make_state(step, spec=spec))


# --- colocated mode, in this process: every replica on one host ------------------------------------


def colocated_config(ramdisk, **kw) -> MTCConfig:
    return MTCConfig(local_checkpoint_directory=str(ramdisk), local_checkpoint_period=1, prefetch_on_start=False, **kw)


def test_colocated_hash_pass_fail(ramdisk):
    with CheckpointManager(colocated_config(ramdisk, twin_check="fail", twin_check_hash=True)) as m:
        m.save(1, make_state(1))
        m.wait_until_finished()
        bad = make_state(2, bad_device=4, spec=P())  # replicated: device 0's copy is written, 4 differs
        m.save(2, bad)
        with pytest.raises(TwinMismatchError) as info:
            m.wait_until_finished()
        (mm,) = info.value.mismatches
        assert mm.array == W_KEY and mm.box == ((0, 8), (0, 16))
        by_blob = {c.blob: c for c in mm.copies}
        assert by_blob[shard_blob(bad["params"]["w"], 4)].devices == (4,)
        assert by_blob[shard_blob(bad["params"]["w"], 0)].devices == (0, 1, 2, 3, 5, 6, 7)
        assert "devices 4" in str(info.value) and "not committed" in str(info.value)
        assert m.latest_step() == 1 and committed_on_disk(ramdisk, 2) == []


def test_colocated_hash_pass_warn_and_identical_replicas(ramdisk):
    cfg = colocated_config(ramdisk, twin_check_hash=True, local_max_to_keep=len(SPECS) + 1)
    with CheckpointManager(cfg) as m:
        m.save(1, make_state(1, bad_device=2))  # P("model"): box [4:6], devices 2 and 6
        m.wait_until_finished()
        report = m.last_save_report
        assert not report.committed
        assert [(x.array, x.box) for x in report.twin_mismatches] == [(W_KEY, ((4, 6), (0, 16)))]
        assert m.latest_step() is None and committed_on_disk(ramdisk, 1) == []
        for step, spec in enumerate(SPECS, start=2):
            m.save(step, make_state(step, spec=spec))
            m.wait_until_finished()
            assert m.last_save_report.committed and m.last_save_report.twin_mismatches == ()
        for step, spec in enumerate(SPECS, start=2):
            assert_trees_bitwise_equal(m.restore(step), make_state(step, spec=spec))
