"""The bucket goes away in the middle of backups: training goes on, the backup is retried and
completes when the server returns, and no half backup is ever listed."""

from __future__ import annotations

import uuid

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from helpers import assert_trees_bitwise_equal
from mtc.head import CheckpointManager, MTCConfig
from mtc.shared import backup_layout
from mtc.shared import format as fmt
from mtc.shared.objstore import open_store

pytestmark = pytest.mark.integration


def state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    sh = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
    return {"w": jax.device_put(rng.standard_normal((1 << 18,), dtype=np.float32), sh)}


def test_emulator_outage_during_backup(ramdisk, emulator_factory, monkeypatch):
    server = emulator_factory("fake-gcs-server", persistent=True)
    bucket = f"mtc-{uuid.uuid4().hex[:12]}"
    server.client().create_bucket(bucket)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.url)
    cfg = MTCConfig(local_checkpoint_directory=str(ramdisk), enable_multi_tier_checkpointing=True,
                    local_checkpoint_period=1, base_output_directory=f"gs://{bucket}", run_name="run",
                    multi_tier_checkpointing_backup_interval_steps=1)
    with CheckpointManager(cfg) as m:
        m.save(1, state(1))
        m.wait_until_finished()
        assert m.wait_for_backup().error is None

        server.stop()  # the bucket vanishes
        m.save(2, state(2))
        m.wait_until_finished()  # the local save is unaffected
        # The backup of step 2 is now retrying against a dead server. Training goes on:
        m.save(3, state(3))
        m.wait_until_finished()
        assert m._cluster_steps()[-2:] == [2, 3]
        assert m.is_backing_up()

        server.start()  # same port, same objects
        report = m.wait_for_backup()
        assert report.error is None and report.step == 2, report
        # Step 3's backup was due while step 2's ran: skipped, and said so by the next one.
        m.save(4, state(4))
        m.wait_until_finished()
        report = m.wait_for_backup()
        assert report.step == 4 and report.skipped_because_running == 1

    st = open_store(f"gs://{bucket}/run/mtc")
    listed = backup_layout.names_from_listing(st.list(backup_layout.BACKUPS))
    assert [backup_layout.parse_backup_name(n) for n in listed] == [4, 2, 1]
    blobs = {o.split("/")[-1] for o in st.list(backup_layout.BLOBS)}
    for n in listed:  # every listed backup is whole
        assert fmt.StepManifest.from_json(st.get_bytes(backup_layout.manifest_object(n))).blob_names() <= blobs
    import shutil

    shutil.rmtree(ramdisk / "mtc")
    with CheckpointManager(cfg) as m:
        assert_trees_bitwise_equal(state(4), m.restore())
        assert m.last_restore_report.bytes_by_tier["backup"] == (1 << 18) * 4


@pytest.mark.parametrize("mode", ["colocated", "cluster"])
def test_a_restart_during_a_bucket_outage_comes_back_from_the_ramdisks(ramdisk, emulator_factory, monkeypatch, mode):
    """The job restarts while the bucket is down: latest_step and restore answer from the hosts
    within the listing deadline (not the uploads' 300 s), with a warning; a bucket that refuses
    (it does not exist) is still an error, not silence."""
    import time

    import mtc.head.restore.restorer as restorer_mod
    from mtc.shared.objstore import FatalStoreError
    from mtc.sidecar.local_cluster import LocalCluster

    monkeypatch.setattr(restorer_mod, "LISTING_DEADLINE_S", 2.0)
    server = emulator_factory("fake-gcs-server", persistent=True)
    bucket = f"mtc-{uuid.uuid4().hex[:12]}"
    server.client().create_bucket(bucket)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.url)
    cluster = LocalCluster(ramdisk / "c", 1, 2, devices_per_host=4).start() if mode == "cluster" else None
    root = str(cluster.root) if cluster else str(ramdisk)
    spec = {"cluster_spec": str(cluster.spec_path)} if cluster else {}
    cfg = MTCConfig(local_checkpoint_directory=root, enable_multi_tier_checkpointing=True, local_checkpoint_period=1,
                    base_output_directory=f"gs://{bucket}", run_name="run",
                    multi_tier_checkpointing_backup_interval_steps=1, **spec)
    try:
        with CheckpointManager(cfg) as m:
            m.save(1, state(1))
            m.wait_until_finished()
            assert m.wait_for_backup().error is None
            m.save(2, state(2))  # on the hosts; its backup may or may not land
            m.wait_until_finished()
        server.stop()
        with CheckpointManager(cfg) as m:
            t0 = time.monotonic()
            assert m.latest_step() == 2
            assert_trees_bitwise_equal(state(2), m.restore())
            assert time.monotonic() - t0 < 30, "waited out the store's upload deadline"
            assert m.last_restore_report.bytes_by_tier["backup"] == 0
        server.start()
        if cluster is None:  # (a daemon keeps the backup root it first served)
            with CheckpointManager(cfg.replace(base_output_directory=f"gs://no-such-{uuid.uuid4().hex[:8]}")) as m:
                with pytest.raises(FatalStoreError):
                    m.latest_step()
    finally:
        if cluster:
            cluster.stop()


