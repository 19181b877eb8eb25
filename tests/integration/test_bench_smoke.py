"""Smoke test of bench/bench_save_restore.py: a tiny run must finish, print its table and
restore the saved state bit for bit. Not a timed test: the ratios are not checked."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "bench_save_restore.py"


def test_bench_smoke(tmp_path):
    pytest.importorskip("orbax.checkpoint")
    # tmpfs when there is one (the benchmark's subject); any directory works for a smoke run.
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    parent = tempfile.mkdtemp(prefix="mtc-bench-smoke-", dir=shm) if shm else str(tmp_path)
    try:
        _run_and_check(parent)
    finally:
        if shm:
            shutil.rmtree(parent, ignore_errors=True)


def _run_and_check(parent: str) -> None:
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--gib", "0.03", "--repeats", "1", "--dir", parent],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{out}\nstderr:\n{proc.stderr[-4000:]}"
    assert "| check | small pages" in out, out
    assert "| what | seconds | GB/s |" in out, out
    assert "bit for bit: ok" in out, out
    for name in ("mtc save total / raw write into recycled files", "mtc save total / raw write into fresh files",
                 "mtc restore / raw read", "mtc save / orbax default save",
                 "mtc save total / Orbax ReplicatorCheckpointManager default",
                 "mtc save total / Orbax ReplicatorCheckpointManager, compression off",
                 "mtc save blocked - memcpy", "peak RSS increase / state, first save"):
        assert name in out, f"row {name!r} missing:\n{out}"
    # The scratch directory is removed at the end.
    left = os.listdir(parent)
    assert not left, f"benchmark left {left} in {parent}"


def test_bench_peer_smoke():
    """bench/bench_peer.py end to end, tiny: both fetch tables (a huge-page tmpfs as root) and replication bytes."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "bench_peer.py"), "--gib", "0.02", "--repeats", "1",
         "--state-mib", "2", "--steps", "1"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert out.count("| peer fetch rate / raw loopback copy rate (memory -> memory, best of 1 and 2 streams) |") == (
        2 if os.geteuid() == 0 else 1), out
    if os.geteuid() == 0:
        assert "ramdisk = tmpfs mounted huge=within_size" in out
    rows = {line.split("|")[1].strip(): line.split("|")[4].strip() for line in out.splitlines()
            if line.startswith("| 2 slices") or line.startswith("| 1 slice")}
    assert rows == {"2 slices x 2 hosts, data-parallel across slices": "0.00",
                    "1 slice x 4 hosts, sharded over all": "1.00"}, out


def test_bench_cluster_smoke():
    """bench/bench_cluster.py end to end, tiny: both fan-out tables (each save and ping both ways) and
    the restore rows against the raw loopback copy, with the restored state checked bit for bit."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=64", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "bench_cluster.py"), "--hosts", "1,2", "--saves", "1",
         "--gib", "0.02", "--repeats", "1"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    for row in ("| 2 | ", "| cluster restore / raw loopback copy |", "| cluster restore (streamed, hashed by the head) |",
                "serial / inline"):
        assert row in out, f"{row!r} missing:\n{out}"
