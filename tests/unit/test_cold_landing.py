"""Cold landings: the first saves on a fresh ramdisk are written with ``write()``, not through maps.

A new file's map would take a page fault per page from user space; so a landing without a warm
map is filled with ``pwrite`` (hashed as it is written), and its map is filled in afterwards, in
the background, so that when the file comes back from the free pool the save is one memcpy.
Pinned here on real files and the real colocated path: a cold save lands the same blobs and
the same manifest as a warm one, bit for bit after restore; the maps do come back warm; a
kernel that refuses ``MADV_POPULATE_WRITE`` gets the fallback, logged once; a fill that runs out
of room is an error the caller can stage around, and leaves nothing behind.
"""

from __future__ import annotations

import errno
import gc
import logging

import numpy as np
import pytest

from mtc.shared import format as fmt
from mtc.shared.hashing import blob_name
from mtc.sidecar import ram
from mtc.sidecar.ram import RamStore
from mtc.sidecar.ram import mapped as landing_mod
from mtc.sidecar.service import SidecarService

KiB, MiB = 1 << 10, 1 << 20


def rand(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def manifest(step: int, names) -> bytes:
    import json
    return json.dumps({"step": step, "shards": [{"blob": n} for n in names]}).encode()


def temps(store: RamStore) -> list:
    return [p for p in (store.root / "blobs").iterdir()
            if p.name.startswith(ram.TMP_PREFIX) and not p.name.startswith(ram.FREE_PREFIX)]


def fill_step(store: RamStore, step: int, blobs: list[np.ndarray]) -> list[bool]:
    """Save ``blobs`` as ``step`` through landings as the colocated head does (fill the cold
    ones, copy into the warm ones); whether each landing was cold."""
    names, colds = [], []
    with store.landings.land([b.nbytes for b in blobs], cold_ok=True) as batch:
        for data, x in zip(blobs, batch.landings):
            colds.append(x.cold)
            if x.cold:
                x.fill(data)
                name = x.name
            else:
                np.copyto(x.buffer, data)
                name = blob_name(x.buffer)
            store.landings.publish(x, name)
            names.append(name)
    store.write_pending(step, manifest(step, names))
    store.commit(step, manifest(step, names))
    return colds


@pytest.mark.unit
def test_cold_landings_are_filled_then_come_back_from_the_pool_warm(tmp_path):
    store = RamStore(tmp_path / "mtc", max_to_keep=1)
    steps = {s: [rand(256 * KiB, 10 * s + i) for i in range(3)] for s in range(1, 5)}
    assert fill_step(store, 1, steps[1]) == [True, True, True]  # a fresh ramdisk: nothing is warm
    assert store.landings.warmer.drain(timeout=30)
    assert store.landings.warmer.warmed == 3
    assert fill_step(store, 2, steps[2]) == [True, True, True]  # step 1 is still kept: no pool yet
    assert store.landings.warmer.drain(timeout=30)
    # Committing 2 pruned 1: its files (warmed) are the pool; this save copies into their maps.
    assert fill_step(store, 3, steps[3]) == [False, False, False]
    assert fill_step(store, 4, steps[4]) == [False, False, False]
    assert store.landings.filled_bytes == 6 * 256 * KiB and store.landings.landed_bytes == 12 * 256 * KiB
    for s in (4,):
        for d in steps[s]:
            assert store.read_blob(blob_name(d)) == d.tobytes() and store.blobs.verify(blob_name(d))
    assert temps(store) == []


@pytest.mark.unit
def test_the_warmer_holds_off_while_a_save_is_landing(tmp_path):
    store = RamStore(tmp_path / "mtc", max_to_keep=2)
    fill_step(store, 1, [rand(256 * KiB, 20)])
    with store.landings.land([256 * KiB], cold_ok=True) as batch:  # the next save is landing
        (x,) = batch.landings
        x.fill(rand(256 * KiB, 21))
        assert not store.landings.warmer.drain(timeout=1.0)  # step 1's map waits for it
        assert store.landings.warmer.warmed == 0
        store.landings.publish(x, x.name)
    assert store.landings.warmer.drain(timeout=30) and store.landings.warmer.warmed == 2


@pytest.mark.unit
def test_a_kernel_that_refuses_populate_write_gets_the_fallback_logged_once(tmp_path, monkeypatch, caplog):
    # An advice value no kernel knows: madvise answers EINVAL, as a kernel before 5.14 does for
    # MADV_POPULATE_WRITE. The maps are then warmed by a MAP_POPULATE remap.
    monkeypatch.setattr(landing_mod, "MADV_POPULATE_WRITE", 9999)
    monkeypatch.setattr(landing_mod, "_madvise_ok", True)
    caplog.set_level(logging.INFO, logger=landing_mod.__name__)
    store = RamStore(tmp_path / "mtc", max_to_keep=1)
    a, b, c = ([rand(128 * KiB, 100 * s + i) for i in range(2)] for s in range(3))
    fill_step(store, 1, a)
    assert store.landings.warmer.drain(timeout=30)  # before committing 2 renames step 1's files into the pool
    fill_step(store, 2, b)
    assert store.landings.warmer.drain(timeout=30) and store.landings.warmer.warmed == 4
    assert fill_step(store, 3, c) == [False, False]  # warm, through the remapped maps
    for d in c:
        assert store.read_blob(blob_name(d)) == d.tobytes()
    refusals = [r for r in caplog.records if "MADV_POPULATE_WRITE" in r.getMessage()]
    assert len(refusals) == 1, [r.getMessage() for r in refusals]


def test_a_fill_that_runs_out_of_room_is_declined_and_leaves_nothing(tmpfs16):
    from mtc.sidecar.colocated import _Zone

    svc = SidecarService(tmpfs16 / "mtc", max_to_keep=1)
    try:
        zone = _Zone(svc)
        bufs = zone.reserve([6 * MiB, 6 * MiB])
        assert all(b is not None for b in bufs)
        fills = [zone.filler(b) for b in bufs]
        assert all(f is not None for f in fills)  # new files: cold, not allocated yet
        hog = tmpfs16 / "hog"
        with open(hog, "wb") as f:  # another writer takes the room between reserve and fill
            f.write(b"\0" * (8 * MiB))
        assert fills[0](rand(6 * MiB, 1)) is True
        assert fills[1](rand(6 * MiB, 2)) is False  # ENOSPC: declined, the head stages it
        zone.release()
        assert temps(svc.store) == []
        del bufs, fills  # the maps of the removed files go with the last buffer over them
        gc.collect()
        hog.unlink()
        # A landing filled by hand past the room raises the OSError itself.
        with svc.store.landings.land([6 * MiB], cold_ok=True) as batch:
            (x,) = batch.landings
            with open(hog, "wb") as f:
                f.write(b"\0" * (11 * MiB))
            with pytest.raises(OSError) as e:
                x.fill(rand(6 * MiB, 3))
            assert e.value.errno in (errno.ENOSPC, errno.EDQUOT)
        assert temps(svc.store) == []
    finally:
        svc.close()


@pytest.mark.unit
@pytest.mark.parametrize("pages", ["ramdisk", "huge_tmpfs"])  # 4 KiB pages: hashed as filled; 2 MiB: after
def test_a_colocated_save_on_a_fresh_ramdisk_lands_what_a_warm_one_lands(pages, request):
    ramdisk = request.getfixturevalue(pages)
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from mtc.head import CheckpointManager, MTCConfig
    from mtc.shared import landing_zones

    devices = jax.devices()
    sharding = NamedSharding(Mesh(np.array(devices), ("d",)), P("d", None))
    rows = 64 * len(devices)
    hosts = [np.random.default_rng(s).random((rows, 1024), np.float32) for s in range(3)]  # 256 KiB shards
    target = {"w": jax.ShapeDtypeStruct(hosts[0].shape, hosts[0].dtype, sharding=sharding)}
    cfg = MTCConfig(local_checkpoint_directory=str(ramdisk), local_checkpoint_period=1, local_max_to_keep=1)
    # Steps 0..4 hold different values; step 5 holds step 0's again, saved into warm maps.
    plan = [hosts[0], hosts[1], hosts[2], hosts[1], hosts[2], hosts[0]]
    with CheckpointManager(cfg) as mgr:
        filled, names = [], {}
        for step, host in enumerate(plan):
            mgr.latest_step()  # the sidecar (and its landing zone) is up
            store = landing_zones.find(cfg.ramdisk_root)._service.store
            before = (store.landings.filled_bytes, store.landings.landed_bytes)
            mgr.save(step, {"w": jax.device_put(host, sharding)}, force=True)
            mgr.wait_until_finished()
            assert store.landings.warmer.drain(timeout=30)
            filled.append((store.landings.filled_bytes - before[0], store.landings.landed_bytes - before[1]))
            names[step] = fmt.collect_blob_names(store.catalog.read(step))
            out = mgr.restore(step, target=target)
            assert np.asarray(out["w"]).tobytes() == host.tobytes()
        assert filled[0] == (hosts[0].nbytes, hosts[0].nbytes)  # cold: every shard written with write()
        assert filled[5] == (0, hosts[0].nbytes)  # warm: every shard copied into a kept map
        assert names[5] == names[0]
        assert store.huge_pages == (pages == "huge_tmpfs")


# --- cluster mode: a daemon receives a write into cold landings ------------------------------


def test_a_daemon_receives_a_fresh_ramdisks_first_saves_with_write_then_into_warm_maps(ramdisk, inprocess_daemon):
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from mtc.head import CheckpointManager, MTCConfig

    svc, spec = inprocess_daemon(max_to_keep=1)
    devices = jax.devices()
    sharding = NamedSharding(Mesh(np.array(devices), ("d",)), P("d", None))
    hosts = [np.random.default_rng(80 + s).random((64 * len(devices), 1024), np.float32) for s in range(4)]
    target = {"w": jax.ShapeDtypeStruct(hosts[0].shape, hosts[0].dtype, sharding=sharding)}
    cfg = MTCConfig(local_checkpoint_directory=str(ramdisk / "head"), cluster_spec=str(spec),
                    local_checkpoint_period=1, local_max_to_keep=1)
    moved = []
    with CheckpointManager(cfg) as mgr:
        for step, host in enumerate(hosts):
            before = (svc.store.landings.filled_bytes, svc.store.landings.landed_bytes)
            mgr.save(step, {"w": jax.device_put(host, sharding)}, force=True)
            mgr.wait_until_finished()
            assert svc.store.landings.warmer.drain(timeout=30)
            moved.append((svc.store.landings.filled_bytes - before[0], svc.store.landings.landed_bytes - before[1]))
            assert np.asarray(mgr.restore(step, target=target)["w"]).tobytes() == host.tobytes()
    n = hosts[0].nbytes
    assert moved[0] == (n, n) and moved[1] == (n, n)  # new files: received with pwrite
    assert moved[3] == (0, n)  # step 1's files, back from the pool with warm maps: received in place


def test_a_receive_that_finds_the_ramdisk_full_goes_on_into_memory(tmpfs16):
    import socket
    import threading

    from mtc.sidecar.ram.mapped import LandingSink

    store = RamStore(tmpfs16 / "mtc", max_to_keep=1)
    data = rand(6 * MiB, 90)
    a, b = socket.socketpair()
    try:
        with store.landings.land([data.nbytes], cold_ok=True) as batch:
            (x,) = batch.landings
            assert x.cold
            with open(tmpfs16 / "hog", "wb") as f:  # the room goes to another writer first
                f.write(b"\0" * (11 * MiB))
            sender = threading.Thread(target=lambda: (a.sendall(data), a.sendall(b"next")))
            sender.start()
            sink = LandingSink(x)
            assert sink.receive(b.recv_into, data.nbytes) == data.nbytes
            sender.join()
            assert sink.buffer is not x.buffer and not x.filled  # spilled: not the landing any more
            assert bytes(sink.buffer) == data.tobytes()
            assert b.recv(16) == b"next"  # the connection is still in step
        assert temps(store) == []
    finally:
        a.close()
        b.close()
