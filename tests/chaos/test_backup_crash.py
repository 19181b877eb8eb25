"""kill -9 of a sidecar during its backup uploads: the backup never becomes visible without
every blob, and the next due backup completes."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from helpers import assert_trees_bitwise_equal
from mtc.head import CheckpointManager, MTCConfig
from mtc.shared import backup_layout
from mtc.shared import format as fmt
from mtc.shared.objstore import open_store
from mtc.sidecar.local_cluster import LocalCluster

pytestmark = pytest.mark.chaos


def state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    sh = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))  # every host holds its own shards
    return {f"w{i}": jax.device_put(rng.standard_normal((64, 64), dtype=np.float32), sh) for i in range(4)}


def test_kill_during_uploads_never_exposes_a_partial_backup(ramdisk):
    bucket = ramdisk / "bucket"
    with LocalCluster(ramdisk / "cluster", 2, 2, devices_per_host=2) as cluster:
        victim = cluster.hosts[1]
        cluster.restart(victim, env={"MTC_CRASH_AT": "between_uploads@3"})
        cfg = MTCConfig(local_checkpoint_directory=str(cluster.root), cluster_spec=str(cluster.spec_path),
                        local_checkpoint_period=1, base_output_directory=str(bucket), run_name="run",
                        multi_tier_checkpointing_backup_interval_steps=1)
        st = open_store(f"{bucket}/run/mtc")
        with CheckpointManager(cfg) as m:
            m.save(1, state(1))
            m.wait_until_finished()
            report = m.wait_for_backup()
            assert report.error is not None and victim in report.error, report
            # Some blobs reached the bucket (the victim's first two, the other hosts' all) ...
            uploaded = st.list(backup_layout.BLOBS)
            assert len(uploaded) >= 2
            # ... but no backup is visible.
            assert st.list(backup_layout.BACKUPS) == [] and m.backups() == []

            cluster.restart(victim)  # back, without the fault
            m.save(2, state(2))
            m.wait_until_finished()
            report = m.wait_for_backup()
            assert report.error is None and report.step == 2, report
            names = [b["name"] for b in m.backups()]
            assert [backup_layout.parse_backup_name(n) for n in names] == [2]
            manifest = fmt.StepManifest.from_json(st.get_bytes(backup_layout.manifest_object(names[0])))
            present = {o.split("/")[-1] for o in st.list(backup_layout.BLOBS)}
            assert manifest.blob_names() <= present
            for h in cluster.hosts:
                cluster.wipe(h)
                cluster.restart(h)
            assert_trees_bitwise_equal(state(2), m.restore())
            assert m.last_restore_report.bytes_by_tier["ram"] == 0
