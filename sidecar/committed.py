"""``CommittedSteps``: the committed steps of one host as its sidecar knows them: manifests,
commit records, local views, the inventory and verification.

The read side of the step catalog: where a step file holds only a commit record, the manifest (or
just its header, for a restore onto the same topology) is fetched from a keeper and checked against
the digest; what this sidecar committed repairs a step file damaged under it. ``SidecarService``
(``mtc.sidecar.service``) makes one over its RAM store and the step index it shares with the save
(``mtc.sidecar.saves``), and gives it the job's peer token once its peer tier starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from typing import Mapping, Sequence

from mtc.shared import format as fmt
from mtc.shared import protocol
from mtc.shared.format import writers
from mtc.shared.host_reports import HostInventory, StepHolding
from mtc.shared.errors import ManifestError, MTCError, RecordOnlyError, StepNotFoundError
from mtc.sidecar.peer import PeerClient
from mtc.sidecar.ram import RamStore
from mtc.sidecar.replication import held_bits, pull_notes
from mtc.sidecar.step_index import StepIndex

log = logging.getLogger(__name__)

# The most writers whose pieces one inventory row reports: a lost writer's pieces beyond them leave its
# step to the rows (exact, slower), and a step of many equal blobs does not make every answer large.
_MAX_PIECES = 64


class CommittedSteps:
    """The committed steps' manifests, records and views, inventory and verify of one host.

    Attributes:
        host_id: the host whose steps these are.
        store: its RAM store (``RamStore``): the step files and blobs.
        index: the per-step memory (``StepIndex``) parsed manifests, records and views are kept in.
        peer_token: the job's peer secret, with which a manifest is fetched from a keeper ("" until
            the service's peer tier starts: no fetch).
    """

    def __init__(self, store: RamStore, index: StepIndex, host_id: str):
        self.host_id = host_id
        self.store = store
        self.index = index
        self.peer_token = ""

    # --- manifests -----------------------------------------------------------------------

    def manifest_bytes(self, step: int, *, here_only: bool = False, header_only: bool = False) -> bytes:
        """The whole manifest of committed ``step`` (fetched from a keeper first if need be;
        with ``here_only``, RecordOnlyError instead when this host committed only a record). With
        ``header_only``, its first line alone (``fmt.StepHeader``): a host that committed a record
        fetches only that line from a keeper, and keeps its record."""
        rec = self._record(step) if self.index.manifest(step) is None else None
        if here_only and rec is not None:
            raise RecordOnlyError(f"host {self.host_id} keeps only a record of step {step}, not its manifest")
        if header_only and rec is not None:
            return bytes(self._fetch_manifest(rec, header_only=True)).partition(b"\n")[0]
        data = self.manifest(step).to_json()
        return bytes(data).partition(b"\n")[0] if header_only else data

    def has_readable(self, step: int) -> bool:
        """Whether ``step`` is committed here with a manifest that passes its checks."""
        try:
            self.manifest(step)
            return True
        except (ManifestError, StepNotFoundError):
            self.index.drop_manifest(step)
            return False

    def manifest(self, step: int, keepers: Mapping[str, str] | None = None) -> fmt.StepManifest:
        """The whole manifest of committed ``step``. Where this host committed only a record
        (``fmt.CommitRecord``), it is fetched from a keeper (at ``keepers``' address where given),
        checked against the digest, and replaces the record (ManifestError if no keeper could give it)."""
        m = self.index.manifest(step)
        if m is None:
            data = self.store.catalog.read(step)
            try:
                rec = fmt.CommitRecord.parse(data, source=f"{self.host_id} step {step} commit record")
                if rec is not None:
                    data = self._fetch_manifest(rec, keepers=keepers)
                m = fmt.StepManifest.from_json(data, source=f"{self.host_id} step {step}")
            except ManifestError:
                # Changed under this live sidecar (bit rot, a stray write): it committed the step
                # itself, so it rewrites the file from the bytes it committed.
                good = self.index.committed_bytes(step)
                if good is None or good == data or not self.store.rewrite_step(step, good):
                    raise
                log.warning("host %s: the file of step %d failed its checks; rewrote it from what this sidecar "
                            "committed", self.host_id, step)
                return self.manifest(step)
            if rec is not None:
                try:
                    self.store.upgrade_step(step, data, rec.digest)
                except StepNotFoundError as e:  # pruned meanwhile: this read has its manifest all the same
                    log.info("host %s: kept step %d's commit record, not the manifest fetched for it: %s",
                             self.host_id, step, e)
            self.index.keep_manifest(step, m)
        return m

    def adopt(self, step: int, manifest_json: bytes) -> bool:
        """Commit ``step`` here from the whole manifest the head gives (a restore onto a host that
        lost the step, once its blobs were pulled), unless a readable manifest of it is here
        already; True when it was committed, so that its blobs are kept and the host counts as
        holding the step again."""
        if self.has_readable(step):
            return False
        manifest = fmt.StepManifest.from_json(manifest_json, source=f"step {step} manifest from head")
        if manifest.step != step:
            raise ManifestError(f"peer pull of step {step} carries the manifest of step {manifest.step}")
        self.store.commit(step, manifest_json)
        self.index.keep_manifest(step, manifest)
        log.info("host %s: step %d restored from peers and committed here again", self.host_id, step)
        return True

    def _record(self, step: int) -> fmt.CommitRecord | None:
        """The commit record of ``step`` here, if that is what this host committed (else None)."""
        return self._read_record(step)[0]

    def _read_record(self, step: int) -> tuple[fmt.CommitRecord | None, frozenset | None]:
        """(the commit record of ``step`` here or None, the blob names of its part). The file is
        read each time (a damaged one must show); bytes read as before are not parsed again."""
        try:
            data = self.store.catalog.read(step)
        except (ManifestError, StepNotFoundError, OSError):
            return None, None
        hit = self.index.record(step, data)
        if hit is not None:
            return hit
        try:
            rec = fmt.CommitRecord.parse(data, source=f"{self.host_id} step {step} record")
            own = None if rec is None else frozenset(rec.host_manifest().blob_names())
        except (ManifestError, OSError):
            return None, None
        self.index.keep_record(step, data, rec, own)
        return rec, own

    def _fetch_manifest(self, rec: fmt.CommitRecord, *, header_only: bool = False,
                        keepers: Mapping[str, str] | None = None, here: str = "is committed here as a record") -> bytes:
        """The manifest (or its header line) of ``rec``'s step from a keeper: at the address the head says
        it serves at now (``keepers``), else the one the record has (from the save: a keeper whose pod
        was restarted since may serve elsewhere). ``here``: what this host has of the step, for the error."""
        what = "the header of its manifest" if header_only else "its manifest"
        causes = []
        for host, address in rec.keepers:
            address = (keepers or {}).get(host, address)
            if host == self.host_id or not self.peer_token:
                causes.append(f"{host}: {'this host' if host == self.host_id else 'no peer token here'}")
                continue
            try:
                with PeerClient(address, self.peer_token, peer=host, timeout_s=60.0) as client:
                    data = client.manifest(rec.step, rec.digest, header_only=header_only)
                log.info("host %s: fetched %s (step %d) from keeper %s", self.host_id, what, rec.step, host)
                return data
            except (MTCError, OSError) as e:
                causes.append(f"{host}: {e}")
        raise ManifestError(f"host {self.host_id}: step {rec.step} {here}, and no keeper "
                            f"could give {what} ({'; '.join(causes)}); the head gives it back at restore")

    def fetch_to_adopt(self, step: int, digest: str, keepers: Sequence[tuple[str, str]]) -> bytes:
        """The whole manifest ``digest`` of ``step`` from one of ``keepers`` ((host, peer address)), checked
        against the digest: what a host that lacks the step (a replaced node) adopts once it pulled the
        parts it reads, the head having named the keepers instead of sending the manifest."""
        rec = fmt.CommitRecord(step=step, digest=digest, keepers=tuple(keepers), part=b"")
        data = bytes(self._fetch_manifest(rec, here="is not here (a replaced node)"))
        if fmt.step_digest(data) != digest:
            raise ManifestError(f"host {self.host_id}: the manifest of step {step} a keeper gave is not "
                                f"{digest[:12]}; not adopting it")
        return data

    def view_for(self, step: int, rows: Sequence[tuple],
                 keepers: Mapping[str, str] | None = None) -> fmt.StepManifest:
        """The manifest to read ``rows`` (key, box, ...) of ``step`` by.

        Where this host keeps the whole manifest, that one. Where it committed a record and every
        row is exactly one of its own shards (a restore onto the same topology), its local view:
        the header fetched from a keeper (one line: arrays and shardings) with its own part, both
        checked against the digest it committed; the other hosts' parts, which grow with hosts x
        shards, are not fetched. Any other read (a resharded restore) fetches the whole manifest.
        ``keepers``: where the keepers serve now (``_fetch_manifest``).
        """
        whole = self.index.manifest(step)
        if whole is not None:
            return whole
        rec = self._record(step)
        if rec is None:
            return self.manifest(step, keepers)
        held = self.index.view(step)
        if held is None or held[0].digest != rec.digest:
            try:
                line = self._fetch_manifest(rec, header_only=True, keepers=keepers)
                view = fmt.StepManifest.local_view(line, self.host_id, rec.part,
                                                   source=f"{self.host_id} step {step} local view")
            except ManifestError as e:
                log.info("host %s: step %d: no local view (%s); reading by the whole manifest", self.host_id, step, e)
                return self.manifest(step, keepers)
            if view.step != step or view.digest != rec.digest:
                return self.manifest(step, keepers)
            boxes = {a.key: {s.box for s in a.shards} for a in view.arrays if a.shards}
            shapes = {a.key: a.shape for a in view.arrays}
            held = (view, boxes, shapes)
            self.index.keep_view(step, held)
        view, boxes, shapes = held
        for key, box, *_ in rows:
            if key not in shapes:
                return self.manifest(step, keepers)
            want = tuple((0, n) for n in shapes[key]) if box is None else tuple(tuple(b) for b in box)
            if want not in boxes.get(key, ()):
                return self.manifest(step, keepers)
        return view

    def own_view(self, step: int) -> fmt.StepManifest:
        """Every array of ``step``, with the shards of this host's own part: from the whole manifest where
        this host keeps it, else its local view (the header from a keeper, its own part checked against it)."""
        whole = self.index.manifest(step)
        if whole is None:
            rec = self._record(step)
            if rec is not None:
                held = self.index.view(step)
                if held is not None and held[0].digest == rec.digest:
                    return held[0]
                return fmt.StepManifest.local_view(self._fetch_manifest(rec, header_only=True), self.host_id,
                                                   rec.part, source=f"{self.host_id} step {step} local view")
            whole = self.manifest(step)
        mine = whole.part_blobs.get(self.host_id)
        if mine is None:
            raise ManifestError(f"host {self.host_id}: step {step} has no part of this host (an older format?)")
        return dataclasses.replace(whole, arrays=tuple(
            dataclasses.replace(a, shards=tuple(sh for sh in a.shards if sh.blob in mine)) for a in whole.arrays))

    def designated_uploads(self, step: int, stand_in: Sequence[tuple[str, str, bool]] = ()) -> list[str]:
        """The blobs of its own part this host uploads in a backup of ``step`` that the hosts share out among
        themselves, each unique box by exactly one host and no head planning (``fmt.writers.designated``);
        ManifestError for a step saved by an older version (the head plans the uploads itself).

        ``stand_in``: (writer, part, pieces) for each writer gone from the step whose share this host
        uploads instead, read from the rows of ``part``: the writer's own (a peer copy of it that this host
        keeps, read by the whole manifest) or this host's own (a data-parallel twin of the writer: the same
        boxes). With ``pieces`` it holds pieces of the writer's part only, and gives the blobs of the share
        that it holds (the holders of the other pieces give the rest; the finalize checks that none lacks)."""
        own = self.own_view(step)
        out = set(writers.designated(own, self.host_id))
        have = self.store.blobs.names()
        for writer, part, pieces in stand_in:
            view = own if part == self.host_id else self.manifest(step)  # a peer copy's rows: the whole manifest
            rows = view.part_blobs.get(part)
            missing = len(rows - have) if rows is not None else "every"
            if missing and not (pieces and rows is not None):
                raise ManifestError(f"host {self.host_id}: it lacks {missing} blob(s) of the part of {part} of step "
                                    f"{step}, so it cannot upload the share of {writer} in a backup")
            out.update(b for b in writers.designated(view, writer, part=part) if not pieces or b in have)
        return sorted(out)

    def held_blobs(self, step: int) -> set[str]:
        """The blobs of ``step`` this host may hold: every blob of its manifest where it keeps it whole (its
        own part and the copies it keeps for others), its own part's where it committed a record, none
        where it has not committed the step. Nothing is fetched."""
        rec, own = self._read_record(step)
        if rec is not None:
            return set(own or ())
        try:
            return set(self.manifest(step).blob_names())
        except (ManifestError, StepNotFoundError):
            return set()

    # --- inventory and verify --------------------------------------------------------------

    def inventory(self, devices: Sequence[int] | None = None) -> dict:
        """What this host holds: committed steps, and for each which of its blobs are here.

        ``blobs``/``local_blobs`` count this host's own share of the step: the shards of
        ``devices`` (the head's device ids of this host) when given, else every blob of the
        step (one host holding every device); ``own`` is the digest of that share's sorted blob
        names (hosts with equal shares, data-parallel twins, have equal ones). The held bits
        cover every blob of the step (of the own share, for a host that committed a record).
        """
        mine = set(devices) if devices is not None else None
        have = self.store.blobs.names()
        out, damaged = [], []
        committed = self.store.catalog.committed()
        for s in sorted(self.index.known_steps() - set(committed)):  # a step file no longer JSON is rewritten
            # (A commit on another thread may prune the step meanwhile: then there is nothing to repair.)
            m = self.index.manifest(s)
            data = self.index.committed_bytes(s) if m is None else None
            with contextlib.suppress(ManifestError, OSError):
                if m is not None:
                    data = m.to_json()
                if data is not None and self.store.repair_step(s, data):
                    committed = self.store.catalog.committed()
        self.index.prune(committed)  # pruned or aborted (or not repairable)
        for s in committed:
            rec, own = (None, None) if self.index.manifest(s) is not None else self._read_record(s)
            if rec is not None:
                # Committed here as a record: this host's own part is all it holds of the step,
                # and all it reports (the head maps it with the manifest): no fetch for an inventory.
                out.append(StepHolding(step=s, blobs=len(own), local_blobs=len(own & have), manifest=rec.digest,
                                       part=True, own=protocol.blob_list_digest(sorted(own)), **held_bits(own, have)))
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
            mine_digest = protocol.blob_list_digest(sorted(share))
            copies, parts, pieces = self._shares_held(m, have)
            out.append(StepHolding(step=s, blobs=len(own), local_blobs=len(own & have), manifest=m.digest,
                                   own=mine_digest, copies=tuple(copies), parts=tuple(parts), pieces=tuple(pieces),
                                   **held_bits(m.blob_names(), have)))
        # A step file that is no longer JSON hides its step; this host committed it, so it is
        # damaged, not gone: the head gives the manifest the others agree on back.
        damaged += [s for s in self.store.unreadable_steps(listed=True) if s not in damaged]
        st = os.statvfs(self.store.root)  # the ramdisk's room, for the head's metrics (no pass over the blobs)
        return HostInventory(self.host_id, tuple(out), damaged=tuple(sorted(damaged)),
                             pull_failures=pull_notes(self.store),
                             ramdisk=(st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize)).to_wire()

    def _shares_held(self, m: fmt.StepManifest, have: set[str]
                     ) -> tuple[list[str], list[str], list[tuple[str, int, str]]]:
        """(the digests of the shares (hosts' parts) of ``m`` that this host holds whole, its own and
        the copies it keeps for others, as the head's replication counts them (``covered_by_shares``);
        the other writers whose parts it holds whole: peer copies and its data-parallel twins' parts,
        which a restore reads from the header alone; the pieces it holds of other writers' parts,
        ``StepHolding.pieces``)."""
        digests = self.index.share_digests_of(
            m.step, m.digest, lambda: {h: protocol.blob_list_digest(sorted(b)) for h, b in m.part_blobs.items()})
        held = {h: d for h, d in digests.items() if m.part_blobs[h] <= have}  # (stops at a blob it lacks)
        # The step's blobs it holds that neither its own share nor a part it holds whole explains (a blob of
        # equal bytes in many parts is in its own share): usually none, and then no part is looked at again.
        known = set(m.part_blobs.get(self.host_id, ())).union(*(m.part_blobs[h] for h in held))
        extra = m.blobs_among(have - known)
        pieces = []
        if extra:
            for h, blobs in m.part_blobs.items():
                if h not in held and h != self.host_id and not blobs.isdisjoint(extra):
                    pieces.append((h, len(blobs), protocol.encode_bitmap([b in have for b in sorted(blobs)])))
                    if len(pieces) == _MAX_PIECES:
                        break
        return (sorted(set(held.values())), sorted(h for h in held if h != self.host_id), sorted(pieces))

    def verify(self, step: int) -> dict:
        """Hash every blob of ``step`` this host holds: {"checked": n, "bad": [names that fail]}.

        A host that committed a record, and whose keepers cannot give the manifest (a stopped job read
        by a tool's daemons: the record has the keepers' addresses of then), hashes the blobs of its own
        part, which its record names, and says why the copies it keeps for others went unhashed
        ("own_part_only")."""
        partial = None
        try:
            wanted = self.manifest(step).blob_names()
        except ManifestError as e:
            rec, own = self._read_record(step)
            if rec is None or own is None:
                raise
            wanted, partial = own, str(e)
        names = sorted(wanted & self.store.blobs.names())
        bad = [n for n in names if not self.store.blobs.verify(n)]
        if bad:
            log.warning("host %s: step %d: %d blobs fail their hash: %s", self.host_id, step, len(bad), bad[:3])
        out = {"host": self.host_id, "checked": len(names), "bad": bad}
        if partial is not None:
            out["own_part_only"] = partial
        return out
