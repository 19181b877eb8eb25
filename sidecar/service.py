"""The sidecar service: all worker-side behaviour of one host, behind plain-value methods.

The head reaches it either through ``jax.experimental.colocated_python`` (see
``mtc.sidecar.colocated``) or through the sidecar daemon's control socket. Both wrappers
call what the table of operations (``mtc.sidecar.ops``) names for each operation: a method
here, or one of the part that owns the state it reads or changes (``saves.write_shards``,
``committed.inventory``, ``lease.claim``, ``jobs.poll``), so tiers, formats and policies are one
code path and the service holds no method that only forwards.

The service composes the parts that own the work: the RAM store (``mtc.sidecar.ram``), the save's
writer (phase 1, phase 2, abort: ``SaveWriter`` in ``mtc.sidecar.saves``), the committed steps
(manifests, records, inventory, verify: ``CommittedSteps`` in ``mtc.sidecar.committed``) over one
``StepIndex`` they share, the box reader, the jobs, the lease, and the peer and backup tiers. It
holds the head's settings and what spans several parts (a peer pull that adopts a step, a backup
fetch whose manifest the restore reads by).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Mapping, Sequence

from mtc.shared import format as fmt
from mtc.shared.format.writers import designated
from mtc.shared import ramdisk, version
from mtc.shared.errors import ConfigError, ManifestError, NotConfiguredError, StepNotFoundError
from mtc.shared.host_settings import HostSettings
from mtc.shared.safe_files import MAX_NOTE_BYTES, UntrustedFileError, read_regular
from mtc.shared.tls import TLSFiles
from mtc.sidecar.fencing import HeadLease
from mtc.sidecar.jobs import Jobs
from mtc.sidecar.ops import MUTATING_OPS
from mtc.sidecar.peer import PeerServer
from mtc.sidecar.ram import RamStore
from mtc.sidecar.ram.common import replace_file
from mtc.sidecar.committed import CommittedSteps
from mtc.sidecar.reads import BoxReader
from mtc.sidecar.replication import Pull, pull_blobs
from mtc.sidecar.saves import SaveWriter
from mtc.sidecar.step_index import StepIndex

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


HOST_FILE = "host.json"  # in the ramdisk root: {"host": id} of the sidecar that serves it

class SidecarService:
    """One host's worker-side checkpointing: the RAM tier, phase 1/2 of saves, restores.

    Methods take and return plain values (ints, bytes, numpy arrays, frozen dataclasses).
    Both transports (the colocated Python object and the daemon) call ``admit`` with each
    request's operation and head generation before they call the method.

    Attributes:
        host_id: this host's id.
        settings: the head's settings (``HostSettings``), from its ``configure``.
        store: the RAM tier (``RamStore``).
        index: what this sidecar remembers per step (``StepIndex``), shared by ``saves`` and ``committed``.
        saves: phase 1, phase 2 and abort of saves (``SaveWriter``).
        committed: the committed steps' manifests, inventory and verify (``CommittedSteps``).
        jobs: the long operations running here (``Jobs``).
        lease: the lease of the head that drives this host (``HeadLease``).
    """

    def __init__(self, root: str | os.PathLike, *, host_id: str = "host-0", max_to_keep: int = 2,
                 io_threads: int = 2, backup_url: str | None = None, awaits_head: bool = False):
        """``max_to_keep``/``backup_url``: the settings of a service used on its own (tools, tests).
        A transport passes ``awaits_head``: then the head's ``configure`` is the only source of
        settings, and what needs them raises NotConfiguredError until it came."""
        self.host_id = host_id
        self.settings = HostSettings(local_max_to_keep=max_to_keep, backup_url=backup_url or None)
        self._configured = not awaits_head
        self._backups: dict[str, object] = {}  # backup root -> its BackupTier
        self._readers: dict[str, object] = {}  # backup root -> a BackupTier that creates no root (listings)
        self._fingerprint: dict | None = None
        self.jobs = Jobs(self.host_id)
        self.store = RamStore(root, max_to_keep=max_to_keep, blobs_of=fmt.collect_blob_names)
        self._note_host_id()
        _log_ramdisk_advice(self.store)
        self._io = ThreadPoolExecutor(max_workers=max(1, io_threads), thread_name_prefix="mtc-io")
        self._reader = BoxReader(self.store, self._io, self.host_id)
        self._lock = threading.Lock()  # the settings and the backup tiers
        self.index = StepIndex()
        self.saves = SaveWriter(self.store, self.index, self._io, self.host_id)
        self.committed = CommittedSteps(self.store, self.index, self.host_id)
        self._peer = None  # the peer tier's server (start_peer_service)
        self._peer_token = ""
        self._closed = False
        self.lease = HeadLease(self.store.root)

    def _note_host_id(self) -> None:
        """Which host's ramdisk this is (``host.json``), for tools that read a stopped job's folders."""
        path = self.store.root / HOST_FILE
        doc = json.dumps({"host": self.host_id}).encode()
        try:
            try:
                same = read_regular(path, MAX_NOTE_BYTES, "host note") == doc
            except (FileNotFoundError, UntrustedFileError):  # missing, or not a regular file: written again
                same = False
            if not same:
                replace_file(path, doc)  # the job's files: its user's only
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

    def configure(self, settings: dict, generation: int | None = None) -> dict:
        """Follow the head's settings (``HostSettings``); ``admit`` checked ``generation`` against
        the lease, so only the head that drives this host sets them."""
        new = HostSettings.from_wire(settings)
        with self._lock:
            old, self.settings, self._configured = self.settings, new, True
            self.store.space.max_to_keep = new.local_max_to_keep
        if old.backup_url != new.backup_url:
            log.info("host %s: backup root %s (generation %s)", self.host_id, new.backup_url, generation)
        return {"host": self.host_id, "settings": new.to_wire()}

    def _settings(self, what: str) -> HostSettings:
        if not self._configured:
            raise NotConfiguredError(f"host {self.host_id}: {what} needs the head's settings, which no head has "
                                     "sent since this sidecar started; the head sends them (configure) first")
        return self.settings

    # --- identity ----------------------------------------------------------------------

    def ping(self) -> dict:
        """Liveness: who serves here (the daemon answers it before authentication too)."""
        return {"host": self.host_id, "pid": os.getpid()}

    def fingerprint(self) -> dict:
        if self._fingerprint is None:  # versions do not change while the process runs
            self._fingerprint = version.fingerprint()
        fp = dict(self._fingerprint)
        fp["host"] = self.host_id
        if self._peer is not None:
            fp["peer"] = self._peer.address  # how the other sidecars reach this one
        return fp

    # --- save (mtc.sidecar.saves) --------------------------------------------------------

    def commit(self, step: int, manifest_json: bytes | None, *, digest: str | None = None,
               keepers: Sequence[tuple[str, str]] | None = None) -> dict:
        """Phase 2 (``SaveWriter.commit``), once the head's settings came: they say how many steps
        the commit keeps."""
        self._settings(f"commit of step {step}")
        return self.saves.commit(step, manifest_json, digest=digest, keepers=keepers)

    # --- restore (mtc.sidecar.reads) ---------------------------------------------------

    def read_boxes_each(self, step: int, reads: Sequence[tuple], *, manifest: str | None = None,
                        stream: Sequence[int] = (), keepers: dict[str, str] | None = None
                        ) -> tuple[list, list[tuple[int, str, str]]]:
        """Read (key, box) or (key, box, as_bytes, out) rows; on a failure, box by box, so that the
        others still count: (buffers, [(index, error type, message)]), with b"" for a failed box.
        Both transports read through this (the daemon's head tries another holder for a failed
        box; the colocated transport raises the first).

        ``manifest`` is the digest of the step manifest the head restores by: when this host's
        copy differs, every box fails (this host's copy counts as missing, never as data).

        ``stream``: rows whose receiver hashes what it gets (the daemon's head); one that is a saved
        shard comes back as a ``BlobStream`` to send and close (``BoxReader.read_each``).

        ``keepers``: where the hosts that keep the whole manifest serve now (host -> peer address), for
        a host that committed a record and fetches the header or the manifest from them."""
        rows = [tuple(r) + (False, None)[len(r) - 2:] if len(r) < 4 else tuple(r) for r in reads]
        mine = self.committed.view_for(step, rows, keepers)
        if manifest is not None and mine.digest != manifest:
            why = (f"host {self.host_id}: its manifest of step {step} ({mine.digest[:12]}) is not the one the head "
                   f"restores by ({manifest[:12]}); not reading from it")
            log.error(why)
            return [b"" for _ in rows], [(i, "ManifestError", why) for i in range(len(rows))]
        return self._reader.read_each(mine, rows, stream)

    # --- backup tier ---------------------------------------------------------------------
    #
    # The table names these methods, not a part: which ``BackupTier`` serves a request depends on
    # its root or on the head's settings, and is opened on first use (``_backup_tier``).

    def _backup_tier(self, root: str | None = None, *, configured: bool = True, create: bool = True):
        """The backup tier of the configured backup root (``configured``), or of ``root``: the
        root a reader names (listings and manifests), which needs no settings, so that a head
        that does not drive these hosts (``mtc status``, an export) can read the backups too.
        Without ``create`` (a reader), a local root that does not exist is not made: it lists as empty."""
        url = self._settings("the backup tier").backup_url if configured else root
        if url is None:
            raise ConfigError("no backup tier: set base_output_directory (and run_name) to back up and "
                              "restore from object storage")
        with self._lock:
            tier = self._backups.get(url) or (None if create else self._readers.get(url))
            if tier is None:
                from mtc.shared.objstore import open_store
                from mtc.sidecar.backup.tier import BackupTier

                from mtc.shared.job_key import JobKey

                key = JobKey.from_secret(self._peer_token)  # the job's secret: MTC_JOB_KEY, else the token
                if create:
                    tier = self._backups[url] = BackupTier(url, self.store, self.host_id, key=key)
                else:
                    tier = self._readers[url] = BackupTier(url, self.store, self.host_id, key=key,
                                                           store=open_store(url, create=False))
            return tier

    def backup_upload(self, blobs: list[str] | None, step: int | None = None,
                      stand_in: Sequence[tuple[str, str, bool]] = ()) -> dict:
        """Upload the blobs the head assigned to this host (those the store lacks); with ``step``
        instead, this host's share of the step's unique boxes (``Committed.designated_uploads``), and
        the shares of the writers gone from the step that it stands in for ((writer, part, pieces only):
        read from the rows of ``part``)."""
        if step is not None:
            blobs = self.committed.designated_uploads(step, stand_in)
        return self._backup_tier().upload(list(blobs or []))

    def backup_finalize(self, name: str, manifest_json: bytes | None, max_to_keep: int | None = None, *,
                        generation: int | None = None, step: int | None = None, digest: str | None = None) -> dict:
        """Make backup ``name`` visible, then keep the newest ``max_to_keep`` (default: the head's
        ``backup_max_to_keep``); ``generation`` is the asking head's (``admit`` checked it once):
        checked again before every bucket operation, so that a head fenced off meanwhile neither
        makes a backup visible nor prunes beside the next head."""
        what = f"backup_finalize of {name} on host {self.host_id}"
        if manifest_json is None:  # this host's own copy of the step's manifest (fetched whole if it kept a record)
            manifest_json = bytes(self.committed.manifest_bytes(step))
            if fmt.step_digest(manifest_json) != digest:
                raise ManifestError(f"host {self.host_id}: its manifest of step {step} is not the one the head "
                                    f"backs up ({str(digest)[:12]}); not finalizing {name}")
        tier = self._backup_tier()
        keep = self.settings.backup_max_to_keep if max_to_keep is None else max_to_keep
        return tier.finalize(name, manifest_json, keep, guard=lambda: self.lease.check(generation, what),
                             generation=generation)

    def backup_listing(self, root: str | None, deadline_s: float | None = None) -> dict:
        """The backups under ``root`` (the head's backup root), newest first."""
        return self._backup_tier(root, configured=False, create=False).listing(deadline_s)

    def backup_manifest(self, root: str | None, name: str, header_only: bool = False,
                        among: Sequence[str] | None = None) -> bytes:
        """The manifest of backup ``name``; with ``header_only``, its header line, read by range and
        checked against the backup's part index (b"" when it has none: read the manifest whole); with
        ``among`` (blob names), those of them the manifest names, sorted and joined (32 characters each):
        a head looking for a few blobs in a backup gets them, not the manifest of every shard."""
        tier = self._backup_tier(root, configured=False, create=False)
        if header_only:
            return tier.header(name) or b""
        if among is not None:
            found = fmt.step_blobs_among(tier.manifest(name), among, source=f"backup {name}")
            return "".join(sorted(found)).encode()
        return tier.manifest(name)

    def backup_fetch(self, name: str, blobs: list[str], parts: Sequence[str] | None = None,
                     wants: Mapping[str, Sequence[fmt.Box] | None] | None = None) -> dict:
        """Pull this host's blobs of backup ``name`` into the ramdisk, verified; restore reads them.

        With ``parts`` (writers' host ids), the blobs of those writers' parts instead, which this host
        reads with the header by range (``BackupTier.parts_view``): its own part on the topology that
        saved the step, after a resize the parts its new boxes overlap. The view of those parts is kept
        to read by, not the whole manifest. With ``wants`` (array key -> the boxes of it this host will
        load, None: all of it), only the blobs of those arrays whose boxes overlap them: a resize reads
        part of a writer's boxes, a partial restore some of the arrays."""
        tier = self._backup_tier()
        if parts is not None:
            manifest = tier.parts_view(name, list(parts))
            if manifest is None:
                raise ManifestError(f"backup {name} has no part index (written by an older version); "
                                    "restore it by the whole manifest")
        else:
            manifest = fmt.StepManifest.from_json(tier.manifest(name), source=f"backup {name}")
        sizes = manifest.blob_sizes() if parts is None or wants is None else manifest.blob_sizes_for(wants)
        out = tier.fetch(sorted(sizes) if parts is not None else list(blobs), sizes)
        self.index.keep_manifest(manifest.step, manifest)
        if parts is not None:
            out["part_blobs"] = len(sizes)
        return out

    def backup_scrub_counts(self) -> dict[str, int]:
        """The backup blobs this sidecar's scrubs hashed (``checked``), found corrupt or missing
        (``bad``) and re-uploaded (``repaired``), over every backup root it scrubbed."""
        with self._lock:
            tiers = list(self._backups.values())
        return {k: sum(t.scrub_stats[k] for t in tiers) for k in ("checked", "bad", "repaired")}

    def backup_scrub(self, root: str | None, blobs: list[str], repair: list[str], damaged: dict[str, str],
                     bytes_per_s: float | None = None, *, ramdisk: Sequence[str] = (),
                     sizes: dict[str, int] | None = None, clear: Sequence[str] = (),
                     parts: Sequence[tuple[str, Sequence[str]]] = (), ramdisk_parts: bool = False) -> dict:
        """Hash ``blobs`` of the backup root ``root`` (None: the head's) at ``bytes_per_s`` (None: the
        head's cap; ``sizes``: each blob's size, an object of another size is bad unread), re-upload
        ``repair`` from this ramdisk where it holds good copies, mark ``damaged`` backups (name -> why)
        so restore skips them, remove the marks of ``clear``; first, hash this ramdisk's copies of
        ``ramdisk`` and remove corrupt ones (``mtc.sidecar.backup.scrub``).

        ``parts``: (backup, writers) whose blobs are hashed too: the writers' parts read with the header
        by range (``BackupTier.parts_view``), of each the blobs that fall to that writer
        (``fmt.writers.designated``: each unique box of the step to one writer, as the uploads share them);
        their sizes from the parts. With ``ramdisk_parts``, first this ramdisk's copies of every blob of
        those steps it holds (its own part, the copies it keeps for others) and of those parts. The answer
        says per backup what was hashed and found bad (``"backups": {name: {"checked", "bad"}}``)."""
        tier = self._backup_tier(root, configured=root is None)
        rate = self._settings("the backup scrub").backup_scrub_bytes_per_s if bytes_per_s is None else bytes_per_s
        sizes, ramdisk, by_backup = dict(sizes or {}), set(ramdisk), {}
        for name, writers in parts:
            view = tier.parts_view(name, list(writers))
            if view is None:
                raise ManifestError(f"backup {name} has no part index (written by an older version); "
                                    "scrub it by its blobs")
            mine = set().union(*(designated(view, w) for w in writers))
            every = view.blob_sizes()
            by_backup[name] = sorted(mine)
            sizes.update((b, every[b]) for b in mine)
            if ramdisk_parts:
                ramdisk.update(every)
                ramdisk.update(self.committed.held_blobs(view.step))
        hashed = sorted(set(blobs).union(*by_backup.values()))
        out = tier.scrub(hashed, float(rate), list(repair), dict(damaged), sorted(ramdisk),
                         sizes=sizes, clear=list(clear))
        if by_backup:
            bad = set(out.get("bad", ())) | set(out.get("missing", ()))
            out["backups"] = {name: {"checked": len(names), "bad": sorted(bad.intersection(names))}
                              for name, names in by_backup.items()}
        return out

    # --- peer tier -----------------------------------------------------------------------

    def start_peer_service(self, listen: tuple[str, int], token: str, *, advertise: str | None = None,
                           tls: TLSFiles | None = None) -> str:
        """Serve this host's blobs to its peers on ``listen``; returns the advertised address.

        ``token`` is the job's shared peer secret; pulls from peers present it too. With ``tls``
        (``mtc.shared.tls``) the peer service and this host's pulls run over mutual TLS.
        """
        if self._peer is not None:
            return self._peer.address
        server = PeerServer(self.store, token, host_id=self.host_id, listen=listen, advertise=advertise, tls=tls)
        server.start()
        self._peer, self._peer_token = server, token
        self.committed.peer_token = token  # a host that committed a record fetches the manifest with it
        return server.address

    @property
    def peer_address(self) -> str | None:
        return None if self._peer is None else self._peer.address

    def peer_stats(self) -> dict:
        """The peer service's counters (blobs and bytes sent and received, connections refused);
        {} while it is not started."""
        return {} if self._peer is None else dict(self._peer.stats)

    def peer_pull(self, step: int, pulls: Sequence, peers: dict[str, str], manifest_json: bytes | None = None,
                  shares: Sequence[tuple[str, Sequence[str]]] = (), adopt: tuple[str, Sequence[str]] | None = None
                  ) -> dict:
        """Pull blobs of ``step`` from the peers that hold them, verified (see mtc.sidecar.replication).

        ``shares`` are (owner host, holders): every blob of the owner's part of the step, which
        this host lists from its manifest (fetched from a keeper if need be), so that the head
        names a share, not its blobs. With ``manifest_json`` (a restore onto a host that lost
        the step), the step is committed here once every pull succeeded, so that its blobs are
        kept and the host counts as holding the step again. With ``adopt`` ((manifest digest, keeper
        hosts)) instead, a host that lacks the step fetches that manifest from a keeper (at its address
        in ``peers``) and commits it the same way: the head names the manifest, it does not send it.
        """
        if self._peer is None:
            raise ConfigError(f"host {self.host_id} has no peer tier: start its sidecar with a peer token "
                              "(MTC_PEER_TOKEN or peer_token)")
        lacks = step not in self.store.catalog.committed()
        if adopt is not None and manifest_json is None and lacks:
            digest, keepers = adopt
            manifest_json = self.committed.fetch_to_adopt(step, digest, [(h, peers[h]) for h in keepers if h in peers])
        if shares:
            # Copies held for others are kept alive by the whole manifest, which also lists the shares.
            m = (fmt.StepManifest.from_json(manifest_json, source=f"step {step} manifest to adopt")
                 if manifest_json is not None and lacks else self.committed.manifest(step, peers))
            sizes = m.blob_sizes()
            pulls = list(pulls)
            for owner, holders in shares:
                blobs = m.part_blobs.get(owner)
                if blobs is None:
                    raise ManifestError(f"host {self.host_id}: step {step}'s manifest has no part of host {owner}")
                pulls += [Pull(b, sizes[b], tuple(holders)) for b in sorted(blobs)]
        elif step in self.store.catalog.committed():
            # Copies held for others are kept alive by the whole manifest: a host that committed
            # only a record fetches it first (if it cannot, ``manifest_json`` below, or a later try).
            with contextlib.suppress(ManifestError, StepNotFoundError):
                self.committed.manifest(step)
        out = pull_blobs(self.store, self._peer_token, pulls, peers, host_id=self.host_id, step=step)
        adopted = manifest_json is not None and not out.failed and self.committed.adopt(step, manifest_json)
        return dataclasses.replace(out, asked_bytes=sum({p.blob: p.size for p in pulls}.values()),
                                   adopted=adopted).to_wire()

    # --- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._peer is not None:
                self._peer.close()
            self._io.shutdown(wait=True)
            self.store.close()
            for tier in [*self._backups.values(), *self._readers.values()]:
                tier.close()
