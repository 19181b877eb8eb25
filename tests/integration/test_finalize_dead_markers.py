"""Finalize markers that no finalize keeps alive hold up no backup for long and stop none, with real
sidecar daemons and a real backup folder:

- a host dies (kill -9) in the middle of a finalize under one head; the job goes on without it under the
  next head (an elastic restart onto the hosts left), whose backups must not wait out a two-minute
  abandonment for the dead host's marker;
- a marker planted under ``finalizing/`` with a huge generation (or left by a head whose clock ran ahead
  and that died in a finalize) must not make every later backup fail.

Restores from the backups are compared bit for bit.
"""

from __future__ import annotations

import json
import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from helpers import assert_trees_bitwise_equal
from mtc.head import CheckpointManager, MTCConfig
from mtc.head.dispatch.cluster.dispatcher import ClusterDispatcher
from mtc.shared import backup_layout as layout
from mtc.shared.objstore import open_store
from mtc.sidecar.backup import fence
from mtc.sidecar.local_cluster import LocalCluster
from stalling_store_sidecar import launch_with, read_control, set_control

pytestmark = pytest.mark.integration


def state(step: int, devices: list) -> dict:
    rng = np.random.default_rng(step)
    sh = NamedSharding(Mesh(np.array(devices), ("x",)), P("x"))
    return {"w": jax.device_put(rng.standard_normal(1 << 12, dtype=np.float32), sh),
            "b": jax.device_put(rng.standard_normal((8, 16), dtype=np.float32), sh)}


def target(devices: list) -> dict:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state(0, devices))


def _until(cond, what: str, timeout: float = 60.0) -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{what} did not happen within {timeout:.0f} s")
        time.sleep(0.05)


def _config(cluster: LocalCluster, bucket, spec=None) -> MTCConfig:
    return MTCConfig(local_checkpoint_directory=str(cluster.root), cluster_spec=str(spec or cluster.spec_path),
                     local_checkpoint_period=1, base_output_directory=str(bucket), run_name="run",
                     multi_tier_checkpointing_backup_interval_steps=1, backup_max_to_keep=2)


def test_a_finalize_whose_host_died_under_the_previous_head_holds_up_the_next_heads_backup_for_seconds(
        ramdisk, tmp_path):
    bucket = tmp_path / "bucket"
    control = tmp_path / "store-control.json"
    set_control(control)
    devices = sorted(jax.devices(), key=lambda d: d.id)
    with LocalCluster(ramdisk / "c", 1, 2, devices_per_host=4, launch=launch_with(control)) as cluster:
        h0, h1 = cluster.hosts
        cfg = _config(cluster, bucket)
        store = open_store(cfg.backup_root)
        m = CheckpointManager(cfg)
        try:
            m.save(1, state(1, devices))
            m.wait_until_finished()
            assert m.wait_for_backup().error is None
            # Backup 2's finalize runs on h0 (the first host) and stops at its manifest; h0 dies there.
            set_control(control, host=h0, op="put_bytes", prefix=layout.BACKUPS, stall=1, release=False)
            m.save(2, state(2, devices))
            m.wait_until_finished()
            _until(lambda: read_control(control).get("stalled") == 1, "backup 2's finalize reaching its manifest")
            (dead,) = fence.list_markers(store)
            assert dead.host == h0 and layout.parse_backup_name(dead.backup) == 2, dead
            cluster.kill(h0)
            assert m.wait_for_backup().error is not None  # its head lost the host in the middle of it
        finally:
            m.close()

        # The job goes on without h0 (its devices are gone): a new head on h1 alone, a new generation.
        spec = tmp_path / "h1-only.json"

        def write_spec() -> None:  # the cluster's spec without h0 (again after a restart: a new address)
            doc = json.loads(cluster.spec_path.read_text())
            spec.write_text(json.dumps({**doc, "hosts": [h for h in doc["hosts"] if h["id"] == h1]}))

        write_spec()
        cfg1 = _config(cluster, bucket, spec)
        mine = devices[4:]  # h1's devices, in spec order
        with CheckpointManager(cfg1, dispatcher=ClusterDispatcher(cfg1, devices=mine)) as m1:
            m1.save(3, state(3, mine))
            m1.wait_until_finished()
            assert m1._dispatch.generation > dead.generation
            t0 = time.monotonic()
            report = m1.wait_for_backup()
            waited = time.monotonic() - t0
            assert report.error is None and report.step == 3, report
            # It watched the dead marker for DEAD_AFTER_S, not the two-minute abandonment.
            assert waited < fence.DEAD_AFTER_S + 10, f"backup 3 waited {waited:.1f} s for a dead host's finalize"
            log = cluster.log_path(h1).read_text()
            assert f"removing the marker of the finalize of backup {dead.backup} on host {h0}" in log, log[-3000:]
            assert "no finalize keeps it alive" in log, log[-3000:]
            assert store.list(layout.FINALIZING) == []
            names = layout.names_from_listing(store.list(layout.BACKUPS))
            assert [layout.parse_backup_name(n) for n in names] == [3, 1], names  # backup 2 never visible

            # h1's ramdisk lost: step 3 comes back from its backup, bit for bit.
            cluster.wipe(h1)
            cluster.restart(h1)
            write_spec()
            assert_trees_bitwise_equal(state(3, mine), m1.restore(3, target=target(mine)))
            assert m1.last_restore_report.bytes_by_tier["backup"] > 0
        store.close()


