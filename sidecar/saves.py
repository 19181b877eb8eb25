"""``SaveWriter``: a save on one host, phase 1 (write the shards as blobs) and phase 2 (commit), or its abort.

The write path, the one a save's time goes into: shards are deduplicated, hashed and written (or
their landings published) on the I/O threads, recorded as this host's part (``pending/``), then
committed. ``SidecarService`` (``mtc.sidecar.service``) makes one and serves phase 1, phase 2 and
abort through it; it is given the RAM store, the step index it shares with the committed steps
(``mtc.sidecar.committed``) and the service's I/O threads.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import Executor, wait
from typing import Sequence

import numpy as np

from mtc.shared import format as fmt
from mtc.shared.buffers import byte_view
from mtc.shared.errors import CorruptBlobError, ManifestError, StepNotFoundError
from mtc.shared.hashing import blob_name
from mtc.sidecar.faults import crash_point
from mtc.sidecar.ram import RamStore
from mtc.sidecar.step_index import StepIndex

log = logging.getLogger(__name__)

# A save part with at most this many bytes is hashed and written on the request's thread.
_INLINE_BYTES = 1 << 20


class SaveWriter:
    """Phase 1, phase 2 and abort of the saves of one host.

    Attributes:
        host_id: the host whose part of each step this writes.
        store: its RAM store (``RamStore``), where the blobs, parts and commits go.
        index: the per-step memory (``StepIndex``) this writer keeps a save's parts in, and notes
            commits and aborts in.
    """

    def __init__(self, store: RamStore, index: StepIndex, io: Executor, host_id: str):
        """``io``: the threads that hash and write shards (the service's I/O pool, shared with reads)."""
        self.host_id = host_id
        self.store = store
        self.index = index
        self._io = io
        # Serialises the recording of a part (its pending host manifest is rewritten whole) and the
        # space check a save makes before its first byte.
        self._lock = threading.Lock()

    # --- save: phase 1 -----------------------------------------------------------------

    def write_shards(self, step: int, shards: Sequence[tuple[int, fmt.Box, np.ndarray]], *,
                     part: int = 0) -> fmt.HostManifest:
        """Phase 1: write this host's unique shards of ``step`` as blobs.

        ``shards`` are (array index, box, data) triples; identical (array, box) pairs (replicas
        on several local devices) are written once. Several calls with increasing ``part``
        add to the same step (one per device group). Returns the host manifest so far, which
        is also kept under ``pending/`` so garbage collection spares its blobs.

        Data that is a buffer of ``Landings.land`` (the usual case: the head's staging copy or the
        daemon's receive put it there) is hashed and published in place; other data (on
        Pathways: the sidecar's own host memory) is written with one copy.
        """
        t0 = time.perf_counter()
        unique: dict[tuple[int, fmt.Box], memoryview] = {}
        landed = {}
        for array, box, data in shards:
            key = (array, tuple(box))
            if key not in unique:
                data = np.ascontiguousarray(data)
                unique[key] = byte_view(data)
                landed[key] = self.store.landings.landed(data)
        rest = [len(buf) for key, buf in unique.items() if landed[key] is None]
        # When every shard not landed fits as a new blob (the usual case), nothing has to be freed
        # and the names are not needed up front: each I/O thread hashes a shard, then writes
        # (or publishes) it, so hashing overlaps the writes of the other thread.
        if self.store.space.fits(rest):
            self.index.start_part(step, part)
            crash_point("before_blobs")
            return self._hash_and_write(step, unique, landed, t0, part)
        names = dict(zip(unique, self._io.map(
            lambda k: landed[k].name if landed[k] is not None and landed[k].name else blob_name(unique[k]), unique)))
        sizes = {names[k]: len(buf) for k, buf in unique.items() if landed[k] is None}
        missing = {n: size for n, size in sizes.items() if not self.store.blobs.has(n)}
        with self._lock:
            self.index.start_part(step, part)
            self.store.space.check_space(self.store.blobs.missing_bytes(missing), step=step, sizes=missing.values())
        crash_point("before_blobs")
        todo = {}
        for key, buf in unique.items():
            todo.setdefault(names[key], (buf, landed[key]))
        entries = [fmt.HostShard(a, box, names[(a, box)], len(unique[(a, box)])) for (a, box) in unique]
        # Pinned until the pending host manifest references them: a concurrent commit's
        # garbage collection must not take blobs of a step still being written.
        with self.store.pins.hold(todo):
            futures = []
            for i, (name, (buf, land)) in enumerate(todo.items()):
                if i == 1:
                    crash_point("between_blobs")
                futures.append(self._io.submit(self._put, buf, land, name))
            wait(futures)
            written = sum(len(buf) for (buf, _), f in zip(todo.values(), futures) if f.result())
            manifest = self._record_part(step, entries, written, t0)
        log.debug("step %d part %d: %d blobs, %d bytes written in %.3fs", step, part, len(todo), written,
                  time.perf_counter() - t0)
        return manifest

    def _put(self, buf: memoryview, land, name: str) -> bool:
        """Store one shard as blob ``name``: publish its landing, or write it; whether it was added."""
        if land is not None:
            return self.store.landings.publish(land, name)
        return self.store.blobs.write(buf, name=name)[1]

    def _hash_and_write(self, step: int, unique: dict[tuple[int, fmt.Box], memoryview], landed: dict,
                        t0: float, part: int) -> fmt.HostManifest:
        """Hash and store each unique shard on the I/O threads; the first of equal blobs writes."""
        claimed: set[str] = set()
        lock = threading.Lock()
        with contextlib.ExitStack() as pins:
            def one(buf: memoryview, land) -> tuple[str, int]:
                # A filled cold landing was hashed as it was written; a landing filled through its
                # map is hashed where it lies.
                name = land.name if land is not None and land.name else blob_name(buf)
                with lock:
                    first = name not in claimed
                    if first:
                        claimed.add(name)
                        # Pinned until the pending host manifest references it (see write_shards).
                        pins.enter_context(self.store.pins.hold([name]))
                if not first:
                    return name, 0  # an equal shard's landing is removed when its batch closes
                return name, len(buf) if self._put(buf, land, name) else 0

            if len(unique) == 1 or sum(len(b) for b in unique.values()) <= _INLINE_BYTES:
                # Small: hashed and written on this thread. A hand-off to the I/O threads would
                # cost more (wake-ups, futexes) than it overlaps.
                results = []
                for i, (key, buf) in enumerate(unique.items()):
                    if i == 1:
                        crash_point("between_blobs")
                    results.append(one(buf, landed[key]))
            else:
                futures = []
                for i, (key, buf) in enumerate(unique.items()):
                    if i == 1:
                        crash_point("between_blobs")
                    futures.append(self._io.submit(one, buf, landed[key]))
                wait(futures)
                results = [f.result() for f in futures]  # the first error, once all writes stopped
            entries = [fmt.HostShard(a, box, name, len(buf))
                       for ((a, box), buf), (name, _) in zip(unique.items(), results)]
            written = sum(n for _, n in results)
            manifest = self._record_part(step, entries, written, t0)
        log.debug("step %d part %d: %d blobs, %d bytes written in %.3fs", step, part, len(claimed), written,
                  time.perf_counter() - t0)
        return manifest

    def _record_part(self, step: int, entries: list[fmt.HostShard], written: int, t0: float) -> fmt.HostManifest:
        with self._lock:
            shards, nbytes, seconds = self.index.add_to_part(step, entries, written, time.perf_counter() - t0)
            manifest = fmt.HostManifest(step, self.host_id, shards, nbytes, seconds)
            data = manifest.to_json()
            self.index.drop_written(step)
            self.store.write_pending(step, data)
            self.index.keep_written(step, data, manifest)
        return manifest

    def part_bytes(self, step: int) -> bytes:
        """This host's part of ``step`` so far (its host manifest), as phase 1 answered it."""
        data = self.store.catalog.read_pending(step)
        if data is None:
            raise StepNotFoundError(f"host {self.host_id}: step {step} has no part here (phase 1 did not run "
                                    "or the step was committed or aborted)")
        return data

    # --- save: phase 2 -----------------------------------------------------------------

    def commit(self, step: int, manifest_json: bytes | None, *, digest: str | None = None,
               keepers: Sequence[tuple[str, str]] | None = None) -> dict:
        """Phase 2: make ``step`` visible on this host by writing its step file, last.

        A keeper gets the whole manifest (``manifest_json``), checks it (every array covered,
        replicas equal, this host's part the one it wrote) and writes it. Every other host
        gets only the decision: the manifest's ``digest`` and the ``keepers`` (host, peer
        address); it writes a ``fmt.CommitRecord`` with its own part, and fetches the manifest
        from a keeper when it first needs it. Retention is the store's (``StoreSpace.max_to_keep``).
        Returns what this host wrote for the step (blobs, bytes, seconds) for the save report.
        """
        pending = self.store.catalog.read_pending(step)
        self.index.end_part(step)
        if pending is None:
            raise StepNotFoundError(
                f"host {self.host_id}: cannot commit step {step}: this host did not write it "
                "(phase 1 missing); save the step again")
        manifest = None
        if manifest_json is not None:
            data = bytes(manifest_json)
            where = f"step {step} manifest from head"
            if data.startswith(b"{") and fmt.step_format(data) == fmt.FORMAT:
                # The hash checks only: the per-shard checks would cost a keeper O(shards) in the
                # save's critical path; they run when the manifest is read.
                got, got_digest, parts = fmt.check_step_bytes(data, source=where)
            else:  # an older format (a restore or repair of an old step): read it whole
                manifest = fmt.StepManifest.from_json(data, source=where)
                got, got_digest, parts = manifest.step, manifest.digest, dict(manifest.parts)
            if got != step:
                raise ManifestError(f"commit of step {step} carries the manifest of step {got}")
            if digest is not None and got_digest != digest:
                raise ManifestError(f"commit of step {step}: the manifest's digest is not the one the head decided")
            own = parts.get(self.host_id)
            if own is not None and own != blob_name(pending):
                raise ManifestError(f"host {self.host_id}: the manifest of step {step} does not hold the part "
                                    "this host wrote in phase 1; not committing")
        elif digest is not None and keepers:
            data = fmt.CommitRecord(step, digest, tuple((str(h), str(a)) for h, a in keepers), pending).to_json()
        else:
            raise ManifestError(f"commit of step {step} needs the step manifest, or its digest and its keepers")
        written = self.index.take_written(step)
        host = written[1] if written is not None and written[0] == pending else fmt.HostManifest.from_json(
            pending, source=f"host {self.host_id} step {step} pending manifest")
        missing = sorted({s.blob for s in host.shards if not self.store.blobs.has(s.blob)})
        if missing:
            raise CorruptBlobError(f"host {self.host_id}: step {step} is missing {len(missing)} of its "
                                   f"blobs ({missing[0]}, ...); not committing")
        crash_point("before_commit")
        kept = self.store.commit(step, data)
        self.index.note_commit(step, data, kept, manifest)  # what this commit pruned is forgotten
        crash_point("after_commit")
        return {"host": self.host_id, "blobs": len(host.blob_names()), "written_bytes": host.written_bytes,
                "write_s": host.seconds, "keeper": manifest_json is not None}

    def abort(self, step: int) -> bool:
        """Forget ``step`` here (its save failed on some host): committed or pending, and its
        unshared blobs. True when there was something to remove."""
        self.index.forget(step)
        removed = self.store.delete_step(step)
        if removed:
            log.info("host %s: step %d aborted (its save failed on some host)", self.host_id, step)
        return removed
