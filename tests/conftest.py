"""Test setup shared by every test: 8 CPU devices, a tmpfs ramdisk folder per test."""

from __future__ import annotations

import os

# Must happen before jax is imported anywhere in the test session.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

_SHM = Path("/dev/shm")


@pytest.fixture
def ramdisk():
    """A fresh directory on tmpfs (/dev/shm when present), removed afterwards."""
    base = _SHM if _SHM.is_dir() and os.access(_SHM, os.W_OK) else None
    d = Path(tempfile.mkdtemp(prefix="mtc-test-", dir=base))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def tmpfs16(tmp_path):
    """A real 16 MiB tmpfs mount (a ramdisk that fills up), unmounted afterwards; needs root."""
    mnt = tmp_path / "ramdisk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a 16 MiB tmpfs (needs root): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
