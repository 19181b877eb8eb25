"""Two finalizes of one backup from the same head, racing: the head gives up on the first (its call
times out) while that one keeps running on its host, stalled at the store, and the finalize runs again
on another host; then the head's next backup finalizes. The first one, left to go on from what it
listed before the stall, deletes the next backup's blobs (they were not in the backups it listed), and
that backup is listed as complete without them. Its head's lease does not stop it: both finalizes come
from the same head. Real sidecar daemons, the real local store behind a wrapper that stalls one
operation (tests/integration/stalling_store_sidecar.py); restores from the backup compared bit for bit.
"""

from __future__ import annotations

import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from helpers import assert_trees_bitwise_equal
from mtc.head import CheckpointManager, MTCConfig
from mtc.head.backup.plan import assign_uploads
from mtc.head.dispatch.cluster.dispatcher import ClusterDispatcher
from mtc.shared import backup_layout as layout
from mtc.shared import format as fmt
from mtc.shared.errors import HostUnreachableError
from mtc.shared.objstore import open_store
from mtc.sidecar.local_cluster import LocalCluster
from stalling_store_sidecar import launch_with, read_control, release, set_control

pytestmark = pytest.mark.integration


def state(step: int) -> dict:
    rng = np.random.default_rng(step)
    sh = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
    return {"w": jax.device_put(rng.standard_normal(1 << 14, dtype=np.float32), sh),
            "b": jax.device_put(rng.standard_normal((8, 64), dtype=np.float32), sh)}


def target() -> dict:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state(0))


def _until(cond, what: str, timeout: float = 60.0) -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{what} did not happen within {timeout:.0f} s")
        time.sleep(0.05)


def test_a_finalize_the_head_gave_up_on_leaves_one_complete_backup_and_the_next_one_whole(ramdisk, tmp_path):
    bucket = tmp_path / "bucket"
    control = tmp_path / "store-control.json"
    set_control(control)
    with LocalCluster(ramdisk / "c", 1, 2, devices_per_host=4, launch=launch_with(control)) as cluster:
        h0, h1 = cluster.hosts
        # A backup every 2 steps (1, 2, 4, ...), the 2 newest kept: step 3's backup is the test's.
        cfg = MTCConfig(local_checkpoint_directory=str(cluster.root), cluster_spec=str(cluster.spec_path),
                        local_checkpoint_period=1, base_output_directory=str(bucket), run_name="run",
                        multi_tier_checkpointing_backup_interval_steps=2, backup_max_to_keep=2)
        store = open_store(cfg.backup_root)
        with CheckpointManager(cfg) as m:
            for step in (1, 2, 3):
                m.save(step, state(step))
                m.wait_until_finished()
                assert m.wait_for_backup().error is None
            assert [layout.parse_backup_name(n) for n in layout.names_from_listing(store.list(layout.BACKUPS))] \
                == [2, 1]
            head = m._dispatch
            manifest3 = head.manifest(3)
            head.backup_upload(assign_uploads(manifest3, head.hosts(), head.host_of_device))
            name3 = layout.backup_name(3)

            # The first finalize of backup 3, on h0: it makes the backup visible, then its retention
            # stalls at the store (its listing of blobs/). The head gives up on it after 2 s.
            set_control(control, host=h0, op="list", prefix=layout.BLOBS, skip=1, stall=1, release=False)
            impatient = ClusterDispatcher(cfg, devices=jax.devices(), backup_timeout_s=2.0)
            impatient.generation = head.generation  # the same head, on a connection it drops
            try:
                with pytest.raises(HostUnreachableError, match="no answer within 2s"):
                    impatient.backup_finalize(h0, name3, manifest3)
            finally:
                impatient.close()
            assert read_control(control)["stalled"] == 1, "the first finalize did not reach its stall"

            # The finalize runs again, on another host: one backup 3, complete.
            again = head.backup_finalize(h1, name3, manifest3)
            assert again["name"] == name3

            # The head's next backup (step 4, finalized on h0 beside the stalled one).
            out: dict = {}

            def save4() -> None:
                m.save(4, state(4))
                m.wait_until_finished()
                out["report"] = m.wait_for_backup()

            t = threading.Thread(target=save4)
            t.start()
            # Once backup 4's finalize has written anything (its manifest, or whatever it announces
            # itself with), the stalled finalize of backup 3 goes on.
            _until(lambda: any("step-000000000004" in p.name for p in bucket.rglob("*")) or not t.is_alive(),
                   "backup 4's finalize")
            time.sleep(0.5)
            release(control)
            t.join(timeout=120)
            assert not t.is_alive(), "backup 4 did not finish"
            assert out["report"].error is None, out["report"]
            time.sleep(1.0)  # whatever the first finalize still does once released
            log = cluster.log_path(h0).read_text()

        # Exactly one manifest per backup, each with every blob it names; nothing else left in the store.
        names = layout.names_from_listing(store.list(layout.BACKUPS))
        assert [layout.parse_backup_name(n) for n in names] == [4, 3], names
        assert name3 in names
        present = {o[len(layout.BLOBS):] for o in store.list(layout.BLOBS)}
        for n in names:
            m_ = fmt.StepManifest.from_json(store.get_bytes(layout.manifest_object(n)), source=n)
            missing = m_.blob_names() - present
            assert not missing, f"backup {n} is listed without {len(missing)} of its blobs"
        assert {o.split("/")[0] for o in store.list("")} == {"blobs", "backups"}, store.list("")
        store.close()
        # Backup 4's finalize waited for the first one of backup 3, which stopped before pruning anything.
        assert f"waits until the finalize of backup {name3} on host {h0}" in log, log[-3000:]
        assert f"BackupSupersededError: the finalize of backup {name3} on host {h0} stopped" in log, log[-3000:]

        # Every ramdisk lost: both backups restore bit for bit.
        for h in cluster.hosts:
            cluster.wipe(h)
            cluster.restart(h)
        with CheckpointManager(cfg) as m:
            for step in (4, 3):
                assert_trees_bitwise_equal(state(step), m.restore(step, target=target()))
                assert m.last_restore_report.bytes_by_tier["backup"] > 0
