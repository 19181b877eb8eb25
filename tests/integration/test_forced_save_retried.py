"""The MaxText launcher's save policy (``SaveFailures``) on real daemons: a forced save (the run's
last step) whose host is gone for a few seconds is saved again once the host is back, so the run
ends with its last step committed instead of an error and a restart."""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mtc.head.elastic import HostLostError
from mtc.head.maxtext.launcher import SaveFailures
from mtc.head.orbax.compat import OrbaxCompatibleManager
from mtc.shared.config import MTCConfig
from mtc.sidecar.local_cluster import LocalCluster

ocp = pytest.importorskip("orbax.checkpoint")

pytestmark = pytest.mark.integration


def _states():
    mesh = Mesh(np.array(jax.devices()), ("x",))
    rng = np.random.default_rng(7)
    return [{"w": jax.device_put(rng.standard_normal((64, 32), np.float32), NamedSharding(mesh, P("x")))}
            for _ in range(2)]


def _config(tmp_path, cluster) -> MTCConfig:
    return MTCConfig(local_checkpoint_directory=str(tmp_path / "c"), cluster_spec=str(cluster.spec_path),
                     local_checkpoint_period=1)


def _save_then_lose_a_host(m, policy, states, cluster) -> None:
    assert policy.save(m, 0, ocp.args.Composite(state=ocp.args.PyTreeSave(item=states[0])), False, elastic=False)
    m.wait_until_finished()
    cluster.kill("s0-h1")


def test_the_last_save_whose_host_came_back_is_committed(tmp_path):
    states = _states()
    with LocalCluster(tmp_path / "c", 1, 2, devices_per_host=4) as cluster:
        policy = SaveFailures({SaveFailures.ENV: "60"})
        with OrbaxCompatibleManager(_config(tmp_path, cluster)) as m:
            _save_then_lose_a_host(m, policy, states, cluster)
            threading.Timer(2.0, cluster.restart, ("s0-h1",)).start()
            assert policy.save(m, 1, ocp.args.Composite(state=ocp.args.PyTreeSave(item=states[1])), True,
                               elastic=False)
            assert policy.tolerated >= 1
        with OrbaxCompatibleManager(_config(tmp_path, cluster)) as again:  # a new head finds step 1
            assert again.latest_step() == 1
            target = jax.tree.map(lambda a: ocp.type_handlers.ArrayRestoreArgs(sharding=a.sharding), states[1])
            got = again.restore(1, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
                item=states[1], restore_args=target))).state
    assert np.asarray(got["w"]).tobytes() == np.asarray(states[1]["w"]).tobytes()


def test_the_last_save_whose_host_stays_gone_raises_after_the_grace(tmp_path):
    states = _states()
    with LocalCluster(tmp_path / "c", 1, 2, devices_per_host=4) as cluster:
        policy = SaveFailures({SaveFailures.ENV: "2"})
        with OrbaxCompatibleManager(_config(tmp_path, cluster)) as m:
            _save_then_lose_a_host(m, policy, states, cluster)
            with pytest.raises(HostLostError, match="s0-h1"):
                policy.save(m, 1, ocp.args.Composite(state=ocp.args.PyTreeSave(item=states[1])), True, elastic=False)


def test_the_last_step_saved_by_the_loop_is_saved_again_at_the_final_wait(tmp_path):
    # MaxText's loop saved the run's last step (not forced: it fell on the period) and skips the
    # final save as "already being saved"; its host dies during that save. MaxText's wait when
    # training ends must not end the run with the lost host's error: the step is saved again
    # once the host is back.
    states = _states()
    with LocalCluster(tmp_path / "c", 1, 2, devices_per_host=4) as cluster:
        policy = SaveFailures({SaveFailures.ENV: "60"})
        with OrbaxCompatibleManager(_config(tmp_path, cluster)) as m:
            _save_then_lose_a_host(m, policy, states, cluster)
            assert policy.save(m, 1, ocp.args.Composite(state=ocp.args.PyTreeSave(item=states[1])), False,
                               elastic=False)
            threading.Timer(2.0, cluster.restart, ("s0-h1",)).start()
            policy.wait(m)
            assert policy.tolerated >= 1
        with OrbaxCompatibleManager(_config(tmp_path, cluster)) as again:
            assert again.latest_step() == 1
            target = jax.tree.map(lambda a: ocp.type_handlers.ArrayRestoreArgs(sharding=a.sharding), states[1])
            got = again.restore(1, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
                item=states[1], restore_args=target))).state
    assert np.asarray(got["w"]).tobytes() == np.asarray(states[1]["w"]).tobytes()


@pytest.mark.parametrize("grace_s", ["60", "0"])
def test_a_failed_save_whose_state_is_gone_is_tolerated_at_the_final_wait_within_the_grace(tmp_path, grace_s):
    # The failed save's arrays were donated to a later train step (deleted): it cannot be saved
    # again. Within the grace the wait goes on (the last committed step stays the restore point);
    # with no grace it raises the lost host's error.
    states = _states()
    with LocalCluster(tmp_path / "c", 1, 2, devices_per_host=4) as cluster:
        policy = SaveFailures({SaveFailures.ENV: grace_s})
        with OrbaxCompatibleManager(_config(tmp_path, cluster)) as m:
            _save_then_lose_a_host(m, policy, states, cluster)
            assert policy.save(m, 1, ocp.args.Composite(state=ocp.args.PyTreeSave(item=states[1])), False,
                               elastic=False)
            states[1]["w"].delete()
            if grace_s == "0":
                with pytest.raises(HostLostError, match="s0-h1"):
                    policy.wait(m)
            else:
                policy.wait(m)
                assert policy.tolerated == 1
                assert not m.mtc_manager.has_step(1)
