"""One host's side of the backup tier: upload blobs, finalize a backup, list, fetch.

The head decides when a backup is due and which host uploads which blob (each unique blob
once, spread over its holders); each sidecar uploads from its committed ramdisk copy. A
backup becomes visible only when its manifest object is written, last and create-only, after
every blob it names is in the store. Finalizes run one at a time per backup root (``fence.py``):
one the head gave up on stops before the next one reads or writes anything.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

from mtc.shared import backup_index
from mtc.shared import backup_layout as layout
from mtc.shared import format as fmt
from mtc.shared.backup_seals import Seals, read_restore_version, seal_object
from mtc.shared.job_key import JobKey
from mtc.shared.errors import CorruptBlobError, ManifestError, StepNotFoundError
from mtc.shared.objstore import open_store
from mtc.shared.objstore.store import ObjectNotFoundError, ObjectStore, UntrustedObjectError
from mtc.shared.safe_files import MAX_MANIFEST_BYTES
from mtc.sidecar.backup.fence import FinalizeFence, sweep_dead
from mtc.sidecar.backup.scrub import Scrubber, read_damaged
from mtc.sidecar.faults import crash_point
from mtc.sidecar.fencing import HeadLease
from mtc.sidecar.ram import RamStore

log = logging.getLogger(__name__)


class BackupTier:
    """Backups of one host's ramdisk to an object store (a GCS bucket or a local directory)."""

    def __init__(self, url: str, ram: RamStore, host_id: str, *, threads: int = 4,
                 store: ObjectStore | None = None, key: JobKey | None = None):
        """``key``: the job key that seals backups and checks seals and fence markers (default: from the
        environment, ``JobKey.from_secret``)."""
        self.url = url
        self._key = key if key is not None else JobKey.from_secret()
        self._ram = ram
        self._host = host_id
        self._store = store or open_store(url)
        self._threads = max(1, threads)
        self._swept = False  # this host's finalize markers from an earlier process removed (fence.py)
        self.scrub_stats = {"checked": 0, "bytes": 0, "bad": 0, "repaired": 0}  # this host's scrubs (metrics)

    def _sweep(self) -> None:
        if not self._swept:
            sweep_dead(self._store, self._host)
            self._swept = True

    # --- save side -----------------------------------------------------------------------

    def upload(self, blobs: list[str]) -> dict:
        """Upload those of ``blobs`` the store lacks, from the ramdisk; skip the others."""
        t0 = time.perf_counter()
        blobs = sorted(set(blobs))
        with self._ram.pins.hold(blobs):
            missing = [b for b in blobs if not self._ram.blobs.has(b)]
            if missing:
                raise StepNotFoundError(
                    f"host {self._host}: cannot back up {len(missing)} blob(s) it no longer holds "
                    f"({missing[0]}, ...); the step was pruned from the ramdisk")

            self._sweep()  # every host uploads before a finalize: a daemon that restarted clears its markers
            # One listing instead of a HEAD per blob: incremental backups skip most blobs.
            present = {o[len(layout.BLOBS):] for o in self._store.list(layout.BLOBS)}

            def one(blob: str) -> int:
                name = layout.blob_object(blob)
                if blob in present:
                    return 0
                crash_point("between_uploads")
                self._store.put_file(name, str(self._ram.blobs.path(blob)))
                return self._ram.blobs.size(blob)

            with ThreadPoolExecutor(self._threads, thread_name_prefix="mtc-upload") as pool:
                sizes = list(pool.map(one, blobs))
        uploaded = [s for s in sizes if s]
        out = {"host": self._host, "uploaded": len(uploaded), "uploaded_bytes": sum(uploaded),
               "skipped": len(blobs) - len(uploaded), "seconds": time.perf_counter() - t0}
        log.info("- backup upload; host=%s; %d blobs, %d bytes in %.3fs", self._host, out["uploaded"],
                 out["uploaded_bytes"], out["seconds"])
        return out

    def finalize(self, name: str, manifest_json: bytes, max_to_keep: int,
                 guard: Callable[[], None] | None = None, generation: int | None = None) -> dict:
        """Make backup ``name`` visible (its manifest, create-only), then apply retention.

        ``guard`` (the sidecar's lease check for the head that asked) runs before every store
        operation and every retry of one, and raises once that head was fenced off: a finalize
        can outlive its head (killed while the bucket was unreachable, this call retrying), and
        left to go on it would write and prune beside the next head's backups, whose manifests
        its retention never listed (it would delete their blobs). The same holds for a finalize
        its own head gave up on: it waits for older finalizes and stops once a newer one starts
        (``fence.py``; ``generation`` orders them, by default the lease's)."""
        manifest = fmt.StepManifest.from_json(manifest_json, source=f"backup {name} manifest")
        if layout.parse_backup_name(name) != manifest.step:
            raise ManifestError(f"backup name {name} does not match the manifest's step {manifest.step}")
        leased = self._store if guard is None else self._store.with_guard(guard)
        if guard is not None:
            guard()  # a fenced-off head announces nothing
        if generation is None:
            generation = (HeadLease(self._ram.root).current() or {}).get("generation")
        fence = FinalizeFence(leased, self._store, name, self._host, generation, key=self._key)
        fence.announce()
        try:
            self._sweep()
            fence.wait_turn()

            def both() -> None:
                if guard is not None:
                    guard()
                fence.check()

            store = self._store.with_guard(both)
            present = {o[len(layout.BLOBS):] for o in store.list(layout.BLOBS)}
            missing = sorted(manifest.blob_names() - present)
            if missing:
                raise CorruptBlobError(f"backup {name}: {len(missing)} blob(s) missing from {self.url} "
                                       f"({missing[0]}, ...); the backup is not made visible")
            if not store.exists(layout.manifest_object(name)):
                # The part index and the seal first: the manifest is what makes the backup visible.
                index = backup_index.make(name, manifest_json)
                if index is not None:
                    store.put_bytes(layout.parts_object(name), index)
                self._seals(store).write(store, name, manifest_json, index)
            created = store.put_bytes(layout.manifest_object(name), manifest_json, if_absent=True)
            if not created and store.get_bytes(layout.manifest_object(name)) != manifest_json:
                raise ManifestError(f"backup {name} is already in {self.url} with another manifest; a backup "
                                    "name is written once: back up again (a new name) to store this one")
            deleted = self._retain(store, max_to_keep)
        finally:
            fence.release()
        return {"name": name, "created": created, "deleted_backups": deleted}

    def _seals(self, store: ObjectStore) -> Seals:
        return Seals(store, self._key, self.url)

    def _names(self, store: ObjectStore, seals: Seals | None = None) -> list[str]:
        """The backups under ``store``, newest first, whose seal checks (``Seals.verify``): a manifest
        planted or copied under another name is neither chosen, nor counted by retention."""
        objects = store.list(layout.BACKUPS)
        return (seals or self._seals(store)).verify(layout.names_from_listing(objects), objects)

    def _retain(self, store: ObjectStore, max_to_keep: int) -> list[str]:
        if not self._names(store)[max_to_keep:]:
            return []
        # The blobs are listed before the backups that say which are live: a blob uploaded after
        # this listing (for a backup not visible yet) is never deleted by this retention.
        blobs = store.list(layout.BLOBS)
        objects = store.list(layout.BACKUPS)
        listed = layout.names_from_listing(objects)
        names = self._seals(store).verify(listed, objects)
        old = names[max_to_keep:]
        if not old:
            return []
        # Manifests first: a backup stops existing before any of its blobs can go; then their seals.
        for n in old:
            store.delete(layout.manifest_object(n))
        for n in old:
            store.delete(seal_object(n))
            store.delete(layout.parts_object(n))
        for obj in store.list(layout.DAMAGED):  # the marks of backups that no longer exist
            if obj[len(layout.DAMAGED):].removesuffix(".json") in old:
                store.delete(obj)
        live: set[str] = set()
        for n in names[:max_to_keep]:
            live.update(fmt.step_blob_names(store.get_bytes(layout.manifest_object(n), max_bytes=MAX_MANIFEST_BYTES),
                                            source=f"backup {n}").names)
        # A manifest this retention leaves in place keeps its blobs, whether or not its seal checked
        # this time: a seal that did not check is never chosen, but a seal that a listing or a read
        # missed once must not cost a backup its blobs (only the manifests deleted above lose theirs).
        for n in sorted(set(listed) - set(names)):
            live |= self._blobs_named_by(store, n)
        for obj in blobs:
            if obj[len(layout.BLOBS):] not in live:
                store.delete(obj)
        return old

    @staticmethod
    def _blobs_named_by(store: ObjectStore, name: str) -> set[str]:
        """The blobs backup ``name``'s manifest names; none when it is gone or is no manifest."""
        try:
            data = store.get_bytes(layout.manifest_object(name), max_bytes=MAX_MANIFEST_BYTES)
            return set(fmt.step_blob_names(data, source=f"backup {name}").names)
        except (ObjectNotFoundError, UntrustedObjectError, ManifestError, ValueError):
            return set()

    # --- restore side --------------------------------------------------------------------

    def list_names(self) -> list[str]:
        """Backup names, newest first."""
        return self._names(self._store)

    def listing(self, deadline_s: float | None = None) -> dict:
        """Backups (newest first, with their steps) and the content of ``restore.version``; the
        backups a scrub marked damaged are left out of ``backups`` (restore never chooses them) and
        listed, with why, in ``damaged``.

        ``deadline_s`` bounds how long an unreachable store is retried (a head waits on this
        at start-up; the store's own deadline is for background uploads).
        """
        store = self._store if deadline_s is None else self._store.with_deadline(deadline_s)
        seals = self._seals(store)
        names = self._names(store, seals)
        rv = read_restore_version(store)
        damaged = {**read_damaged(store), **seals.refused}
        listed = sorted({*names, *seals.refused}, key=layout.order_key, reverse=True)
        return {"backups": [{"name": n, "step": layout.parse_backup_name(n)} for n in names if n not in damaged],
                "restore_version": rv,
                "damaged": [{"name": n, "step": layout.parse_backup_name(n), "why": damaged[n]}
                            for n in listed if n in damaged]}

    def scrub(self, blobs: list[str], bytes_per_s: float, repair: list[str], damaged: dict[str, str],
              ramdisk: list[str] = (), *, sizes: dict[str, int] | None = None, clear: list[str] = ()) -> dict:
        """Check this host's ramdisk copies of ``ramdisk`` and ``blobs`` in the store (an object whose
        size is not ``sizes[blob]`` is bad without being read), re-upload ``repair`` from the ramdisk
        where it holds them, mark ``damaged`` backups, remove the marks of ``clear`` (``scrub.py``)."""
        scrubber = Scrubber(self._store, self._ram, self._host)
        out: dict = {"host": self._host}
        if ramdisk:
            out.update(scrubber.check_ramdisk(list(ramdisk)))
        if blobs:
            out.update(scrubber.check(blobs, bytes_per_s, sizes))
            for key, n in (("checked", out["checked"]), ("bytes", out["bytes"]),
                           ("bad", len(out["bad"]) + len(out["missing"]))):
                self.scrub_stats[key] += n
        if repair:
            out["repaired"] = scrubber.repair(repair)
            self.scrub_stats["repaired"] += len(out["repaired"])
        if damaged:
            out["marked"] = scrubber.mark(damaged)
        if clear:
            out["cleared"] = scrubber.clear(list(clear))
        return out

    def manifest(self, name: str) -> bytes:
        """The manifest of backup ``name``, checked against its seal (ManifestError when it fails)."""
        data = self._store.get_bytes(layout.manifest_object(name))
        self._seals(self._store).check_manifest(name, data)
        return data

    def parts_view(self, name: str, writers: Sequence[str]) -> fmt.StepManifest | None:
        """This host's view of backup ``name``'s manifest (every array, the shards of the parts of
        ``writers``: its own, or after a resize those its new boxes overlap), from the header and those
        parts read by range and checked against the sealed part index; None when the backup has none
        (read the manifest whole)."""
        got = backup_index.read(self._store, self._seals(self._store), name, writers)
        if got is None:
            return None
        header, parts = got
        view = fmt.StepManifest.parts_view(header, parts, source=f"backup {name} (the parts host {self._host} reads)")
        if view.step != layout.parse_backup_name(name):
            raise ManifestError(f"backup {name} holds the manifest of step {view.step}; it is not restored")
        log.info("host %s: backup %s: read the manifest's header and %d part(s) by range (%d bytes)",
                 self._host, name, len(parts), len(header) + sum(len(p) for p in parts.values()))
        return view

    def header(self, name: str) -> bytes | None:
        """The header line of backup ``name``'s manifest, checked against the sealed part index; None
        when the backup has none."""
        got = backup_index.read(self._store, self._seals(self._store), name)
        return None if got is None else got[0]

    def fetch(self, blobs: list[str], sizes: dict[str, int] | None = None) -> dict:
        """Download ``blobs`` the ramdisk lacks, each verified against its name before it counts; with
        ``sizes`` (blob -> its size, from the manifest), an object of another size is corrupt and not
        downloaded (no object stored under a blob's name can fill the ramdisk)."""
        t0 = time.perf_counter()
        need = sorted({b for b in blobs if not self._ram.blobs.has(b)})

        def one(blob: str) -> int:
            want = (sizes or {}).get(blob)
            if want is not None:
                n = self._store.size(layout.blob_object(blob))
                if n is None:
                    raise ObjectNotFoundError(f"object {layout.blob_object(blob)!r} does not exist in {self.url}")
                if n != want:
                    raise CorruptBlobError(f"blob {blob} in {self.url} is {n} bytes, the blob {want}: it is corrupt "
                                           f"(not downloaded, host {self._host})")
            fd, tmp = self._ram.blobs.open_temp()
            os.close(fd)
            try:
                n = self._store.get_to_file(layout.blob_object(blob), str(tmp))
                self._ram.blobs.finalize_temp(tmp, blob, verify=True)
                return n
            except BaseException:
                self._ram.blobs.discard_temp(tmp)
                raise

        with self._ram.pins.hold(need), ThreadPoolExecutor(self._threads, thread_name_prefix="mtc-fetch") as pool:
            sizes = list(pool.map(one, need))
        out = {"host": self._host, "downloaded": len(need), "downloaded_bytes": sum(sizes),
               "seconds": time.perf_counter() - t0}
        log.info("- backup fetch; host=%s; %d blobs, %d bytes in %.3fs", self._host, out["downloaded"],
                 out["downloaded_bytes"], out["seconds"])
        return out

    def close(self) -> None:
        self._store.close()
