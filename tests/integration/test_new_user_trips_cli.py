"""What a new user tripped over in the CLI, each pinned with a test that fails without its fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mtc.head import CheckpointManager, MTCConfig
from mtc.sidecar.local_cluster import LocalCluster

pytestmark = pytest.mark.integration

WITHOUT = "import sys; [sys.modules.__setitem__(m, None) for m in sys.argv[1].split(',')]; " \
          "from mtc.head.tools.cli.main import main; sys.exit(main(sys.argv[2:]))"


def cli_without(modules: str, *args: str) -> subprocess.CompletedProcess:
    """The CLI as after a plain ``pip install mtc``: ``modules`` cannot be imported."""
    return subprocess.run([sys.executable, "-c", WITHOUT, modules, *args], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1"))


def test_status_when_hosts_do_not_answer_exits_1_and_plain_status_needs_no_rich(tmp_path, monkeypatch):
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    with LocalCluster(tmp_path / "c", 1, 2, devices_per_host=4) as cluster:
        monkeypatch.setenv("MTC_PEER_TOKEN", cluster.peer_token)
        cfg = MTCConfig(local_checkpoint_directory=str(tmp_path / "c"), cluster_spec=str(cluster.spec_path),
                        local_checkpoint_period=1)
        with CheckpointManager(cfg) as m:
            m.save(1, {"w": jax.device_put(np.ones((16, 8), np.float32), NamedSharding(mesh, P("data", "model")))})
            m.wait_until_finished()
        ok = cli_without("rich", "status", "--cluster-spec", str(cluster.spec_path))
        assert ok.returncode == 0, ok.stderr[-2000:]
        assert "<- restore" in ok.stdout and "Traceback" not in ok.stderr
        cluster.kill("s0-h1")
        down = cli_without("rich", "status", "--cluster-spec", str(cluster.spec_path))
        assert down.returncode == 1, down.stdout + down.stderr[-2000:]
        assert "1 of 2 hosts did not answer" in down.stderr and "Traceback" not in down.stderr
        as_json = subprocess.run([sys.executable, "-m", "mtc.head.tools.cli", "status", "--json", "--cluster-spec",
                                  str(cluster.spec_path)], capture_output=True, text=True, timeout=300)
        assert as_json.returncode == 1 and "s0-h1" in json.loads(as_json.stdout)["unreachable"]


def test_manifests_check_without_the_k8s_extra_says_it_once(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text("apiVersion: jobset.x-k8s.io/v1alpha2\nkind: JobSet\n")
    r = cli_without("yaml", "manifests", "check", str(f))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.count("mtc[k8s]") == 1, r.stderr
