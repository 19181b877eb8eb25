"""Cluster mode, real daemons: a failed save is aborted once on every host. The transport reports
the failure; the manager aborts (at once on the hosts that answer, on reconnect on the others)."""

from __future__ import annotations

import collections

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from helpers import random_array
from mtc.head import CheckpointManager, MTCConfig
from mtc.head.dispatch.cluster.client import HostConnection
from mtc.shared.errors import SaveError
from mtc.sidecar.local_cluster import LocalCluster

pytestmark = pytest.mark.integration


def _state(seed: int) -> dict:
    mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: d.id)), ("x",))
    rng = np.random.default_rng(seed)
    return {"w": jax.device_put(random_array(rng, (64, 8), np.float32), NamedSharding(mesh, P("x")))}


@pytest.fixture
def aborts_sent(monkeypatch) -> collections.Counter:
    """(host, step) -> the abort requests the head sent that host's daemon."""
    sent: collections.Counter = collections.Counter()
    real = HostConnection.send

    def counting(self, op, args, payloads, **kw):
        if op == "abort":
            sent[(self.id, args.get("step"))] += 1
        return real(self, op, args, payloads, **kw)

    monkeypatch.setattr(HostConnection, "send", counting)
    return sent


@pytest.mark.parametrize("how", ["commit_fails", "host_down"])
def test_a_failed_save_is_aborted_once_per_host(ramdisk, aborts_sent, how):
    with LocalCluster(ramdisk / "cluster", 2, 2, devices_per_host=2) as cluster:
        cfg = MTCConfig(local_checkpoint_directory=str(cluster.root), cluster_spec=str(cluster.spec_path),
                        local_checkpoint_period=1, prefetch_on_start=False)
        bad = cluster.hosts[1]
        with CheckpointManager(cfg) as m:
            m.save(1, _state(1))
            m.wait_until_finished()
            if how == "commit_fails":  # phase 1 done everywhere; phase 2 fails on one host
                cluster.restart(bad, env={"MTC_FAIL_AT": "before_commit"})
            else:  # the host is down during the save; its abort waits for it to come back
                cluster.kill(bad)
            m.save(2, _state(2))
            with pytest.raises(SaveError):
                m.wait_until_finished()
            if how == "host_down":
                assert (bad, 2) not in aborts_sent
                cluster.restart(bad)
            else:
                cluster.restart(bad)  # without the fault; the head reconnects
            m.save(3, _state(3))
            m.wait_until_finished()
            assert m.all_steps() == [1, 3]
        assert dict(aborts_sent) == {(h, 2): 1 for h in cluster.hosts}
        for h in cluster.hosts:
            assert not (cluster.store_root(h) / "pending" / f"{2:012d}").exists()
