"""A blob whose only peer copy is corrupt and whose step has no backup comes from an older backup
that holds the same bytes.

Found by the soak (tests/chaos/soak.py, flip_peer_copy): a host was replaced, the peer copy of one of
its blobs was corrupt, and the step had no backup of its own; the blob (an array that had not changed
since an earlier step) was in that earlier step's backup, yet the restore failed with "backup (no backup
of this step)". Blobs are content-addressed and shared by every backup, so a backup of another step that
lists the blob is as good a source.

The head asks a host which of the blobs it looks for each backup lists; it never reads a backup's
manifest itself (a spy on the host-part parser in the head's process counts the parts of backups it
parses: none).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from helpers import assert_trees_bitwise_equal, random_array
from mtc.head import CheckpointManager, MTCConfig
from mtc.shared import format as fmt
from mtc.shared.hashing import blob_name
from mtc.sidecar.local_cluster import LocalCluster

pytestmark = pytest.mark.integration


@pytest.fixture
def backup_parts_parsed(monkeypatch):
    """The parts of backup manifests the head has parsed (the sidecars parse theirs in their own processes)."""
    seen = []
    real = fmt.PartColumns.from_json.__func__

    def counting(cls, data, **kw):
        if "backup" in kw.get("source", ""):
            seen.append(kw["source"])
        return real(cls, data, **kw)

    monkeypatch.setattr(fmt.PartColumns, "from_json", classmethod(counting))
    return seen


def test_corrupt_only_peer_copy_of_an_unchanged_blob_comes_from_an_older_backup(ramdisk, tmp_path,
                                                                                 backup_parts_parsed):
    rng = np.random.default_rng(0)
    frozen = random_array(rng, (8, 1024), np.float32)  # the same in every step
    sh = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))  # one row per device

    def state(step: int) -> dict:
        return {"frozen": jax.device_put(frozen, sh),
                "w": jax.device_put(random_array(np.random.default_rng(step), (8, 1024), np.float32), sh)}

    with LocalCluster(ramdisk / "cluster", 2, 1, devices_per_host=4) as cluster:
        cfg = MTCConfig(local_checkpoint_directory=str(ramdisk), cluster_spec=str(cluster.spec_path),
                        local_checkpoint_period=1, base_output_directory=str(tmp_path / "backup"), run_name="r",
                        multi_tier_checkpointing_backup_interval_steps=100)  # only the first step is backed up
        with CheckpointManager(cfg) as m:
            m.save(1, state(1))
            m.wait_until_finished()
            assert m.wait_for_backup().step == 1
            two = state(2)
            m.save(2, two)
            m.wait_until_finished()
            assert m.wait_for_replication().replicated
            assert [b["step"] for b in m.backups()] == [1]
        # s1-h0 holds rows 4..7 (devices 4..7); s0-h0 keeps the peer copies of them. Corrupt the copy
        # of row 4 of the unchanged array, then replace s1-h0.
        blob = blob_name(np.ascontiguousarray(frozen[4:5]).tobytes())
        copy = cluster.store_root("s0-h0") / "blobs" / blob
        data = bytearray(copy.read_bytes())
        data[100] ^= 0x01
        copy.write_bytes(bytes(data))
        cluster.wipe("s1-h0")
        cluster.restart("s1-h0")
        with CheckpointManager(cfg.replace(prefetch_on_start=False)) as m:
            assert m.latest_step() == 2
            assert_trees_bitwise_equal(two, m.restore(2), check_sharding=True)
            rep = m.last_restore_report
            assert rep.bytes_by_tier["backup"] == 4096 and rep.bytes_by_tier["peer"] > 0, rep
        assert backup_parts_parsed == [], f"the head read backup manifests: {backup_parts_parsed}"


def test_a_step_whose_lost_blobs_are_in_an_older_backup_is_still_the_latest(ramdisk, tmp_path, backup_parts_parsed):
    """Found by the soak (slice_lost right after a restore from the backup, replication still running):
    the lost slice's blobs of the newest step were all unchanged since a backed-up step, yet the restore
    chose that older backup, losing the newest committed step."""
    import json

    from mtc.head.dispatch.cluster.dispatcher import ClusterDispatcher

    rng = np.random.default_rng(1)
    frozen = random_array(rng, (8, 512), np.float32)
    devices = sorted(jax.devices(), key=lambda d: d.id)

    def shardings(devs):
        mesh = Mesh(np.array(devs), ("x",))
        return {"frozen": NamedSharding(mesh, P("x")), "w": NamedSharding(mesh, P())}

    def state(step: int, devs) -> dict:
        sh = shardings(devs)
        w = random_array(np.random.default_rng(step), (64, 64), np.float32)
        return {"frozen": jax.device_put(frozen, sh["frozen"]), "w": jax.device_put(w, sh["w"])}

    with LocalCluster(ramdisk / "cluster", 2, 1, devices_per_host=4) as cluster:
        cfg = MTCConfig(local_checkpoint_directory=str(ramdisk), cluster_spec=str(cluster.spec_path),
                        local_checkpoint_period=1, base_output_directory=str(tmp_path / "backup"), run_name="r",
                        multi_tier_checkpointing_backup_interval_steps=100, replication_factor=1)
        with CheckpointManager(cfg) as m:
            m.save(1, state(1, devices))
            m.wait_until_finished()
            assert m.wait_for_backup().step == 1
            m.save(2, state(2, devices))  # only "w" changed; it is whole on every host (replicated)
            m.wait_until_finished()
        cluster.kill("s1-h0")  # slice 1 lost: its halves of "frozen" are only in the backup of step 1
        spec = json.loads(cluster.spec_path.read_text())
        sub = tmp_path / "slice0.json"
        sub.write_text(json.dumps({**spec, "hosts": [h for h in spec["hosts"] if h["slice"] == 0]}))
        small = cfg.replace(cluster_spec=str(sub), prefetch_on_start=False)
        live = devices[:4]
        with CheckpointManager(small, dispatcher=ClusterDispatcher(small, devices=live)) as m:
            assert m.latest_step() == 2
            target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s)
                      for (k, v), s in zip(state(2, live).items(), shardings(live).values())}
            assert_trees_bitwise_equal(state(2, live), m.restore(2, target=target), check_sharding=True)
            assert m.last_restore_report.bytes_by_tier["backup"] == 4 * 512 * 4
        assert backup_parts_parsed == [], f"the head read backup manifests: {backup_parts_parsed}"
