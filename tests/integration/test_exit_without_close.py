"""A training script that never closes its manager (MaxText's does not) still exits promptly.

Python joins executor threads at exit before atexit handlers run; a replication retry loop
left running would keep the process alive for its whole patience (half an hour).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from mtc.sidecar.local_cluster import LocalCluster

pytestmark = pytest.mark.integration

SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from mtc.head import CheckpointManager, MTCConfig
    mesh = Mesh(np.array(jax.devices()), ("x",))
    m = CheckpointManager(MTCConfig(local_checkpoint_directory=sys.argv[1], cluster_spec=sys.argv[2],
                                    local_checkpoint_period=1))
    rng = np.random.default_rng(0)
    state = {f"w{i}": jax.device_put(rng.standard_normal((1024, 1024), np.float32), NamedSharding(mesh, P("x")))
             for i in range(16)}
    m.save(0, state)
    m.wait_until_finished()  # committed; replication to the other host is now running
    print("saved", flush=True)
    # no m.close(): the script just ends
""")


def test_process_exits_while_replication_runs(tmp_path):
    with LocalCluster(tmp_path / "c", 1, 2, devices_per_host=2) as cluster:
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "c"), str(cluster.spec_path)],
                           capture_output=True, text=True, timeout=120)
        took = time.monotonic() - t0
    assert r.returncode == 0 and "saved" in r.stdout, r.stderr[-3000:]
    assert took < 60, f"the script took {took:.0f} s to exit"
