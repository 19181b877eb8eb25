"""The one interface between the checkpoint manager and the sidecars (docs/architecture.md, "The seam").

Two implementations: ``ColocatedDispatcher`` (colocated Python: Pathways, and in-process on a
CPU backend) and ``ClusterDispatcher`` (sidecar daemons reached over TCP); the
manager above it is the same code in both modes, and ``mtc.head.dispatch.factory`` picks one.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
from typing import Any, Callable, Iterable, Mapping, Sequence, TypeVar

import msgspec

from mtc.head.commit import choose_keepers
from mtc.shared import errors, op_table, protocol, requests
from mtc.shared import format as fmt
from mtc.shared import wire_errors
from mtc.shared.host_reports import HostInventory, PullResult, StepHolding

log = logging.getLogger(__name__)
_M = TypeVar("_M")  # what a manifest read returns (``Dispatcher._read_manifest``)

__all__ = ["Dispatcher", "HostInventory", "Leaf", "LoadRequest", "PullResult", "StepHolding", "WriteResult",
           "host_failure", "raise_claim_failures", "raise_host_failures", "raise_remote",
           "save_error", "wire", "wire_per_host"]


def wire(op: str, request: requests.Request) -> dict:
    """The one place a head's request becomes what a transport moves: the struct of ``op``'s row
    (``mtc.shared.requests``, the type its sidecar decodes with), as a JSON object."""
    if type(request) is not op_table.SPECS[op].request:
        raise TypeError(f"{op} takes a requests.{op_table.SPECS[op].request.__name__}, "
                        f"not a {type(request).__name__}")
    return request.to_wire()


def wire_per_host(op: str, per_host: Mapping[str, requests.Request]) -> tuple[dict, dict[str, dict]]:
    """Requests of ``op``, one per host, as (the arguments they share, each host's own): the fields
    the type names ``PER_HOST`` travel per host, the others once (the colocated transport sends one
    request to every host). The shared fields must be the same in every host's request."""
    if not per_host:
        return {}, {}
    first = next(iter(per_host.values()))
    own = first.PER_HOST
    shared = {k: v for k, v in wire(op, first).items() if k not in own}
    fields = msgspec.structs.fields(type(first))
    same = [f.name for f in fields if f.name not in own]
    defaults = {f.name: f.default if f.default_factory is msgspec.NODEFAULT else f.default_factory()
                for f in fields if f.name in own}
    out = {}
    for h, r in per_host.items():
        if type(r) is not type(first) or any((a := getattr(r, n)) is not (b := getattr(first, n)) and a != b
                                             for n in same):
            raise ValueError(f"{op}: the hosts' requests differ outside the fields of each host {own}")
        values = {f: getattr(r, f) for f in own}
        out[h] = msgspec.to_builtins({f: v for f, v in values.items() if v is not msgspec.UNSET
                                      and (defaults[f] is msgspec.NODEFAULT or v != defaults[f])})
    return shared, out


@dataclasses.dataclass
class Leaf:
    """One leaf of the state being saved, as the manager sees it."""

    index: int
    key: str
    kind: str  # "jax", "numpy" or "scalar"
    value: Any  # the jax.Array / numpy array / scalar
    dtype: str | None = None
    shape: tuple[int, ...] = ()
    sharding: Any = None  # the jax Sharding of a "jax" leaf
    device_boxes: dict[int, fmt.Box] = dataclasses.field(default_factory=dict)
    prng_impl: str | None = None  # a typed PRNG key array: ``value`` is its key data
    prng_key_shape: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        if self.kind == "scalar":
            return 0
        return int(self.value.nbytes)


@dataclasses.dataclass(frozen=True)
class LoadRequest:
    """One array to restore: its saved record and the sharding it must come back with."""

    record: fmt.ArrayRecord
    sharding: Any  # target jax Sharding, or None for a host numpy leaf


@dataclasses.dataclass(frozen=True)
class WriteResult:
    """Phase 1 across all hosts: each host's part of the step manifest, and what each host did.

    ``parts`` are (host, the host manifest bytes it answered): the head hashes and forwards
    them (``fmt.encode_step``) without parsing them.
    """

    parts: list[tuple[str, bytes]]
    hosts: dict[str, dict]  # host id -> {"written_bytes": ..., "blobs": ...}


class Dispatcher(abc.ABC):
    """How the head reaches the sidecars: every operation the manager, the restore, the tiers'
    loops and the tools call, and no transport has one of its own. Every method is called from
    one thread at a time, except the backup and peer methods, which background threads call
    beside the others.

    Every request carries ``generation`` (set once the manager has claimed the hosts), so
    that sidecars refuse changes from a head that a newer one fenced off.

    Errors are typed where they arrive: what a sidecar raised comes back as that type
    (``mtc.shared.wire_errors.decode``, the host named in its message), a host that cannot be
    reached as ``HostUnreachableError``. One host's failure means the same in both transports (its
    operation's row, ``OpSpec.failure``; ``settle``):

    - per host, in the answer, the others answering: ``inventories``/``peer_inventories`` (an
      inventory with an ``error``), ``peer_pull`` (a ``PullResult`` with an ``error``),
      ``verify`` (``{"error": why}``); ``abort`` logs it (best effort);
    - raised, naming each failed host: ``commit`` and the cluster transport's ``write``
      (``SaveError`` with ``.hosts``, its cause the ``FencedError`` if a newer head took a host,
      else the ``HostUnreachableError``; the colocated ``write`` raises its first host's error,
      which the manager reports as the save's), the backup jobs (one host's error as it is;
      several: one error listing them, ``CorruptBlobError`` when each found a corrupt copy);
    - skipped while it cannot be reached, raised otherwise: ``fingerprints``, ``leases``,
      ``claim`` (a host that is down takes the claim with its next request); ``backup_listing``
      and ``backup_manifest`` ask the next host.

    A host that cannot be reached is one the cluster transport cannot connect to or that stops
    answering. The colocated transport reaches every host in one colocated call: a host's
    sidecar that raises is that host's failure, as above, but a call that fails as a whole (the
    colocated runtime lost a host) raises its error for the whole operation, since it cannot tell
    which host it was.
    """

    generation: int | None = None

    def __init__(self, keepers: int, host_settings: dict):
        self._keepers = keepers  # the hosts that keep each whole step manifest (``choose_keepers``)
        # The settings every sidecar follows (``HostSettings.to_wire``): sent with the claim.
        self._host_settings = host_settings

    @abc.abstractmethod
    def hosts(self) -> list[str]:
        """Host ids of the sidecars in the current topology."""

    def fingerprints(self) -> dict[str, dict]:
        """host id -> version fingerprint, of the hosts that answer; one that cannot be reached is
        checked when it comes back, any other failure raises."""
        results, failures = self._each("fingerprint")
        settle("fingerprint", failures, "version check: %s; it is checked when the host comes back")
        return results

    @abc.abstractmethod
    def stage(self, leaves: list[Leaf]) -> Any:
        """Copy the state to host memory (the device-to-host copy); blocks until done.

        The result is what ``write`` sends; the caller must not stage again until the write
        of the previous staged state has finished (staging buffers are reused).
        """

    @abc.abstractmethod
    def write(self, step: int, staged: Any) -> WriteResult:
        """Phase 1 on every host."""

    @abc.abstractmethod
    def commit(self, step: int, manifest: bytes | protocol.Gathered, digest: str, keepers: list[str]
               ) -> dict[str, dict]:
        """Phase 2 on every host (``manifest``: the step manifest's bytes, or the save's buffers of it,
        unjoined; ``digest`` its digest): the whole manifest to ``keepers`` (the manager's choice,
        ``commit.choose_keepers``), the decision to the others (``commit.commit_messages``); host id ->
        what the host wrote for the step."""

    @property
    def keeper_count(self) -> int:
        """How many hosts keep each whole step manifest (two, or the replication factor)."""
        return self._keepers

    @abc.abstractmethod
    def abort(self, step: int) -> None:
        """Forget ``step`` on every host that answers (its save failed); best effort."""

    # --- the control requests every host answers: written once, over the transport's fan-out ----

    @abc.abstractmethod
    def _each(self, op: str, args: dict | None = None, *, hosts: Sequence[str] | None = None,
              per_host: dict[str, dict] | None = None, lane: str | None = None
              ) -> tuple[dict[str, Any], dict[str, BaseException]]:
        """The transport's fan-out of control request ``op``: to every host (or ``hosts``) with
        ``args``, or to the hosts of ``per_host`` each with its own; (host -> its result, host -> its
        failure, typed). ``lane``: the connection class a transport that has several uses (None:
        the operation's row says)."""

    @abc.abstractmethod
    def _devices_by_host(self) -> dict[str, list[int]]:
        """host id -> the head's device ids whose shards its sidecar holds."""

    @abc.abstractmethod
    def _take_settings(self) -> dict:
        """The host settings this head sends with ``configure`` (``HostSettings.to_wire``), now
        remembered by the transport for hosts that (re)connect later."""

    def leases(self) -> dict[str, dict | None]:
        """host id -> the lease of the head that drives it ({"generation", "head"}), or None; a host
        that cannot be reached is asked again when it is back."""
        results, failures = self._each("lease")
        settle("lease", failures)
        return {h: r.get("lease") for h, r in results.items()}

    def claim(self, generation: int, head: dict) -> None:
        """Every host takes ``head`` (``generation`` newer than its lease), then its settings
        (``configure``, checked against the lease), or raises FencedError. A host that cannot be
        reached takes the generation with its next request and is configured when it says it is not."""
        _, failures = self._each("claim", wire("claim", requests.Claim(generation=generation, head=head)))
        self.generation = generation
        settings = self._take_settings()
        reached = [h for h in self.hosts() if h not in failures]
        if reached:
            failures.update(self._each("configure", wire("configure", requests.Configure(settings=settings)),
                                       hosts=reached)[1])
        raise_claim_failures(failures, generation)

    def inventories(self) -> dict[str, HostInventory]:
        """host id -> what it holds (each host counts its own share by its devices); a host that
        failed (unreachable, its sidecar raised, a malformed answer) has an ``error`` and no steps."""
        return self._inventories("control")

    def peer_inventories(self) -> dict[str, HostInventory]:
        """``inventories()`` for background replication, on the peer lane where the transport has
        one: it never holds the control lane."""
        return self._inventories("peer")

    def _inventories(self, lane: str) -> dict[str, HostInventory]:
        _, per_host = wire_per_host("inventory", {h: requests.Inventory(devices=sorted(ids))
                                                  for h, ids in self._devices_by_host().items()})
        replies, failures = self._each("inventory", per_host=per_host, lane=lane)
        results: dict[str, HostInventory] = {}
        for h, doc in replies.items():
            try:
                results[h] = HostInventory.from_wire(h, doc)
            except Exception as e:  # a malformed answer: this host's failure, like any other
                failures[h] = e
        for h, e in failures.items():
            log.warning("inventory: host %s: %s; its steps cannot be confirmed", h, host_failure(e))
            results[h] = HostInventory.unreachable(h, host_failure(e))
        return {h: results[h] for h in self.hosts()}

    def verify(self, step: int) -> dict[str, dict]:
        """Every host hashes its blobs of ``step``: host -> {"checked", "bad": [blob names]}, or
        {"error": why} for a host that failed (one that does not hold the step, one that is down)."""
        replies, failures = self._each("verify", wire("verify", requests.StepRequest(step=step)))
        return {**replies, **{h: {"error": host_failure(e)} for h, e in failures.items()}}

    def manifest(self, step: int, digest: str | None = None) -> fmt.StepManifest:
        """The committed step manifest of ``step`` from a host that holds it (with ``digest``: a
        copy with that digest; a host whose copy differs is passed over), from one host at a time:
        first those that keep it (the keepers this step had, if the hosts are the same), then the
        others; those that keep only a record of it (``RecordOnlyError``) are asked again last,
        to fetch it from a keeper. One host's answer is one manifest, so the head never receives
        a copy per host."""
        return self._read_manifest(step, digest, fmt.StepManifest.from_json)

    def manifest_blob_names(self, step: int, digest: str | None = None) -> list[str]:
        """Every blob name of ``step``'s manifest (with ``digest``: that copy's), sorted, from a host as
        ``manifest`` asks; read from the parts' columns (``fmt.step_blob_names``: the hashes checked, no
        shard record made)."""
        return self._read_manifest(step, digest, fmt.step_blob_names).names

    def _read_manifest(self, step: int, digest: str | None, parse: Callable[..., _M]) -> _M:
        hosts = sorted(self.hosts())
        likely = choose_keepers(hosts, self.slice_of, step, self._keepers)
        causes: list[str] = []
        records: list[str] = []
        for here_only, order in ((True, likely + [h for h in hosts if h not in likely]), (False, records)):
            for h in order:
                try:
                    m = parse(self._manifest_from(h, step, here_only), source=f"step {step} manifest on {h}")
                except errors.RecordOnlyError as e:
                    if here_only:
                        records.append(h)
                    else:
                        causes.append(f"{h}: {e}")
                    continue
                except (errors.MTCError, OSError) as e:  # HostUnreachableError, ManifestError, ...
                    causes.append(f"{h}: {e}")
                    continue
                if digest is None or m.digest == digest:
                    return m
                causes.append(f"{h}: its copy differs from the one the other hosts agree on")
        raise errors.StepNotFoundError(f"no host could give the manifest of step {step}: " + "; ".join(causes))

    def manifest_header(self, step: int, digest: str) -> fmt.StepHeader:
        """The header of the step manifest of ``step`` with ``digest`` (``fmt.StepHeader``: one line,
        O(arrays + hosts)), from the hosts in the order of ``manifest``; a host that keeps a record
        fetches the line from a keeper. StepNotFoundError when none gives it (an older format too)."""
        hosts = sorted(self.hosts())
        likely = choose_keepers(hosts, self.slice_of, step, self._keepers)
        causes: list[str] = []
        for h in likely + [h for h in hosts if h not in likely]:
            try:
                header = fmt.StepHeader.from_line(self._manifest_from(h, step, False, header_only=True),
                                                  source=f"step {step} manifest header on {h}")
            except (errors.MTCError, OSError) as e:
                causes.append(f"{h}: {e}")
                if len(causes) >= 3:  # the keepers and one more: the whole manifest is the way after that
                    break
                continue
            if header.digest == digest:
                return header
            causes.append(f"{h}: its copy differs from the one the other hosts agree on")
        raise errors.StepNotFoundError(f"no host could give the manifest header of step {step}: " + "; ".join(causes))

    def _manifest_from(self, host: str, step: int, here_only: bool, header_only: bool = False) -> bytes:
        """Host ``host``'s step manifest of ``step`` (its text); with ``here_only``, RecordOnlyError
        where the host keeps only a record of it; with ``header_only``, its first line alone. The
        errors are the sidecar's, typed."""
        _, payloads = self._call(host, "manifest", wire("manifest", requests.Manifest(
            step=step, here_only=here_only, header_only=header_only)))
        if len(payloads) != 1:
            raise errors.ProtocolError(f"host {host}: no manifest payload")
        return bytes(payloads[0])

    @abc.abstractmethod
    def load(self, step: int, requests: list[LoadRequest], holders: Mapping[str, set[str]] | None = None,
             manifest: str | None = None, keepers: Sequence[str] = ()) -> list[Any]:
        """Restore: one jax.Array (or numpy array) per request, with the target sharding.

        ``manifest`` (the digest of the step manifest the requests come from): hosts whose copy
        differs read nothing (a missing copy, never data).

        ``keepers``: the hosts that keep the step's whole manifest. Each host is told where they serve
        now (their peer addresses), so that one that committed a record fetches the header or the
        manifest from them even when their pods were restarted since the save (its record has the
        addresses of then).

        ``holders`` (blob -> hosts, from the inventories) says where each saved shard is now.
        After an elastic resize a device id no longer names the host that wrote its shard.
        """

    @abc.abstractmethod
    def host_of_device(self, device_id: int) -> str:
        """The host whose sidecar holds the shards of device ``device_id`` (ConfigError naming the
        device when it is one of no host)."""

    # --- backup tier (run by the sidecars; the head only coordinates) --------------------
    #
    # Written once, over the transport's primitives: long jobs on some hosts (``_jobs``), one
    # host's control request (``_call``), a question any host can answer (``_any_host``).

    @abc.abstractmethod
    def _jobs(self, op: str, per_host: dict[str, dict], args: dict | None = None, *, lane: str | None = None,
              own_threads: bool = False, payloads: Sequence[bytes] = ()) -> tuple[dict[str, Any], dict[str, BaseException]]:
        """Run sidecar job ``op`` on each host of ``per_host`` (its own arguments, with ``args`` and
        ``payloads``) until all end: (host -> its result, host -> its failure). ``own_threads``: a job
        that runs for minutes (a scrub) goes on threads of its own, holding up no other job of its lane."""

    @abc.abstractmethod
    def _call(self, host: str, op: str, args: dict, payloads: Sequence[bytes] = ()) -> tuple[Any, list]:
        """One control request to one host: (its result, the payloads it answered); its error raised, typed."""

    @abc.abstractmethod
    def _any_host(self, op: str, args: dict) -> tuple[str, Any, list]:
        """(host, result, payloads) of the first host, in host order, that answers a question any
        host can answer; one that cannot be reached is passed over (HostUnreachableError when none
        could be asked, so that a listing reads as "not known")."""

    def _all_jobs(self, what: str, op: str, per_host: Mapping[str, requests.Request], **kw: Any) -> dict[str, dict]:
        """Job ``op`` on each host of ``per_host`` with its request; every host's result, or raises."""
        args, own = wire_per_host(op, per_host)
        results, failures = self._jobs(op, own, args, **kw)
        settle(op, failures, what=what)
        return results

    def backup_upload(self, assignments: dict[str, list[str]]) -> dict[str, dict]:
        """Every host uploads the blobs assigned to it; host id -> what it uploaded."""
        return self._all_jobs("backup upload", "backup_upload",
                              {h: requests.BackupUpload(blobs=list(b)) for h, b in assignments.items()}, lane="backup")

    def backup_upload_parts(self, step: int, hosts: Mapping[str, Sequence[tuple[str, str, bool]]]
                            ) -> dict[str, dict]:
        """Every host of ``hosts`` uploads its designated share of ``step``'s unique boxes
        (``Committed.designated_uploads``: the hosts share the work out among themselves, by the
        manifest's sharding descriptions and ``topology.devices``), and those of the writers it stands in
        for ((writer, the part whose rows it reads, whether it holds pieces of it only)); host id -> what
        it uploaded."""
        return self._all_jobs("backup upload", "backup_upload", {h: requests.BackupUpload(
            step=step, stand_in=[requests.StandIn(w, p, pieces) for w, p, pieces in ws]) for h, ws in hosts.items()},
            lane="backup")

    def backup_finalize_step(self, host: str, name: str, step: int, digest: str) -> dict:
        """``backup_finalize`` from the host's own copy of the manifest of ``step`` (``digest``): the head
        sends no manifest."""
        return self._call(host, "backup_finalize", wire("backup_finalize", requests.BackupFinalize(
            name=name, step=step, digest=digest)))[0]

    def backup_finalize(self, host: str, name: str, manifest: fmt.StepManifest) -> dict:
        """One host makes backup ``name`` visible (manifest last, create-only), then keeps the
        newest ``backup_max_to_keep`` (the settings the hosts were configured with)."""
        return self._call(host, "backup_finalize", wire("backup_finalize", requests.BackupFinalize(name=name)),
                          [manifest.to_json()])[0]

    def backup_listing(self, deadline_s: float | None = None) -> dict:
        """{"backups": [{"name", "step"}, ...] newest first, "restore_version": str | None}.

        ``deadline_s`` bounds the retries of an unreachable store (None: the store's own).
        """
        return self._any_host("backup_listing", wire("backup_listing", requests.BackupListing(
            root=self._host_settings["backup_url"], deadline_s=deadline_s)))[1]

    def backup_manifest(self, name: str) -> fmt.StepManifest:
        """The step manifest of backup ``name``."""
        h, _, payloads = self._any_host("backup_manifest", wire("backup_manifest", requests.BackupManifest(
            root=self._host_settings["backup_url"], name=name)))
        if len(payloads) != 1:
            raise errors.ProtocolError(f"host {h}: backup_manifest answered no manifest")
        return fmt.StepManifest.from_json(bytes(payloads[0]), source=f"backup {name} (via {h})")

    def backup_blobs_among(self, name: str, blobs: Iterable[str]) -> set[str]:
        """Those of ``blobs`` that backup ``name``'s manifest names, as a host that reads it answers: the
        head gets the names it asked after, not the manifest of every shard (``fmt.step_blobs_among``)."""
        blobs = sorted(set(blobs))
        if not blobs:
            return set()
        h, _, payloads = self._any_host("backup_manifest", wire("backup_manifest", requests.BackupManifest(
            root=self._host_settings["backup_url"], name=name, among=blobs)))
        if len(payloads) != 1:
            raise errors.ProtocolError(f"host {h}: backup_manifest answered no blob names")
        text = bytes(payloads[0]).decode("ascii", "replace")
        found = {text[i:i + 32] for i in range(0, len(text), 32)}
        if len(text) % 32 or not found <= set(blobs):
            raise errors.ProtocolError(f"host {h}: backup_manifest answered blob names it was not asked after")
        return found

    def backup_header(self, name: str) -> fmt.StepHeader | None:
        """The header of backup ``name``'s manifest (``fmt.StepHeader``), read by a host by range and
        checked against the backup's sealed part index; None when the backup has none (an older
        version's: read the manifest whole)."""
        h, _, payloads = self._any_host("backup_manifest", wire("backup_manifest", requests.BackupManifest(
            root=self._host_settings["backup_url"], name=name, header_only=True)))
        if len(payloads) != 1:
            raise errors.ProtocolError(f"host {h}: backup_manifest answered no header")
        line = bytes(payloads[0])
        return fmt.StepHeader.from_line(line, source=f"backup {name} header (via {h})") if line else None

    def backup_fetch(self, name: str, needs: dict[str, list[str]]) -> dict[str, dict]:
        """Every host downloads its needed blobs of backup ``name`` into its ramdisk, verified."""
        return self._all_jobs(f"fetch of backup {name}", "backup_fetch",
                              {h: requests.BackupFetch(name=name, blobs=list(b)) for h, b in needs.items()},
                              lane="backup")

    def backup_fetch_parts(self, name: str, parts: Mapping[str, Iterable[str]],
                           wants: Mapping[str, list[tuple[list[str], list[fmt.Box] | None]]] | None = None
                           ) -> dict[str, dict]:
        """Every host of ``parts`` downloads the blobs of the writers' parts named for it (host -> writers),
        which it reads with the manifest's header by range, checked against the backup's part index: every
        blob, or with ``wants`` (host -> what it will load, ``fmt.writers.loads``) only those it loads."""
        return self._all_jobs(f"fetch of backup {name}", "backup_fetch",
                              {h: requests.BackupFetch(name=name, blobs=[], parts=sorted(ws),
                                                       wants=None if wants is None else _wanted(wants.get(h, ())))
                               for h, ws in parts.items()}, lane="backup")

    def backup_scrub(self, work: dict[str, dict], bytes_per_s: float | None = None) -> dict[str, dict]:
        """Each host of ``work`` scrubs the backup root: host -> {"blobs": to hash in the store,
        "parts": [(backup, the writers whose parts it reads, to hash what falls to each)],
        "repair": to re-upload from its ramdisk where it holds good copies, "damaged": {backup: why}
        to mark}, each optional; at most ``bytes_per_s`` (None: the configured cap). Host -> what it
        found ({"checked", "bytes", "bad", "missing", "repaired", "marked", "backups", ...})."""
        root = self._host_settings["backup_url"]
        scrubs = {}
        for h, w in work.items():
            if "parts" in w:
                w = {**w, "parts": [requests.ScrubPart(name=n, writers=list(ws)) for n, ws in w["parts"]]}
            scrubs[h] = requests.BackupScrub(root=root, bytes_per_s=bytes_per_s, **w)
        return self._all_jobs("backup scrub", "backup_scrub", scrubs, own_threads=True)

    # --- peer tier (the sidecars pull from each other; the head plans) --------------------

    @abc.abstractmethod
    def slice_of(self, host_id: str) -> int:
        """The slice of host ``host_id`` (0 where the dispatcher knows no slices)."""

    @abc.abstractmethod
    def _peer_book(self) -> dict[str, str]:
        """host id -> the address its peer service serves at now, as the sidecars report it."""

    def peer_pull(self, step: int, pulls: dict[str, list[tuple[str, int, list[str]]]],
                  manifest: fmt.StepManifest | None = None, *,
                  shares: dict[str, list[tuple[str, list[str]]]] | None = None,
                  adopt: tuple[str, Sequence[str]] | None = None,
                  peers: Mapping[str, str] | None = None) -> dict[str, PullResult]:
        """Each host of ``pulls`` fetches [(blob, nbytes, [holders to try])] from its peers, verified;
        each host of ``shares`` fetches [(owner host, [holders])]: every blob of the owner's share,
        which the host lists from its own copy of the step manifest. With ``adopt`` ((manifest digest,
        keeper hosts)), a host that lacks the step fetches that manifest from a keeper first, and
        commits the step once its pulls succeeded (a replaced node: the head sends no manifest).

        host -> what it pulled (a host that could not be asked has an ``error``). With
        ``manifest``, a host that lacks the step commits it once all its pulls succeeded. The
        addresses are the sidecars' own (``_peer_book``); ``peers`` adds those of hosts outside
        this head's topology.
        """
        shares = shares or {}
        asked = sorted({*pulls, *shares})
        book = {**self._peer_book(), **(peers or {})}
        take = None if adopt is None else requests.Adopt(digest=adopt[0], keepers=list(adopt[1]))
        args, per_host = wire_per_host("peer_pull", {h: requests.PeerPull(
            step=step, peers=book, adopt=take,
            pulls=[requests.Pull(b, n, tuple(srcs)) for b, n, srcs in pulls.get(h, ())],
            shares=[requests.Share(o, tuple(srcs)) for o, srcs in shares[h]] if h in shares else None)
            for h in asked})
        try:
            results, failures = self._jobs("peer_pull", per_host, args, lane="peer",
                                           payloads=(manifest.to_json(),) if manifest is not None else ())
        except errors.MTCError as e:  # not one host's (re-configuring the hosts failed): every host's
            return {h: PullResult.unreachable(h, host_failure(e)) for h in asked}
        out: dict[str, PullResult] = {}
        for h in asked:
            e = failures.get(h)
            if e is None and h not in results:
                e = errors.HostUnreachableError(f"host {h} did not answer the peer pull")
            if e is None:
                try:
                    out[h] = PullResult.from_wire(h, results[h])
                    continue
                except errors.MTCError as bad:  # a malformed answer: this host's failure
                    e = bad
            log.warning("peer pull of step %d on %s failed: %s", step, h, host_failure(e))
            out[h] = PullResult.unreachable(h, host_failure(e))
        return out


    @abc.abstractmethod
    def close(self) -> None:
        """Stop using the sidecars."""


def raise_remote(host: str, name: str, message: str) -> None:
    """Re-raise an error a sidecar reported (``mtc.shared.wire_errors``), typed."""
    raise wire_errors.decode(host, name, message)


def host_failure(e: BaseException) -> str:
    """One line that says why a host failed, for error messages and SaveError.hosts."""
    if isinstance(e, (errors.HostUnreachableError, wire_errors.SidecarError)):  # these name their cause
        return str(e)
    return f"{type(e).__name__}: {e}"


def settle(op: str, failures: Mapping[str, BaseException], note: str | None = None, *, what: str = "") -> None:
    """The hosts' failures of ``op`` as its row says (``OpSpec.failure``): "skip", one that cannot be
    reached is passed over (``note`` logged with its cause), any other raised; "raise", every one is
    (``raise_host_failures``, ``what`` naming the operation). Under "report" and "next" the caller
    puts a failure in that host's answer, or asks the next host: nothing to raise here."""
    rule = op_table.SPECS[op].failure
    if rule == "raise":
        raise_host_failures(what or op, failures)
    elif rule == "skip":
        for h, e in sorted(failures.items()):
            if not isinstance(e, errors.HostUnreachableError):
                raise e
            if note is not None:
                log.warning(note, host_failure(e))


def raise_claim_failures(failures: Mapping[str, BaseException], generation: int) -> None:
    """A claim's per-host failures, the same in both modes: a host that cannot be reached now takes
    the head's generation with its next request (logged); any other failure is raised."""
    for h, e in sorted(failures.items()):
        if isinstance(e, errors.HostUnreachableError):
            log.warning("host %s could not be claimed now (%s); it takes generation %d with the next request",
                        h, e, generation)
            continue
        raise e


def save_error(step: int, phase: str, failures: Mapping[str, BaseException], total: int) -> errors.SaveError:
    """The SaveError of a save that failed on the hosts of ``failures`` (of ``total``), each named
    with why; its cause is what matters: a newer head took the hosts (fencing), else an
    unreachable host (a lost slice, to elastic training)."""
    hosts = {h: host_failure(e) for h, e in sorted(failures.items())}
    lines = "; ".join(f"{h}: {c}" for h, c in hosts.items())
    err = errors.SaveError(f"save of step {step} failed in {phase} on {len(hosts)} of {total} hosts "
                           f"({lines}); step {step} is not committed and is aborted on every host; "
                           "earlier steps are unaffected, and the next save retries the failed hosts",
                           step=step, hosts=hosts)
    err.__cause__ = next((e for e in failures.values() if isinstance(e, errors.FencedError)), None) or next(
        (e for e in failures.values() if isinstance(e, errors.HostUnreachableError)), None)
    return err


def raise_host_failures(what: str, failures: Mapping[str, BaseException]) -> None:
    """Raise the failures of an operation every host of which must succeed (a backup job): one
    host's error as it is; several hosts' as one error naming each (``CorruptBlobError`` when
    every host found a corrupt copy, so the caller can say which array it was)."""
    if not failures:
        return
    if len(failures) == 1:
        (e,) = failures.values()
        raise e
    kinds = {wire_errors.name_of(e) for e in failures.values()}
    error = errors.CorruptBlobError if kinds == {"CorruptBlobError"} else errors.MTCError
    err = error(f"{what} failed on {len(failures)} hosts: "
                + "; ".join(f"{h}: {host_failure(e)}" for h, e in sorted(failures.items())))
    # What a caller acts on: a newer head's fence first, else a host that did not answer (it may come back).
    err.__cause__ = next((e for e in failures.values() if isinstance(e, errors.FencedError)), None) or next(
        (e for e in failures.values() if isinstance(e, errors.HostUnreachableError)), None)
    raise err


def _wanted(wants: Iterable[tuple[list[str], list[fmt.Box] | None]]) -> list[requests.Wanted]:
    """(array keys, their boxes or None: every box) as the wire's ``Wanted``."""
    return [requests.Wanted(keys=list(keys), boxes=None if boxes is None else
                            [[requests.Span(lo, hi) for lo, hi in b] for b in boxes]) for keys, boxes in wants]
