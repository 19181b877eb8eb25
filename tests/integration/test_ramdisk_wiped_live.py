"""A ramdisk emptied under a running sidecar daemon: the daemon notices, starts again empty, carries on.

Found by the soak (tests/chaos/soak.py, wipe_all with live=True): after ``rm -rf`` of every
ramdisk's contents under the live daemons, the restore from the backup failed on every host with
``FileNotFoundError: .../mtc/head.lock``, and so did every later save, until the daemons restarted.
"""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from helpers import assert_trees_bitwise_equal, random_array
from mtc.head import CheckpointManager, MTCConfig
from mtc.sidecar.local_cluster import LocalCluster
from mtc.sidecar.ram import RamStore

pytestmark = pytest.mark.integration


def _state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    sh = NamedSharding(Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b")), P("a", "b"))
    return {"w": jax.device_put(random_array(rng, (64, 128), np.float32), sh),
            "v": jax.device_put(random_array(rng, (32, 64), np.float32), sh)}


def _empty(path) -> None:
    for p in path.iterdir():
        shutil.rmtree(p) if p.is_dir() else p.unlink()


def test_every_ramdisk_emptied_under_live_daemons_restores_from_backup_and_saves_again(ramdisk, tmp_path):
    with LocalCluster(ramdisk / "cluster", 2, 2, devices_per_host=2) as cluster:
        cfg = MTCConfig(local_checkpoint_directory=str(ramdisk), cluster_spec=str(cluster.spec_path),
                        local_checkpoint_period=1, base_output_directory=str(tmp_path / "backup"), run_name="r",
                        multi_tier_checkpointing_backup_interval_steps=1)
        with CheckpointManager(cfg) as m:
            one = _state(1)
            m.save(1, one)
            m.wait_until_finished()
            assert m.wait_for_backup().step == 1
            m.wait_for_replication()  # no peer copy still landing while the folders are emptied
            for h in cluster.hosts:  # under the running daemons: none of them restarts
                _empty(cluster.ramdisk(h))
            assert m.latest_step() == 1  # from the backup
            assert_trees_bitwise_equal(one, m.restore(1), check_sharding=True)
            two = _state(2)
            m.save(2, two)
            m.wait_until_finished()  # raised FileNotFoundError (head.lock, blobs/) before the fix
            assert_trees_bitwise_equal(two, m.restore(2), check_sharding=True)
            assert m.last_restore_report.bytes_by_tier["backup"] == 0
        assert all(cluster.is_running(h) for h in cluster.hosts)
        assert "was emptied under this sidecar" in cluster.log_path("s0-h0").read_text()


def test_ram_store_recreates_its_layout_once_after_a_wipe(ramdisk):
    store = RamStore(ramdisk / "mtc")
    name, _ = store.blobs.write(b"x" * 100_000)
    assert not store.check_layout()  # nothing missing: nothing done
    shutil.rmtree(ramdisk / "mtc")
    assert store.check_layout()
    assert not store.check_layout()
    assert store.blobs.names() == set() and store.catalog.committed() == []
    assert store.blobs.write(b"x" * 100_000) == (name, True)
    assert store.read_blob(name) == b"x" * 100_000
