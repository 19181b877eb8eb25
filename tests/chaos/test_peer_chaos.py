"""kill -9 of a sidecar daemon in the middle of a replication transfer (the peer tier).

What must hold:
- a blob cut off mid-transfer is never counted: the receiver's temp file is discarded (or removed
  when its daemon restarts), and every file under a blob name hashes to that name;
- replication completes: when the killed source returns, or, when a receiver was killed, with
  copies placed on the other hosts meanwhile;
- the step restores bit for bit afterwards.

The kill lands mid-blob deterministically enough: the test watches the receivers' ramdisks and
kills as soon as a transfer's temp file has bytes (blobs of 32 MiB take tens of milliseconds);
if replication finished before it could, the trial is repeated with the next step.
"""

from __future__ import annotations

import os
import signal
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import assert_trees_bitwise_equal
from mtc.head import CheckpointManager, MTCConfig
from mtc.shared.errors import StepsUnconfirmedError
from mtc.shared.hashing import blob_name
from mtc.sidecar.local_cluster import LocalCluster

pytestmark = pytest.mark.chaos

SHARD_MIB = 32
TRIES = 6


def big_state(seed: int) -> dict:
    """8 shards of 48 MiB, one per device: no twins, so every byte is replicated."""
    rows = SHARD_MIB * (1 << 20) // 4 // 1024
    x = np.random.default_rng(seed).integers(0, 1 << 31, size=(8 * rows, 1024), dtype=np.int32).view(np.float32)
    m = Mesh(np.array(jax.devices()), ("d",))
    return {"x": jax.device_put(x, NamedSharding(m, P("d"))), "step": seed}


def receiving(cluster: LocalCluster) -> dict[str, int]:
    """host -> bytes in its peer-receive temp files (blob writes of saves are done by then)."""
    out = {}
    for h in cluster.hosts:
        try:
            entries = list(os.scandir(cluster.store_root(h) / "blobs"))
        except FileNotFoundError:
            continue
        for e in entries:
            if e.name.startswith(".tmp-") and not e.name.startswith(".tmp-free-"):
                try:  # allocated bytes: a receive sizes its temp file before the first byte arrives
                    size = e.stat().st_blocks * 512
                except FileNotFoundError:
                    continue
                if size:
                    out[h] = out.get(h, 0) + size
    return out


def temp_files(cluster: LocalCluster, host: str) -> list[str]:
    return [p.name for p in (cluster.store_root(host) / "blobs").iterdir()
            if p.name.startswith(".tmp-") and not p.name.startswith(".tmp-free-")]


def blob_files(cluster: LocalCluster, host: str) -> set[str]:
    return {p.name for p in (cluster.store_root(host) / "blobs").iterdir() if not p.name.startswith(".")}


def assert_every_blob_verifies(cluster: LocalCluster) -> None:
    for h in cluster.hosts:
        for name in blob_files(cluster, h):
            data = (cluster.store_root(h) / "blobs" / name).read_bytes()
            assert blob_name(data) == name, f"{h} counts a partial or corrupt copy as blob {name}"


def wait_until(cond, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not (v := cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)
    return v


def save_and_catch_a_transfer(m: CheckpointManager, cluster: LocalCluster, first_step: int):
    """Save steps until a replication transfer is seen in flight: (step, state, receiving host)."""
    for step in range(first_step, first_step + TRIES):
        state = big_state(step)
        m.save(step, state)
        m.wait_until_finished()  # committed: from here on, blob temp files are peer receives
        while m.is_replicating():
            busy = receiving(cluster)
            if busy:
                return step, state, next(iter(busy))
        m.wait_for_replication()
    pytest.skip(f"replication finished before a transfer could be caught in {TRIES} tries (machine too fast)")


def test_kill_9_of_the_source_mid_blob_counts_no_partial_blob_and_completes_when_it_returns(ramdisk):
    with LocalCluster(ramdisk / "c", 1, 2, devices_per_host=4) as cluster:
        cfg = MTCConfig(local_checkpoint_directory=str(ramdisk), cluster_spec=str(cluster.spec_path),
                        local_checkpoint_period=1, restore_host_wait_s=0)
        with CheckpointManager(cfg) as m:
            step, state, receiver = save_and_catch_a_transfer(m, cluster, 1)
            source = next(h for h in cluster.hosts if h != receiver)
            cluster.kill(source)
            # The cut-off copy is discarded on the receiver, never published under its name.
            wait_until(lambda: not temp_files(cluster, receiver), what="the partial copy to be discarded")
            assert_every_blob_verifies(cluster)
            with pytest.raises(StepsUnconfirmedError, match=source):  # a host is down: nothing is confirmed
                m.latest_step()
            cluster.restart(source)
            rep = m.wait_for_replication()
            # It kept retrying while the source was down, and finished once it was back.
            assert rep.step == step and rep.complete and rep.replicated and rep.attempts > 1, rep
            assert_every_blob_verifies(cluster)
            for h in cluster.hosts:
                assert blob_files(cluster, h) == blob_files(cluster, receiver), "each host holds both shares"
            assert_trees_bitwise_equal(state, m.restore())


def test_kill_9_of_a_receiver_mid_blob_places_the_copies_elsewhere(ramdisk):
    with LocalCluster(ramdisk / "c", 1, 4, devices_per_host=2) as cluster:
        cfg = MTCConfig(local_checkpoint_directory=str(ramdisk), cluster_spec=str(cluster.spec_path),
                        local_checkpoint_period=1)
        with CheckpointManager(cfg) as m:
            step, state, victim = save_and_catch_a_transfer(m, cluster, 1)
            cluster.kill(victim)
            assert cluster.wait(victim) == -signal.SIGKILL
            survivors = [h for h in cluster.hosts if h != victim]
            written = {h: {b for b in blob_files(cluster, h)} for h in survivors}

            def survivors_replicated() -> bool:
                # Every blob a survivor wrote is on two survivors: copies meant for the victim went elsewhere.
                held = {h: blob_files(cluster, h) for h in survivors}
                return all(sum(b in held[o] for o in survivors) >= 2 for h in survivors for b in written[h])

            wait_until(survivors_replicated, what="copies to be placed on the surviving hosts")
            assert_every_blob_verifies(cluster)
            cluster.restart(victim)  # its ramdisk survived; the temp file of the cut-off copy did not
            assert not temp_files(cluster, victim)
            rep = m.wait_for_replication()
            assert rep.complete and rep.replicated, rep
            assert_every_blob_verifies(cluster)
            assert m.latest_step() == step
            assert_trees_bitwise_equal(state, m.restore())
