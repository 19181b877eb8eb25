"""A corrupt blob in the backup, every ramdisk gone: the restore fails naming the array, the shard and the
tiers tried, and no corrupt byte reaches it.

Found by the soak (tests/chaos/soak.py, flip_backup_blob): with the step's only copy in the backup
corrupt, several hosts' fetches failed and the head raised a bare ``MTCError("fetch of backup ... failed
on 2 hosts: ...")`` that named blobs and hosts but not the array or the tiers, unlike a corrupt only copy
on the peers (with no good copy left, the error names the array, the shard and the tiers tried).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from helpers import assert_trees_bitwise_equal, random_array
from mtc.head import CheckpointManager, MTCConfig
from mtc.shared.errors import CorruptBlobError
from mtc.sidecar.local_cluster import LocalCluster

pytestmark = pytest.mark.integration


def _state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    # Replicated: every host needs the same blob, so every host's fetch meets the corrupt copy.
    sh = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P())
    return {"w": jax.device_put(random_array(rng, (256, 64), np.float32), sh)}


def test_corrupt_backup_blob_with_no_other_copy_names_array_shard_and_tiers(ramdisk, tmp_path):
    backup = tmp_path / "backup"
    with LocalCluster(ramdisk / "cluster", 1, 2, devices_per_host=4) as cluster:
        cfg = MTCConfig(local_checkpoint_directory=str(ramdisk), cluster_spec=str(cluster.spec_path),
                        local_checkpoint_period=1, base_output_directory=str(backup), run_name="r",
                        multi_tier_checkpointing_backup_interval_steps=1)
        one = _state(1)
        with CheckpointManager(cfg) as m:
            m.save(1, one)
            m.wait_until_finished()
            assert m.wait_for_backup().step == 1
        (blob,) = [p for p in (backup / "r" / "mtc" / "blobs").iterdir() if not p.name.startswith(".")]
        good = blob.read_bytes()
        bad = bytearray(good)
        bad[len(bad) // 2] ^= 0x10
        blob.write_bytes(bytes(bad))
        for h in cluster.hosts:
            cluster.wipe(h)
            cluster.restart(h)
        with CheckpointManager(cfg.replace(prefetch_on_start=False)) as m:
            assert m.latest_step() == 1  # listed: the backup is whole (its blob is there)
            with pytest.raises(CorruptBlobError) as e:
                m.restore(1)
            msg = str(e.value)
            assert "array" in msg and "'w'" in msg and "tiers tried" in msg and "backup" in msg and blob.name in msg, msg
            blob.write_bytes(good)  # repaired: the same head restores it
            assert_trees_bitwise_equal(one, m.restore(1), check_sharding=True)
