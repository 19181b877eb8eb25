"""The RAM tier's free pool (recycled blob files), mapped reads and the manifest caches.

Safety properties pinned here:
- a recycled file is published only once wholly rewritten: it never shows up as a committed
  blob with other bytes, and a failed rewrite leaves nothing visible;
- a file that this process reads or maps is never recycled, so a mapped (restored) array never
  changes, whatever later saves write;
- pool files are temp files: invisible, removed when a store opens, reclaimable for space.
"""

from __future__ import annotations

import gc
import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from mtc.shared.errors import CorruptBlobError, InsufficientSpaceError
from mtc.shared.hashing import blob_name
from mtc.sidecar import ram
from mtc.sidecar.ram import RamStore
from mtc.sidecar.ram import blobs as ram_blobs, readers as ram_readers, steps as ram_steps

KiB, MiB = 1 << 10, 1 << 20


def rand_bytes(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def manifest(step: int, names) -> bytes:
    return json.dumps({"step": step, "shards": [{"blob": n} for n in names]}).encode()


def save_step(store: RamStore, step: int, blobs: list[bytes]) -> list[str]:
    names = [store.blobs.write(b)[0] for b in blobs]
    store.write_pending(step, manifest(step, names))
    store.commit(step, manifest(step, names))
    return names


def pool_files(store: RamStore) -> dict[int, Path]:
    """inode -> path of every free-pool file."""
    return {p.stat().st_ino: p for p in (store.root / "blobs").iterdir() if p.name.startswith(ram.FREE_PREFIX)}


def temps(root: Path) -> list[Path]:
    return [p for p in root.rglob(".tmp-*")]


def ino(store: RamStore, name: str) -> int:
    return store.blobs.path(name).stat().st_ino


# --- recycling ------------------------------------------------------------------------------

@pytest.mark.unit
def test_collected_files_are_recycled_and_rewritten_whole(tmp_path):
    store = RamStore(tmp_path / "mtc", max_to_keep=1)
    a, b, c = (rand_bytes(256 * KiB, s) for s in (1, 2, 3))
    (na,) = save_step(store, 1, [a])
    old_ino = ino(store, na)
    save_step(store, 2, [b])  # step 1 is pruned: its file goes to the pool, not away
    assert store.blobs.names() == {blob_name(b)}
    assert not store.blobs.has(na)
    assert list(pool_files(store)) == [old_ino]
    u = store.space.usage()
    assert u["free_pool_count"] == 1 and u["free_pool_bytes"] >= len(a)
    assert u["reclaimable_bytes"] == u["free_bytes"] + u["free_pool_bytes"]
    # A blob of the same size overwrites the pool file, then is published like a new file.
    nc, written = store.blobs.write(c)
    assert written and ino(store, nc) == old_ino
    assert pool_files(store) == {}
    assert store.read_blob(nc) == c and store.blobs.verify(nc)
    assert os.stat(store.blobs.path(nc)).st_nlink == 1
    # Another size never takes a pool file of the wrong size.
    save_step(store, 3, [c])  # step 2's blob b goes to the pool
    nd, _ = store.blobs.write(rand_bytes(256 * KiB + 1, 4))
    assert ino(store, nd) not in (old_ino,) and len(pool_files(store)) == 1
    assert store.read_blob(nd) == rand_bytes(256 * KiB + 1, 4)


@pytest.mark.unit
def test_a_failed_rewrite_of_a_pool_file_leaves_nothing_visible(tmp_path, monkeypatch):
    store = RamStore(tmp_path / "mtc", max_to_keep=1)
    a, b, c = (rand_bytes(256 * KiB, s) for s in (11, 12, 13))
    save_step(store, 1, [a])
    save_step(store, 2, [b])
    assert len(pool_files(store)) == 1
    monkeypatch.setattr(ram_blobs, "_WRITE_CHUNK", 64 * KiB)
    real_write, calls = os.write, []

    def failing_write(fd, data):
        calls.append(len(data))
        if len(calls) == 2:
            raise OSError(5, "Input/output error")
        return real_write(fd, data)

    monkeypatch.setattr(ram_blobs.os, "write", failing_write)
    with pytest.raises(OSError, match="Input/output"):
        store.blobs.write(c)
    monkeypatch.setattr(ram_blobs.os, "write", real_write)
    assert len(calls) == 2  # it did rewrite the pool file, part way
    assert not store.blobs.has(blob_name(c))
    assert temps(store.root) == []  # the half-rewritten file is gone, not back in the pool
    assert store.blobs.names() == {blob_name(b)} and store.read_blob(blob_name(b)) == b
    # The store carries on: a new write of c is whole.
    assert store.blobs.write(c) == (blob_name(c), True) and store.read_blob(blob_name(c)) == c


@pytest.mark.unit
def test_pool_is_bounded_by_the_newest_step_and_small_files_are_not_pooled(tmp_path):
    store = RamStore(tmp_path / "mtc", max_to_keep=1)
    save_step(store, 1, [rand_bytes(128 * KiB, s) for s in range(20, 24)] + [b"tiny"])
    save_step(store, 2, [rand_bytes(128 * KiB, 30)])  # a smaller step: the pool takes one file
    u = store.space.usage()
    assert u["free_pool_count"] == 1 and u["free_pool_bytes"] == 128 * KiB
    assert len(temps(store.root)) == 1


@pytest.mark.unit
def test_pool_files_a_step_did_not_use_are_freed_at_its_commit(tmp_path):
    store = RamStore(tmp_path / "mtc", max_to_keep=1)
    save_step(store, 1, [rand_bytes(128 * KiB, 40)])
    save_step(store, 2, [rand_bytes(128 * KiB, 41)])
    stale = set(pool_files(store))
    assert len(stale) == 1
    save_step(store, 3, [rand_bytes(200 * KiB, 42)])  # other size: the stale file is not used
    assert not stale & set(pool_files(store))  # freed; step 2's file took its place
    assert store.space.usage()["free_pool_count"] == 1


@pytest.mark.unit
def test_reopening_empties_the_pool_and_keeps_steps(tmp_path):
    store = RamStore(tmp_path / "mtc", max_to_keep=1)
    save_step(store, 1, [rand_bytes(128 * KiB, 50)])
    kept = rand_bytes(128 * KiB, 51)
    save_step(store, 2, [kept])
    assert pool_files(store)
    store2 = RamStore(tmp_path / "mtc", max_to_keep=1)
    assert temps(store2.root) == []
    assert store2.catalog.committed() == [2] and store2.read_blob(blob_name(kept)) == kept
    assert store2.space.usage()["free_pool_count"] == 0
    # The first store's pool is stale now: writing through it still works (fresh files).
    assert store.blobs.write(rand_bytes(128 * KiB, 52))[1]


@pytest.mark.unit
def test_pool_off(tmp_path):
    store = RamStore(tmp_path / "mtc", max_to_keep=1, free_pool=False)
    save_step(store, 1, [rand_bytes(128 * KiB, 60)])
    save_step(store, 2, [rand_bytes(128 * KiB, 61)])
    assert temps(store.root) == [] and store.space.usage()["free_pool_count"] == 0


@pytest.mark.unit
def test_temp_blob_api_refuses_pool_files(tmp_path):
    store = RamStore(tmp_path / "mtc", max_to_keep=1)
    save_step(store, 1, [rand_bytes(128 * KiB, 70)])
    save_step(store, 2, [rand_bytes(128 * KiB, 71)])
    (path,) = pool_files(store).values()
    with pytest.raises(ValueError, match="not a temp blob"):
        store.blobs.finalize_temp(path, blob_name(rand_bytes(128 * KiB, 70)))
    assert path.exists()


# --- readers and mappings are never recycled ------------------------------------------------

@pytest.mark.unit
def test_a_mapped_blob_never_changes_whatever_later_saves_write(tmp_path):
    store = RamStore(tmp_path / "mtc", max_to_keep=1)
    a = rand_bytes(256 * KiB, 80)
    (na,) = save_step(store, 1, [a])
    a_ino = ino(store, na)
    in_use_before = ram.in_use()
    view = store.blobs.map(na, len(a)).view(np.float32)
    assert view.tobytes() == a
    for step in range(2, 6):  # step 1 is collected; every later write has a's size
        save_step(store, step, [rand_bytes(256 * KiB, 80 + step)])
        assert a_ino not in pool_files(store)
        assert view.tobytes() == a, f"the mapped blob changed after step {step}"
    # Writing to the array never reaches a file (private, copy-on-write mapping).
    view[:] = 0
    assert all(store.blobs.verify(n) for n in store.blobs.names())
    del view
    gc.collect()
    assert ram.in_use() <= in_use_before  # released with the mapping


@pytest.mark.unit
def test_without_a_mapping_the_same_file_is_recycled(tmp_path):
    # The control for the test above: the pool does reuse that file when nothing maps it.
    store = RamStore(tmp_path / "mtc", max_to_keep=1)
    (na,) = save_step(store, 1, [rand_bytes(256 * KiB, 80)])
    a_ino = ino(store, na)
    view = store.blobs.map(na)
    del view
    gc.collect()
    save_step(store, 2, [rand_bytes(256 * KiB, 82)])
    assert a_ino in pool_files(store)
    (nc,) = save_step(store, 3, [rand_bytes(256 * KiB, 83)])
    assert ino(store, nc) == a_ino


@pytest.mark.unit
def test_a_blob_collected_while_being_read_is_not_recycled_under_the_reader(tmp_path, monkeypatch):
    store = RamStore(tmp_path / "mtc", max_to_keep=1)
    monkeypatch.setattr(ram_blobs, "_READ_CHUNK", 16 * KiB)
    a, b, c = (rand_bytes(256 * KiB, s) for s in (90, 91, 92))
    (na,) = save_step(store, 1, [a])
    nb, _ = store.blobs.write(b)
    store.write_pending(2, manifest(2, [nb]))
    real_hasher, fired = ram_blobs.new_hasher, []

    class Hasher:
        def __init__(self):
            self._h = real_hasher()

        def update(self, data):
            if not fired:
                fired.append(1)
                # Mid-read: commit step 2 (collects a's file), then write c, of a's size.
                store.commit(2, manifest(2, [nb]))
                assert store.blobs.write(c)[1]
            self._h.update(data)

        def hexdigest(self):
            return self._h.hexdigest()

    monkeypatch.setattr(ram_blobs, "new_hasher", Hasher)
    buf = bytearray(len(a))
    store.blobs.read_into(na, buf)  # CorruptBlobError if c had been written over a's file
    assert fired and bytes(buf) == a
    assert store.read_blob(blob_name(c)) == c


@pytest.mark.unit
def test_a_mapping_freed_by_the_collector_inside_the_registry_lock_does_not_deadlock(tmp_path):
    store = RamStore(tmp_path / "mtc")
    na, _ = store.blobs.write(rand_bytes(64 * KiB, 95))
    key = (store.blobs.path(na).stat().st_dev, ino(store, na))

    class Cycle:
        pass

    c = Cycle()
    c.me, c.array = c, store.blobs.map(na)
    assert key in ram.in_use()
    del c
    done = threading.Event()

    def collect_holding_the_lock():
        with ram_readers.registry:
            gc.collect()  # the mapping's finaliser runs here, in a thread that holds the lock
        done.set()

    t = threading.Thread(target=collect_holding_the_lock, daemon=True)
    t.start()
    t.join(10)
    assert done.is_set(), "deadlock: a finaliser waited for the lock its own thread held"
    assert key not in ram.in_use()


@pytest.mark.unit
def test_map_blob_verifies(tmp_path):
    store = RamStore(tmp_path / "mtc")
    a = rand_bytes(64 * KiB, 100)
    in_use_before = ram.in_use()
    na, _ = store.blobs.write(a)
    with pytest.raises(CorruptBlobError, match="expects"):
        store.blobs.map(na, len(a) + 1)
    with pytest.raises(CorruptBlobError, match="missing"):
        store.blobs.map(blob_name(b"absent"))
    path = store.blobs.path(na)
    data = bytearray(path.read_bytes())
    data[7] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptBlobError, match="corrupt"):
        store.blobs.map(na)
    gc.collect()
    assert ram.in_use() <= in_use_before
    e, _ = store.blobs.write(b"")
    assert store.blobs.map(e).size == 0


