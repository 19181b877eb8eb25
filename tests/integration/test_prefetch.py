"""The start-up pull: a new manager brings the newest step local before ``restore`` is called."""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from helpers import assert_trees_bitwise_equal, random_array
from mtc.head import CheckpointManager, MTCConfig
from mtc.sidecar.local_cluster import LocalCluster

pytestmark = pytest.mark.integration


def split_state(seed: int) -> dict:
    """Split over all 8 devices: every host holds shards no other host wrote."""
    rng = np.random.default_rng(seed)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    return {"w": jax.device_put(random_array(rng, (256, 96), np.float32), NamedSharding(mesh, P("data", "model"))),
            "step": seed}


def own_bytes(state: dict, devices: range) -> int:
    return sum(sh.data.nbytes for sh in state["w"].addressable_shards if sh.device.id in devices)


def test_a_replaced_node_refills_from_peers_when_the_manager_starts(ramdisk):
    with LocalCluster(ramdisk / "c", 2, 2, devices_per_host=2) as cluster:
        cfg = MTCConfig(local_checkpoint_directory=str(cluster.root), cluster_spec=str(cluster.spec_path),
                        local_checkpoint_period=1)
        state = split_state(3)
        with CheckpointManager(cfg) as m:
            m.save(3, state)
            m.wait_until_finished()
            assert m.wait_for_replication().replicated
        cluster.wipe("s0-h0")  # a replaced node: empty ramdisk
        cluster.restart("s0-h0")
        with CheckpointManager(cfg) as m:
            pre = m.wait_for_prefetch()  # started by the constructor, before any restore
            assert pre is not None and pre.step == 3 and pre.source == "cluster"
            assert pre.bytes_by_tier == {"peer": own_bytes(state, range(0, 2)), "backup": 0}, pre
            assert [s.step for s in m.step_status() if s.restorable and "s0-h0" in s.hosts] == [3]
            assert_trees_bitwise_equal(state, m.restore())
            rep = m.last_restore_report
            # The bytes are counted once, by the tier they came from; the restore itself pulled none.
            assert rep.prefetched and rep.bytes_by_tier["peer"] == pre.bytes_by_tier["peer"], rep
            assert_trees_bitwise_equal(state, m.restore())
            assert not m.last_restore_report.prefetched and m.last_restore_report.bytes_by_tier["peer"] == 0


def test_all_ramdisks_lost_the_backup_is_downloaded_at_start(ramdisk, tmp_path):
    cfg = MTCConfig(local_checkpoint_directory=str(ramdisk), enable_multi_tier_checkpointing=True,
                    local_checkpoint_period=1, base_output_directory=str(tmp_path / "bucket"), run_name="run",
                    multi_tier_checkpointing_backup_interval_steps=1)
    state = split_state(5)
    with CheckpointManager(cfg) as m:
        m.save(5, state)
        m.wait_until_finished()
        assert m.wait_for_backup().error is None
    shutil.rmtree(ramdisk / "mtc")
    with CheckpointManager(cfg) as m:
        pre = m.wait_for_prefetch()
        assert pre is not None and pre.step == 5 and pre.source.endswith("-step-000000000005")
        assert pre.bytes_by_tier == {"peer": 0, "backup": state["w"].nbytes}, pre
        assert_trees_bitwise_equal(state, m.restore())
        rep = m.last_restore_report
        assert rep.prefetched and rep.bytes_by_tier["backup"] == state["w"].nbytes and rep.source == pre.source


def test_nothing_to_pull_and_switched_off(ramdisk):
    cfg = MTCConfig(local_checkpoint_directory=str(ramdisk), enable_multi_tier_checkpointing=True,
                    local_checkpoint_period=1)
    with CheckpointManager(cfg) as m:
        assert m.wait_for_prefetch() is None  # a fresh ramdisk: nothing to restore, no error
        m.save(1, split_state(1))
        m.wait_until_finished()
    with CheckpointManager(cfg.replace(prefetch_on_start=False)) as m:
        assert m.wait_for_prefetch() is None
        assert_trees_bitwise_equal(split_state(1), m.restore())
        assert not m.last_restore_report.prefetched
    with CheckpointManager(cfg) as m:  # everything already local: the pull moves nothing
        pre = m.wait_for_prefetch()
        assert pre is not None and pre.bytes_by_tier == {"peer": 0, "backup": 0}
