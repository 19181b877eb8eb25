"""A backup on demand: ``save(step, state, backup=True)``, and SIGUSR1 to a head that watches for it
(``watch_backup_requests``), put the step in the bucket now, long before the backup interval would,
and it restores bit for bit after every ramdisk is lost. Without a backup root, the ask is refused
and nothing is saved."""

from __future__ import annotations

import os
import signal

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import assert_trees_bitwise_equal, random_array
from mtc.head import CheckpointManager, MTCConfig
from mtc.shared.errors import ConfigError

pytestmark = pytest.mark.integration


def make_state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    m = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    return {"w": jax.device_put(random_array(rng, (64, 48), np.float32), NamedSharding(m, P(None, "model"))),
            "b": jax.device_put(random_array(rng, (16,), np.int32), NamedSharding(m, P())), "step": seed}


def config(cluster, ramdisk, **kw) -> MTCConfig:
    return MTCConfig(local_checkpoint_directory=str(cluster.root), cluster_spec=str(cluster.spec_path),
                     local_checkpoint_period=1, base_output_directory=str(ramdisk / "bucket"), run_name="run",
                     multi_tier_checkpointing_backup_interval_steps=100, **kw)


def backed_up(m: CheckpointManager) -> list[int]:
    m.wait_until_finished()
    m.wait_for_backup()
    return sorted(b["step"] for b in m.backups())


def test_a_step_asked_for_is_in_the_bucket_now_and_restores_after_every_ramdisk_is_lost(local_cluster, ramdisk):
    states = {s: make_state(s) for s in range(1, 7)}
    previous = signal.getsignal(signal.SIGUSR1)
    with CheckpointManager(config(local_cluster, ramdisk)) as m:
        m.save(1, states[1])
        assert backed_up(m) == [1]  # the first committed step, at once
        m.save(2, states[2])
        assert backed_up(m) == [1]  # the next is due at step 100
        assert m.save(3, states[3], backup=True)
        assert backed_up(m) == [1, 3]
        m.watch_backup_requests()
        assert not m.backup_requested
        os.kill(os.getpid(), signal.SIGUSR1)  # an operator: kill -USR1 <pid>
        assert m.backup_requested
        m.save(4, states[4])
        assert backed_up(m) == [1, 3, 4] and not m.backup_requested
        m.save(5, states[5])
        assert backed_up(m) == [1, 3, 4]  # one request, one backup
    assert signal.getsignal(signal.SIGUSR1) == previous  # close() gave the handler back
    for h in local_cluster.hosts:
        local_cluster.wipe(h)
        local_cluster.restart(h)
    with CheckpointManager(config(local_cluster, ramdisk)) as m:
        assert m.latest_step() == 4
        assert_trees_bitwise_equal(states[4], m.restore())
        assert m.last_restore_report.source != "cluster" and m.last_restore_report.bytes_by_tier["ram"] == 0
        assert_trees_bitwise_equal(states[3], m.restore(3))


def test_a_backup_asked_for_without_a_backup_root_is_refused_and_saves_nothing(local_cluster):
    cfg = MTCConfig(local_checkpoint_directory=str(local_cluster.root), cluster_spec=str(local_cluster.spec_path),
                    local_checkpoint_period=1)
    with CheckpointManager(cfg) as m:
        with pytest.raises(ConfigError, match="base_output_directory"):
            m.save(1, make_state(1), backup=True)
        m.wait_until_finished()
        assert m.all_steps() == []
        m.save(2, make_state(2))  # training goes on
        m.wait_until_finished()
        assert m.all_steps() == [2]