@pytest.mark.parametrize("mode,prefetch", [("colocated", False), ("colocated", True), ("cluster", True)])
def test_a_restart_during_a_bucket_outage_waits_out_the_listing_deadline_once(ramdisk, emulator_factory, monkeypatch,
                                                                             mode, prefetch):
    """Found by the soak (gcs_outage_head_restart): a new head's start-up pull, latest_step,
    all_steps and restore each listed the backups and each waited the full deadline (30 s), so a
    restart that had everything in RAM took 150 s. Only the first listing in an outage waits it;
    the next ones try briefly, and a store that answers again is listed in full at once. In cluster
    mode the start-up pull's listing and the first latest_step()'s share the host's connection:
    the second waited for the first, then for a whole deadline of its own."""
    import time

    import mtc.head.restore.restorer as restorer_mod
    from mtc.sidecar.local_cluster import LocalCluster

    monkeypatch.setattr(restorer_mod, "LISTING_DEADLINE_S", 6.0)
    server = emulator_factory("fake-gcs-server", persistent=True)
    bucket = f"mtc-{uuid.uuid4().hex[:12]}"
    server.client().create_bucket(bucket)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.url)
    cluster = LocalCluster(ramdisk / "c", 1, 1, devices_per_host=8).start() if mode == "cluster" else None
    spec = {"cluster_spec": str(cluster.spec_path)} if cluster else {}
    cfg = MTCConfig(local_checkpoint_directory=str(cluster.root if cluster else ramdisk),
                    enable_multi_tier_checkpointing=True, local_checkpoint_period=1,
                    base_output_directory=f"gs://{bucket}", run_name="run",
                    multi_tier_checkpointing_backup_interval_steps=1, **spec)
    try:
        with CheckpointManager(cfg.replace(prefetch_on_start=False)) as m:
            m.save(1, state(1))
            m.wait_until_finished()
            assert m.wait_for_backup().error is None
        server.stop()
        t0 = time.monotonic()
        with CheckpointManager(cfg.replace(prefetch_on_start=prefetch)) as m:
            assert m.latest_step() == 1
            first = time.monotonic() - t0
            assert first < 10.0, f"the first latest_step took {first:.1f} s: it waited out the deadline twice"
            t1 = time.monotonic()
            assert m.all_steps() == [1]
            assert m.latest_step() == 1
            assert_trees_bitwise_equal(state(1), m.restore())
            later = time.monotonic() - t1
            assert first >= 5.0, first  # the first listing did wait for the store
            assert later < 11.0, f"three more calls took {later:.1f} s: each waited out the listing deadline again"
            server.start()
            assert [b["step"] for b in m.backups()] == [1]  # the store is back: listed again
            assert m.latest_step() == 1
    finally:
        if cluster:
            cluster.stop()
