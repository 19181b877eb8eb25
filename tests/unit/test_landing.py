"""One copy per save: shards land in mapped ramdisk files and are published where they lie.

Pinned here, on real files (no mocks): a landing becomes a committed blob only through its
hash, whole; an equal blob that exists already is not written again; a failed save leaves no
visible file; landings are pool files (pages of pruned steps, their maps kept from one save to
the next) or new files whose space is taken first; a map never holds the pages of a file that
was deleted; a ramdisk without room for every shard lands none (the caller stages and the
store hashes first); a colocated save on a CPU backend goes through landings end to end, and
a train step that donates the state right after ``save`` returns cannot change what is saved.
"""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import numpy as np
import pytest

from mtc.shared.hashing import blob_name
from mtc.sidecar import ram
from mtc.sidecar.ram import RamStore
from mtc.sidecar.ram.mapped import LANDING_MIN
from mtc.sidecar.service import SidecarService

KiB, MiB = 1 << 10, 1 << 20


def rand(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def manifest(step: int, names) -> bytes:
    return json.dumps({"step": step, "shards": [{"blob": n} for n in names]}).encode()


def land_step(store: RamStore, step: int, blobs: list[np.ndarray]) -> tuple[list[str], list[int]]:
    """Save ``blobs`` as ``step`` through landings; (names, buffer addresses)."""
    batch = store.landings.land([b.nbytes for b in blobs])
    assert all(buf is not None for buf in batch.buffers), "every shard should have landed"
    names, addresses = [], []
    with batch:
        for data, x in zip(blobs, batch.landings):
            np.copyto(x.buffer, data)
            name = blob_name(x.buffer)
            store.landings.publish(x, name)
            names.append(name)
            addresses.append(x.address)
    store.write_pending(step, manifest(step, names))
    store.commit(step, manifest(step, names))
    return names, addresses


def temps(store: RamStore, *, pool: bool = False) -> list[Path]:
    """Temp files in blobs/ (landings in flight), pool files only with ``pool``."""
    return [p for p in (store.root / "blobs").iterdir()
            if p.name.startswith(ram.TMP_PREFIX) and (pool or not p.name.startswith(ram.FREE_PREFIX))]


def mapped_inodes(root: Path) -> set[int]:
    """Inodes of the files under ``root`` this process maps (a landed file keeps the name it was
    mapped under in /proc/self/maps, "(deleted)" once renamed: the inode is what counts)."""
    with open("/proc/self/maps") as f:
        return {int(line.split()[4]) for line in f if str(root) in line}


def file_inodes(store: RamStore) -> set[int]:
    return {p.stat().st_ino for p in (store.root / "blobs").iterdir()}


@pytest.mark.unit
def test_a_landing_is_published_under_its_hash_whole(tmp_path):
    store = RamStore(tmp_path / "mtc")
    data = [rand(256 * KiB, 1), rand(LANDING_MIN, 2)]
    names, _ = land_step(store, 1, data)
    for name, d in zip(names, data):
        assert store.read_blob(name) == d.tobytes()
        assert store.blobs.verify(name)
    assert store.landings.landed_bytes == sum(d.nbytes for d in data)
    assert temps(store) == []


@pytest.mark.unit
def test_small_shards_are_not_landed(tmp_path):
    store = RamStore(tmp_path / "mtc")
    with store.landings.land([LANDING_MIN - 1, 0, LANDING_MIN]) as batch:
        assert [b is None for b in batch.buffers] == [True, True, False]
    assert temps(store) == []


@pytest.mark.unit
def test_an_equal_blob_that_exists_is_not_written_again(tmp_path):
    store = RamStore(tmp_path / "mtc")
    d = rand(128 * KiB, 3)
    (name,), _ = land_step(store, 1, [d])
    before = store.blobs.path(name).stat().st_ino
    with store.landings.land([d.nbytes]) as batch:
        (x,) = batch.landings
        np.copyto(x.buffer, d)
        assert store.landings.publish(x, blob_name(x.buffer)) is False
    assert store.blobs.path(name).stat().st_ino == before  # the committed file was not replaced
    assert temps(store) == []
    assert store.landings.landed_bytes == d.nbytes


@pytest.mark.unit
def test_a_failed_save_leaves_no_visible_file(tmp_path):
    store = RamStore(tmp_path / "mtc")
    with pytest.raises(RuntimeError):
        with store.landings.land([256 * KiB, 256 * KiB]) as batch:
            np.copyto(batch.buffers[0], rand(256 * KiB, 4))
            raise RuntimeError("the save failed half way")
    assert temps(store) == [] and store.blobs.names() == set()
    # A landing given up cannot be published afterwards.
    with pytest.raises(ValueError, match="already published or discarded"):
        store.landings.publish(batch.landings[0], blob_name(batch.buffers[0]))


@pytest.mark.unit
def test_landings_reuse_pruned_files_and_their_maps(tmp_path):
    store = RamStore(tmp_path / "mtc", max_to_keep=1)
    size = 512 * KiB
    names1, addr1 = land_step(store, 1, [rand(size, 10), rand(size, 11)])
    inodes1 = {store.blobs.path(n).stat().st_ino for n in names1}
    land_step(store, 2, [rand(size, 12), rand(size, 13)])  # step 1 is pruned into the pool
    names3, addr3 = land_step(store, 3, [rand(size, 14), rand(size, 15)])
    assert {store.blobs.path(n).stat().st_ino for n in names3} == inodes1  # its pages, rewritten in place
    assert set(addr3) == set(addr1)  # and the same maps: no page faults the second time
    for n, seed in zip(names3, (14, 15)):
        assert store.read_blob(n) == rand(size, seed).tobytes()


@pytest.mark.unit
def test_a_deleted_blob_is_not_held_by_a_kept_map(tmp_path):
    root = tmp_path / "mtc"
    store = RamStore(root, max_to_keep=1, free_pool=False)  # collected files are unlinked, not pooled
    (n1,), _ = land_step(store, 1, [rand(256 * KiB, 20)])
    gc.collect()
    first = store.blobs.path(n1).stat().st_ino
    assert mapped_inodes(root) == {first}  # kept for the next save
    land_step(store, 2, [rand(256 * KiB, 21)])  # step 1's blob is unlinked: its map must go
    gc.collect()
    assert first not in mapped_inodes(root)
    assert mapped_inodes(root) <= file_inodes(store)


@pytest.mark.unit
def test_a_restored_map_is_never_landed_in(tmp_path):
    store = RamStore(tmp_path / "mtc", max_to_keep=1)
    d = rand(256 * KiB, 30)
    (name,), _ = land_step(store, 1, [d])
    restored = store.blobs.map(name, d.nbytes)  # what a restore holds
    for step in range(2, 5):  # same sizes: the pool would love that file
        land_step(store, step, [rand(256 * KiB, 30 + step)])
        assert restored.tobytes() == d.tobytes(), f"the restored array changed at step {step}"


@pytest.mark.unit
def test_closing_the_store_lets_go_of_its_maps(tmp_path):
    root = tmp_path / "mtc"
    store = RamStore(root)
    land_step(store, 1, [rand(256 * KiB, 40)])
    with store.landings.land([256 * KiB]):
        store.close()  # also drops a landing in flight
    gc.collect()
    assert mapped_inodes(root) == set() and temps(store) == []


def test_no_room_for_every_shard_lands_none(tmpfs16):
    store = RamStore(tmpfs16 / "mtc", max_to_keep=1)
    with store.landings.land([6 * MiB, 6 * MiB, 6 * MiB]) as batch:  # 18 MiB do not fit in 16
        assert batch.buffers == [None, None, None]
    assert temps(store) == [] and store.space.usage()["blob_bytes"] == 0
    with store.landings.land([6 * MiB, 6 * MiB]) as batch:
        assert all(b is not None for b in batch.buffers)
        assert store.space.usage()["free_bytes"] < 5 * MiB  # fallocated: the space is taken before any byte


def test_write_shards_hashes_first_when_only_dedupe_makes_the_step_fit(tmpfs16):
    # A step of unchanged shards needs no new space; landing it would. The service stages the
    # shards in memory, hashes them first and writes nothing.
    svc = SidecarService(tmpfs16 / "mtc", max_to_keep=1)
    try:
        shards = [(0, ((0, 6 * MiB),), rand(6 * MiB, 50)), (1, ((0, 6 * MiB),), rand(6 * MiB, 51))]
        with svc.store.landings.land([s[2].nbytes for s in shards]) as batch:
            for (a, box, d), buf in zip(shards, batch.buffers):
                np.copyto(buf, d)
            m = svc.saves.write_shards(1, [(a, box, buf) for (a, box, _), buf in zip(shards, batch.buffers)])
        # Step 1 stays pending: its host manifest keeps its blobs alive.
        assert m.written_bytes == 12 * MiB and svc.store.landings.landed_bytes == 12 * MiB
        with svc.store.landings.land([6 * MiB, 6 * MiB]) as batch:
            assert batch.buffers == [None, None]  # 12 MiB more do not fit
        m2 = svc.saves.write_shards(2, shards)
        assert m2.written_bytes == 0 and {s.blob for s in m2.shards} == {s.blob for s in m.shards}
    finally:
        svc.close()


# --- colocated, end to end ------------------------------------------------------------------


@pytest.mark.unit
def test_a_colocated_save_lands_its_shards_and_donation_after_save_is_safe(ramdisk):
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from mtc.head import CheckpointManager, MTCConfig
    from mtc.shared import landing_zones

    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("d",))
    sharding = NamedSharding(mesh, P("d", None))
    rows = 64 * len(devices)
    host = np.random.default_rng(60).random((rows, 1024), np.float32)  # 256 KiB per shard
    saved = host.copy()
    state = {"w": jax.device_put(host, sharding), "n": np.arange(LANDING_MIN, dtype=np.int32), "k": 7}
    bump = jax.jit(lambda s: {**s, "w": s["w"] * 2 + 1}, donate_argnums=0)
    cfg = MTCConfig(local_checkpoint_directory=str(ramdisk), local_checkpoint_period=1, local_max_to_keep=2)
    with CheckpointManager(cfg) as mgr:
        mgr.save(1, state, force=True)
        state = bump({"w": state["w"]})  # the train step donates the saved buffers at once
        jax.block_until_ready(state)
        mgr.wait_until_finished()
        store = landing_zones.find(cfg.ramdisk_root)._service.store
        assert store.landings.landed_bytes == saved.nbytes + LANDING_MIN * 4  # every shard and the numpy leaf, in place
        assert [p for p in (cfg.ramdisk_root / "blobs").iterdir() if p.name.startswith(".tmp-")
                and not p.name.startswith(ram.FREE_PREFIX)] == []
        target = {"w": jax.ShapeDtypeStruct(saved.shape, saved.dtype, sharding=sharding), "n": np.zeros(LANDING_MIN, np.int32), "k": 0}
        out = mgr.restore(1, target=target)
        assert np.asarray(out["w"]).tobytes() == saved.tobytes()
        assert np.array_equal(out["n"], np.arange(LANDING_MIN, dtype=np.int32)) and out["k"] == 7
    assert landing_zones.find(cfg.ramdisk_root) is None  # closing the manager unregisters the zone
    assert os.path.isdir(cfg.ramdisk_root)


