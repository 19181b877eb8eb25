"""The sidecar service: all worker-side behaviour of one host, behind plain-value methods.

The head reaches it either through ``jax.experimental.colocated_python`` (see
``mtc.sidecar.colocated``) or through the sidecar daemon's control socket. Both wrappers
call the same methods here, so tiers, formats and policies are one code path.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Sequence

import numpy as np

from mtc.shared import format as fmt
from mtc.shared.buffers import byte_view
from mtc.shared import ramdisk, version
from mtc.shared.errors import ConfigError, CorruptBlobError, ManifestError, StepNotFoundError
from mtc.shared.hashing import blob_name
from mtc.sidecar.faults import crash_point
from mtc.sidecar.fencing import HeadLease
from mtc.sidecar.jobs import Jobs
from mtc.sidecar.peer import PeerServer
from mtc.sidecar.ram import RamStore
from mtc.sidecar.reads import BoxReader
from mtc.sidecar.replication import held_bits, pull_blobs

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
        _log_ramdisk_advice(self.store)
        self._io = ThreadPoolExecutor(max_workers=max(1, io_threads), thread_name_prefix="mtc-io")
        self._reader = BoxReader(self.store, self._io, self.host_id)
        self._lock = threading.Lock()
        # step -> (shards written so far, bytes written so far, seconds so far), across parts.
        self._partial: dict[int, tuple[list[fmt.HostShard], int, float]] = {}
        self._manifests: dict[int, fmt.StepManifest] = {}
        self._peer = None  # the peer tier's server (start_peer_service)
        self._peer_token = ""
        self._closed = False
        self.lease = HeadLease(self.store.root)

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

    def write_shards(self, step: int, shards: Sequence[tuple[int, fmt.Box, np.ndarray]], *,
                     part: int = 0) -> fmt.HostManifest:
        """Phase 1: write this host's unique shards of ``step`` as blobs.

        ``shards`` are (array index, box, data) triples; identical (array, box) pairs (replicas
        on several local devices) are written once. Several calls with increasing ``part``
        add to the same step (one per device group). Returns the host manifest so far, which
        is also kept under ``pending/`` so garbage collection spares its blobs.
        """
        t0 = time.perf_counter()
        unique: dict[tuple[int, fmt.Box], memoryview] = {}
        for array, box, data in shards:
            unique.setdefault((array, tuple(box)), byte_view(np.ascontiguousarray(data)))
        # When every shard fits as a new blob (the usual case), nothing has to be freed and the
        # names are not needed up front: each I/O thread hashes a shard, then writes it, so
        # hashing overlaps the writes of the other thread.
        if self.store.fits(len(buf) for buf in unique.values()):
            with self._lock:
                self._start_part(step, part)
            crash_point("before_blobs")
            return self._hash_and_write(step, unique, t0, part)
        names = dict(zip(unique, self._io.map(blob_name, unique.values())))
        sizes = {names[k]: len(buf) for k, buf in unique.items()}
        missing = {n: size for n, size in sizes.items() if not self.store.has_blob(n)}
        with self._lock:
            self._start_part(step, part)
            self.store.check_space(self.store.missing_bytes(missing), step=step, sizes=missing.values())
        crash_point("before_blobs")
        todo = {}
        for key, buf in unique.items():
            todo.setdefault(names[key], buf)
        entries = [fmt.HostShard(a, box, names[(a, box)], len(unique[(a, box)])) for (a, box) in unique]
        # Pinned until the pending host manifest references them: a concurrent commit's
        # garbage collection must not take blobs of a step still being written.
        with self.store.pin(todo):
            futures = []
            for i, (name, buf) in enumerate(todo.items()):
                if i == 1:
                    crash_point("between_blobs")
                futures.append(self._io.submit(self.store.write_blob, buf, name=name))
            written = sum(len(buf) for (name, buf), f in zip(todo.items(), futures) if f.result()[1])
            manifest = self._record_part(step, entries, written, t0)
        log.info("step %d part %d: %d blobs, %d bytes written in %.3fs", step, part, len(todo), written,
                 time.perf_counter() - t0)
        return manifest

    def _start_part(self, step: int, part: int) -> None:
        if part == 0:
            self._partial[step] = ([], 0, 0.0)
        elif step not in self._partial:
            raise ManifestError(f"step {step}: part {part} of a save arrived before part 0")

    def _hash_and_write(self, step: int, unique: dict[tuple[int, fmt.Box], memoryview], t0: float,
                        part: int) -> fmt.HostManifest:
        """Hash and write each unique shard on the I/O threads; the first of equal blobs writes."""
        claimed: set[str] = set()
        lock = threading.Lock()
        with contextlib.ExitStack() as pins:
            def one(buf: memoryview) -> tuple[str, int]:
                name = blob_name(buf)
                with lock:
                    first = name not in claimed
                    if first:
                        claimed.add(name)
                        # Pinned until the pending host manifest references it (see write_shards).
                        pins.enter_context(self.store.pin([name]))
                if not first:
                    return name, 0
                return name, len(buf) if self.store.write_blob(buf, name=name)[1] else 0

            futures = []
            for i, buf in enumerate(unique.values()):
                if i == 1:
                    crash_point("between_blobs")
                futures.append(self._io.submit(one, buf))
            wait(futures)
            results = [f.result() for f in futures]  # the first error, once all writes stopped
            entries = [fmt.HostShard(a, box, name, len(buf))
                       for ((a, box), buf), (name, _) in zip(unique.items(), results)]
            written = sum(n for _, n in results)
            manifest = self._record_part(step, entries, written, t0)
        log.info("step %d part %d: %d blobs, %d bytes written in %.3fs", step, part, len(claimed), written,
                 time.perf_counter() - t0)
        return manifest

    def _record_part(self, step: int, entries: list[fmt.HostShard], written: int, t0: float) -> fmt.HostManifest:
        with self._lock:
            done, done_bytes, done_s = self._partial[step]
            done.extend(entries)
            self._partial[step] = (done, done_bytes + written, done_s + time.perf_counter() - t0)
            manifest = fmt.HostManifest(step, self.host_id, tuple(done), done_bytes + written,
                                        done_s + time.perf_counter() - t0)
            self.store.write_pending(step, manifest.to_json())
        return manifest

    # --- save: phase 2 -----------------------------------------------------------------

    def commit(self, step: int, manifest_json: bytes, *, max_to_keep: int | None = None) -> dict:
        """Phase 2: make ``step`` visible on this host by writing its step manifest, last.

        ``max_to_keep`` (the head's ``local_max_to_keep``) overrides the sidecar's own, so the
        head's config decides retention on every host. Returns what this host wrote for the
        step (blobs, bytes, seconds) for the save report.
        """
        if max_to_keep is not None:
            self.store.max_to_keep = int(max_to_keep)
        manifest = fmt.StepManifest.from_json(manifest_json, source=f"step {step} manifest from head")
        if manifest.step != step:
            raise ManifestError(f"commit of step {step} carries the manifest of step {manifest.step}")
        pending = self.store.read_pending(step)
        with self._lock:
            self._partial.pop(step, None)
        if pending is None:
                raise StepNotFoundError(
                    f"host {self.host_id}: cannot commit step {step}: this host did not write it "
                "(phase 1 missing); save the step again")
        host = fmt.HostManifest.from_json(pending, source=f"host {self.host_id} step {step} pending manifest")
        missing = sorted({s.blob for s in host.shards if not self.store.has_blob(s.blob)})
        if missing:
            raise CorruptBlobError(f"host {self.host_id}: step {step} is missing {len(missing)} of its "
                                   f"blobs ({missing[0]}, ...); not committing")
        crash_point("before_commit")
        self.store.commit(step, manifest_json)
        self._manifests[step] = manifest
        crash_point("after_commit")
        return {"host": self.host_id, "blobs": len(host.blob_names()), "written_bytes": host.written_bytes,
                "write_s": host.seconds}

    # --- inventory ---------------------------------------------------------------------

    def steps(self) -> list[int]:
        return self.store.committed_steps()

    def manifest_bytes(self, step: int) -> bytes:
        return self.store.read_step(step)

    def _has_readable(self, step: int) -> bool:
        """Whether ``step`` is committed here with a manifest that passes its checks."""
        try:
            self.manifest(step)
            return True
        except (ManifestError, StepNotFoundError):
            self._manifests.pop(step, None)
            return False

    def manifest(self, step: int) -> fmt.StepManifest:
        m = self._manifests.get(step)
        if m is None:
            m = fmt.StepManifest.from_json(self.store.read_step(step), source=f"{self.host_id} step {step}")
            self._manifests[step] = m
        return m

    def inventory(self, devices: Sequence[int] | None = None) -> dict:
        """What this host holds: committed steps, and for each which of its blobs are here.

        ``blobs``/``local_blobs`` count this host's own share of the step: the shards of
        ``devices`` (the head's device ids of this host) when given, else every blob of the
        step (one host holding every device). The held bits cover every blob of the step.
        """
        mine = set(devices) if devices is not None else None
        have = self.store.list_blobs()
        out, damaged = [], []
        committed = self.store.committed_steps()
        for s in sorted(set(self._manifests) - set(committed)):  # a step file no longer JSON is rewritten
            with contextlib.suppress(ManifestError, OSError):
                if self.store.repair_step(s, self._manifests[s].to_json()):
                    committed = self.store.committed_steps()
        for s in committed:
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
            out.append({"step": s, "blobs": len(own), "local_blobs": len(own & have), "manifest": m.digest,
                        **held_bits(m.blob_names(), have)})
        return {"host": self.host_id, "steps": out, "damaged": damaged}

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
        mine = self.manifest(step)
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

    def backup_finalize(self, name: str, manifest_json: bytes, max_to_keep: int) -> dict:
        return self._backup_tier().finalize(name, manifest_json, max_to_keep)

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

    def peer_pull(self, step: int, pulls: Sequence, peers: dict[str, str], manifest_json: bytes | None = None) -> dict:
        """Pull blobs of ``step`` from the peers that hold them, verified (see mtc.sidecar.replication).

        With ``manifest_json`` (a restore onto a host that lost the step), the step is committed
        here once every pull succeeded, so that its blobs are kept and the host counts as
        holding the step again.
        """
        if self._peer is None:
            raise ConfigError(f"host {self.host_id} has no peer tier: start its sidecar with a peer token "
                              "(MTC_PEER_TOKEN or peer_token)")
        out = pull_blobs(self.store, self._peer_token, pulls, peers, host_id=self.host_id)
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
            if self._backup is not None:
                self._backup.close()
