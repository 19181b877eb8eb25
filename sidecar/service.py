"""The sidecar service: all worker-side behaviour of one host, behind plain-value methods.

The head reaches it either through ``jax.experimental.colocated_python`` (see
``mtc.sidecar.colocated``) or through the sidecar daemon's control socket. Both wrappers
call the same methods here, so tiers, formats and policies are one code path.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Sequence

import numpy as np

from mtc.shared import format as fmt
from mtc.shared.buffers import byte_view
from mtc.shared import protocol, ramdisk, version
from mtc.shared.errors import ConfigError, CorruptBlobError, ManifestError, MTCError, StepNotFoundError
from mtc.shared.hashing import blob_name
from mtc.sidecar.faults import crash_point
from mtc.sidecar.fencing import HeadLease
from mtc.sidecar.jobs import Jobs
from mtc.sidecar.peer import PeerClient, PeerServer
from mtc.sidecar.ram import RamStore
from mtc.sidecar.reads import BoxReader
from mtc.sidecar.replication import Pull, held_bits, pull_blobs, pull_notes

log = logging.getLogger(__name__)

_advised: set[str] = set()  # mount points already logged by this process


def _log_ramdisk_advice(store: RamStore) -> None:
    """Say once per mount, at start, when the ramdisk is not a tmpfs or has 4 KiB pages."""
    m = store.mount
    if m is None or m.mountpoint in _advised:
        return
    _advised.add(m.mountpoint)
    text = ramdisk.advice_for(store.root, m)
    if text:
        (log.info if m.is_tmpfs else log.warning)("%s", text)


# A save part with at most this many bytes is hashed and written on the request's thread.
_INLINE_BYTES = 1 << 20

HOST_FILE = "host.json"  # in the ramdisk root: {"host": id} of the sidecar that serves it

# Requests that change a host: only the head holding the lease may send them (fencing).
MUTATING_OPS = frozenset({"write", "commit", "abort", "peer_pull", "backup_upload", "backup_finalize",
                          "backup_fetch"})


class SidecarService:
    """One host's worker-side checkpointing: the RAM tier, phase 1/2 of saves, restores.

    Methods take and return plain values (ints, bytes, numpy arrays, frozen dataclasses).
    Both transports (the colocated Python object and the daemon) call ``admit`` with each
    request's operation and head generation before they call the method.
    """

    def __init__(self, root: str | os.PathLike, *, host_id: str = "host-0", max_to_keep: int = 2,
                 io_threads: int = 2, backup_url: str | None = None):
        self.host_id = host_id
        self.backup_url = backup_url or None
        self._backup = None
        self.jobs = Jobs(self.host_id)
        self.store = RamStore(root, max_to_keep=max_to_keep, blobs_of=fmt.collect_blob_names)
        self._note_host_id()
        _log_ramdisk_advice(self.store)
        self._io = ThreadPoolExecutor(max_workers=max(1, io_threads), thread_name_prefix="mtc-io")
        self._reader = BoxReader(self.store, self._io, self.host_id)
        self._lock = threading.Lock()
        # step -> (shards written so far, bytes written so far, seconds so far), across parts.
        self._partial: dict[int, tuple[list[fmt.HostShard], int, float]] = {}
        self._manifests: dict[int, fmt.StepManifest] = {}
        # step -> the bytes this sidecar committed (a manifest or a record): a step file damaged
        # under a live sidecar is rewritten from them (see inventory).
        self._committed: dict[int, bytes] = {}
        # step -> (local view of a step committed here as a record, {array key: its own boxes}):
        # what a restore onto the same topology reads by, without the other hosts' parts.
        self._views: dict[int, tuple[fmt.StepManifest, dict[str, set], dict[str, tuple]]] = {}
        # (step, manifest digest) -> {host: digest of its share's blob names}, for inventories.
        self._share_digests: dict[tuple[int, str], dict[str, str]] = {}
        # step -> (step file bytes, its commit record or None, the record part's blob names): parsed once.
        self._records: dict[int, tuple[bytes, fmt.CommitRecord | None, frozenset | None]] = {}
        # step -> (pending host manifest bytes, that manifest) as this sidecar wrote it in phase 1.
        self._parts: dict[int, tuple[bytes, fmt.HostManifest]] = {}
        self._peer = None  # the peer tier's server (start_peer_service)
        self._peer_token = ""
        self._closed = False
        self.lease = HeadLease(self.store.root)

    def _note_host_id(self) -> None:
        """Which host's ramdisk this is (``host.json``), for tools that read a stopped job's folders."""
        path = self.store.root / HOST_FILE
        doc = json.dumps({"host": self.host_id}).encode()
        try:
            if not path.exists() or path.read_bytes() != doc:
                tmp = path.with_name(f".{HOST_FILE}.tmp")
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # the job's files: its user's only
                with os.fdopen(fd, "wb") as f:
                    f.write(doc)
                os.replace(tmp, path)
        except OSError as e:  # a note for tools; the sidecar serves without it
            log.warning("host %s: could not write %s: %s", self.host_id, path, e)

    # --- fencing (one head at a time) --------------------------------------------------

    def admit(self, op: str, generation: int | None) -> None:
        """Refuse a changing request (``MUTATING_OPS``) from a head that was fenced off.

        First, a ramdisk emptied under this sidecar gets its layout back (``RamStore.check_layout``),
        so the request, and every one after it, finds the folders (and the lease file) it needs."""
        self.store.check_layout()
        if op in MUTATING_OPS:
            self.lease.check(generation, f"{op} on host {self.host_id}")

    def claim(self, generation: int, head: dict) -> dict:
        """A starting head takes this host (its generation must be newer than the lease's)."""
        return self.lease.claim(generation, head)

    def current_lease(self) -> dict | None:
        return self.lease.current()

    def use_backup_root(self, url: str | None) -> None:
        """Back up to ``url``: adopted if none is set yet; another one is refused."""
        if not url:
            return
        with self._lock:
            if self.backup_url is None:
                self.backup_url = url  # the head's config names the backup root
            elif self.backup_url != url:
                raise ConfigError(f"host {self.host_id} backs up to {self.backup_url}, but the head asks for "
                                  f"{url}; restart the daemon (or the head) with one backup root")

    # --- identity ----------------------------------------------------------------------

    def fingerprint(self) -> dict:
        fp = version.fingerprint()
        fp["host"] = self.host_id
        if self._peer is not None:
            fp["peer"] = self._peer.address  # how the other sidecars reach this one
        return fp

    # --- save: phase 1 -----------------------------------------------------------------

    def land(self, sizes: Sequence[int], *, cold_ok: bool = False):
        """Mapped temp blob files for the shards of the next ``write_shards``, one per size
        (``RamStore.land``: None for a size not landed; with ``cold_ok``, some cold: filled with
        ``Landing.fill``). The bytes written into them are not copied again: ``write_shards``
        hashes (unless the fill did) and publishes them where they are."""
        return self.store.land(sizes, cold_ok=cold_ok)

    def write_shards(self, step: int, shards: Sequence[tuple[int, fmt.Box, np.ndarray]], *,
                     part: int = 0) -> fmt.HostManifest:
        """Phase 1: write this host's unique shards of ``step`` as blobs.

        ``shards`` are (array index, box, data) triples; identical (array, box) pairs (replicas
        on several local devices) are written once. Several calls with increasing ``part``
        add to the same step (one per device group). Returns the host manifest so far, which
        is also kept under ``pending/`` so garbage collection spares its blobs.

        Data that is a buffer of ``land`` (the usual case: the head's staging copy or the
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
                landed[key] = self.store.landed(data)
        rest = [len(buf) for key, buf in unique.items() if landed[key] is None]
        # When every shard not landed fits as a new blob (the usual case), nothing has to be freed
        # and the names are not needed up front: each I/O thread hashes a shard, then writes
        # (or publishes) it, so hashing overlaps the writes of the other thread.
        if self.store.fits(rest):
            with self._lock:
                self._start_part(step, part)
            crash_point("before_blobs")
            return self._hash_and_write(step, unique, landed, t0, part)
        names = dict(zip(unique, self._io.map(
            lambda k: landed[k].name if landed[k] is not None and landed[k].name else blob_name(unique[k]), unique)))
        sizes = {names[k]: len(buf) for k, buf in unique.items() if landed[k] is None}
        missing = {n: size for n, size in sizes.items() if not self.store.has_blob(n)}
        with self._lock:
            self._start_part(step, part)
            self.store.check_space(self.store.missing_bytes(missing), step=step, sizes=missing.values())
        crash_point("before_blobs")
        todo = {}
        for key, buf in unique.items():
            todo.setdefault(names[key], (buf, landed[key]))
        entries = [fmt.HostShard(a, box, names[(a, box)], len(unique[(a, box)])) for (a, box) in unique]
        # Pinned until the pending host manifest references them: a concurrent commit's
        # garbage collection must not take blobs of a step still being written.
        with self.store.pin(todo):
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
            return self.store.publish_landed(land, name)
        return self.store.write_blob(buf, name=name)[1]

    def _start_part(self, step: int, part: int) -> None:
        if part == 0:
            self._partial[step] = ([], 0, 0.0)
        elif step not in self._partial:
            raise ManifestError(f"step {step}: part {part} of a save arrived before part 0")

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
                        pins.enter_context(self.store.pin([name]))
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
            done, done_bytes, done_s = self._partial[step]
            done.extend(entries)
            self._partial[step] = (done, done_bytes + written, done_s + time.perf_counter() - t0)
            manifest = fmt.HostManifest(step, self.host_id, tuple(done), done_bytes + written,
                                        done_s + time.perf_counter() - t0)
            data = manifest.to_json()
            self._parts.pop(step, None)
            self.store.write_pending(step, data)
            self._parts[step] = (data, manifest)
        return manifest

    def part_bytes(self, step: int) -> bytes:
        """This host's part of ``step`` so far (its host manifest), as phase 1 answered it."""
        data = self.store.read_pending(step)
        if data is None:
            raise StepNotFoundError(f"host {self.host_id}: step {step} has no part here (phase 1 did not run "
                                    "or the step was committed or aborted)")
        return data

    # --- save: phase 2 -----------------------------------------------------------------

    def commit(self, step: int, manifest_json: bytes | None, *, max_to_keep: int | None = None,
               digest: str | None = None, keepers: Sequence[tuple[str, str]] | None = None) -> dict:
        """Phase 2: make ``step`` visible on this host by writing its step file, last.

        A keeper gets the whole manifest (``manifest_json``), checks it (every array covered,
        replicas equal, this host's part the one it wrote) and writes it. Every other host
        gets only the decision: the manifest's ``digest`` and the ``keepers`` (host, peer
        address); it writes a ``fmt.CommitRecord`` with its own part, and fetches the manifest
        from a keeper when it first needs it. ``max_to_keep`` (the head's ``local_max_to_keep``)
        overrides the sidecar's own, so the head's config decides retention on every host.
        Returns what this host wrote for the step (blobs, bytes, seconds) for the save report.
        """
        if max_to_keep is not None:
            self.store.max_to_keep = int(max_to_keep)
        pending = self.store.read_pending(step)
        with self._lock:
            self._partial.pop(step, None)
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
        written = self._parts.get(step)
        for s in [s for s in self._parts if s <= step]:  # committed now, or abandoned before it
            self._parts.pop(s, None)
        host = written[1] if written is not None and written[0] == pending else fmt.HostManifest.from_json(
            pending, source=f"host {self.host_id} step {step} pending manifest")
        missing = sorted({s.blob for s in host.shards if not self.store.has_blob(s.blob)})
        if missing:
            raise CorruptBlobError(f"host {self.host_id}: step {step} is missing {len(missing)} of its "
                                   f"blobs ({missing[0]}, ...); not committing")
        crash_point("before_commit")
        kept = set(self.store.commit(step, data))
        self._committed[step] = data
        for s in [s for s in self._committed if s not in kept]:  # pruned by this commit
            del self._committed[s]
            self._manifests.pop(s, None)
        if manifest is not None:
            self._manifests[step] = manifest
        crash_point("after_commit")
        return {"host": self.host_id, "blobs": len(host.blob_names()), "written_bytes": host.written_bytes,
                "write_s": host.seconds, "keeper": manifest_json is not None}

    # --- inventory ---------------------------------------------------------------------

    def steps(self) -> list[int]:
        return self.store.committed_steps()

    def manifest_bytes(self, step: int, *, here_only: bool = False) -> bytes:
        """The whole manifest of committed ``step`` (fetched from a keeper first if need be;
        with ``here_only``, StepNotFoundError instead when this host committed only a record)."""
        if here_only and step not in self._manifests and self._record(step) is not None:
            raise StepNotFoundError(f"host {self.host_id} keeps only a record of step {step}, not its manifest")
        return self.manifest(step).to_json()

    def _has_readable(self, step: int) -> bool:
        """Whether ``step`` is committed here with a manifest that passes its checks."""
        try:
            self.manifest(step)
            return True
        except (ManifestError, StepNotFoundError):
            self._manifests.pop(step, None)
            return False

    def manifest(self, step: int) -> fmt.StepManifest:
        """The whole manifest of committed ``step``. Where this host committed only a record
        (``fmt.CommitRecord``), it is fetched from a keeper, checked against the digest, and
        replaces the record (ManifestError if no keeper could give it)."""
        m = self._manifests.get(step)
        if m is None:
            data = self.store.read_step(step)
            try:
                rec = fmt.CommitRecord.parse(data, source=f"{self.host_id} step {step} commit record")
                if rec is not None:
                    data = self._fetch_manifest(rec)
                m = fmt.StepManifest.from_json(data, source=f"{self.host_id} step {step}")
            except ManifestError:
                # Changed under this live sidecar (bit rot, a stray write): it committed the step
                # itself, so it rewrites the file from the bytes it committed.
                good = self._committed.get(step)
                if good is None or good == data or not self.store.rewrite_step(step, good):
                    raise
                log.warning("host %s: the file of step %d failed its checks; rewrote it from what this sidecar "
                            "committed", self.host_id, step)
                return self.manifest(step)
            if rec is not None:
                self.store.upgrade_step(step, data, rec.digest)
            self._manifests[step] = m
        return m

    def _record(self, step: int) -> fmt.CommitRecord | None:
        """The commit record of ``step`` here, if that is what this host committed (else None)."""
        return self._read_record(step)[0]

    def _read_record(self, step: int) -> tuple[fmt.CommitRecord | None, frozenset | None]:
        """(the commit record of ``step`` here or None, the blob names of its part). The file is
        read each time (a damaged one must show); bytes read as before are not parsed again."""
        try:
            data = self.store.read_step(step)
        except (ManifestError, StepNotFoundError, OSError):
            return None, None
        hit = self._records.get(step)
        if hit is not None and hit[0] == data:
            return hit[1], hit[2]
        try:
            rec = fmt.CommitRecord.parse(data, source=f"{self.host_id} step {step} record")
            own = None if rec is None else frozenset(rec.host_manifest().blob_names())
        except (ManifestError, OSError):
            return None, None
        self._records[step] = (data, rec, own)
        return rec, own

    def _fetch_manifest(self, rec: fmt.CommitRecord, *, header_only: bool = False) -> bytes:
        what = "the header of its manifest" if header_only else "its manifest"
        causes = []
        for host, address in rec.keepers:
            if host == self.host_id or not self._peer_token:
                causes.append(f"{host}: {'this host' if host == self.host_id else 'no peer token here'}")
                continue
            try:
                with PeerClient(address, self._peer_token, peer=host, timeout_s=60.0) as client:
                    data = client.manifest(rec.step, rec.digest, header_only=header_only)
                log.info("host %s: fetched %s (step %d) from keeper %s", self.host_id, what, rec.step, host)
                return data
            except (MTCError, OSError) as e:
                causes.append(f"{host}: {e}")
        raise ManifestError(f"host {self.host_id}: step {rec.step} is committed here as a record, and no keeper "
                            f"could give {what} ({'; '.join(causes)}); the head gives it back at restore")

    def _view_for(self, step: int, rows: Sequence[tuple]) -> fmt.StepManifest:
        """The manifest to read ``rows`` (key, box, ...) of ``step`` by.

        Where this host keeps the whole manifest, that one. Where it committed a record and every
        row is exactly one of its own shards (a restore onto the same topology), its local view:
        the header fetched from a keeper (one line: arrays and shardings) with its own part, both
        checked against the digest it committed; the other hosts' parts, which grow with hosts x
        shards, are not fetched. Any other read (a resharded restore) fetches the whole manifest.
        """
        if step in self._manifests:
            return self._manifests[step]
        rec = self._record(step)
        if rec is None:
            return self.manifest(step)
        held = self._views.get(step)
        if held is None or held[0].digest != rec.digest:
            try:
                view = fmt.StepManifest.local_view(self._fetch_manifest(rec, header_only=True), self.host_id, rec.part,
                                                   source=f"{self.host_id} step {step} local view")
            except ManifestError as e:
                log.info("host %s: step %d: no local view (%s); reading by the whole manifest", self.host_id, step, e)
                return self.manifest(step)
            if view.step != step or view.digest != rec.digest:
                return self.manifest(step)
            boxes = {a.key: {s.box for s in a.shards} for a in view.arrays if a.shards}
            shapes = {a.key: a.shape for a in view.arrays}
            held = self._views[step] = (view, boxes, shapes)
        view, boxes, shapes = held
        for key, box, *_ in rows:
            if key not in shapes:
                return self.manifest(step)
            want = tuple((0, n) for n in shapes[key]) if box is None else tuple(tuple(b) for b in box)
            if want not in boxes.get(key, ()):
                return self.manifest(step)
        return view

    def inventory(self, devices: Sequence[int] | None = None) -> dict:
        """What this host holds: committed steps, and for each which of its blobs are here.

        ``blobs``/``local_blobs`` count this host's own share of the step: the shards of
        ``devices`` (the head's device ids of this host) when given, else every blob of the
        step (one host holding every device); ``own`` is the digest of that share's sorted blob
        names (hosts with equal shares, data-parallel twins, have equal ones). The held bits
        cover every blob of the step (of the own share, for a host that committed a record).
        """
        mine = set(devices) if devices is not None else None
        have = self.store.list_blobs()
        out, damaged = [], []
        committed = self.store.committed_steps()
        kept = set(self._manifests) | set(self._committed)
        for s in sorted(kept - set(committed)):  # a step file no longer JSON is rewritten
            # (A commit on another thread may prune the step meanwhile: then there is nothing to repair.)
            m = self._manifests.get(s)
            data = self._committed.get(s) if m is None else None
            with contextlib.suppress(ManifestError, OSError):
                if m is not None:
                    data = m.to_json()
                if data is not None and self.store.repair_step(s, data):
                    committed = self.store.committed_steps()
        for s in set(self._committed) - set(committed):  # pruned or aborted (or not repairable)
            self._committed.pop(s, None)
        for s in (set(self._records) | set(self._views)) - set(committed):
            self._records.pop(s, None)
            self._views.pop(s, None)
        for s in committed:
            rec, own = (None, None) if s in self._manifests else self._read_record(s)
            if rec is not None:
                # Committed here as a record: this host's own part is all it holds of the step,
                # and all it reports (the head maps it with the manifest): no fetch for an inventory.
                out.append({"step": s, "blobs": len(own), "local_blobs": len(own & have), "manifest": rec.digest,
                            "part": True, "own": protocol.blob_list_digest(sorted(own)), **held_bits(own, have)})
                continue
            try:
                m = self.manifest(s)
            except (ManifestError, StepNotFoundError) as e:
                log.warning("host %s: step %d manifest unreadable: %s", self.host_id, s, e)
                damaged.append(s)  # its blobs may be fine: the head can give the manifest back (peer_pull)
                continue
            if mine is None:
                own = m.blob_names()
            else:  # shards with no device record (older manifests) count for every host
                own = {sh.blob for rec in m.arrays for sh in rec.shards if not sh.devices or mine & set(sh.devices)}
            # Its share: the part it wrote (mtc/3), else the shards of its devices.
            share = m.part_blobs.get(self.host_id, own)
            out.append({"step": s, "blobs": len(own), "local_blobs": len(own & have), "manifest": m.digest,
                        "own": protocol.blob_list_digest(sorted(share)), "copies": self._shares_held(m, have),
                        **held_bits(m.blob_names(), have)})
        # A step file that is no longer JSON hides its step; this host committed it, so it is
        # damaged, not gone: the head gives the manifest the others agree on back.
        damaged += [s for s in self.store.unreadable_steps(listed=True) if s not in damaged]
        return {"host": self.host_id, "steps": out, "damaged": sorted(damaged), **pull_notes(self.store)}

    def _shares_held(self, m: fmt.StepManifest, have: set[str]) -> list[str]:
        """The digests of the shares (hosts' parts) of ``m`` that this host holds whole, its own
        and the copies it keeps for others, as the head's replication counts them
        (``covered_by_shares``)."""
        key = (m.step, m.digest)
        digests = self._share_digests.get(key)
        if digests is None:
            digests = {h: protocol.blob_list_digest(sorted(b)) for h, b in m.part_blobs.items()}
            # Rebuilt, not changed in place: inventories may run on several threads at once.
            kept = {k: v for k, v in list(self._share_digests.items()) if k[0] in self._manifests}
            kept[key] = digests
            self._share_digests = kept
        return sorted({d for h, d in digests.items() if m.part_blobs[h] <= have})

    def verify(self, step: int) -> dict:
        """Hash every blob of ``step`` this host holds: {"checked": n, "bad": [names that fail]}."""
        names = sorted(self.manifest(step).blob_names() & self.store.list_blobs())
        bad = [n for n in names if not self.store.verify_blob(n)]
        if bad:
            log.warning("host %s: step %d: %d blobs fail their hash: %s", self.host_id, step, len(bad), bad[:3])
        return {"host": self.host_id, "checked": len(names), "bad": bad}

    def abort(self, step: int) -> bool:
        """Forget ``step`` here (its save failed on some host): committed or pending, and its
        unshared blobs. True when there was something to remove."""
        with self._lock:
            self._partial.pop(step, None)
        self._manifests.pop(step, None)
        self._committed.pop(step, None)
        self._views.pop(step, None)
        self._records.pop(step, None)
        self._parts.pop(step, None)
        removed = self.store.delete_step(step)
        if removed:
            log.info("host %s: step %d aborted (its save failed on some host)", self.host_id, step)
        return removed

    # --- restore (mtc.sidecar.reads) ---------------------------------------------------

    def read_box(self, step: int, key: str, box: fmt.Box | None = None, *, as_bytes: bool = False,
                 out: np.ndarray | None = None) -> np.ndarray:
        """Assemble the part ``box`` of array ``key`` of ``step`` from verified blobs (``as_bytes``:
        the whole array as a flat uint8 buffer, for host numpy leaves)."""
        return self._reader.read_box(self.manifest(step), key, box, as_bytes=as_bytes, out=out)

    def read_boxes_each(self, step: int, reads: Sequence[tuple], *, manifest: str | None = None,
                        stream: Sequence[int] = ()) -> tuple[list, list[tuple[int, str, str]]]:
        """Read (key, box) or (key, box, as_bytes, out) rows; on a failure, box by box, so that the
        others still count: (buffers, [(index, error type, message)]), with b"" for a failed box.
        Both transports read through this (the daemon's head tries another holder for a failed
        box; the colocated transport raises the first).

        ``manifest`` is the digest of the step manifest the head restores by: when this host's
        copy differs, every box fails (this host's copy counts as missing, never as data).

        ``stream``: rows whose receiver hashes what it gets (the daemon's head); one that is a saved
        shard comes back as a ``BlobStream`` to send and close (``BoxReader.read_each``)."""
        rows = [tuple(r) + (False, None)[len(r) - 2:] if len(r) < 4 else tuple(r) for r in reads]
        mine = self._view_for(step, rows)
        if manifest is not None and mine.digest != manifest:
            why = (f"host {self.host_id}: its manifest of step {step} ({mine.digest[:12]}) is not the one the head "
                   f"restores by ({manifest[:12]}); not reading from it")
            log.error(why)
            return [b"" for _ in rows], [(i, "ManifestError", why) for i in range(len(rows))]
        return self._reader.read_each(mine, rows, stream)

    # --- long operations (mtc.sidecar.jobs) --------------------------------------------

    def start_job(self, fn, *args) -> str:
        """Run ``fn(*args)`` as a job of this sidecar; the head asks ``job`` for its end."""
        return self.jobs.start(fn, *args)

    def job(self, job_id: str, wait_s: float = 0.0) -> dict:
        """{"done": False} while running (after waiting up to ``wait_s``); then the result or the error, once."""
        return self.jobs.poll(job_id, wait_s)

    # --- backup tier ---------------------------------------------------------------------

    def _backup_tier(self):
        if self.backup_url is None:
            raise ConfigError("no backup tier: set base_output_directory (and run_name) to back up and "
                              "restore from object storage")
        with self._lock:
            if self._backup is None:
                from mtc.sidecar.backup.tier import BackupTier

                self._backup = BackupTier(self.backup_url, self.store, self.host_id)
            return self._backup

    def backup_upload(self, assignments: dict[str, list[str]]) -> dict:
        """Upload the blobs the head assigned to this host (those the store lacks)."""
        return self._backup_tier().upload(list(assignments.get(self.host_id, [])))

    def backup_finalize(self, name: str, manifest_json: bytes, max_to_keep: int,
                        generation: int | None = None) -> dict:
        """Make backup ``name`` visible, then apply retention; ``generation`` is the asking head's
        (``admit`` checked it once): checked again before every bucket operation, so that a head
        fenced off meanwhile neither makes a backup visible nor prunes beside the next head."""
        what = f"backup_finalize of {name} on host {self.host_id}"
        return self._backup_tier().finalize(name, manifest_json, max_to_keep,
                                            guard=lambda: self.lease.check(generation, what))

    def backup_listing(self, deadline_s: float | None = None) -> dict:
        return self._backup_tier().listing(deadline_s)

    def backup_manifest(self, name: str) -> bytes:
        return self._backup_tier().manifest(name)

    def backup_fetch(self, name: str, needs: dict[str, list[str]]) -> dict:
        """Pull this host's blobs of backup ``name`` into the ramdisk, verified; restore reads them."""
        tier = self._backup_tier()
        manifest = fmt.StepManifest.from_json(tier.manifest(name), source=f"backup {name}")
        out = tier.fetch(list(needs.get(self.host_id, [])))
        self._manifests[manifest.step] = manifest
        return out

    # --- peer tier -----------------------------------------------------------------------

    def start_peer_service(self, listen: tuple[str, int], token: str, *, advertise: str | None = None) -> str:
        """Serve this host's blobs to its peers on ``listen``; returns the advertised address.

        ``token`` is the job's shared peer secret; pulls from peers present it too.
        """
        if self._peer is not None:
            return self._peer.address
        server = PeerServer(self.store, token, host_id=self.host_id, listen=listen, advertise=advertise)
        server.start()
        self._peer, self._peer_token = server, token
        return server.address

    @property
    def peer_address(self) -> str | None:
        return None if self._peer is None else self._peer.address

    def peer_pull(self, step: int, pulls: Sequence, peers: dict[str, str], manifest_json: bytes | None = None,
                  shares: Sequence[tuple[str, Sequence[str]]] = ()) -> dict:
        """Pull blobs of ``step`` from the peers that hold them, verified (see mtc.sidecar.replication).

        ``shares`` are (owner host, holders): every blob of the owner's part of the step, which
        this host lists from its manifest (fetched from a keeper if need be), so that the head
        names a share, not its blobs. With ``manifest_json`` (a restore onto a host that lost
        the step), the step is committed here once every pull succeeded, so that its blobs are
        kept and the host counts as holding the step again.
        """
        if self._peer is None:
            raise ConfigError(f"host {self.host_id} has no peer tier: start its sidecar with a peer token "
                              "(MTC_PEER_TOKEN or peer_token)")
        if shares:
            # Copies held for others are kept alive by the whole manifest, which also lists the shares.
            m = self.manifest(step)
            sizes = m.blob_sizes()
            pulls = list(pulls)
            for owner, holders in shares:
                blobs = m.part_blobs.get(owner)
                if blobs is None:
                    raise ManifestError(f"host {self.host_id}: step {step}'s manifest has no part of host {owner}")
                pulls += [Pull(b, sizes[b], tuple(holders)) for b in sorted(blobs)]
        elif step in self.store.committed_steps():
            # Copies held for others are kept alive by the whole manifest: a host that committed
            # only a record fetches it first (if it cannot, ``manifest_json`` below, or a later try).
            with contextlib.suppress(ManifestError, StepNotFoundError):
                self.manifest(step)
        out = pull_blobs(self.store, self._peer_token, pulls, peers, host_id=self.host_id, step=step)
        out["asked_bytes"] = sum({p.blob: p.size for p in pulls}.values())
        out["adopted"] = False
        if manifest_json is not None and not out["failed"] and not self._has_readable(step):
            manifest = fmt.StepManifest.from_json(manifest_json, source=f"step {step} manifest from head")
            if manifest.step != step:
                raise ManifestError(f"peer pull of step {step} carries the manifest of step {manifest.step}")
            self.store.commit(step, manifest_json)
            self._manifests[step] = manifest
            out["adopted"] = True
            log.info("host %s: step %d restored from peers and committed here again", self.host_id, step)
        return out

    # --- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._peer is not None:
                self._peer.close()
            self._io.shutdown(wait=True)
            self.store.close()
            if self._backup is not None:
                self._backup.close()