# --- manifest caches --------------------------------------------------------------------------

@pytest.mark.unit
def test_committed_steps_parses_each_step_file_once_and_sees_replacements(tmp_path, monkeypatch, caplog):
    store = RamStore(tmp_path / "mtc")
    for s in (1, 2):
        save_step(store, s, [rand_bytes(1000, s)])
    parsed = []
    real = ram_steps.parse_step

    def counting(data, step, where):
        parsed.append(step)
        return real(data, step, where)

    monkeypatch.setattr(ram_steps, "parse_step", counting)
    assert store.catalog.committed() == [1, 2]
    assert parsed == []  # cached since the commits
    # A step file replaced (a new inode) is parsed again: here, by something bad.
    bad = store.root / "steps" / ".tmp-bad"
    bad.write_bytes(b"{truncated")
    os.replace(bad, store.root / "steps" / "000000000002.json")
    assert store.catalog.committed() == [1]
    assert parsed == [2]
    assert store.catalog.committed() == [1] and parsed == [2]


# --- space: the pool is reclaimable, and reused in place on a full ramdisk --------------------

def tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_ino) for p in root.rglob("*") if p.is_file()}


def test_full_ramdisk_reuses_pool_files_in_place(tmpfs16):
    store = RamStore(tmpfs16 / "mtc", max_to_keep=2)
    data = {s: rand_bytes(5 * MiB, 110 + s) for s in range(1, 6)}
    for s in (1, 2, 3):
        save_step(store, s, [data[s]])
    assert store.space.usage()["free_pool_count"] == 1  # step 1's file; steps 2 and 3 kept: 15 MiB used
    sizes = {blob_name(data[4]): len(data[4])}
    needed = store.blobs.missing_bytes(sizes)
    assert needed > store.space.usage()["free_bytes"]
    assert store.space.fits(sizes.values())  # the pool file is rewritten in place: no new space
    store.space.check_space(needed, step=4, sizes=sizes.values())
    assert store.catalog.committed() == [2, 3]  # nothing freed early
    save_step(store, 4, [data[4]])
    save_step(store, 5, [data[5]])
    assert store.catalog.committed() == [4, 5]
    for s in (4, 5):
        assert store.read_blob(blob_name(data[s])) == data[s]


