"""Incoming peer copies yield to local saves (``Arrivals.receiving``, ``check_space``).

A copy received into a recycled pool file holds the whole file from its first byte; when a save
is short of that room, the copy is dropped (its socket shut down, its temp file removed) and the
save goes on. A save that would not fit even then drops nothing.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path

import numpy as np
import pytest

from mtc.shared.errors import ConfigError, InsufficientSpaceError
from mtc.shared.hashing import blob_name
from mtc.sidecar import ram
from mtc.sidecar.peer import PeerServer, receive_blob
from mtc.sidecar.peer.wire import YieldedCopyError
from mtc.sidecar.ram import RamStore

MiB = 1 << 20


def rand_bytes(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def manifest(step: int, names) -> bytes:
    return json.dumps({"step": step, "shards": [{"blob": n} for n in names]}).encode()


def save_step(store: RamStore, step: int, blobs: list[bytes]) -> None:
    names = [store.blobs.write(b)[0] for b in blobs]
    store.write_pending(step, manifest(step, names))
    store.commit(step, manifest(step, names))


def temps(store: RamStore) -> list[Path]:
    """Temp blob files that are not pool files: copies being received."""
    return [p for p in (store.root / "blobs").iterdir()
            if p.name.startswith(".tmp-") and not p.name.startswith(ram.FREE_PREFIX)]


def pool_bytes(store: RamStore) -> int:
    return store.space.usage()["free_pool_bytes"]


class StalledCopy:
    """A copy of a ``size``-byte blob received by ``receive_blob`` on its own thread; one byte, then nothing."""

    def __init__(self, store: RamStore, size: int):
        self.name = blob_name(b"a copy whose bytes stop coming")
        self._send, recv = socket.socketpair()
        recv.settimeout(60)
        self.error: BaseException | None = None
        self.done = threading.Event()

        def run():
            try:
                receive_blob(recv, store, self.name, size)
            except BaseException as e:
                self.error = e
            finally:
                recv.close()
                self.done.set()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        self._send.sendall(b"\x01")

    def close(self) -> None:
        self._send.close()
        self._thread.join(10)


@pytest.fixture
def store(tmpfs16):
    """A store on a 16 MiB tmpfs whose free pool holds one 6 MiB file, with 6 MiB of step 2 kept."""
    s = RamStore(tmpfs16 / "mtc", max_to_keep=1)
    save_step(s, 1, [rand_bytes(6 * MiB, 1)])
    save_step(s, 2, [rand_bytes(6 * MiB, 2)])  # step 1's blob goes to the free pool
    assert pool_bytes(s) == 6 * MiB
    return s


def _wait_for(what: str, cond, timeout: float = 10.0) -> None:
    ev = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        ev.wait(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_copy_in_a_recycled_file_yields_its_room_to_a_save(store):
    copy = StalledCopy(store, 6 * MiB)
    try:
        _wait_for("the copy to take the pool file", lambda: temps(store) and pool_bytes(store) == 0)
        free = store.space.usage()["free_bytes"]
        assert free < 8 * MiB  # a step of 8 MiB fits only with the copy's room
        store.space.check_space(8 * MiB, step=3)  # before: InsufficientSpaceError (the copy held the file)
        assert copy.done.wait(10)
        assert isinstance(copy.error, YieldedCopyError), copy.error
        assert isinstance(copy.error, InsufficientSpaceError)  # what replication already retries on
        msg = str(copy.error)
        assert copy.name in msg and "local save" in msg and "retries later" in msg, msg
        assert not temps(store) and not store.blobs.has(copy.name)
        assert store.space.usage()["free_bytes"] >= 8 * MiB
    finally:
        copy.close()


def test_a_save_counts_a_pool_file_a_copy_is_taking_once(store):
    """A copy between taking its pool file and holding it: a save checking its room waits for the
    take (``Arrivals.take``, ``Arrivals.settled``), then counts the file as the copy's and yields it.
    Counted nowhere, the save would fail at once with InsufficientSpaceError."""
    name = blob_name(b"a copy caught between taking its file and holding it")
    took, go, dropped = threading.Event(), threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def taker():
        taken = store.blobs.reuse_temp(6 * MiB)
        took.set()
        assert go.wait(30)
        return taken

    def receive():
        try:
            with store.arrivals.receiving(name, dropped.set) as arrival:
                os.close(store.arrivals.take(arrival, taker))
                assert dropped.wait(30)  # the save took the room back
                store.blobs.discard_temp(arrival.path)
        except BaseException as e:
            errors.append(e)

    def save():
        try:
            store.space.check_space(8 * MiB, step=3)
        except BaseException as e:
            errors.append(e)

    copy = threading.Thread(target=receive, daemon=True)
    copy.start()
    assert took.wait(30) and pool_bytes(store) == 0  # the pool file is taken, not yet held
    saver = threading.Thread(target=save, daemon=True)
    saver.start()
    saver.join(0.5)
    assert saver.is_alive() and not errors, errors  # it waits for the take instead of counting nothing
    go.set()
    saver.join(30)
    copy.join(30)
    assert not saver.is_alive() and not copy.is_alive() and not errors, errors
    assert store.space.usage()["free_bytes"] >= 8 * MiB and not temps(store)


def test_a_save_that_would_not_fit_anyway_drops_no_copy(store):
    copy = StalledCopy(store, 6 * MiB)
    try:
        _wait_for("the copy to take the pool file", lambda: temps(store) and pool_bytes(store) == 0)
        with pytest.raises(InsufficientSpaceError, match="step 3 does not fit"):
            store.space.check_space(15 * MiB, step=3)
        assert not copy.done.is_set() and len(temps(store)) == 1  # still being received
    finally:
        copy.close()
    assert copy.done.wait(10) and not isinstance(copy.error, YieldedCopyError), copy.error
    assert not temps(store)


def test_a_copy_into_a_fresh_file_holds_only_what_arrived(small_huge_tmpfs):
    s = RamStore(small_huge_tmpfs / "mtc", max_to_keep=1)
    assert s.huge_pages  # received straight into a map of the temp file
    free0 = s.space.usage()["free_bytes"]
    copy = StalledCopy(s, 6 * MiB)  # most of the 8 MiB ramdisk
    try:
        _wait_for("the copy's temp file", lambda: temps(s))
        held = free0 - s.space.usage()["free_bytes"]
        assert held <= 4 * MiB, f"a copy that sent 1 byte holds {held / MiB:.0f} MiB"  # before: all 6
        s.space.check_space(2 * MiB, step=1)  # fits beside it: nothing to take back
        assert not copy.done.is_set()
    finally:
        copy.close()
    assert copy.done.wait(10) and not temps(s)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan")])
def test_the_receive_deadline_must_be_positive(tmp_path, bad):
    with pytest.raises(ConfigError, match="receive_timeout_s"):
        PeerServer(RamStore(tmp_path / "r"), "t" * 32, receive_timeout_s=bad)
