"""The backup object stores against real servers: the same tests on a local directory,
fake-gcs-server and gcp-storage-emulator; then outages, dropped connections and wrong
buckets on the emulators."""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from gcs_emulators import FAKE_GCS, GCS_KINDS, GSE, FaultProxy, free_port

from mtc.shared.errors import ConfigError
from mtc.shared.objstore import open_store
from mtc.shared.objstore.store import (
    FatalStoreError,
    InvalidObjectNameError,
    ObjectNotFoundError,
    TransientStoreError,
    UntrustedObjectError,
)

pytestmark = pytest.mark.integration

MiB = 1 << 20
CHUNK = 8 * MiB  # small resumable chunks, so that large files take several


def _random_file(path, size: int, seed: int) -> bytes:
    data = random.Random(seed).randbytes(size)
    path.write_bytes(data)
    return data


# -- the same behaviour on every backend ------------------------------------------------


def test_round_trip_bit_for_bit(store_backend, tmp_path):
    store = store_backend.make(chunk_size=CHUNK)
    cases = {
        "blobs/empty": 0,
        "blobs/small": 1 * MiB + 7,
        "blobs/large": 20 * MiB + 13,  # above the 8 MiB threshold: resumable, three chunks
    }
    for i, (name, size) in enumerate(cases.items()):
        src = tmp_path / f"src-{i}"
        data = _random_file(src, size, seed=i)
        assert store.put_file(name, str(src)) is True
        assert store.size(name) == size
        assert store.exists(name)
        dst = tmp_path / f"dst-{i}"
        assert store.get_to_file(name, str(dst)) == size
        assert dst.read_bytes() == data, name
    manifest = b'{"format": "mtc/1", "step": 7}'
    assert store.put_bytes("backups/step-7.json", manifest) is True
    assert store.get_bytes("backups/step-7.json") == manifest
    assert store.get_bytes("blobs/small") == (tmp_path / "src-1").read_bytes()


def test_list_with_prefix(store_backend):
    store = store_backend.make()
    names = ["backups/2026-01-02T03-04-05Z-step-10.json", "backups/2026-01-02T03-09-05Z-step-20.json",
             "blobs/aa11", "blobs/bb22", "restore.version"]
    for n in reversed(names):
        store.put_bytes(n, n.encode())
    assert store.list() == names
    assert store.list("blobs/") == ["blobs/aa11", "blobs/bb22"]
    assert store.list("backups/2026-01-02T03-0") == names[:2]
    assert store.list("blobs/b") == ["blobs/bb22"]
    assert store.list("nothing/") == []
    # Another prefix of the same bucket (another run) is a separate store.
    other = store_backend.make("other-run/mtc")
    other.put_bytes("blobs/cc33", b"x")
    assert other.list() == ["blobs/cc33"]
    assert store.list("blobs/") == ["blobs/aa11", "blobs/bb22"]


def test_create_only_returns_false_and_keeps_the_first(store_backend, tmp_path):
    store = store_backend.make(chunk_size=CHUNK)
    assert store.put_bytes("backups/b1.json", b"first", if_absent=True) is True
    assert store.put_bytes("backups/b1.json", b"second", if_absent=True) is False
    assert store.get_bytes("backups/b1.json") == b"first"
    for size in (2 * MiB, 12 * MiB):  # one request / resumable
        a, b = tmp_path / f"a{size}", tmp_path / f"b{size}"
        first = _random_file(a, size, seed=1)
        _random_file(b, size, seed=2)
        assert store.put_file(f"blobs/{size}", str(a), if_absent=True) is True
        assert store.put_file(f"blobs/{size}", str(b), if_absent=True) is False
        assert store.get_bytes(f"blobs/{size}") == first
    # Without if_absent a put replaces the object.
    assert store.put_bytes("backups/b1.json", b"third") is True
    assert store.get_bytes("backups/b1.json") == b"third"


def test_create_only_race_has_one_winner(store_backend):
    if not store_backend.enforces_create_only:
        pytest.skip(f"{store_backend.name} ignores generation preconditions: no atomic create-only")
    store = store_backend.make()
    writers = 8
    barrier = threading.Barrier(writers)

    def write(i: int) -> bool:
        barrier.wait(timeout=10)
        return store.put_bytes("backups/commit.json", f"writer {i}".encode(), if_absent=True)

    for _ in range(3):
        store.delete("backups/commit.json")
        with ThreadPoolExecutor(writers) as pool:
            results = list(pool.map(write, range(writers)))
        assert results.count(True) == 1, results
        assert store.get_bytes("backups/commit.json") == f"writer {results.index(True)}".encode()


