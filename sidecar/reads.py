"""Restore reads on a sidecar: a box of an array assembled from this host's verified blobs.

A saved shard that is exactly the box comes back as a private mapping of its blob (no copy;
on a CPU backend the restored array is that map): the file stays locked for as long as the map
lives, so that no process's garbage collection recycles it and writes other bytes into it
(``mtc.sidecar.ram.readers``). Anything else is read, or cut out of mapped shards, into one
fresh buffer. Used by ``SidecarService`` for both transports. Every byte is hashed before it
counts: here, or, for a box the daemon sends as a ``BlobStream`` (a map of its blob's file,
straight to the socket), by the head as it arrives.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Collection, Sequence

import numpy as np

from mtc.shared import format as fmt
from mtc.shared.buffers import aligned_empty, byte_view
from mtc.shared.errors import CorruptBlobError, MTCError, StepNotFoundError
from mtc.sidecar.ram import RamStore
from mtc.sidecar.ram.common import open_blob

log = logging.getLogger(__name__)

# Shards at least this large are restored by mapping their blob (BlobFiles.map), not read:
# smaller ones are cheap to read, and mappings are a limited resource (vm.max_map_count).
_MAP_MIN = 1 << 20


class BlobStream:
    """A saved shard's blob open for sending as it is, unverified: the receiver hashes it.

    ``payload`` is a read-only shared map of the blob's file, which the socket copies from once
    (a small blob, under ``_MAP_MIN``, is read instead: mappings are a limited resource). Not
    ``sendfile``: on loopback the receiver then copies out of 4 KiB page-cache fragments, and a
    1 GiB restore over 4 daemons took 1.2-3x as long (see ``mtc.sidecar.peer.wire`` too). The
    blob is pinned (no collection recycles its file) until ``close()``."""

    def __init__(self, store: RamStore, blob: str, nbytes: int):
        self.blob = blob
        self._stack = contextlib.ExitStack()
        try:
            self._stack.enter_context(store.pins.hold([blob]))
            fd = open_blob(store.blobs.path(blob))  # FileNotFoundError: not here (or not a regular file)
            try:
                size = os.fstat(fd).st_size
                if size != nbytes:
                    raise CorruptBlobError(f"blob {blob} has {size} bytes, the manifest says {nbytes}")
                if nbytes >= _MAP_MIN:
                    self._map: mmap.mmap | None = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
                    self.payload: bytes | mmap.mmap = self._map
                else:
                    self._map, self.payload = None, os.pread(fd, nbytes, 0)
                    if len(self.payload) != nbytes:
                        raise CorruptBlobError(f"blob {blob} ended after {len(self.payload)} of {nbytes} bytes")
            finally:
                os.close(fd)  # the map keeps the pages
        except BaseException:
            self._stack.close()
            raise

    def close(self) -> None:
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a view still held somewhere: the map goes with it
                self._map.close()
        self._stack.close()


class BoxReader:
    def __init__(self, store: RamStore, io: ThreadPoolExecutor, host_id: str):
        self.store = store
        self._io = io
        self.host_id = host_id
        self._scrubbed: dict[str, str] = {}  # blob -> why it was removed (its copy here was corrupt)

    def read_box(self, manifest: fmt.StepManifest, key: str, box: fmt.Box | None = None, *, as_bytes: bool = False,
                 out: np.ndarray | None = None) -> np.ndarray:
        """Assemble the part ``box`` of array ``key`` of ``step`` from verified blobs.

        With ``as_bytes`` the whole array comes back as a flat uint8 buffer (for host numpy
        leaves whose dtype JAX may not hold).
        """
        step = manifest.step
        rec = _record(manifest, key)
        full = tuple((0, n) for n in rec.shape)
        box = full if box is None else tuple(box)
        dtype = rec.np_dtype
        if out is None and not as_bytes:
            # A saved shard that is exactly the box comes back as a private mapping of its
            # blob: no copy, no fresh pages (see BlobFiles.map for why it never changes).
            for shard in rec.shards:
                if shard.box == box:
                    try:
                        mapped = self._map_shard(shard, dtype)
                    except CorruptBlobError as e:
                        self._scrub(shard.blob, e)
                        raise _no_good_copy(step, key, shard, self.host_id, e) from None
                    if mapped is not None:
                        return mapped
                    break
        if out is None:
            out = aligned_empty(fmt.box_shape(box), dtype)
        target = out.view(dtype).reshape(fmt.box_shape(box)) if as_bytes else out
        done: set[fmt.Box] = set()
        for shard in rec.shards:
            if shard.box in done:
                continue
            inter = fmt.box_intersect(shard.box, box)
            if inter is None:
                continue
            done.add(shard.box)
            try:
                if shard.box == box:
                    self.store.blobs.read_into(shard.blob, byte_view(target))
                else:
                    tmp = self._map_shard(shard, dtype)
                    if tmp is None:
                        tmp = aligned_empty(fmt.box_shape(shard.box), dtype)
                        self.store.blobs.read_into(shard.blob, byte_view(tmp))
                    src = tuple(slice(a - s0, b - s0) for (a, b), (s0, _) in zip(inter, shard.box))
                    dst = tuple(slice(a - t0, b - t0) for (a, b), (t0, _) in zip(inter, box))
                    target[dst] = tmp[src]
            except (CorruptBlobError, FileNotFoundError, ValueError) as e:
                if shard.blob in self._scrubbed:  # it was corrupt here a moment ago, and removed: say so
                    e = CorruptBlobError(self._scrubbed[shard.blob])
                elif isinstance(e, CorruptBlobError):
                    self._scrub(shard.blob, e)
                raise _no_good_copy(step, key, shard, self.host_id, e) from None
        return out

    def _scrub(self, blob: str, e: Exception) -> None:
        """A corrupt copy read here is removed, so this host stops counting as its holder: the head's
        next plan brings a good copy from a peer or the backup instead of reading this one again."""
        with contextlib.suppress(OSError, ValueError):
            if self.store.scrub_blob(blob) == "removed":
                if len(self._scrubbed) > 4096:
                    self._scrubbed.clear()
                self._scrubbed[blob] = f"{e}; removed it from this host"

    def read_each(self, manifest: fmt.StepManifest, rows: Sequence[tuple],
                  stream: Collection[int] = ()) -> tuple[list, list[tuple[int, str, str]]]:
        """``read_boxes``; on a failure, box by box, so that the others still count.

        A row whose index is in ``stream`` and whose box is exactly one saved shard comes back
        as a ``BlobStream`` of that shard's blob (the caller sends it, then closes it): its
        receiver hashes the bytes, so they are read here only by the socket. The others (and a
        blob that cannot be opened) are read and verified here."""
        streams: dict[int, BlobStream] = {}
        try:
            for i in sorted(set(stream)):
                key, box, as_bytes, buf = rows[i]
                try:
                    shard = None if as_bytes or buf is not None else _exact_shard(manifest, key, box)
                except MTCError:  # no such array: read below, which reports it
                    shard = None
                if shard is not None:
                    with contextlib.suppress(OSError, CorruptBlobError):  # read below: its error is reported
                        streams[i] = BlobStream(self.store, shard.blob, shard.nbytes)
            rest = [i for i in range(len(rows)) if i not in streams]
            got, errors = self._read_rows(manifest, [rows[i] for i in rest])
        except BaseException:
            for st in streams.values():
                st.close()
            raise
        out: list = [None] * len(rows)
        for i, st in streams.items():
            out[i] = st
        for i, data in zip(rest, got):
            out[i] = data
        return out, [(rest[j], kind, msg) for j, kind, msg in errors]

    def _read_rows(self, manifest: fmt.StepManifest, rows: Sequence[tuple]) -> tuple[list, list[tuple[int, str, str]]]:
        try:
            return self.read_boxes(manifest, rows), []
        except MTCError:
            pass
        out, errors = [], []
        for i, (key, box, as_bytes, buf) in enumerate(rows):
            try:
                out.append(self.read_box(manifest, key, box, as_bytes=as_bytes, out=buf))
            except MTCError as e:  # this box fails; the others of the request still count
                log.warning("host %s: read of %r failed: %s", self.host_id, key, e)
                errors.append((i, type(e).__name__, str(e)))
                out.append(b"")
        return out, errors

    def read_boxes(self, manifest: fmt.StepManifest,
                   reads: Sequence[tuple[str, fmt.Box | None, bool, np.ndarray | None]]) -> list[np.ndarray]:
        """``read_box(step, key, box, as_bytes=, out=)`` for each (key, box, as_bytes, out) of
        ``reads``, on the I/O threads; results in order, the first error raised once all ended.

        Mapping a blob and hashing it (which releases the GIL) fault pages in, which two threads
        do side by side. Buffers that are read into, not mapped, are allocated here, in the
        calling thread: large allocations from worker threads land in per-thread heaps.
        """
        jobs = []
        for key, box, as_bytes, out in reads:
            if out is None and not as_bytes:
                rec = _record(manifest, key)
                b = tuple((0, n) for n in rec.shape) if box is None else tuple(box)
                if not any(s.box == b and s.nbytes >= _MAP_MIN for s in rec.shards):
                    out = aligned_empty(fmt.box_shape(b), rec.np_dtype)
            jobs.append(self._io.submit(self.read_box, manifest, key, box, as_bytes=as_bytes, out=out))
        wait(jobs)
        return [j.result() for j in jobs]

    def _map_shard(self, shard: fmt.ShardRecord, dtype: np.dtype) -> np.ndarray | None:
        """The verified blob of ``shard`` as a mapped array of its box, or None (small, or the
        mapping failed: the caller reads it instead). CorruptBlobError when it is bad."""
        shape = fmt.box_shape(shard.box)
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if nbytes < _MAP_MIN:
            return None
        try:
            data = self.store.blobs.map(shard.blob, nbytes)
        except CorruptBlobError:
            raise
        except OSError as e:  # out of mappings (vm.max_map_count) or map locks (descriptors): read instead
            log.debug("host %s: cannot map blob %s (%s); reading it", self.host_id, shard.blob, e)
            return None
        return data.view(dtype).reshape(shape)


def _exact_shard(manifest: fmt.StepManifest, key: str, box: fmt.Box | None) -> fmt.ShardRecord | None:
    """The saved shard of ``key`` whose box is exactly ``box`` (None: the whole array), if any."""
    rec = _record(manifest, key)
    box = tuple((0, n) for n in rec.shape) if box is None else tuple(box)
    return next((s for s in rec.shards if s.box == box), None)


def _record(manifest: fmt.StepManifest, key: str) -> fmt.ArrayRecord:
    for rec in manifest.arrays:
        if rec.key == key:
            return rec
    raise StepNotFoundError(f"step {manifest.step} has no array {key!r}")


def _no_good_copy(step: int, key: str, shard: fmt.ShardRecord, host: str, e: Exception) -> CorruptBlobError:
    return CorruptBlobError(f"step {step}: array {key!r} shard {fmt.box_str(shard.box)} (blob {shard.blob}) "
                            f"has no good copy on host {host}; tiers tried: ram ({e})")


