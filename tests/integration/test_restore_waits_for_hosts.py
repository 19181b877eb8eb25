"""A restore that needs hosts that do not answer waits for them (``restore_host_wait_s``), with real
daemons: after a failure the head's training process restarts in seconds (the supervisor's standby),
while a replaced host or slice comes back a little later; at a job's start the head can be up before
its hosts. The restore plans again until they answer, then restores bit for bit; with
``restore_host_wait_s=0`` it fails at once, naming the hosts."""

from __future__ import annotations

import logging
import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from helpers import assert_trees_bitwise_equal
from mtc.head import CheckpointManager, MTCConfig
from mtc.shared.errors import HostUnreachableError

pytestmark = pytest.mark.integration


def _config(cluster, **kw) -> MTCConfig:
    return MTCConfig(local_checkpoint_directory=str(cluster.root), cluster_spec=str(cluster.spec_path),
                     local_checkpoint_period=1, prefetch_on_start=False, **kw)


def _state(step: int):
    mesh = Mesh(np.array(jax.devices()), ("x",))
    rng = np.random.default_rng(step)
    return {"w": jax.device_put(rng.standard_normal((64, 4), dtype=np.float32), NamedSharding(mesh, P("x")))}


def _target():
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), _state(0))


def test_a_restore_waits_for_hosts_that_come_back(local_cluster, caplog):
    with CheckpointManager(_config(local_cluster)) as m:
        for step in (1, 2):
            m.save(step, _state(step))
            m.wait_until_finished()
    for h in local_cluster.hosts:
        local_cluster.kill(h)
    back_at: list[float] = []

    def come_back() -> None:
        time.sleep(3.0)
        back_at.append(time.monotonic())
        for h in local_cluster.hosts:
            local_cluster.restart(h)

    t = threading.Thread(target=come_back)
    caplog.set_level(logging.WARNING, logger="mtc.head.restore.restorer")
    with CheckpointManager(_config(local_cluster, restore_host_wait_s=60)) as m:
        t.start()
        restored = m.restore(2, target=_target())
        done = time.monotonic()
    t.join()
    assert_trees_bitwise_equal(_state(2), restored)
    assert back_at and done >= back_at[0]
    assert "waiting for the hosts that do not answer" in caplog.text and "restore_host_wait_s" in caplog.text


def test_with_no_wait_a_restore_fails_at_once_naming_the_hosts(local_cluster):
    with CheckpointManager(_config(local_cluster)) as m:
        m.save(1, _state(1))
        m.wait_until_finished()
    for h in local_cluster.hosts:
        local_cluster.kill(h)
    t0 = time.monotonic()
    with CheckpointManager(_config(local_cluster, restore_host_wait_s=0)) as m:
        with pytest.raises(HostUnreachableError, match="s0-h0"):
            m.restore(1, target=_target())
    assert time.monotonic() - t0 < 30


def test_a_bad_wait_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match="restore_host_wait_s=-1"):
        MTCConfig(restore_host_wait_s=-1.0)


def test_the_latest_step_waits_for_hosts_that_come_back(local_cluster):
    """MaxText asks for the latest step before it restores: while hosts that may hold a step do not
    answer, that is not known ("no step" would start training over), so it waits for them too."""
    with CheckpointManager(_config(local_cluster)) as m:
        m.save(1, _state(1))
        m.wait_until_finished()
    for h in local_cluster.hosts[:2]:
        local_cluster.kill(h)
    t = threading.Timer(2.0, lambda: [local_cluster.restart(h) for h in local_cluster.hosts[:2]])
    with CheckpointManager(_config(local_cluster, restore_host_wait_s=60)) as m:
        t.start()
        assert m.latest_step() == 1
        assert_trees_bitwise_equal(_state(1), m.restore(1, target=_target()))
    t.join()


def test_a_newer_step_on_a_host_that_is_back_is_not_passed_over_for_the_backup(local_cluster, tmp_path):
    """Step 2 is in the backup, step 3 only on the hosts. While a host does not answer, step 3 is not
    confirmed, but the backup's step 2 is: answering 2 then would retrain every step since. So the
    latest step waits for the host (and says so), and is 3; a reader, or ``restore_host_wait_s=0``,
    answers at once with what it can confirm."""
    backup = dict(base_output_directory=str(tmp_path / "bucket"), run_name="r",
                  multi_tier_checkpointing_backup_interval_steps=2)
    with CheckpointManager(_config(local_cluster, **backup)) as m:
        for step in (2, 3):
            m.save(step, _state(step))
            m.wait_until_finished()
        assert m.wait_for_backup().error is None
    down = local_cluster.hosts[0]
    local_cluster.wipe(down)
    local_cluster.kill(down)
    t0 = time.monotonic()
    with CheckpointManager(_config(local_cluster, restore_host_wait_s=0, **backup)) as m:
        at_once = m.latest_step()
    assert time.monotonic() - t0 < 30 and at_once in (2, 3)
    t = threading.Timer(2.0, lambda: local_cluster.restart(down))
    with CheckpointManager(_config(local_cluster, restore_host_wait_s=60, **backup)) as m:
        t.start()
        assert m.latest_step() == 3
        assert_trees_bitwise_equal(_state(3), m.restore(3, target=_target()))
    t.join()
