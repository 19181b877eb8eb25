"""A backup finalize that outlives its head: the head is killed while the bucket is unreachable, the
sidecar's finalize keeps retrying, a new head takes the host over, the bucket comes back. The old
finalize must then neither make its backup visible nor prune: its retention never listed the new
head's backups, so it would delete blobs they use (the soak's gcs_outage_head_restart found backups
pruned under it after the new head's backup had finished). Real sidecar service, real fake-gcs-server."""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np
import pytest

from mtc.shared import backup_layout as layout
from mtc.shared import format as fmt
from mtc.shared.errors import FencedError
from mtc.shared.hashing import blob_name
from mtc.shared.objstore import open_store
from mtc.sidecar.service import SidecarService

pytestmark = pytest.mark.integration


def _backup(store, step: int, seed: int) -> tuple[str, bytes]:
    """A one-array step manifest whose blob is uploaded to ``store``: (backup name, manifest)."""
    data = np.random.default_rng(seed).standard_normal(1024).astype(np.float32).tobytes()
    blob = blob_name(data)
    store.put_bytes(layout.blob_object(blob), data)
    shard = fmt.ShardRecord(box=((0, 1024),), blob=blob, nbytes=len(data), devices=(0,))
    rec = fmt.ArrayRecord(key="w", kind="numpy", dtype="float32", shape=(1024,), shards=(shard,))
    m = fmt.StepManifest(step=step, arrays=(rec,), tree=None)
    return layout.backup_name(step), m.to_json()


def test_a_finalize_fenced_off_while_the_bucket_was_down_writes_and_prunes_nothing(
        tmp_path, emulator_factory, monkeypatch):
    server = emulator_factory("fake-gcs-server", persistent=True)
    bucket = f"mtc-{uuid.uuid4().hex[:12]}"
    server.client().create_bucket(bucket)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.url)
    url = f"gs://{bucket}/run/mtc"
    store = open_store(url)
    svc = SidecarService(tmp_path / "ram", host_id="h0", backup_url=url)
    try:
        old = {"host": "a", "pid": 1, "started": "t1"}
        svc.lease.claim(1, old)
        kept = []
        for step in (1, 2):  # two backups made by the first head
            name, manifest = _backup(store, step, step)
            assert svc.backup_finalize(name, manifest, 2, generation=1)["created"]
            kept.append(name)
        name3, manifest3 = _backup(store, 3, 3)
        before = store.list("")

        server.stop()  # the bucket goes away; the first head asks for backup 3 (keep 1) and dies
        outcome: dict = {}

        def zombie() -> None:
            try:
                outcome["result"] = svc.backup_finalize(name3, manifest3, 1, generation=1)
            except Exception as e:  # noqa: BLE001 - the test judges what came out
                outcome["error"] = e

        t = threading.Thread(target=zombie)
        t.start()
        time.sleep(1.0)
        assert t.is_alive(), f"the finalize did not wait for the bucket: {outcome}"
        svc.lease.claim(2, {"host": "b", "pid": 2, "started": "t2"})  # the restarted head takes the host
        server.start()  # same port, same objects
        t.join(timeout=120)
        assert not t.is_alive(), "the fenced-off finalize still runs two minutes after the bucket came back"

        assert isinstance(outcome.get("error"), FencedError), outcome
        assert "generation 2" in str(outcome["error"]), outcome["error"]
        # Nothing changed in the bucket: backup 3 not visible, backups 1 and 2 and their blobs kept.
        assert store.list("") == before
        assert layout.names_from_listing(store.list(layout.BACKUPS)) == kept[::-1]
        # The new head's own finalize goes through (and applies its retention).
        assert svc.backup_finalize(name3, manifest3, 1, generation=2)["deleted_backups"] == kept[::-1]
    finally:
        svc.close()
        store.close()


def test_a_guarded_store_asks_its_guard_before_every_retry(emulator_factory, monkeypatch):
    """An operation that started before its head was fenced off, and is still retrying against an
    unreachable bucket, stops at its next try: it does not land once the bucket is back."""
    server = emulator_factory("fake-gcs-server", persistent=True)
    bucket = f"mtc-{uuid.uuid4().hex[:12]}"
    server.client().create_bucket(bucket)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.url)
    store = open_store(f"gs://{bucket}/run/mtc")
    fenced = threading.Event()

    def guard() -> None:
        if fenced.is_set():
            raise FencedError("fenced off by generation 2")

    guarded = store.with_guard(guard)
    try:
        server.stop()
        outcome: dict = {}

        def put() -> None:
            try:
                outcome["result"] = guarded.put_bytes("backups/x.json", b"{}", if_absent=True)
            except Exception as e:  # noqa: BLE001 - the test judges what came out
                outcome["error"] = e

        t = threading.Thread(target=put)
        t.start()
        time.sleep(1.0)
        assert t.is_alive(), outcome  # retrying: the guard passed when the put started
        fenced.set()
        server.start()
        t.join(timeout=60)
        assert not t.is_alive()
        assert isinstance(outcome.get("error"), FencedError), outcome
        assert not store.exists("backups/x.json")
        with pytest.raises(FencedError):  # and refused at once from now on
            guarded.list("backups/")
        assert store.list("backups/") == []  # the unguarded store is unaffected
    finally:
        store.close()
