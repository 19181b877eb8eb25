"""Files someone else put in a host's ramdisk folder (another container on the volume, a shared
directory): a FIFO, a link to a FIFO or to a secret, under the names of a step manifest, the head's
lease, the host note, a blob. Real sidecar daemons read none of them through the link or block on
them: the daemon starts, lists, saves and restores as before, bit for bit, and the tools that read
a stopped job's folders do too."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from mtc.head.manager import CheckpointManager
from mtc.shared.config import MTCConfig
from mtc.sidecar.local_cluster import LocalCluster

pytestmark = pytest.mark.integration


def _state(step: int) -> dict:
    return {"w": np.random.default_rng(step).standard_normal(4096).astype(np.float32), "step": np.int64(step)}


def _manager(cluster: LocalCluster) -> CheckpointManager:
    return CheckpointManager(MTCConfig(local_checkpoint_directory=str(cluster.root), cluster_spec=str(cluster.spec_path),
                                       local_checkpoint_period=1, local_max_to_keep=5, prefetch_on_start=False))


def _fifo(path) -> None:
    os.mkfifo(path, 0o666)


def test_planted_fifos_and_links_in_a_ramdisk_block_nothing_and_are_not_followed(ramdisk, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("a secret of this machine")
    elsewhere = tmp_path / "fifo"
    _fifo(elsewhere)
    with LocalCluster(ramdisk / "c", 1, 1, devices_per_host=len(jax.devices())) as cluster:
        (host,) = cluster.hosts
        root = cluster.store_root(host)
        with _manager(cluster) as m:
            for step in (1, 2):
                m.save(step, _state(step))
                m.wait_until_finished()
        steps = root / "steps"
        _fifo(steps / "000000000003.json")  # opening it for reading would block until a writer came
        os.symlink(elsewhere, steps / "000000000004.json")  # a link to a FIFO
        os.symlink(secret, steps / "000000000005.json")  # a link to a secret
        (root / "host.json").unlink()
        _fifo(root / "host.json")
        cluster.kill(host)
        cluster.restart(host)  # the daemon starts (it rewrites its host note) and serves
        with _manager(cluster) as m:
            assert m.all_steps() == [1, 2]
            got = m.restore(2)
            np.testing.assert_array_equal(got["w"], _state(2)["w"])
            assert got["step"] == 2
            m.save(6, _state(6))
            m.wait_until_finished()
            assert m.all_steps() == [1, 2, 6]
        log = cluster.log_path(host).read_text(errors="replace")
        assert "Traceback" not in log, log[-3000:]
        assert "a secret of this machine" not in log
    assert os.path.isfile(root / "host.json") and not os.path.islink(root / "host.json")
    # The tools on the stopped job's folder: the same steps, no hang.
    r = subprocess.run([sys.executable, "-m", "mtc.head.tools.cli", "status", "--local-checkpoint-directory",
                        str(root.parent)], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1"))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout + r.stderr[-3000:]
    assert "6" in r.stdout


def test_a_blob_name_planted_as_a_link_is_not_a_copy_and_the_restore_takes_the_peer(ramdisk, tmp_path):
    """A blob's file replaced by a link to a secret: not read through the link (nothing of the secret
    leaves the host), taken as missing, and the step restores from the other slice's copy."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * 64)
    with LocalCluster(ramdisk / "c", 2, 1, devices_per_host=len(jax.devices()) // 2) as cluster:
        with _manager(cluster) as m:
            m.save(1, _state(1))
            m.wait_until_finished()
            m.wait_for_replication()
        host = cluster.hosts[0]
        blobs = cluster.store_root(host) / "blobs"
        for p in [p for p in blobs.rglob("*") if p.is_file()]:
            p.unlink()
            os.symlink(secret, p)
        with _manager(cluster) as m:
            got = m.restore(1)
            np.testing.assert_array_equal(got["w"], _state(1)["w"])
