"""A blob being read is locked shared, so another process's collection cannot recycle it under the read,
and a blob another process is recycling right now is not read (it counts as missing, never as corrupt)."""

from __future__ import annotations

import fcntl
import os

import numpy as np
import pytest

from mtc.sidecar.ram import RamStore, readers

pytestmark = pytest.mark.unit


def test_a_read_blob_cannot_be_recycled_and_a_blob_being_recycled_is_not_read(tmp_path):
    store = RamStore(tmp_path / "mtc", max_to_keep=1)
    data = np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    name, _ = store.blobs.write(data)
    path = store.blobs.path(name)
    key = (os.stat(path).st_dev, os.stat(path).st_ino)
    with store.blobs.reading(name) as (fd, size, got):
        assert got == key and size == len(data)
        # Another process's collection (its own open file description): the exclusive lock fails.
        assert not readers.rename_unless_mapped(path, tmp_path / "moved", key)
        assert path.exists()
    assert store.read_blob(name) == data
    # A collection in another process holds the exclusive lock: the read does not take the file.
    other = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(FileNotFoundError):
            with store.blobs.reading(name):
                pass
    finally:
        os.close(other)
    assert store.read_blob(name) == data and store.blobs.verify(name)