def test_delete(store_backend):
    store = store_backend.make()
    store.put_bytes("blobs/x", b"x")
    store.put_bytes("blobs/y", b"y")
    store.delete("blobs/x")
    assert not store.exists("blobs/x")
    assert store.size("blobs/x") is None
    assert store.list() == ["blobs/y"]
    store.delete("blobs/x")  # missing is fine
    store.delete("never/was")


@pytest.mark.parametrize("bad", ["", "/etc/passwd", "../escape", "blobs/../../escape", "a//b", "blobs/",
                                 "./a", "blobs/.mtc-tmp-1", "a\\b", "a\x00b", "x" * 1100])
def test_bad_names_are_refused(store_backend, tmp_path, bad):
    store = store_backend.make()
    src = tmp_path / "src"
    src.write_bytes(b"payload")
    calls = [
        lambda: store.put_bytes(bad, b"x"),
        lambda: store.put_file(bad, str(src)),
        lambda: store.get_bytes(bad),
        lambda: store.get_to_file(bad, str(tmp_path / "dst")),
        lambda: store.exists(bad),
        lambda: store.size(bad),
        lambda: store.delete(bad),
    ]
    for call in calls:
        with pytest.raises(InvalidObjectNameError, match="not valid"):
            call()
    with pytest.raises(InvalidObjectNameError):
        store.list("../")
    assert store.list() == []
    assert not (tmp_path / "escape").exists() and not (tmp_path.parent / "escape").exists()


def test_ranges_read_the_bytes_they_name(store_backend):
    store = store_backend.make()
    data = random.Random(5).randbytes(100_000)
    store.put_bytes("backups/x.json", data)
    for offset, length in ((0, 1), (0, 100_000), (12_345, 777), (99_999, 1), (0, 0), (50_000, 0)):
        assert store.get_range("backups/x.json", offset, length) == data[offset:offset + length], (offset, length)
    # past the end: fewer bytes (the caller checks the count), not an error
    assert store.get_range("backups/x.json", 99_990, 100) == data[99_990:]
    assert store.get_range("backups/x.json", 100_000, 10) == b""
    with pytest.raises(ObjectNotFoundError, match="backups/missing"):
        store.get_range("backups/missing", 0, 10)
    with pytest.raises(ValueError, match="negative"):
        store.get_range("backups/x.json", -1, 10)


def test_missing_object_is_a_clear_error(store_backend, tmp_path):
    store = store_backend.make()
    for call in (lambda: store.get_bytes("blobs/missing"),
                 lambda: store.get_to_file("blobs/missing", str(tmp_path / "dst"))):
        with pytest.raises(ObjectNotFoundError, match="blobs/missing") as info:
            call()
        assert isinstance(info.value, FatalStoreError) and isinstance(info.value, FileNotFoundError)
    assert store.size("blobs/missing") is None
    assert store.exists("blobs/missing") is False


def test_an_object_larger_than_its_kind_is_refused_without_reading_it_whole(store_backend):
    store = store_backend.make()
    store.put_bytes("finalizing/marker", b"x" * 5000)
    store.put_bytes("backups/empty.json", b"")
    with pytest.raises(UntrustedObjectError, match="larger than 4096 bytes"):
        store.get_bytes("finalizing/marker", max_bytes=4096)
    assert store.get_bytes("finalizing/marker", max_bytes=5000) == b"x" * 5000
    assert store.get_bytes("backups/empty.json", max_bytes=10) == b""


def test_a_local_object_that_is_a_link_a_fifo_or_a_device_is_refused_at_once(tmp_path):
    """Whoever can write a local backup root can plant these: a link to a secret of the reader's machine
    (its content must not be read, or uploaded), a FIFO (opening it would block until a writer comes),
    a link to /dev/zero (reading it would never end)."""
    store = open_store(str(tmp_path / "root"))
    secret = tmp_path / "token"
    secret.write_bytes(b"the job's token")
    secret.chmod(0o600)
    (tmp_path / "root" / "backups").mkdir()
    os.symlink(secret, tmp_path / "root" / "backups" / "secret.json")
    os.symlink("/dev/zero", tmp_path / "root" / "restore.version")
    os.mkfifo(tmp_path / "root" / "backups" / "fifo.json")
    for name in ("backups/secret.json", "restore.version", "backups/fifo.json"):
        t0 = time.monotonic()
        with pytest.raises(UntrustedObjectError, match="regular|link"):
            store.get_bytes(name)
        with pytest.raises(UntrustedObjectError):
            store.get_to_file(name, str(tmp_path / "out"))
        assert time.monotonic() - t0 < 2, f"{name} blocked the read"
        assert not store.exists(name) and store.size(name) is None
    assert not (tmp_path / "out").exists() or (tmp_path / "out").read_bytes() == b""


