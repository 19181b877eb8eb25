"""Fixtures for tests with real sidecar daemons."""

from __future__ import annotations

import pytest

from mtc.sidecar.local_cluster import LocalCluster


@pytest.fixture
def local_cluster(ramdisk):
    """2 slices x 2 hosts x 2 devices of real daemons (the head's 8 CPU devices), stopped afterwards."""
    with LocalCluster(ramdisk / "cluster", 2, 2, devices_per_host=2) as cluster:
        yield cluster


# GCS emulator servers and object store backends (tests/integration/gcs_emulators.py).
from gcs_emulators import (  # noqa: E402,F401
    emulator_factory,
    fake_gcs_server,
    gcp_storage_emulator,
    store_backend,
)