# --- cluster mode: the daemon receives a write into landings ---------------------------------


def test_a_daemon_receives_a_write_into_landings_and_a_refused_one_leaves_nothing(ramdisk, inprocess_daemon):
    # An in-process daemon (real sockets, the real head): its store is in reach, so the test
    # can see the shards published from where the socket put them.
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from mtc.head import CheckpointManager, MTCConfig
    from mtc.shared.errors import FencedError

    svc, spec = inprocess_daemon(max_to_keep=2)
    devices = jax.devices()
    sharding = NamedSharding(Mesh(np.array(devices), ("d",)), P("d", None))
    host = np.random.default_rng(70).random((64 * len(devices), 1024), np.float32)
    target = {"w": jax.ShapeDtypeStruct(host.shape, host.dtype, sharding=sharding)}
    cfg = MTCConfig(local_checkpoint_directory=str(ramdisk / "head"), cluster_spec=str(spec),
                    local_checkpoint_period=1, local_max_to_keep=2)
    with CheckpointManager(cfg) as mgr:
        mgr.save(1, {"w": jax.device_put(host, sharding)}, force=True)
        mgr.wait_until_finished()
        assert svc.store.landings.landed_bytes == host.nbytes  # received in place, not copied again
        assert np.asarray(mgr.restore(1, target=target)["w"]).tobytes() == host.tobytes()
        # A newer head takes the host; the old one's next write is received, refused, and
        # the landings it filled are removed.
        with CheckpointManager(cfg) as newer:
            newer.save(2, {"w": jax.device_put(host + 1, sharding)}, force=True)
            newer.wait_until_finished()
            landed = svc.store.landings.landed_bytes
            mgr.save(3, {"w": jax.device_put(host + 2, sharding)}, force=True)
            with pytest.raises(FencedError):  # the news that matters: another head drives the host
                mgr.wait_until_finished()
            assert svc.store.landings.landed_bytes == landed
            assert [p for p in svc.store.root.joinpath("blobs").iterdir()
                    if p.name.startswith(".tmp-") and not p.name.startswith(ram.FREE_PREFIX)] == []
            assert svc.store.catalog.committed() == [1, 2]

