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
