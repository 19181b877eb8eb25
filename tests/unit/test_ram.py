"""The RAM tier (mtc.sidecar.ram): blobs, commits, retention, space, corruption, names."""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from mtc.shared.errors import CorruptBlobError, InsufficientSpaceError, ManifestError, StepNotFoundError
from mtc.shared.hashing import blob_name
from mtc.sidecar import faults, ram
from mtc.shared.format import collect_blob_names
from mtc.sidecar.ram import RamStore, format_binary_bytes
from mtc.sidecar.ram import blobs as ram_blobs

MiB = 1 << 20


def rand_bytes(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def manifest(step: int, names) -> bytes:
    return json.dumps({"step": step, "shards": [{"blob": n} for n in names]}).encode()


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under root: relative path -> (size, inode)."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = Path(dirpath, f)
            st = p.stat()
            out[str(p.relative_to(root))] = (st.st_size, st.st_ino)
    return out


def temps(root: Path) -> list[str]:
    return [k for k in tree(root) if Path(k).name.startswith(".tmp-")]


@pytest.fixture
def store(tmp_path) -> RamStore:
    return RamStore(tmp_path / "mtc")


# --- blobs ---------------------------------------------------------------------------------

@pytest.mark.unit
@pytest.mark.parametrize("dtype", [np.float32, np.int8, np.complex64, ml_dtypes.bfloat16, np.bool_])
def test_array_round_trip_bit_for_bit(store, dtype):
    rng = np.random.default_rng(7)
    a = rng.standard_normal((13, 7, 3)).astype(dtype)
    name, written = store.blobs.write(a)
    assert written
    assert name == blob_name(a.tobytes())
    out = np.empty_like(a)
    store.blobs.read_into(name, out)
    assert out.tobytes() == a.tobytes()
    assert store.read_blob(name) == a.tobytes()
    assert store.blobs.size(name) == a.nbytes
    assert store.blobs.names() == {name}


@pytest.mark.unit
def test_multi_chunk_round_trip(store, monkeypatch):
    # Small chunks force the write/read loops through many partial iterations.
    monkeypatch.setattr(ram_blobs, "_WRITE_CHUNK", 4096)
    monkeypatch.setattr(ram_blobs, "_READ_CHUNK", 1000)
    data = rand_bytes(100_003, 1)
    name, written = store.blobs.write(memoryview(data))
    assert written and name == blob_name(data)
    buf = bytearray(len(data))
    store.blobs.read_into(name, buf)
    assert bytes(buf) == data
    assert store.blobs.verify(name)


@pytest.mark.unit
def test_empty_blob(store):
    name, written = store.blobs.write(b"")
    assert written and store.blobs.size(name) == 0
    assert store.read_blob(name) == b""
    assert store.blobs.verify(name)


@pytest.mark.unit
def test_refuses_non_contiguous_and_object_arrays(store):
    a = np.arange(20, dtype=np.float32).reshape(4, 5)
    with pytest.raises(ValueError, match="C-contiguous"):
        store.blobs.write(a[:, ::2])
    with pytest.raises(TypeError, match="object"):
        store.blobs.write(np.array([object()]))
    assert store.blobs.names() == set()


@pytest.mark.unit
def test_dedupe_does_not_touch_the_file(store):
    data = rand_bytes(50_000, 2)
    name, written = store.blobs.write(data)
    assert written
    before = os.stat(store.blobs.path(name))
    name2, written2 = store.blobs.write(bytearray(data))
    assert (name2, written2) == (name, False)
    after = os.stat(store.blobs.path(name))
    assert (after.st_ino, after.st_mtime_ns, after.st_nlink) == (before.st_ino, before.st_mtime_ns, before.st_nlink)
    assert temps(store.root) == []


@pytest.mark.unit
def test_precomputed_name_is_trusted_and_a_wrong_one_is_caught_on_read(store):
    data = rand_bytes(4096, 3)
    name, _ = store.blobs.write(data, name=blob_name(data))
    assert store.read_blob(name) == data
    wrong = "0" * 32
    assert store.blobs.write(data, name=wrong) == (wrong, True)
    with pytest.raises(CorruptBlobError, match=wrong):
        store.read_blob(wrong)


@pytest.mark.unit
def test_concurrent_writes_of_one_blob(store):
    data = rand_bytes(3 * MiB + 17, 4)
    barrier = threading.Barrier(8)
    results, errors = [], []

    def worker():
        try:
            barrier.wait()
            results.append(store.blobs.write(data))
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert {n for n, _ in results} == {blob_name(data)}
    assert sum(w for _, w in results) == 1  # exactly one writer wins
    assert store.read_blob(blob_name(data)) == data
    assert store.blobs.names() == {blob_name(data)}
    assert temps(store.root) == []


@pytest.mark.unit
def test_concurrent_writes_of_different_blobs(store):
    datas = [rand_bytes(200_000 + i, 10 + i) for i in range(8)]
    barrier = threading.Barrier(8)

    def worker(d):
        barrier.wait()
        store.blobs.write(d)

    threads = [threading.Thread(target=worker, args=(d,)) for d in datas]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.blobs.names() == {blob_name(d) for d in datas}
    for d in datas:
        assert store.read_blob(blob_name(d)) == d


# --- corruption ----------------------------------------------------------------------------

@pytest.mark.unit
def test_flipped_byte_is_detected(store):
    data = rand_bytes(10_000, 5)
    name, _ = store.blobs.write(data)
    path = store.blobs.path(name)
    raw = bytearray(path.read_bytes())
    raw[1234] ^= 0x01
    path.write_bytes(raw)
    out = bytearray(len(data))
    with pytest.raises(CorruptBlobError) as ei:
        store.blobs.read_into(name, out)
    assert name in str(ei.value) and str(path) in str(ei.value)
    with pytest.raises(CorruptBlobError, match=name):
        store.read_blob(name)
    assert not store.blobs.verify(name)


@pytest.mark.unit
def test_wrong_size_and_missing_are_corrupt(store):
    data = rand_bytes(1000, 6)
    name, _ = store.blobs.write(data)
    with pytest.raises(CorruptBlobError, match="1000 bytes"):
        store.blobs.read_into(name, bytearray(999))
    store.blobs.path(name).write_bytes(data[:500])  # truncated on disk
    with pytest.raises(CorruptBlobError, match=name):
        store.blobs.read_into(name, bytearray(1000))
    missing = blob_name(b"not stored")
    with pytest.raises(CorruptBlobError, match="missing"):
        store.blobs.read_into(missing, bytearray(10))
    assert not store.blobs.verify(missing)
    with pytest.raises(FileNotFoundError):
        store.blobs.size(missing)


@pytest.mark.unit
def test_read_into_readonly_buffer_is_refused(store):
    name, _ = store.blobs.write(b"abc")
    with pytest.raises(TypeError, match="writable"):
        store.blobs.read_into(name, b"xyz")


# --- receiving blobs -----------------------------------------------------------------------

@pytest.mark.unit
def test_temp_blob_good_and_corrupt(store):
    data = rand_bytes(70_000, 8)
    name = blob_name(data)
    fd, tmp = store.blobs.open_temp()
    assert tmp.name.startswith(".tmp-") and tmp.parent == store.root / "blobs"
    os.write(fd, data)
    os.close(fd)
    assert store.blobs.names() == set()  # a temp file is not a blob
    assert store.blobs.finalize_temp(tmp, name) is True
    assert not tmp.exists()
    assert store.read_blob(name) == data

    bad = bytearray(rand_bytes(5000, 9))
    good_name = blob_name(bytes(bad))
    bad[10] ^= 0xFF
    fd, tmp = store.blobs.open_temp()
    os.write(fd, bad)
    os.close(fd)
    with pytest.raises(CorruptBlobError, match=good_name):
        store.blobs.finalize_temp(tmp, good_name)
    assert not tmp.exists()
    assert not store.blobs.has(good_name)
    assert temps(store.root) == []


@pytest.mark.unit
def test_finalize_existing_blob_and_foreign_paths(store, tmp_path):
    data = b"same bytes"
    name, _ = store.blobs.write(data)
    fd, tmp = store.blobs.open_temp()
    os.write(fd, data)
    os.close(fd)
    assert store.blobs.finalize_temp(tmp, name) is False
    assert not tmp.exists()
    outside = tmp_path / ".tmp-elsewhere"
    outside.write_bytes(data)
    with pytest.raises(ValueError, match="not a temp blob"):
        store.blobs.finalize_temp(outside, name)
    assert outside.exists()


@pytest.mark.unit
def test_put_blob_file(store, tmp_path):
    data = rand_bytes(300_000, 11)
    src = tmp_path / "download"
    src.write_bytes(data)
    assert store.blobs.put_file(blob_name(data), src) is True
    assert store.read_blob(blob_name(data)) == data
    assert store.blobs.put_file(blob_name(data), src) is False
    src.write_bytes(data[:-1] + b"\x00")
    other = blob_name(b"something else")
    with pytest.raises(CorruptBlobError, match=other):
        store.blobs.put_file(other, src)
    assert not store.blobs.has(other)
    assert temps(store.root) == []


# --- names from outside --------------------------------------------------------------------

BAD_NAMES = ["../x", "A" * 32, "", "a" * 31, "a" * 33, "0" * 32 + "\n", "../" + "0" * 29,
             "0" * 16 + "/" + "0" * 15, "g" * 32, None, 123]


@pytest.mark.unit
@pytest.mark.parametrize("bad", BAD_NAMES)
def test_malformed_names_are_refused(store, tmp_path, bad):
    (store.root / "x").write_bytes(b"outside the blob dir")
    before = tree(store.root)
    for call in (store.blobs.path, store.blobs.has, store.read_blob, store.blobs.verify, store.blobs.size,
                 lambda n: store.blobs.read_into(n, bytearray(20)),
                 lambda n: store.blobs.put_file(n, store.root / "x")):
        with pytest.raises(ValueError, match="invalid blob name"):
            call(bad)
    if bad is not None:  # name=None means "hash it yourself"
        with pytest.raises(ValueError, match="invalid blob name"):
            store.blobs.write(b"data", name=bad)
    fd, tmp = store.blobs.open_temp()
    os.close(fd)
    with pytest.raises(ValueError, match="invalid blob name"):
        store.blobs.finalize_temp(tmp, bad)
    assert not tmp.exists()
    assert tree(store.root) == before


@pytest.mark.unit
def test_collect_blob_names():
    a, b, c = blob_name(b"a"), blob_name(b"b"), blob_name(b"c")
    doc = {"step": 1, "arrays": [{"shards": [{"blob": a, "size": 3}, {"blob": b}]}],
           "extra": {"blob": [c]}, "other": "ffffffffffffffffffffffffffffffff"}
    assert collect_blob_names(json.dumps(doc).encode()) == {a, b, c}
    with pytest.raises(ManifestError, match="not a blob name"):
        collect_blob_names(b'{"blob": "../../etc/passwd"}')
    with pytest.raises(ManifestError, match="not valid JSON"):
        collect_blob_names(b"{nope")


@pytest.mark.unit
def test_a_committed_manifest_must_be_json_lines_of_its_step():
    """What a host checks before it keeps a step manifest (``parse_step``): its header names the step
    and every further line is JSON; any line that is not, an empty last line included, is refused."""
    from mtc.sidecar.ram.steps import parse_step

    good = b'{"step": 4, "format": "mtc/3"}\n{"host": "h0", "columns": "AAAA"}\n{"host": "h1"}'
    parse_step(good, 4, "here")
    parse_step(b'{"step": 4}', 4, "here")
    for bad, message in ((good + b"\n", "not valid JSON"), (good.replace(b'"h1"}', b'"h1"'), "not valid JSON"),
                         (b'{"step": 4}\n{nope}\n{}', "not valid JSON"), (good, "must be a JSON object with \"step\": 5")):
        with pytest.raises(ManifestError, match=message):
            parse_step(bad, 5 if message.startswith("must") else 4, "here")


# --- commit, retention, GC -----------------------------------------------------------------

def save_step(store: RamStore, step: int, blobs: list[bytes], *, commit: bool = True) -> list[str]:
    names = [store.blobs.write(b)[0] for b in blobs]
    store.write_pending(step, manifest(step, names))
    if commit:
        store.commit(step, manifest(step, names))
    return names


@pytest.mark.unit
def test_step_visible_only_after_commit(store):
    names = save_step(store, 5, [rand_bytes(1000, 20)], commit=False)
    assert store.catalog.committed() == []
    assert store.latest_step() is None
    assert store.catalog.pending_steps() == [5]
    with pytest.raises(StepNotFoundError, match=r"step 5 .*committed steps: \[\]"):
        store.catalog.read(5)
    store.commit(5, manifest(5, names))
    assert store.catalog.committed() == [5]
    assert store.latest_step() == 5
    assert json.loads(store.catalog.read(5))["shards"][0]["blob"] == names[0]
    assert store.catalog.pending_steps() == [] and store.catalog.read_pending(5) is None
    assert temps(store.root) == []


@pytest.mark.unit
def test_commit_rejects_a_manifest_of_another_step(store):
    names = save_step(store, 3, [b"x"], commit=False)
    for bad in (manifest(4, names), b"not json", b"[1, 2]", json.dumps({"step": True}).encode()):
        with pytest.raises(ManifestError, match="step 3"):
            store.commit(3, bad)
    assert store.catalog.committed() == []
    assert store.catalog.read_pending(3) == manifest(3, names)


@pytest.mark.unit
def test_malformed_step_files_are_ignored(store, caplog):
    save_step(store, 1, [b"one"])
    steps = store.root / "steps"
    (steps / "000000000002.json").write_bytes(b"{truncated")
    (steps / "000000000003.json").write_bytes(json.dumps({"step": 4}).encode())
    (steps / "notes.txt").write_text("hello")
    (steps / "7.json").write_text('{"step": 7}')
    with caplog.at_level(logging.WARNING, logger="mtc.sidecar.ram"):
        assert store.catalog.committed() == [1]
    warned = " ".join(r.getMessage() for r in caplog.records)
    for f in ("000000000002.json", "000000000003.json", "notes.txt", "7.json"):
        assert f in warned
    with pytest.raises(StepNotFoundError, match=r"committed steps: \[1\]"):
        store.catalog.read(2)
    with pytest.raises(StepNotFoundError):
        store.catalog.read(3)


@pytest.mark.unit
def test_prune_keeps_max_to_keep_and_gc_keeps_shared_blobs(tmp_path):
    store = RamStore(tmp_path / "mtc", max_to_keep=2)
    shared = rand_bytes(20_000, 30)
    uniq = {s: rand_bytes(10_000, 30 + s) for s in (1, 2, 3)}
    names = {s: save_step(store, s, [shared, uniq[s]]) for s in (1, 2)}
    assert store.catalog.committed() == [1, 2]
    assert store.blobs.names() == {blob_name(shared), blob_name(uniq[1]), blob_name(uniq[2])}
    names[3] = save_step(store, 3, [shared, uniq[3]])
    assert store.catalog.committed() == [2, 3]
    assert store.blobs.names() == {blob_name(shared), blob_name(uniq[2]), blob_name(uniq[3])}
    for s in (2, 3):
        m = json.loads(store.catalog.read(s))
        got = [store.read_blob(sh["blob"]) for sh in m["shards"]]
        assert got == [shared, uniq[s]]
    with pytest.raises(StepNotFoundError, match=r"\[2, 3\]"):
        store.catalog.read(1)


@pytest.mark.unit
def test_gc_spares_pending_pinned_and_extra_live(store):
    save_step(store, 1, [b"committed"])
    pending = save_step(store, 2, [b"pending step 2"], commit=False)
    orphan, _ = store.blobs.write(b"orphan")
    pinned, _ = store.blobs.write(b"pinned")
    extra, _ = store.blobs.write(b"extra")
    with store.pins.hold([pinned]):
        collected = store.space.gc(extra_live={extra})
        assert (collected.freed, collected.count, collected.skipped) == (len(b"orphan"), 1, None)
        assert store.blobs.names() == {blob_name(b"committed"), pending[0], pinned, extra}
    store.space.gc()
    assert store.blobs.names() == {blob_name(b"committed"), pending[0]}
    assert store.read_blob(pending[0]) == b"pending step 2"


@pytest.mark.unit
def test_gc_with_an_unreadable_manifest_deletes_nothing(tmp_path):
    def strict(data: bytes) -> set[str]:  # like a format module's: KeyError on a bad manifest
        return {s["blob"] for s in json.loads(data)["shards"]}

    store = RamStore(tmp_path / "mtc", blobs_of=strict)
    save_step(store, 1, [b"one"])
    orphan, _ = store.blobs.write(b"orphan")
    store.write_pending(2, json.dumps({"step": 2}).encode())
    collected = store.space.gc()
    assert (collected.freed, collected.count) == (0, 0) and "manifest is unreadable" in collected.skipped
    assert orphan in store.blobs.names()
    # A later commit drops the stale pending manifest; collection works again.
    save_step(store, 3, [b"three"])
    assert store.catalog.committed() == [1, 3]
    assert store.catalog.pending_steps() == []
    assert store.blobs.names() == {blob_name(b"one"), blob_name(b"three")}


@pytest.mark.unit
def test_prune_drops_stale_pending(store):
    save_step(store, 1, [b"a"], commit=False)  # abandoned: older than the next commit
    save_step(store, 3, [b"c"], commit=False)  # in flight: newer than the next commit
    save_step(store, 2, [b"b"])
    assert store.catalog.pending_steps() == [3]
    assert store.blobs.names() == {blob_name(b"b"), blob_name(b"c")}


@pytest.mark.unit
def test_reopen_removes_leftover_temps_and_keeps_steps(tmp_path):
    store = RamStore(tmp_path / "mtc")
    names = save_step(store, 1, [b"kept"])
    store.write_pending(2, manifest(2, []))
    leftovers = [store.root / "blobs" / ".tmp-deadbeef", store.root / "steps" / ".tmp-000000000002.json-x",
                 store.root / "pending" / "000000000002" / ".tmp-host.json-y"]
    for p in leftovers:
        p.write_bytes(b"partial")
    fd, tmp = store.blobs.open_temp()
    os.close(fd)
    store2 = RamStore(tmp_path / "mtc")
    assert temps(store2.root) == []
    assert store2.catalog.committed() == [1]
    assert store2.read_blob(names[0]) == b"kept"
    assert store2.catalog.pending_steps() == [2]


@pytest.mark.unit
def test_delete_step_wipe_usage(store):
    save_step(store, 1, [b"one"])
    save_step(store, 2, [b"two"])
    u = store.space.usage()
    assert u["blob_bytes"] == 6 and u["blob_count"] == 2 and u["committed_steps"] == [1, 2]
    assert 0 < u["free_bytes"] <= u["total_bytes"]
    assert store.delete_step(1) is True
    assert store.delete_step(1) is False
    assert store.catalog.committed() == [2]
    assert store.blobs.names() == {blob_name(b"two")}
    (store.root / "stray").write_text("x")
    store.wipe()
    assert tree(store.root) == {}
    assert sorted(p.name for p in store.root.iterdir()) == ["blobs", "pending", "steps"]
    save_step(store, 3, [b"three"])
    assert store.catalog.committed() == [3]


@pytest.mark.unit
def test_missing_bytes(store):
    block = os.statvfs(store.root).f_frsize
    have, _ = store.blobs.write(b"x" * 10)
    new1, new2 = blob_name(b"new1"), blob_name(b"new2")
    assert store.blobs.missing_bytes({have: 10, new1: block, new2: block + 1}) == 3 * block
    assert store.blobs.missing_bytes({have: 10}) == 0


@pytest.mark.unit
def test_invalid_arguments(tmp_path):
    with pytest.raises(ValueError, match="local_max_to_keep"):
        RamStore(tmp_path / "a", max_to_keep=0)
    store = RamStore(tmp_path / "b")
    for bad in (-1, 10**12, "3", 2.0, True):
        with pytest.raises(ValueError, match="invalid step"):
            store.write_pending(bad, b"{}")
    with pytest.raises(ValueError, match="needed_bytes"):
        store.space.check_space(-1, step=1)


@pytest.mark.unit
def test_format_bytes():
    assert format_binary_bytes(0) == "0 B"
    assert format_binary_bytes(1023) == "1023 B"
    assert format_binary_bytes(1536) == "1.50 KiB"
    assert format_binary_bytes(int(1.2 * 2**30)) == "1.20 GiB"
    assert format_binary_bytes(5 * 2**40) == "5.00 TiB"


# --- space (size-limited tmpfs) ------------------------------------------------------------

def test_step_that_does_not_fit_writes_nothing(tmpfs16):
    store = RamStore(tmpfs16 / "mtc", max_to_keep=2)
    data = {1: rand_bytes(4 * MiB, 41), 2: rand_bytes(4 * MiB, 42)}
    for s, d in data.items():
        save_step(store, s, [d])
    before = tree(store.root)
    big = {blob_name(b"a big step"): 20 * MiB}
    needed = store.blobs.missing_bytes(big)
    with pytest.raises(InsufficientSpaceError) as ei:
        store.space.check_space(needed, step=3)
    msg = str(ei.value)
    free = os.statvfs(store.root).f_bavail * os.statvfs(store.root).f_frsize
    assert "step 3" in msg and "20.00 MiB" in msg and f"({needed} bytes)" in msg
    assert f"{format_binary_bytes(free)} ({free} bytes) are free" in msg
    assert "mtc size" in msg and "local_max_to_keep" in msg
    assert isinstance(ei.value, OSError)
    assert tree(store.root) == before  # not even the old step was sacrificed in vain
    assert store.catalog.committed() == [1, 2]
    for s, d in data.items():
        assert store.read_blob(json.loads(store.catalog.read(s))["shards"][0]["blob"]) == d


def test_step_fits_after_policy_frees_the_oldest(tmpfs16):
    store = RamStore(tmpfs16 / "mtc", max_to_keep=2)
    data = {s: rand_bytes(6 * MiB, 50 + s) for s in (1, 2, 3)}
    shared = rand_bytes(64 * 1024, 59)
    for s in (1, 2):
        save_step(store, s, [shared, data[s]])
    sizes = {blob_name(shared): len(shared), blob_name(data[3]): len(data[3])}
    needed = store.blobs.missing_bytes(sizes)
    assert needed > os.statvfs(store.root).f_bavail * os.statvfs(store.root).f_frsize
    store.space.check_space(needed, step=3)
    assert store.catalog.committed() == [2]  # the newest survives; step 1 went early
    assert store.read_blob(blob_name(shared)) == shared
    save_step(store, 3, [shared, data[3]])
    assert store.catalog.committed() == [2, 3]
    for s in (2, 3):
        got = [store.read_blob(sh["blob"]) for sh in json.loads(store.catalog.read(s))["shards"]]
        assert got == [shared, data[s]]


def test_check_space_never_removes_the_newest_step(tmpfs16):
    store = RamStore(tmpfs16 / "mtc", max_to_keep=1)
    save_step(store, 1, [rand_bytes(10 * MiB, 60)])
    with pytest.raises(InsufficientSpaceError, match="step 2"):
        store.space.check_space(store.blobs.missing_bytes({blob_name(b"z"): 10 * MiB}), step=2)
    assert store.catalog.committed() == [1]


def test_disk_full_during_a_write_is_typed_and_leaves_no_temp(tmpfs16):
    store = RamStore(tmpfs16 / "mtc")
    save_step(store, 1, [b"small"])
    with pytest.raises(InsufficientSpaceError, match="mtc size"):
        store.blobs.write(np.zeros(20 * MiB, np.uint8))
    assert temps(store.root) == []
    assert store.blobs.names() == {blob_name(b"small")}
    big = b"\1" * (20 * MiB)
    src = tmpfs16.parent / "download"  # outside the ramdisk
    src.write_bytes(big)
    with pytest.raises(InsufficientSpaceError, match="mtc size"):
        store.blobs.put_file(blob_name(big), src)
    assert temps(store.root) == []
    assert store.catalog.committed() == [1]


# --- crash points (in-process behaviour; the kill itself is in tests/chaos) ----------------

@pytest.mark.unit
def test_crash_point_inert_without_the_variable(monkeypatch):
    monkeypatch.delenv("MTC_CRASH_AT", raising=False)
    faults.crash_point("before_commit")
    monkeypatch.setenv("MTC_CRASH_AT", "after_commit@5,before_blobs@99")
    faults.crash_point("before_commit")
    faults.crash_point("after_commit")


@pytest.mark.unit
@pytest.mark.parametrize("spec", ["nowhere", "before_commit@0", "before_commit@x", "before_commit@"])
def test_crash_point_rejects_bad_specs(monkeypatch, spec):
    monkeypatch.setenv("MTC_CRASH_AT", spec)
    with pytest.raises(ValueError, match="MTC_CRASH_AT"):
        faults.crash_point("before_commit")


@pytest.mark.unit
def test_crash_point_rejects_unknown_names(monkeypatch):
    monkeypatch.delenv("MTC_CRASH_AT", raising=False)
    with pytest.raises(ValueError, match="unknown crash point"):
        faults.crash_point("typo_point")


@pytest.mark.unit
def test_a_commit_lists_each_folder_once_and_reads_back_nothing_it_wrote(store, monkeypatch):
    """Retention and garbage collection after a commit work from one listing of steps/ and
    pending/ and from what this store wrote; they still collect what the pruned step held."""
    from mtc.sidecar.ram import steps as ram_steps

    for s in (1, 2):
        save_step(store, s, [rand_bytes(1000, s)])
    listed, read = [], []
    real_listdir, real_scandir, real_read = os.listdir, os.scandir, ram_steps.read_file
    monkeypatch.setattr(os, "listdir", lambda p=".": listed.append(os.path.basename(p)) or real_listdir(p))
    monkeypatch.setattr(os, "scandir", lambda p=".": listed.append(os.path.basename(p)) or real_scandir(p))
    monkeypatch.setattr(ram_steps, "read_file", lambda p, *a: read.append(os.path.basename(p)) or real_read(p, *a))
    names = save_step(store, 3, [rand_bytes(1000, 3)])
    assert sorted(listed) == ["blobs", "pending", "steps"]
    assert read == []  # not the step file it wrote, nor the ones it checked before
    monkeypatch.undo()
    assert store.catalog.committed() == [2, 3]
    assert len(store.blobs.names()) == 2 and set(names) <= store.blobs.names()  # step 1's blob collected
    assert not (store.root / "pending" / f"{3:012d}").exists()


@pytest.mark.unit
def test_a_pending_dir_with_a_stray_file_still_goes_at_commit(store):
    names = save_step(store, 4, [b"four"], commit=False)
    stray = store.root / "pending" / f"{4:012d}" / ".tmp-host.json-left"
    stray.write_bytes(b"an interrupted writer's temp file")
    store.commit(4, manifest(4, names))
    assert not stray.parent.exists() and store.catalog.committed() == [4]
