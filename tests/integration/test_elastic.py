"""Elastic resize in cluster mode: a job saved on one topology restores on another, bit for bit.

Each phase is its own head process (``elastic_job.py``) with as many CPU devices as its
topology has, over real sidecar daemons whose ramdisks stay under one root between phases:
losing a slice means fewer devices and the departed hosts' ramdisks out of reach; gaining
one means new hosts with empty ramdisks.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from elastic_job import state  # noqa: E402

pytestmark = pytest.mark.integration

JOB = Path(__file__).parent / "elastic_job.py"


# One job token for every phase, as a job keeps its secret across restarts (a phase that made its own
# could not read the backups the last one sealed; which phase ran first in a worker decided it).
TOKEN = secrets.token_hex(32)


def phase(root: Path, slices: int, hosts: int, devices: int, mode: str, step: int, out: Path, *extra: str) -> dict:
    r = subprocess.run([sys.executable, str(JOB), str(root), str(slices), str(hosts), str(devices), mode, str(step),
                        str(out), *extra], capture_output=True, text=True, timeout=240,
                       env=dict(os.environ, MTC_PEER_TOKEN=TOKEN))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return json.loads(Path(str(out) + ".json").read_text())


def assert_restored(out: Path, step: int) -> None:
    got = np.load(out, allow_pickle=False)
    want = state(step)
    assert sorted(got.files) == sorted(want)
    for k, v in want.items():
        g = got[k]
        assert g.shape == v.shape and g.dtype.itemsize == v.dtype.itemsize, k
        assert g.tobytes() == v.tobytes(), f"{k} differs after the resize"


def test_losing_a_slice_restores_from_the_slice_that_is_left(ramdisk, tmp_path):
    root = ramdisk / "job"
    assert phase(root, 2, 2, 8, "save", 3, tmp_path / "s")["replicated"]
    # One slice left, half the devices: the departed slice's shards come from their copies here.
    r = phase(root, 1, 2, 4, "restore", 3, tmp_path / "r.npz")
    assert_restored(tmp_path / "r.npz", 3)
    assert r["bytes_by_tier"]["peer"] > 0 and r["bytes_by_tier"]["backup"] == 0, r
    # Training goes on in the new shape: its next step saves and restores there.
    phase(root, 1, 2, 4, "save", 4, tmp_path / "s4")
    r = phase(root, 1, 2, 4, "restore", 4, tmp_path / "r4.npz")
    assert_restored(tmp_path / "r4.npz", 4)
    assert r["bytes_by_tier"]["peer"] == 0 and r["steps"][-1] == 4, r


def test_losing_a_slice_reads_no_row_on_the_head(ramdisk, tmp_path):
    """The head plans a shrink from the manifest's header, reading no shard row. Where the slices were
    data-parallel twins, the one left wrote every box: each of its hosts reads its own part and nothing
    moves. Where arrays were split over the slices too, the lost slice's parts are peer copies on the
    slice left (each host's inventory names the writers whose parts it keeps): each host pulls whole
    the parts it reads and does not keep."""
    root = ramdisk / "job"
    phase(root, 2, 2, 8, "save", 3, tmp_path / "s", "--data-parallel")
    r = phase(root, 1, 2, 4, "restore", 3, tmp_path / "r.npz", "--data-parallel")
    assert_restored(tmp_path / "r.npz", 3)
    assert r["rows_parsed"] == 0 and r["bytes_by_tier"]["peer"] == 0 and r["bytes_by_tier"]["backup"] == 0, r
    phase(root, 2, 2, 8, "save", 4, tmp_path / "s4")
    r = phase(root, 1, 2, 4, "restore", 4, tmp_path / "r4.npz")
    assert_restored(tmp_path / "r4.npz", 4)
    assert r["rows_parsed"] == 0 and r["bytes_by_tier"]["peer"] > 0, r


def test_gaining_a_slice_fills_the_new_hosts_from_peers(ramdisk, tmp_path):
    root = ramdisk / "job"
    phase(root, 1, 2, 4, "save", 5, tmp_path / "s")
    r = phase(root, 2, 2, 8, "restore", 5, tmp_path / "r.npz")  # s1-h0, s1-h1 start empty
    assert_restored(tmp_path / "r.npz", 5)
    assert r["bytes_by_tier"]["peer"] > 0 and r["bytes_by_tier"]["backup"] == 0, r


def test_more_hosts_per_slice_same_devices(ramdisk, tmp_path):
    root = ramdisk / "job"
    phase(root, 2, 2, 8, "save", 6, tmp_path / "s")
    r = phase(root, 1, 4, 8, "restore", 6, tmp_path / "r.npz")
    assert_restored(tmp_path / "r.npz", 6)
    assert r["bytes_by_tier"]["backup"] == 0, r


@pytest.mark.parametrize("slices,hosts,devices", [(1, 2, 4), (4, 2, 16)], ids=["shrink", "grow"])
def test_every_ramdisk_lost_and_resized_restores_from_the_backup_by_its_parts(ramdisk, tmp_path, slices, hosts,
                                                                                devices):
    """Saved on 2 slices, every ramdisk then lost (a new root), restored onto fewer or more slices: each
    host reads the backup manifest's header and the writers' parts its new boxes overlap by range, the
    head the header alone (no shard row), and the state comes back bit for bit."""
    backup = tmp_path / "bucket"
    phase(ramdisk / "job", 2, 2, 8, "save", 5, tmp_path / "s", "--backup", str(backup))
    r = phase(ramdisk / "new", slices, hosts, devices, "restore", 5, tmp_path / "r.npz", "--backup", str(backup))
    assert_restored(tmp_path / "r.npz", 5)
    assert r["source"] != "cluster" and r["bytes_by_tier"]["backup"] > 0 and r["bytes_by_tier"]["peer"] == 0, r
    assert r["rows_parsed"] == 0, r


def test_shards_only_the_lost_slice_held_come_from_the_backup(ramdisk, tmp_path):
    root = ramdisk / "job"
    backup = tmp_path / "bucket"
    # No peer copies (replication_factor=1): the shards unique to slice 1 live on its hosts and in
    # the backup only.
    phase(root, 2, 2, 8, "save", 7, tmp_path / "s", "--replication-factor", "1", "--backup", str(backup))
    r = phase(root, 1, 2, 4, "restore", 7, tmp_path / "r.npz", "--replication-factor", "1", "--backup", str(backup))
    assert_restored(tmp_path / "r.npz", 7)
    assert r["bytes_by_tier"]["backup"] > 0 and r["bytes_by_tier"]["peer"] == 0, r
