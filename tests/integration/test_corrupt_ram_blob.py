"""A host's own copy of a blob is corrupt and no peer holds another: the restore takes it from the backup.

Found by the soak (tests/chaos/soak.py, flip_ram_blob, 1 slice x 4 hosts, replication behind): the load
found the corrupt copy and failed with "could not be read from any host that holds it (tiers tried:
ram)", although the backup of that very step held a good copy. Now the host removes the corrupt copy
when it reads it, and the head plans the restore once more: the blob is lacking, so it is fetched.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from helpers import assert_trees_bitwise_equal, random_array
from mtc.head import CheckpointManager, MTCConfig
from mtc.shared.hashing import blob_name
from mtc.sidecar.local_cluster import LocalCluster

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("rows", [4, 2], ids=["mapped", "read"])
def test_corrupt_only_ram_copy_is_replaced_from_the_backup(ramdisk, tmp_path, rows):
    rng = np.random.default_rng(0)
    w = random_array(rng, (8 * rows, 1 << 15), np.float32)  # one device's shard: 512 KiB (mapped) or 256 KiB
    sh = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
    state = {"w": jax.device_put(w, sh)}
    with LocalCluster(ramdisk / "cluster", 1, 2, devices_per_host=4) as cluster:
        cfg = MTCConfig(local_checkpoint_directory=str(ramdisk), cluster_spec=str(cluster.spec_path),
                        local_checkpoint_period=1, base_output_directory=str(tmp_path / "backup"), run_name="r",
                        multi_tier_checkpointing_backup_interval_steps=1, replication_factor=1)
        with CheckpointManager(cfg) as m:
            m.save(1, state)
            m.wait_until_finished()
            assert m.wait_for_backup().step == 1
        blob = blob_name(np.ascontiguousarray(w[4 * rows:5 * rows]).tobytes())  # device 4: on s0-h1 only
        path = cluster.store_root("s0-h1") / "blobs" / blob
        data = bytearray(path.read_bytes())
        data[1234] ^= 0x08
        path.write_bytes(bytes(data))
        with CheckpointManager(cfg.replace(prefetch_on_start=False)) as m:
            assert m.latest_step() == 1
            assert_trees_bitwise_equal(state, m.restore(1), check_sharding=True)
            assert m.last_restore_report.bytes_by_tier["backup"] == len(data)
        assert blob_name(path.read_bytes()) == blob  # the host holds a good copy again
