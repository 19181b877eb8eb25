"""One host's copy of a step manifest is damaged: the head reads the manifest from the next host.

Found by the soak (tests/chaos/soak.py, flip_manifest): one flipped bit in ``steps/<step>.json`` on the
first host of the spec (still valid JSON, but a shard's size no longer matched its box) made every
restore of that step fail with ManifestError, although every other host held an intact copy.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from helpers import assert_trees_bitwise_equal, random_array
from mtc.head import CheckpointManager, MTCConfig
from mtc.sidecar.local_cluster import LocalCluster

pytestmark = pytest.mark.integration


def _damage_a_part(data: bytes) -> bytes:
    """One character of the first part's columns changed (a row's array, box, size or blob, as a
    flipped bit would): still JSON and base64, the same size."""
    return re.sub(rb'("columns":")(.)', lambda mo: mo.group(1) + (b"B" if mo.group(2) != b"B" else b"C"), data,
                  count=1)


def test_a_damaged_manifest_on_the_first_host_is_read_from_the_next(ramdisk):
    rng = np.random.default_rng(0)
    sh = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
    state = {"w": jax.device_put(random_array(rng, (64, 256), np.float32), sh)}
    with LocalCluster(ramdisk / "cluster", 1, 2, devices_per_host=4) as cluster:
        cfg = MTCConfig(local_checkpoint_directory=str(ramdisk), cluster_spec=str(cluster.spec_path),
                        local_checkpoint_period=1)
        with CheckpointManager(cfg) as m:
            m.save(1, state)
            m.wait_until_finished()
        (path,) = [p for p in (cluster.store_root("s0-h0") / "steps").iterdir() if p.name.endswith(".json")]
        text = path.read_bytes()
        damaged = _damage_a_part(text)
        assert damaged != text
        path.write_bytes(damaged)
        with CheckpointManager(cfg) as m:
            assert m.latest_step() == 1
            assert_trees_bitwise_equal(state, m.restore(1), check_sharding=True)


def test_a_step_file_made_unreadable_under_a_live_daemon_is_rewritten_and_its_blobs_count(ramdisk):
    """Found by the soak (flip_manifest before replication caught up): a flipped byte that made one
    host's step file invalid JSON hid the step on that host, so its blobs, the only copies of its
    shards, stopped counting and the restore chose the step before. The daemon that committed the
    step still has its manifest: it rewrites the file."""
    rng = np.random.default_rng(1)
    sh = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
    state = {"w": jax.device_put(random_array(rng, (64, 256), np.float32), sh)}
    with LocalCluster(ramdisk / "cluster", 1, 2, devices_per_host=4) as cluster:
        cfg = MTCConfig(local_checkpoint_directory=str(ramdisk), cluster_spec=str(cluster.spec_path),
                        local_checkpoint_period=1, replication_factor=1)  # s0-h1's shards live on s0-h1 only
        with CheckpointManager(cfg) as m:
            m.save(1, state)
            m.wait_until_finished()
        (path,) = [p for p in (cluster.store_root("s0-h1") / "steps").iterdir() if p.name.endswith(".json")]
        good = path.read_bytes()
        path.write_bytes(b"{" + good[1:-1])  # no longer JSON
        with CheckpointManager(cfg) as m:
            assert m.latest_step() == 1
            assert_trees_bitwise_equal(state, m.restore(1), check_sharding=True)
        assert path.read_bytes() == good
        assert "was damaged; rewrote it" in cluster.log_path("s0-h1").read_text()


def test_latest_step_counts_a_step_whose_damaged_copy_the_head_gives_back(ramdisk):
    """Found by the soak (flip_manifest on a keeper before replication caught up, under load): the only
    host with some shards of the newest step had a damaged step file. ``restore()`` gives the host its
    manifest back before it chooses, but ``latest_step()`` (what a training script asks first) did not,
    so it named the step before, and that was restored. Here the host's daemon was restarted after the
    commit, so it cannot rewrite the file from what it committed: only the head can."""
    rng = np.random.default_rng(2)
    sh = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
    states = [{"w": jax.device_put(random_array(rng, (64, 256), np.float32), sh)} for _ in range(2)]
    with LocalCluster(ramdisk / "cluster", 1, 2, devices_per_host=4) as cluster:
        cfg = MTCConfig(local_checkpoint_directory=str(ramdisk), cluster_spec=str(cluster.spec_path),
                        local_checkpoint_period=1, replication_factor=1,  # s0-h1's shards live on s0-h1 only
                        prefetch_on_start=False)
        with CheckpointManager(cfg) as m:
            for step, state in enumerate(states, 1):
                m.save(step, state)
                m.wait_until_finished()
            path = cluster.store_root("s0-h1") / "steps" / f"{2:012d}.json"
            good = path.read_bytes()
            damaged = _damage_a_part(good)  # still JSON, but its hash fails
            assert damaged != good
            cluster.kill("s0-h1")
            path.write_bytes(damaged)
            cluster.restart("s0-h1")
            assert m.all_steps() == [1, 2]
            assert m.latest_step() == 2
            assert_trees_bitwise_equal(states[1], m.restore(m.latest_step()), check_sharding=True)
        assert path.read_bytes() == good