def test_local_store_leaves_no_temp_files_and_hides_strays(tmp_path):
    from mtc.shared.objstore.local import LocalStore

    store = LocalStore(tmp_path / "store")
    src = tmp_path / "src"
    _random_file(src, 3 * MiB, seed=3)
    store.put_file("blobs/a", str(src))
    store.put_bytes("blobs/b", b"b", if_absent=True)
    assert store.put_bytes("blobs/b", b"c", if_absent=True) is False
    assert sorted(os.listdir(tmp_path / "store" / "blobs")) == ["a", "b"]  # temp files all gone
    # What a writer killed in the middle leaves behind is never an object.
    (tmp_path / "store" / "blobs" / ".mtc-tmp-killed").write_bytes(b"half")
    assert store.list() == ["blobs/a", "blobs/b"]
    assert store.list("blobs/") == ["blobs/a", "blobs/b"]



def test_a_local_listing_that_cannot_read_its_directory_is_an_error_not_an_empty_listing(tmp_path):
    """os.walk skips what it cannot read: a listing of backups/ came back empty, and read as "no backups"."""
    import subprocess
    import sys

    from mtc.shared.objstore.local import LocalStore

    store = LocalStore(tmp_path / "store")
    assert store.list("backups/") == []  # no backups yet: nothing there, no error
    store.put_bytes("backups/b1.json", b"{}")
    assert store.list("backups/") == ["backups/b1.json"]
    # backups/ is there but is not a directory that can be read: refused, naming the store.
    other = LocalStore(tmp_path / "other")
    (tmp_path / "other" / "backups").write_bytes(b"not a directory")
    with pytest.raises(FatalStoreError, match=r"cannot list 'backups/' in file://.*other/: .*Not a directory"):
        other.list("backups/")
    # Out of file descriptors (a daemon under load): a transient error, not an empty listing.
    code = (
        "import os, resource, sys\n"
        "from mtc.shared.objstore.local import LocalStore\n"
        "from mtc.shared.objstore.store import TransientStoreError\n"
        f"store = LocalStore({str(tmp_path / 'store')!r})\n"
        "n = len(os.listdir('/proc/self/fd'))\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (n - 1, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
        "try:\n"
        "    print(store.list('backups/'))\n"
        "except TransientStoreError as e:\n"
        "    print('transient:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.startswith("transient: cannot list 'backups/'") and "Too many open files" in out.stdout, out


# -- dispatch by URL --------------------------------------------------------------------


def test_open_store_by_url(tmp_path, fake_gcs_server, monkeypatch):
    from mtc.shared.objstore.gcs import GCSStore
    from mtc.shared.objstore.local import LocalStore

    for url in (str(tmp_path / "plain"), (tmp_path / "as-url").as_uri()):
        with open_store(url) as store:
            assert isinstance(store, LocalStore)
            store.put_bytes("blobs/a", b"local")
    assert (tmp_path / "plain" / "blobs" / "a").read_bytes() == b"local"
    assert (tmp_path / "as-url" / "blobs" / "a").read_bytes() == b"local"

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", fake_gcs_server.url)
    fake_gcs_server.client().create_bucket("open-store")
    with open_store("gs://open-store/base/run/mtc") as store:
        assert isinstance(store, GCSStore) and store.url == "gs://open-store/base/run/mtc/"
        store.put_bytes("blobs/a", b"gcs")
    blob = fake_gcs_server.client().bucket("open-store").blob("base/run/mtc/blobs/a")
    assert blob.download_as_bytes() == b"gcs"

    for bad in ("s3://bucket/x", "gs:///nobucket", "file://otherhost/x"):
        with pytest.raises(ConfigError, match="backup store URL"):
            open_store(bad)


# -- failures on the emulators ----------------------------------------------------------


@pytest.mark.parametrize("kind", GCS_KINDS)
def test_wrong_bucket_is_fatal_at_once(kind, request, tmp_path):
    from mtc.shared.objstore.gcs import GCSStore

    server = request.getfixturevalue("fake_gcs_server" if kind == FAKE_GCS else "gcp_storage_emulator")
    src = tmp_path / "src"
    src.write_bytes(os.urandom(10 * MiB))
    with GCSStore("no-such-bucket", "run", client=server.client(), deadline=120) as store:
        for call in (lambda: store.put_bytes("blobs/a", b"x"),
                     lambda: store.put_file("blobs/b", str(src)),
                     lambda: store.get_bytes("blobs/a"),
                     lambda: store.list()):
            t0 = time.monotonic()
            with pytest.raises(FatalStoreError, match="bucket 'no-such-bucket' does not exist"):
                call()
            assert time.monotonic() - t0 < 5, "a fatal error must not be retried until the deadline"


class _RetrySeen(logging.Handler):
    """Sets `event` when the retry loop reports a failed try of an operation on `name`."""

    def __init__(self, name: str):
        super().__init__(logging.INFO)
        self.name_, self.event = name, threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "failed" in record.msg and self.name_ in str(record.args[0]):
            self.event.set()


@pytest.mark.parametrize("kind", GCS_KINDS)
def test_outage_is_transient_and_retried(kind, emulator_factory, tmp_path, caplog):
    from mtc.shared.objstore.gcs import GCSStore
    from mtc.shared.objstore.retry import Backoff

    server = emulator_factory(kind, persistent=True, default_bucket="outage")
    client = server.client()
    fast = Backoff(initial=0.02, maximum=0.2)
    quick = GCSStore("outage", "run", client=client, deadline=1.0, backoff=fast)
    patient = GCSStore("outage", "run", client=client, deadline=60.0, backoff=fast, chunk_size=CHUNK)
    assert quick.put_bytes("blobs/before", b"before") is True

    server.stop()  # SIGKILL, mid-test
    t0 = time.monotonic()
    with pytest.raises(TransientStoreError, match="still failing"):
        quick.put_bytes("blobs/during", b"during")
    assert 0.9 < time.monotonic() - t0 < 10
    with pytest.raises(TransientStoreError):
        quick.list()

    # A call made during the outage keeps retrying and completes when the server is back.
    src = tmp_path / "big"
    data = _random_file(src, 12 * MiB, seed=5)  # resumable
    caplog.set_level(logging.INFO, logger="mtc.shared.objstore.retry")
    seen = _RetrySeen("blobs/after")
    logging.getLogger("mtc.shared.objstore.retry").addHandler(seen)
    try:
        with ThreadPoolExecutor(1) as pool:
            upload = pool.submit(patient.put_file, "blobs/after", str(src), if_absent=True)
            assert seen.event.wait(30), "the upload never met the outage"
            assert not upload.done()
            server.start()  # same port
            assert upload.result(timeout=60) is True
    finally:
        logging.getLogger("mtc.shared.objstore.retry").removeHandler(seen)
    assert patient.get_bytes("blobs/after") == data
    assert quick.get_bytes("blobs/after") == data
    quick.close()
    patient.close()


@pytest.mark.parametrize("kind", GCS_KINDS)
def test_upload_survives_a_dropped_connection(kind, emulator_factory, tmp_path):
    """A connection cut in the middle of a 40 MiB resumable upload. gcp-storage-emulator
    resumes the session from the byte it confirms; fake-gcs-server finalizes the object
    early on the status query, which the store detects (size, crc32c): it deletes
    that generation and uploads again. Either way the object is whole, bit for bit."""
    from mtc.shared.objstore.gcs import GCSStore, make_client
    from mtc.shared.objstore.retry import Backoff

    size = 40 * MiB + 5
    src = tmp_path / "big"
    data = _random_file(src, size, seed=9)
    port = free_port()
    with FaultProxy(port, cut_after=size // 2) as proxy:
        server = emulator_factory(kind, port=port, external_url=proxy.url, default_bucket="cut")

        store = GCSStore("cut", "run", client=make_client(proxy.url), deadline=30,
                         backoff=Backoff(initial=0.02, maximum=0.2), chunk_size=CHUNK)
        assert store.put_file("blobs/big", str(src)) is True
        assert proxy.cuts == 1
        sent = proxy.sent
        store.close()
    dst = tmp_path / "back"
    with GCSStore("cut", "run", client=server.client()) as direct:
        assert direct.get_to_file("blobs/big", str(dst)) == size
    assert dst.read_bytes() == data
    if kind == GSE:
        assert sent < size + 2 * CHUNK, f"resumed upload sent {sent} bytes for {size}"
    else:
        assert sent > size + size // 2 - 2 * CHUNK, f"restarted upload sent only {sent} bytes for {size}"


@pytest.mark.parametrize("kind", GCS_KINDS)
def test_download_resumes_after_a_dropped_connection(kind, emulator_factory, tmp_path):
    from mtc.shared.objstore.gcs import GCSStore, make_client
    from mtc.shared.objstore.retry import Backoff

    size = 24 * MiB + 3
    src = tmp_path / "big"
    data = _random_file(src, size, seed=11)
    port = free_port()
    with FaultProxy(port, cut_after=size // 3, direction="down") as proxy:
        server = emulator_factory(kind, port=port, external_url=proxy.url, default_bucket="dl")
        with GCSStore("dl", "run", client=server.client()) as direct:
            direct.put_file("blobs/big", str(src))
        with GCSStore("dl", "run", client=make_client(proxy.url), deadline=30,
                      backoff=Backoff(initial=0.02, maximum=0.2)) as store:
            dst = tmp_path / "back"
            assert store.get_to_file("blobs/big", str(dst)) == size
        assert proxy.cuts == 1
        assert proxy.received < size + size // 2, f"download restarted from zero ({proxy.received} bytes)"
    assert dst.read_bytes() == data

