"""One head at a time (docs/architecture.md, "One head at a time"): a second head fences the first off; a head killed
with kill -9 and started again takes over without cleanup. Both modes, real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from helpers import assert_trees_bitwise_equal
from mtc.head import CheckpointManager, MTCConfig
from mtc.shared.errors import FencedError
from mtc.sidecar.local_cluster import LocalCluster

pytestmark = pytest.mark.integration


def _state(seed: int):
    mesh = Mesh(np.array(jax.devices()), ("x",))
    rng = np.random.default_rng(seed)
    return {"w": jax.device_put(rng.standard_normal((64, 8)).astype(np.float32), NamedSharding(mesh, P("x"))),
            "b": jax.device_put(rng.integers(0, 9, (8,), dtype=np.int32), NamedSharding(mesh, P()))}


@pytest.fixture(params=["colocated", "cluster"])
def config(request, ramdisk, tmp_path):
    if request.param == "colocated":
        yield MTCConfig(local_checkpoint_directory=str(ramdisk), local_checkpoint_period=1, prefetch_on_start=False)
        return
    with LocalCluster(tmp_path / "c", 1, 2, devices_per_host=4) as cluster:
        yield MTCConfig(local_checkpoint_directory=str(tmp_path / "c"), cluster_spec=str(cluster.spec_path),
                        local_checkpoint_period=1, prefetch_on_start=False)


def test_a_second_head_fences_the_first_off(config):
    first = CheckpointManager(config)
    second = None
    try:
        first.save(1, _state(1))
        first.wait_until_finished()
        second = CheckpointManager(config)
        assert_trees_bitwise_equal(_state(1), second.restore(1))  # the second head takes the hosts
        first.save(2, _state(2))
        with pytest.raises(FencedError) as info:
            first.wait_until_finished()
        msg = str(info.value)
        assert "fenced off" in msg and f"pid {os.getpid()}" in msg and second.head["started"] in msg, msg
        with pytest.raises(FencedError):  # refused at once from now on
            first.save(3, _state(3))
        assert second.all_steps() == [1]  # the fenced save left nothing visible
        second.save(4, _state(4))
        second.wait_until_finished()
        assert second.all_steps() == [1, 4]
        assert_trees_bitwise_equal(_state(4), second.restore(4))
    finally:
        for m in (first, second):
            if m is not None:
                try:
                    m.close()
                except FencedError:
                    pass


HEAD = textwrap.dedent("""
    import os, sys, time
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    sys.path.insert(0, sys.argv[3])
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from mtc.head import CheckpointManager, MTCConfig
    from test_fencing import _state
    cfg = MTCConfig(local_checkpoint_directory=sys.argv[1], cluster_spec=sys.argv[2], local_checkpoint_period=1)
    m = CheckpointManager(cfg)
    m.save(1, _state(1))
    m.wait_until_finished()
    print("saved", flush=True)
    time.sleep(600)
""")


def test_a_head_killed_and_restarted_takes_over(config):
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.Popen([sys.executable, "-c", HEAD, config.local_checkpoint_directory, config.cluster_spec,
                             os.path.join(here, "..")], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": here + os.pathsep + os.environ.get("PYTHONPATH", "")})
    try:
        assert proc.stdout.readline().strip() == "saved"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    with CheckpointManager(config) as m:  # no cleanup: the dead head's lease is simply superseded
        assert_trees_bitwise_equal(_state(1), m.restore(1))
        m.save(2, _state(2))
        m.wait_until_finished()
        assert m.all_steps() == [1, 2]
