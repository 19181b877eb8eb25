"""Cluster mode, real daemons: one host's failure is that host's answer where the interface
answers per host (one daemon killed with kill -9), and a daemon's error arrives typed, naming
its host (tests/unit/test_colocated_host_failure.py: the same in colocated mode)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mtc.head import CheckpointManager, MTCConfig
from mtc.head.dispatch.cluster.dispatcher import ClusterDispatcher
from mtc.shared.errors import FencedError, HostUnreachableError, NotConfiguredError, StepNotFoundError

pytestmark = pytest.mark.integration


def _config(cluster) -> MTCConfig:
    return MTCConfig(local_checkpoint_directory=str(cluster.root), cluster_spec=str(cluster.spec_path),
                     local_checkpoint_period=1, prefetch_on_start=False)


def _state():
    mesh = Mesh(np.array(jax.devices()), ("x",))
    return {"w": jax.device_put(np.arange(64 * 4, dtype=np.float32).reshape(64, 4), NamedSharding(mesh, P("x")))}


def test_a_killed_host_is_that_hosts_answer_and_the_others_answer(local_cluster):
    with CheckpointManager(_config(local_cluster)) as m:
        m.save(1, _state())
        m.wait_until_finished()
        d = m._dispatch
        dead = "s0-h1"
        alive = [h for h in local_cluster.hosts if h != dead]
        local_cluster.kill(dead)
        inv = d.inventories()
        assert set(inv) == set(local_cluster.hosts)
        assert inv[dead].steps == () and "connection refused" in inv[dead].error
        assert all([s.step for s in inv[h].steps] == [1] and inv[h].error is None for h in alive)
        checked = d.verify(1)
        assert "connection refused" in checked[dead]["error"]
        assert all(checked[h]["checked"] > 0 and checked[h]["bad"] == [] for h in alive)
        pulled = d.peer_pull(1, {dead: [], alive[0]: []})
        assert "connection refused" in pulled[dead].error and pulled[alive[0]].error is None
        d.abort(9)  # best effort: the dead host's abort waits for its restart
        assert set(d.leases()) == set(alive)  # asked again when it is back
        local_cluster.restart(dead)
        assert [s.step for s in d.inventories()[dead].steps] == [1]


def test_a_daemons_error_arrives_typed_with_its_host(local_cluster):
    config = _config(local_cluster)
    first = ClusterDispatcher(config)
    second = ClusterDispatcher(config)
    try:
        host = local_cluster.hosts[0]
        with pytest.raises(StepNotFoundError, match=host):
            first.lanes.call(host, "manifest", {"step": 42})
        _, failures = first.lanes.call_each("manifest", args={"step": 42})
        assert set(failures) == set(local_cluster.hosts)
        assert all(isinstance(e, StepNotFoundError) and h in str(e) for h, e in failures.items())
        with pytest.raises(NotConfiguredError, match=host):  # no head configured it yet
            first.lanes.run_job(host, "backup_upload", {"blobs": []})
        head = {"host": "test", "pid": 1, "id": "first", "started": "2024-01-01T00:00:00Z"}
        first.claim(10, head)
        second.claim(11, {**head, "id": "second"})
        with pytest.raises(FencedError, match=host):  # refused by the host, raised by type at the call
            first.lanes.call(host, "abort", {"step": 1})
        _, failures = first.lanes.call_each("abort", args={"step": 1})
        assert all(isinstance(e, FencedError) for e in failures.values()) and set(failures) == set(local_cluster.hosts)
        local_cluster.kill(host)
        with pytest.raises(HostUnreachableError, match=host):
            first.lanes.call(host, "ping")
    finally:
        first.close()
        second.close()