def test_full_ramdisk_frees_the_pool_when_a_step_needs_its_space(tmpfs16):
    store = RamStore(tmpfs16 / "mtc", max_to_keep=1)
    save_step(store, 1, [rand_bytes(4 * MiB, 120)])
    save_step(store, 2, [rand_bytes(4 * MiB, 121)])
    assert store.space.usage()["free_pool_count"] == 1  # 8 MiB used, ~8 MiB free
    before = tree(store.root)
    too_big = {blob_name(b"13 MiB"): 13 * MiB}
    with pytest.raises(InsufficientSpaceError, match="step 3"):
        store.space.check_space(store.blobs.missing_bytes(too_big), step=3, sizes=too_big.values())
    assert tree(store.root) == before  # not even the pool was freed in vain
    big = rand_bytes(10 * MiB, 122)  # fits once the pool file is freed
    store.space.check_space(store.blobs.missing_bytes({blob_name(big): len(big)}), step=3, sizes=[len(big)])
    assert store.space.usage()["free_pool_count"] == 0 and store.catalog.committed() == [2]
    save_step(store, 3, [big])
    assert store.read_blob(blob_name(big)) == big


def test_disk_full_during_a_write_frees_the_pool_and_retries(tmpfs16):
    store = RamStore(tmpfs16 / "mtc", max_to_keep=1)
    save_step(store, 1, [rand_bytes(4 * MiB, 130)])
    save_step(store, 2, [rand_bytes(4 * MiB, 131)])
    assert store.space.usage()["free_pool_count"] == 1
    big = rand_bytes(10 * MiB, 132)  # written without check_space: ENOSPC, pool freed, written
    assert store.blobs.write(big)[1]
    assert store.read_blob(blob_name(big)) == big
    assert store.space.usage()["free_pool_count"] == 0
    assert [p for p in temps(store.root)] == []


