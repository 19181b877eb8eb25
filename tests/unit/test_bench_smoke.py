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


@pytest.mark.integration
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
    assert "| check | measured | target | result |" in out, out
    assert "| what | seconds | GB/s |" in out, out
    assert "bit for bit: ok" in out, out
    for name in ("mtc save total / raw write", "mtc restore / raw read", "mtc save / orbax default save",
                 "mtc save blocked - memcpy", "peak RSS increase / state, first save"):
        assert name in out, f"row {name!r} missing:\n{out}"
    # The scratch directory is removed at the end.
    left = os.listdir(parent)
    assert not left, f"benchmark left {left} in {parent}"
