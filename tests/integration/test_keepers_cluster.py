"""Phase 2 with real daemons: the whole step manifest goes to two keepers on distinct slices, the
other hosts commit a record of the decision; restores read through the records, also when one
keeper is gone, and compare bit for bit."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from helpers import assert_trees_bitwise_equal, random_array
from mtc.head import CheckpointManager, MTCConfig
from mtc.shared import format as fmt
from mtc.sidecar.local_cluster import LocalCluster

pytestmark = pytest.mark.integration


def _state(seed: int) -> dict:
    # Data-parallel over the 2 slices, FSDP within each (as MaxText runs multi-slice): every shard
    # has a twin on the other slice, so replication moves nothing and no host needs the manifest.
    mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: d.id)).reshape(2, 4), ("data", "fsdp"))
    rng = np.random.default_rng(seed)
    return {"w": jax.device_put(random_array(rng, (64, 32), np.float32), NamedSharding(mesh, P("fsdp"))),
            "b": jax.device_put(random_array(rng, (32,), np.float32), NamedSharding(mesh, P()))}


def test_only_the_keepers_get_the_manifest_and_restores_read_through_records(ramdisk):
    with LocalCluster(ramdisk / "cluster", 2, 2, devices_per_host=2) as cluster:
        cfg = MTCConfig(local_checkpoint_directory=str(cluster.root), cluster_spec=str(cluster.spec_path),
                        local_checkpoint_period=1, prefetch_on_start=False)
        state = _state(1)
        with CheckpointManager(cfg) as m:
            m.save(5, state)
            m.wait_until_finished()
            m.wait_for_replication()
        kinds = {}
        for h in cluster.hosts:
            data = (cluster.store_root(h) / "steps" / f"{5:012d}.json").read_bytes()
            kinds[h] = "record" if fmt.CommitRecord.parse(data) is not None else "manifest"
        keepers = sorted(h for h, k in kinds.items() if k == "manifest")
        # Two keepers, one per slice; replication and inventories made no other host fetch it.
        assert len(keepers) == 2 and {h.split("-")[0] for h in keepers} == {"s0", "s1"}, kinds
        digest = fmt.StepManifest.from_json((cluster.store_root(keepers[0]) / "steps" / f"{5:012d}.json")
                                            .read_bytes()).digest
        records = [h for h in cluster.hosts if h not in keepers]
        for h in records:
            assert fmt.CommitRecord.parse((cluster.store_root(h) / "steps" / f"{5:012d}.json").read_bytes()).digest == digest
        # One keeper replaced by an empty host (its ramdisk gone): the other keeper gives the
        # manifest; the new host gets its shards back from its twin on the other slice.
        cluster.kill(keepers[0])
        cluster.wipe(keepers[0])
        cluster.restart(keepers[0])
        with CheckpointManager(cfg) as m:
            assert m.latest_step() == 5
            assert_trees_bitwise_equal(state, m.restore())
            assert m.last_restore_report.step == 5