PLANTED = (f"{layout.FINALIZING}99999999999999999999.99991231T235959Z-step-999999999999.s9-h9."
           f"{'e' * 12}.{'f' * 12}")


def test_a_planted_marker_kept_alive_stops_no_backup_and_holds_none_up(ramdisk, tmp_path):
    """A marker under ``finalizing/`` the job did not sign (a huge generation, a newer backup's name),
    rewritten every 0.5 s by someone with write access to the bucket, as a live finalize's is: before the
    job key, every finalize gave way to it (BackupSupersededError) for as long as it was kept alive."""
    bucket = tmp_path / "bucket"
    devices = sorted(jax.devices(), key=lambda d: d.id)
    with LocalCluster(ramdisk / "c", 1, 2, devices_per_host=4) as cluster:
        cfg = _config(cluster, bucket)
        store = open_store(cfg.backup_root)
        stop = threading.Event()

        def keep_alive() -> None:
            beat = 0
            while not stop.is_set():
                beat += 1
                store.put_bytes(PLANTED, json.dumps({"backup": "planted", "beat": beat}).encode())
                stop.wait(0.5)

        writer = threading.Thread(target=keep_alive, daemon=True)
        writer.start()
        try:
            with CheckpointManager(cfg) as m:
                for step in (1, 2, 3):
                    m.save(step, state(step, devices))
                    m.wait_until_finished()
                    report = m.wait_for_backup()
                    assert report.error is None and report.step == step, report
                    assert report.seconds < fence.DEAD_AFTER_S, report  # not even waited out as dead
                log = "".join(cluster.log_path(h).read_text() for h in cluster.hosts)
                assert f"{fence.KIND} {PLANTED} failed the job key's check" in log, log[-3000:]
                assert "BackupSupersededError" not in log and "was NOT made" not in log, log[-3000:]
                names = layout.names_from_listing(store.list(layout.BACKUPS))
                assert [layout.parse_backup_name(n) for n in names] == [3, 2], names
                for h in cluster.hosts:
                    cluster.wipe(h)
                    cluster.restart(h)
                for step in (3, 2):
                    assert_trees_bitwise_equal(state(step, devices), m.restore(step, target=target(devices)))
        finally:
            stop.set()
            writer.join()
        assert store.list(layout.FINALIZING) == [PLANTED]  # ignored as if absent, not this job's to remove
        store.close()
