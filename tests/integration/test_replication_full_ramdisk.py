"""A host whose ramdisk fills while its peer copies arrive: ``wait_for_replication`` comes back in
bounded time and says which step, which host and how much room it lacks; replication goes on in the
background (``step_status()``, ``mtc status`` say so) and completes once the room is there."""

from __future__ import annotations

import inspect
import json
import os
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import mtc.head.replication.loop as replication_loop
from helpers import assert_trees_bitwise_equal
from mtc.head import CheckpointManager, MTCConfig
from mtc.head.tools.cli.main import main
from mtc.sidecar.local_cluster import LocalCluster

pytestmark = pytest.mark.integration

MIB = 1 << 20


def _fill(path, leave: int) -> None:
    """Write a filler file into ``path`` until ``leave`` bytes are free (as another tenant would)."""
    st = os.statvfs(path)
    fill = st.f_bavail * st.f_frsize - leave
    with open(path / "filler", "wb") as f:
        while fill > 0:
            n = min(fill, MIB)
            f.write(b"\xa5" * n)
            fill -= n


def test_a_full_ramdisk_while_copies_arrive_does_not_block_wait_for_replication(ramdisk, tmpfs16, capsys):
    root = ramdisk / "c"
    root.mkdir()
    (root / "s1-h0").symlink_to(tmpfs16)  # the host of slice 1 has a 16 MiB ramdisk; slice 0's is large
    # 8 MiB over 8 devices, 4 per host, one host per slice: each host writes 4 MiB and must keep a
    # copy of the other's 4 MiB (FSDP across slices).
    sh = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
    state = {"w": jax.device_put(np.random.default_rng(7).standard_normal(2 * MIB, dtype=np.float32), sh)}
    with LocalCluster(root, 2, 1, devices_per_host=4) as cluster:
        cfg = MTCConfig(local_checkpoint_directory=str(root), cluster_spec=str(cluster.spec_path),
                        local_checkpoint_period=1, prefetch_on_start=False)
        _fill(tmpfs16, 6 * MIB + 512 * 1024)  # room for its own 4 MiB, not for the 4 MiB of copies as well
        with CheckpointManager(cfg) as m:
            m.save(1, state)
            m.wait_until_finished()

            # The wait is bounded: by default a minute (documented), here 4 s.
            default = inspect.signature(m.wait_for_replication).parameters["timeout"].default
            assert default == replication_loop.REPLICATION_WAIT_S and 0 < default <= 120, default
            t0 = time.monotonic()
            rep = m.wait_for_replication(timeout=4)
            waited = time.monotonic() - t0
            assert waited < 20, f"wait_for_replication(timeout=4) took {waited:.0f} s"
            assert rep.step == 1 and rep.in_progress and not rep.complete and not rep.replicated, rep
            assert "step 1" in rep.error and "s1-h0" in rep.error, rep.error
            assert "MiB" in rep.error and "lacks" in rep.error and "ramdisk" in rep.error, rep.error
            assert "in the background" in rep.error, rep.error
            assert rep.short_of_copies and set(rep.short_of_copies) == {"s1-h0"}, rep
            t0 = time.monotonic()
            rep = m.wait_for_replication(timeout=1.0)
            assert time.monotonic() - t0 < 10 and rep.in_progress and "s1-h0" in rep.short_of_copies, rep

            # Still retrying in the background, and step_status() says so, with the reason.
            st = {s.step: s for s in m.step_status()}[1]
            assert st.restorable and not st.replicated and st.replicating, st
            assert "s1-h0" in st.short_of_copies and "lacks" in st.short_of_copies["s1-h0"], st

            # mtc status (another process's view, from the hosts) says so too.
            assert main(["status", "--cluster-spec", str(cluster.spec_path), "--json"]) == 0
            row = {r["step"]: r for r in json.loads(capsys.readouterr().out)["steps"]}[1]
            assert not row["replicated"] and "s1-h0" in row["replication"], row
            assert "lacks" in row["replication"] and "retries" in row["replication"], row

            # The room comes back: the background replication, which never stopped, completes.
            (tmpfs16 / "filler").unlink()
            rep = m.wait_for_replication(timeout=60)
            assert rep.step == 1 and rep.complete and rep.replicated and not rep.in_progress, rep
            assert rep.attempts > 1 and rep.moved_bytes >= 4 * MIB, rep
            st = {s.step: s for s in m.step_status()}[1]
            assert st.replicated and not st.replicating and not st.short_of_copies, st
            assert main(["status", "--cluster-spec", str(cluster.spec_path), "--json"]) == 0
            row = {r["step"]: r for r in json.loads(capsys.readouterr().out)["steps"]}[1]
            assert row["replicated"] and not row["replication"], row

        # The copies are good: slice 0's host is replaced (empty ramdisk) and the step comes back
        # from the copies on slice 1, bit for bit.
        cluster.wipe("s0-h0")
        cluster.restart("s0-h0")
        with CheckpointManager(cfg) as m:
            assert_trees_bitwise_equal(state, m.restore(1))
            assert m.last_restore_report.bytes_by_tier["peer"] == 4 * MIB, m.last_restore_report