@pytest.mark.unit
def test_a_received_blob_overwrites_a_pool_file_of_its_size(tmp_path):
    """Peers and downloads receive into recycled files: written whole, verified, then published."""
    store = RamStore(tmp_path / "mtc", max_to_keep=1)
    a, b, c = (rand_bytes(256 * KiB, s) for s in (11, 12, 13))
    save_step(store, 1, [a])
    old_ino = ino(store, blob_name(a))
    save_step(store, 2, [b])  # a's file goes to the pool
    assert list(pool_files(store)) == [old_ino]
    fd, tmp = store.blobs.open_temp(len(c))
    assert os.fstat(fd).st_ino == old_ino and not tmp.name.startswith(ram.FREE_PREFIX)
    os.write(fd, c)
    os.close(fd)
    assert store.blobs.finalize_temp(tmp, blob_name(c))
    assert pool_files(store) == {} and store.read_blob(blob_name(c)) == c
    # A partial receive into a pool file is discarded: its old tail never becomes a blob.
    save_step(store, 3, [c])  # b's file goes to the pool
    fd, tmp = store.blobs.open_temp(len(a))
    os.write(fd, a[: len(a) // 2])
    os.close(fd)
    with pytest.raises(CorruptBlobError):
        store.blobs.finalize_temp(tmp, blob_name(a))
    assert not store.blobs.has(blob_name(a)) and not tmp.exists()
    # No pool file of that size: a fresh temp file.
    fd, tmp = store.blobs.open_temp(len(a) + 1)
    os.close(fd)
    assert os.stat(tmp).st_size == 0
    store.blobs.discard_temp(tmp)


@pytest.mark.unit
def test_copies_kept_for_peers_are_recycled_for_the_next_steps_copies(ramdisk):
    """A replica holder: at each commit its new step's copies have not arrived yet, while the
    older kept step holds the last ones; those of the pruned step go to the pool (sized by the
    largest kept step), and the next copies are received into them instead of new pages."""
    store = RamStore(ramdisk / "s", max_to_keep=2)
    sizes = [3 * MiB, 2 * MiB + 5]

    def data(step: int) -> list[bytes]:
        return [rand_bytes(n, 100 * step + i) for i, n in enumerate(sizes)]

    def commit(step: int) -> None:  # another host's blobs: this host commits the manifest first ...
        names = [blob_name(d) for d in data(step)]
        store.write_pending(step, manifest(step, names))
        store.commit(step, manifest(step, names))

    def receive(step: int) -> set[int]:  # ... and replication brings the copies after it
        inodes = set()
        for d in data(step):
            fd, tmp = store.blobs.open_temp(len(d))
            inodes.add(os.fstat(fd).st_ino)
            os.write(fd, d)
            os.close(fd)
            store.blobs.finalize_temp(tmp, blob_name(d))
        return inodes

    for step in (1, 2):
        commit(step)
        receive(step)
    commit(3)  # prunes step 1: its copies are garbage, kept as pool files (step 2 holds as much)
    pooled = pool_files(store)
    assert sorted(p.stat().st_size for p in pooled.values()) == sorted(sizes)
    assert receive(3) == set(pooled)  # step 3's copies overwrite those files: no new pages
    assert pool_files(store) == {}
    assert all(store.blobs.verify(n) for n in store.blobs.names())
