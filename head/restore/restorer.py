"""Restore orchestration (docs/architecture.md, "A restore"): choose the step, plan, bring what hosts lack, load.

``Restorer`` is what ``CheckpointManager.restore`` and the start-up pull run. Each restore
takes one look at the hosts (an ``Inventory`` value) and the backup listing, chooses the
newest step whose every blob has a copy somewhere (or the one asked for, or the one
``restore.version`` pins), plans per host what it needs (``RestorePlan``), has the hosts that
lack blobs pull them from peers (the rest from a backup of that step), and loads from where
the blobs are after that (``RestorePlan.after_fetch``). No per-call state; across calls only
whether the store answered, manifests read, and which hosts a reader gave a manifest.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import time
from typing import Any, Callable, TypeVar

from mtc.head.restore import manifest_gift
from mtc.head.backup.listing import BackupLister, damaged_note, without_backup
from mtc.head.dispatch.interface import Dispatcher, LoadRequest
from mtc.head.replication.plan import ReplicationStrategy, step_views
from mtc.head.reports import Inventory, PrefetchReport, Pulled, RestoreReport
from mtc.head.restore.plan import RestorePlan, make_plan, plan_target
from mtc.head.commit import CommittedStep
from mtc.shared import backup_layout, shardings
from mtc.shared import format as fmt
from mtc.shared.format import writers
from mtc.shared.config import MTCConfig
from mtc.shared.errors import (CorruptBlobError, FencedError, HostUnreachableError, ManifestError, MTCError,
                               StepNotFoundError, StepsUnconfirmedError, cause_in_chain)

log = logging.getLogger(__name__)

HOST_WAIT_POLL_S = 1.0  # how often a restore that waits for hosts plans again
_IN_BACKUP = "(backup)"  # who holds every writer's part, to ``writers.plan``, in a restore from a backup
_T = TypeVar("_T")
# What a host that is not there (yet) answers: its daemon is not running or restarting, or does not answer.
# A TLS or authentication failure is not among them: waiting would not change it.
_GONE = ("connection refused", "connection lost (daemon", "no answer within")


class _NewerMayExist(StepsUnconfirmedError):
    """Steps are known, but hosts that did not answer may hold newer ones (``Restorer.all_steps`` waits)."""


def _may_come_back(e: BaseException) -> bool:
    """``e`` names hosts that did not answer, each because it is not there (yet), not because it refused us."""
    if cause_in_chain(e, HostUnreachableError) is None:
        return False
    reasons = list(e.hosts.values()) if isinstance(e, StepsUnconfirmedError) and getattr(e, "hosts", None) else [str(e)]
    return all(any(g in str(r) for g in _GONE) for r in reasons)

# How long listing the backups may retry an unreachable store (latest_step, restore wait on it).
LISTING_DEADLINE_S = 30.0
# Once a listing could not reach the store, the next ones (a restart calls latest_step, all_steps
# and restore, each listing the backups) retry only this long until one gets through: a restart
# during an outage waits out the deadline once, not once per call.
LISTING_RETRY_DEADLINE_S = 2.0


def _transport(cause: str) -> bool:
    """Whether a pull failure's cause is the transport's (refused, reset, timed out, busy), not the bytes'."""
    c = cause.lower()
    if "does not hold blob" in c:  # the holder answered: it has no copy (it removed a corrupt one)
        return False
    return any(w in c for w in ("refused", "timed out", "timeout", "connection", "unreachable", "busy", "reset"))


class Restorer:
    """Restores through ``dispatch``; ``replicate`` re-makes peer copies after a host was refilled."""

    def __init__(self, dispatch: Dispatcher, config: MTCConfig, strategy: ReplicationStrategy,
                 replicate: Callable[[CommittedStep], None]):
        self._dispatch = dispatch
        self._config = config
        self._strategy = strategy
        self._replicate = replicate
        self._lister = BackupLister(dispatch, config)
        self._manifests: dict[str, fmt.StepManifest] = {}  # digest -> manifest (see _remember)
        self._headers: dict[str, fmt.StepHeader] = {}  # manifest digest -> its header line, as a host gave it
        self.read_only = False  # a reader's (mtc export of a running job): never changes the hosts
        # A starting head waits for hosts that do not answer (restore_host_wait_s); the manager turns this off
        # once it saved or restored: then a host that goes away is a failure, not a host still starting.
        self.waits_for_hosts = True
        self._given: set[tuple[int, str, str]] = set()  # (step, manifest digest, host) a reader gave it to

    # --- what there is ---------------------------------------------------------------------

    def inventory(self, listing: dict | None = None) -> Inventory:
        """Ask every host what it holds. A step is restorable while every blob has a copy on
        some host: the one that saved it, a data-parallel twin or a peer copy, so a host that
        lost its ramdisk does not make a step unrestorable."""
        inv = self._dispatch.inventories()
        return Inventory(views=step_views(inv, self._manifest_for, self._header_for), unreachable={h: i.error for h, i in inv.items() if i.error},
                         backup_unreachable=(listing or {}).get("unreachable"),
                         damaged={h: i.damaged for h, i in inv.items() if i.damaged})

    def _inventory_repaired(self, listing: dict) -> Inventory:
        """The inventory, after hosts with a damaged copy of a step manifest got it back: what
        ``all_steps`` (so ``latest_step``) and a restore's choice both read, so that the step
        ``latest_step`` names is the one ``restore()`` would choose."""
        inv = self.inventory(listing)
        if inv.damaged and not inv.unreachable and not self.read_only and manifest_gift.repair_damaged(self._dispatch, inv):
            inv = self.inventory(listing)
        return inv

    def backup_listing(self) -> dict:
        """The backups and ``restore.version``; while the store is unreachable, none, marked
        ``"unreachable"``: a step on the hosts may be chosen without them, never "no backup" where the
        answer depends on them (``BackupLister``)."""
        return self._lister.listing(LISTING_DEADLINE_S, LISTING_RETRY_DEADLINE_S)

    def all_steps(self, repair: bool = True) -> list[int]:
        """Restorable steps, ascending; with ``repair`` (a head that took the hosts: the repair
        changes them), hosts with a damaged copy of a step manifest get it back first, as for a
        restore's choice, so that the newest step listed is the one ``restore()`` would choose.
        While hosts that may hold a step do not answer, it waits for them (``_waiting_for_hosts``)."""
        if not self.waits_for_hosts or self.read_only:  # no wait: one inventory, not a strict one and a fallback
            return self._all_steps(repair)
        return self._waiting_for_hosts("listing the steps", lambda: self._all_steps(repair, strict=True),
                                       fallback=lambda: self._all_steps(repair, strict=False))

    def _all_steps(self, repair: bool, strict: bool = False) -> list[int]:
        """``strict``: while a host does not answer, a newer step than those known may be on it (a step the
        backup does not have yet): ``_NewerMayExist``, for ``all_steps`` to wait for the host."""
        listing = self.backup_listing()
        if listing["restore_version"]:
            return [self.pinned_backup(listing)[1]]
        inv = self._inventory_repaired(listing) if repair else self.inventory(listing)
        if self._no_host_answered(inv):  # the backups are listed through the hosts: they cannot decide either
            raise self._unconfirmed(inv)
        if not inv.restorable and "unreachable" in listing:  # nothing on the hosts: the backups decide
            self._lister.required(listing, LISTING_DEADLINE_S, "any step", _hosts_note(inv))
            if listing["restore_version"]:
                return [self.pinned_backup(listing)[1]]
        steps = set(inv.restorable) | {b["step"] for b in listing["backups"]}
        whole = self._completed_by_backups(inv, listing, newer_than=max(steps, default=-1), only=None)
        steps |= {whole} if whole is not None else set()
        if not steps and inv.unreachable:  # "no step" is not known while a host that may hold one is not asked
            raise self._unconfirmed(inv)
        if strict and inv.unreachable:
            hosts = dict(sorted(inv.unreachable.items()))
            raise _NewerMayExist(f"steps up to {max(steps)} are confirmed, but {len(hosts)} host(s) could not be asked "
                                 "and may hold newer ones (" + "; ".join(f"{h}: {e}" for h, e in hosts.items()) + ")",
                                 hosts=hosts)
        return sorted(steps)

    def _no_host_answered(self, inv: Inventory) -> bool:
        return bool(inv.unreachable) and set(inv.unreachable) >= set(self._dispatch.hosts())

    def _unconfirmed(self, inv: Inventory) -> StepsUnconfirmedError:
        """The error of a step listing that hosts it could not ask leave empty: never "no step"."""
        hosts = dict(sorted(inv.unreachable.items()))
        total = len(self._dispatch.hosts())
        others = "no host answered" if self._no_host_answered(inv) else "the hosts that answered confirm no step alone"
        return StepsUnconfirmedError(
            f"no step can be confirmed: {len(hosts)} of {total} hosts could not be asked what they hold ("
            + "; ".join(f"{h}: {e}" for h, e in hosts.items())
            + f") and {others}; they may hold committed steps, so this is not \"no step\" (do not start training "
            "from the beginning). Fix what stops the head from reaching them (a TLS error: give the head the job's "
            "TLS folder, MTC_TLS_DIR or tls_dir; a host down: restart it) and ask again, or open the manager on "
            "the hosts that remain (a cluster spec without them)", hosts=hosts)

    def pinned_backup(self, listing: dict) -> tuple[str, int]:
        rv = listing["restore_version"]
        step = backup_layout.parse_backup_name(rv)
        names = [b["name"] for b in listing["backups"]]
        if rv not in names:
            raise StepNotFoundError(
                f"restore.version in {self._config.backup_root} names backup {rv!r}, which does not exist "
                f"(backups: {names[:5]}){damaged_note(listing)}; fix it with `mtc restore-version set NAME` or "
                "remove it with `mtc restore-version clear`; nothing was restored")
        return rv, step

    def choose_step(self, step: int | None, listing: dict) -> tuple[int, str | None, str | None, Inventory]:
        """(step, backup to restore it from or None for the hosts, a backup of it as fallback,
        the inventory the choice was made on)."""
        if listing["restore_version"]:
            backup_name, pinned = self.pinned_backup(listing)
            if step is not None and step != pinned:
                raise StepNotFoundError(f"restore.version pins backup {backup_name} (step {pinned}); "
                                        f"step {step} was asked for; clear restore.version to restore it")
            return pinned, backup_name, None, Inventory(views={}, unreachable={})  # the hosts are not asked
        inv = self._inventory_repaired(listing)
        cluster = inv.restorable
        in_backup: dict[int, str] = {}
        for b in listing["backups"]:  # newest first: keep the newest backup of each step
            in_backup.setdefault(b["step"], b["name"])
        steps = sorted(set(cluster) | set(in_backup))
        if step is None or step not in steps:
            # A step on the hosts whose blobs no host holds are in the backups of other steps (an array
            # that did not change since) is whole too: the restore fetches those from there.
            whole = self._completed_by_backups(inv, listing, newer_than=max(steps, default=-1), only=step)
            if whole is not None:
                cluster = sorted(set(cluster) | {whole})
                steps = sorted(set(steps) | {whole})
        if "unreachable" in listing and self._no_host_answered(inv):  # the listing went through no host either
            raise self._unconfirmed(inv)
        if "unreachable" in listing and (step not in steps if step is not None else not steps):
            # Not on the hosts, and the listing failed: "not found" is not known; ask it again, or say so.
            self._lister.required(listing, LISTING_DEADLINE_S, "any step" if step is None else f"step {step}",
                                  _hosts_note(inv))
            return self.choose_step(step, listing)
        # While a host cannot be asked, "not found" may only mean "on the host that is gone".
        lost = (HostUnreachableError("; ".join(f"{h}: {e}" for h, e in sorted(inv.unreachable.items())))
                if inv.unreachable else None)
        if step is None:
            if not steps:
                raise StepNotFoundError(
                    f"no committed step in {self._config.ramdisk_root}"
                    + (f" nor in {self._config.backup_root}" if self._config.base_output_directory else "")
                    + "; nothing to restore (save a step first, or check local_checkpoint_directory)"
                    + damaged_note(listing) + inv.note()) from lost
            step = steps[-1]
        elif step not in steps:
            raise StepNotFoundError(f"step {step} is not committed on every host, and not every blob of it has a "
                                    f"copy on some host or in a backup; committed steps: {steps}"
                                    + damaged_note(listing) + inv.note()) from lost
        return step, (None if step in cluster else in_backup[step]), in_backup.get(step), inv

    def _completed_by_backups(self, inv: Inventory, listing: dict, *, newer_than: int,
                              only: int | None) -> int | None:
        """The newest step committed on the hosts (newer than ``newer_than``; ``only``, if given)
        whose blobs that no host holds are all listed by backups; None if there is none. The head
        reads the step's blob names (no shard record) and asks a host which of the lacking blobs each
        backup lists, newest first, until none is left: it never reads a backup's manifest itself."""
        if inv.unreachable or not listing["backups"]:
            return None
        candidates = sorted((s for s, v in inv.views.items() if not v.restorable and s > newer_than
                             and (only is None or s == only)), reverse=True)
        for s in candidates:
            try:
                names = self._dispatch.manifest_blob_names(s, inv.views[s].manifest or None)
            except MTCError:
                continue
            lacking = inv.views[s].lacking(names)
            if lacking is None:
                continue
            left = set(lacking)
            self._find_in_backups(s, left, _names(listing))
            if not left:
                return s
        return None

    def _find_in_backups(self, step: int, blobs: set[str], backups: list[str]) -> dict[str, list[str]]:
        """Backup -> those of ``blobs`` that it is the newest to list, asking each backup (newest first)
        after the blobs not found yet; the blobs found are taken out of ``blobs``, so that what is left
        is what no backup lists."""
        found: dict[str, list[str]] = {}
        for name in backups:  # newest first
            if not blobs:
                break
            try:
                held = self._dispatch.backup_blobs_among(name, blobs)
            except MTCError as e:
                log.warning("step %d: backup %s cannot be read (%s); its blobs do not count", step, name, e)
                continue
            if held:
                found[name] = sorted(held)
                blobs -= held
        return found

    def manifest_of(self, step: int | None, shards: bool = True) -> fmt.StepManifest:
        """The manifest of ``step`` (default: the one a restore would choose), as a restore reads it. Without
        ``shards``, from its header alone where it has one (every array, the tree, the topology; no shard:
        O(arrays + hosts), ``fmt.StepHeader.as_manifest``), else whole."""
        listing = self.backup_listing()
        step, backup_name, _, inv = self.choose_step(step, listing)
        view = inv.views.get(step) if backup_name is None else None
        agreed = view.manifest if view is not None and view.manifest else None
        if not shards:
            header = (self._backup_header(step, backup_name) if backup_name is not None
                      else self._header_for(step, agreed) if agreed else None)
            if header is not None:
                return header.as_manifest()
        return self._manifest(step, backup_name, agreed)

    # --- restore ---------------------------------------------------------------------------

    def restore(self, step: int | None, target: Any, partial: Any,
                prefetched: PrefetchReport | None, pull: bool = True) -> tuple[Any, RestoreReport]:
        """Restore ``step`` (None: the newest restorable), waiting for hosts it needs (``_waiting_for_hosts``)."""
        first = [prefetched]

        def once() -> tuple[Any, RestoreReport]:
            pre, first[0] = first[0], None  # a prefetch is only the first try's
            return self._restore_checked(step, target, partial, pre, pull)

        return self._waiting_for_hosts("restore", once)

    def _waiting_for_hosts(self, what: str, fn: Callable[[], _T], fallback: Callable[[], _T] | None = None) -> _T:
        """``fn()``, tried again every ``HOST_WAIT_POLL_S`` for up to ``restore_host_wait_s`` while it fails
        because hosts do not answer: a host or slice replaced after a failure comes back empty a little
        after the head restarts (on a CPU or multi-controller backend nothing else makes the head wait for
        it), and at a job's start the head can be up before its hosts. A newer head's fence, any other
        error, and a reader's (``read_only``: a tool answers at once) are raised at once. ``fallback``: the
        answer without those hosts, when ``fn`` only found that they may know more (``_NewerMayExist``)."""
        wait_s = self._config.restore_host_wait_s if self.waits_for_hosts and not self.read_only else 0.0
        since = time.monotonic()
        said = -math.inf
        while True:
            try:
                return fn()
            except MTCError as e:
                if cause_in_chain(e, FencedError) is not None:
                    raise
                left = since + wait_s - time.monotonic()
                if fallback is not None and isinstance(e, _NewerMayExist) and (left <= 0 or not _may_come_back(e)):
                    if wait_s > 0 and _may_come_back(e):
                        log.warning("%s: %s; after %.0f s, going on without them (restore_host_wait_s)", what, e,
                                    time.monotonic() - since)
                    return fallback()
                if not _may_come_back(e):
                    raise
                if left <= 0:
                    if wait_s > 0:
                        e.add_note(f"(the {what} waited {time.monotonic() - since:.0f} s for the hosts that did not "
                                   "answer: restore_host_wait_s)")
                    raise
                if time.monotonic() - said >= 10.0:
                    said = time.monotonic()
                    log.warning("%s: %s; waiting for the hosts that do not answer (%.0f s more: restore_host_wait_s)",
                                what, e, left)
                time.sleep(min(HOST_WAIT_POLL_S, left))

    def _restore_checked(self, step: int | None, target: Any, partial: Any,
                         prefetched: PrefetchReport | None, pull: bool = True) -> tuple[Any, RestoreReport]:
        try:
            return self._restore_once(step, target, partial, prefetched, pull)
        except CorruptBlobError as e:
            # A host found its own copy corrupt while loading and removed it (mtc.sidecar.reads): plan
            # once more, so that a good copy comes from a peer or a backup.
            log.warning("restore: %s; planning the restore again without that copy", e)
            try:
                return self._restore_once(step, target, partial, None, pull)
            except StepNotFoundError:
                raise e from None  # no other copy anywhere: the error that names the array and the shard

    def _restore_once(self, step: int | None, target: Any, partial: Any,
                      prefetched: PrefetchReport | None, pull: bool = True,
                      listing: dict | None = None) -> tuple[Any, RestoreReport]:
        t0 = time.perf_counter()
        listing, asked = listing or self.backup_listing(), step
        while True:
            step, backup_name, fallback, inv = self.choose_step(asked, listing)
            view = inv.views.get(step) if backup_name is None else None
            agreed = view.manifest if view is not None and view.manifest else None
            header = self._headers.get(agreed) if view is not None and view.by_writers and agreed else None
            needs = None
            if backup_name is not None:
                try:
                    header = self._backup_header(step, backup_name)
                except ManifestError as e:
                    log.warning("backup %s cannot be restored (%s); choosing again without it", backup_name, e)
                    listing = without_backup(listing, backup_name, f"its manifest fails its checks: {e}")
                    continue
                if header is not None:
                    requests, finish = plan_target(header.as_manifest(), target, partial)
                    parts = self._backup_parts(header, requests)
                    if parts is not None:
                        t1 = time.perf_counter()
                        try:
                            done = self._load_backup_parts(step, backup_name, header, parts, requests, finish, t0,
                                                           t1, prefetched)
                        except ManifestError as e:
                            log.warning("backup %s cannot be restored (%s); choosing again without it",
                                        backup_name, e)
                            return self._restore_once(asked, target, partial, None, pull, without_backup(
                                listing, backup_name, f"its manifest fails its checks: {e}"))
                        if done is not None:
                            return done
                header = None
            if header is not None:
                requests, finish = plan_target(header.as_manifest(), target, partial)
                if view.by_parts and self._same_layout(header, requests):
                    manifest = None
                    break
                needs = self._writers_plan(header, requests, view, pull)
                if needs is not None:
                    manifest = None
                    break
            try:
                manifest = self._manifest(step, backup_name, agreed)
                break
            except ManifestError as e:  # a backup whose manifest fails its checks is no restore point
                if backup_name is None:
                    raise
                log.warning("backup %s cannot be restored (%s); choosing again without it", backup_name, e)
                listing = without_backup(listing, backup_name, f"its manifest fails its checks: {e}")
        t1 = time.perf_counter()
        if manifest is None and needs is None:  # onto the hosts and shardings that saved it: each its own part
            return self._load_own_parts(step, header, requests, finish, t0, t1, view, prefetched)
        if manifest is None:  # another target, or a writer lost its part: by the writers' parts
            pulled = Pulled()
            done = self._load_by_writers(step, header, requests, finish, needs, t0, view, prefetched, pulled)
            if done is not None:
                return done
            # A part could not be brought (the pulls found bad copies, and removed them): plan by the rows,
            # which fetch what no peer has a good copy of from a backup, or name the shard that has none.
            manifest = self._manifest(step, None, agreed)
        requests, finish = plan_target(manifest, target, partial)
        if needs is None:
            pulled = Pulled()
        plan = self._fetch_lacking(step, manifest, requests, backup_name, fallback, pulled, inv, _names(listing), pull)
        if plan is None:
            needed = (sum(r.record.nbytes for r in requests), len(manifest.blob_names()))
            holders = None
        else:
            needed = plan.nbytes(manifest.blob_sizes())
            holders = plan.after_fetch(pulled.fetched).holders
        t_pull = time.perf_counter()
        counted = prefetched is not None and prefetched.step == step
        if counted:  # where those bytes really came from
            for tier in ("peer", "backup"):
                pulled.add(tier, prefetched.bytes_by_tier.get(tier, 0), prefetched.blobs_by_tier.get(tier, 0))
        arrays = self._dispatch.load(step, requests, holders, agreed, view.keepers if view is not None else ())
        t2 = time.perf_counter()
        result = finish(arrays)
        (needed_bytes, needed_blobs), p = needed, pulled
        by_tier = {"ram": max(0, needed_bytes - p.bytes["peer"] - p.bytes["backup"]), **p.bytes}
        blobs = {"ram": max(0, needed_blobs - p.blobs["peer"] - p.blobs["backup"]), **p.blobs}
        report = RestoreReport(
            step=step, bytes_by_tier=by_tier, blobs_by_tier=blobs, source=backup_name or "cluster",
            skipped_copies=tuple(p.skipped), inventory_s=t1 - t0, pull_s=t_pull - t1,
            load_s=t2 - t_pull, total_s=time.perf_counter() - t0, prefetched=counted)
        log.info("- restore step %d; duration=%.3fs; size=%d bytes", step, report.total_s,
                 sum(r.record.nbytes for r in requests))
        return result, report

    def _load_own_parts(self, step: int, header: fmt.StepHeader, requests: list[LoadRequest], finish: Callable,
                        t0: float, t1: float, view: Any, prefetched: PrefetchReport | None) -> tuple[Any, RestoreReport]:
        """The restore of a step onto the hosts and shardings that saved it, from the header alone: every
        host that wrote a part holds it whole (``StepView.by_parts``), so nothing is pulled, and each host
        reads its own shards by its own part. The head reads no shard row: its work is O(arrays + hosts)."""
        arrays = self._dispatch.load(step, requests, None, header.digest, view.keepers)
        t2 = time.perf_counter()
        result = finish(arrays)
        report = self._parts_report(step, requests, view, Pulled(), prefetched, t0, t1, t1, t2)
        log.info("- restore step %d; duration=%.3fs; size=%d bytes (each host its own part)", step, report.total_s,
                 sum(r.record.nbytes for r in requests))
        return result, report

    def _backup_header(self, step: int, name: str) -> fmt.StepHeader | None:
        """The header of backup ``name`` (of ``step``), read by range; None when it has no part index or
        no host could read it (its whole manifest is read then); ManifestError when it fails its checks."""
        try:
            header = self._dispatch.backup_header(name)
        except ManifestError:
            raise
        except MTCError as e:
            log.info("backup %s: no header by its part index (%s); reading its whole manifest", name, e)
            return None
        if header is not None and header.step != step:
            raise ManifestError(f"backup {name} holds the manifest of step {header.step}, not {step}")
        return header

    def _host_of(self, device_id: int) -> str | None:
        """The host of device ``device_id`` now; None for a device this topology does not have."""
        try:
            return self._dispatch.host_of_device(device_id)
        except MTCError:
            return None

    def _backup_parts(self, header: fmt.StepHeader, requests: list[LoadRequest]) -> dict[str, set[str]] | None:
        """Which writers' parts of a backup each host reads, from the header: onto the hosts and shardings
        that saved the step its own; onto another target (an elastic resize, another mesh) those whose
        boxes its new ones overlap (``fmt.writers.plan``; every part is in the backup). None where the
        header cannot say (the manifest's rows decide)."""
        if self._same_layout(header, requests):
            hosts = set(self._dispatch.hosts())
            return {h: {h} for h, _ in header.parts if h in hosts}

        needs = writers.plan(header, requests, {w: {_IN_BACKUP} for w, _ in header.parts}, self._host_of,
                             self._dispatch.hosts())
        return None if needs is None else {h: ws for h, ws in needs.items() if ws}

    def _load_backup_parts(self, step: int, name: str, header: fmt.StepHeader, parts: dict[str, set[str]],
                           requests: list[LoadRequest], finish: Callable, t0: float, t1: float,
                           prefetched: PrefetchReport | None) -> tuple[Any, RestoreReport] | None:
        """The restore from backup ``name`` by its parts (``parts``: host -> the writers whose parts it
        reads): each host reads the header and those parts by range (checked against the sealed part
        index), downloads the blobs of them it loads and loads its boxes by them. The head reads the header alone:
        O(arrays + hosts). None when a blob of the backup is corrupt (the rows path names the array and
        the shard)."""
        pulled = Pulled()
        try:
            # Only the blobs it loads: a writer's boxes it does not overlap, arrays the restore leaves out
            # (each host all of its own part where it loads it whole: nothing to choose).
            whole = (all(ws == {h} for h, ws in parts.items())
                     and {a.key for a in header.arrays} <= {r.record.key for r in requests})
            fetched = self._dispatch.backup_fetch_parts(
                name, parts, None if whole else writers.loads(requests, self._host_of, self._dispatch.hosts()))
        except CorruptBlobError as e:
            log.warning("restore of step %d from backup %s by parts: %s; planning by the manifest's rows", step, name, e)
            return None
        pulled.add_backup(fetched)
        t_pull = time.perf_counter()
        arrays = self._dispatch.load(step, requests, None, header.digest, ())
        t2 = time.perf_counter()
        result = finish(arrays)
        counted = prefetched is not None and prefetched.step == step
        if counted:
            pulled.add("backup", prefetched.bytes_by_tier.get("backup", 0), prefetched.blobs_by_tier.get("backup", 0))
        nbytes = sum(r.record.nbytes for r in requests)
        nblobs = sum(f.get("part_blobs", 0) for f in fetched.values())
        report = RestoreReport(
            step=step, bytes_by_tier={"ram": max(0, nbytes - pulled.bytes["backup"]), **pulled.bytes},
            blobs_by_tier={"ram": max(0, nblobs - pulled.blobs["backup"]), **pulled.blobs}, source=name,
            skipped_copies=(), inventory_s=t1 - t0, pull_s=t_pull - t1, load_s=t2 - t_pull,
            total_s=time.perf_counter() - t0, prefetched=counted)
        log.info("- restore step %d; duration=%.3fs; size=%d bytes (from backup %s by parts: %d read by %d hosts)",
                 step, report.total_s, nbytes, name, sum(len(ws) for ws in parts.values()), len(parts))
        return result, report

    @staticmethod
    def _parts_report(step: int, requests: list[LoadRequest], view: Any, pulled: Pulled,
                      prefetched: PrefetchReport | None, t0: float, t1: float, t_pull: float,
                      t2: float) -> RestoreReport:
        """The report of a restore by parts: what ``pulled`` moved (and the start-up pull before it, when
        it brought this step: where those bytes really came from), the rest from the hosts' RAM."""
        counted = prefetched is not None and prefetched.step == step
        if counted:
            for tier in ("peer", "backup"):
                pulled.add(tier, prefetched.bytes_by_tier.get(tier, 0), prefetched.blobs_by_tier.get(tier, 0))
        nbytes = sum(r.record.nbytes for r in requests)
        moved, moved_blobs = pulled.bytes["peer"] + pulled.bytes["backup"], pulled.blobs["peer"] + pulled.blobs["backup"]
        return RestoreReport(
            step=step, bytes_by_tier={"ram": max(0, nbytes - moved), **pulled.bytes},
            blobs_by_tier={"ram": max(0, view.part_blobs - moved_blobs), **pulled.blobs}, source="cluster",
            skipped_copies=tuple(pulled.skipped), inventory_s=t1 - t0, pull_s=t_pull - t1, load_s=t2 - t_pull,
            total_s=time.perf_counter() - t0, prefetched=counted)

    def _writers_plan(self, header: fmt.StepHeader, requests: list[LoadRequest], view: Any,
                      pull: bool) -> dict[str, set[str]] | None:
        """Which writers' parts each host reads besides its own (``fmt.writers.plan``), from the header:
        None where it cannot say, or where parts would have to move and ``pull`` is off (a reader), or
        where a host lacks the step and no host keeps its whole manifest: the rows decide then. A host
        that lacks the step (a replaced node) pulls every part it reads and adopts the step from a keeper."""
        readers = self._dispatch.hosts()
        new = set(readers) - set(view.hosts)
        if new and not view.keepers:
            return None

        holders = view.sources
        needs = writers.plan(header, requests, holders, self._host_of, readers, pieced=view.pieces)
        if needs is None:
            return None
        for h in new:  # it holds nothing: even one that reads no box pulls a part, so that it adopts the step
            if not needs.get(h):
                needs.setdefault(h, set()).add(min(w for w, hs in holders.items() if hs))
        if not pull and any(needs.values()):
            return None
        return needs

    def _load_by_writers(self, step: int, header: fmt.StepHeader, requests: list[LoadRequest], finish: Callable,
                         needs: dict[str, set[str]], t0: float, view: Any,
                         prefetched: PrefetchReport | None, pulled: Pulled) -> tuple[Any, RestoreReport] | None:
        """The restore planned from the header onto another target (an elastic resize, another mesh), or
        onto the saving topology where a writer lost its part: every host first pulls, whole, the parts
        of the writers whose boxes it reads (``needs``: a data-parallel twin's, a neighbour's on the new
        mesh, or a lost writer's from the host that keeps a peer copy of it), then reads its boxes from
        its ramdisk by the manifest it keeps. The head reads no shard row. None when a part could not be
        brought (the caller plans by the rows, with ``pulled``: what moved, and the copies found bad,
        which their holders removed)."""
        t1 = time.perf_counter()
        if not self._pull_writers(step, header, needs, view, pulled):
            return None
        t_pull = time.perf_counter()
        try:
            arrays = self._dispatch.load(step, requests, None, header.digest, view.keepers)
        except (ManifestError, CorruptBlobError, StepNotFoundError) as e:
            # A host that committed a record reads by the header a keeper gives it; a keeper it cannot
            # reach (its address changed with a restart) leaves it nothing to read by. The rows path gives
            # hosts the manifest.
            log.warning("restore of step %d by the writers' parts: %s; planning by the manifest's rows", step, e)
            return None
        t2 = time.perf_counter()
        result = finish(arrays)
        report = self._parts_report(step, requests, view, pulled, prefetched, t0, t1, t_pull, t2)
        log.info("- restore step %d; duration=%.3fs; size=%d bytes (by the writers' parts: %d pulled whole)", step,
                 report.total_s, sum(r.record.nbytes for r in requests), sum(len(ws) for ws in needs.values()))
        return result, report

    def _pull_writers(self, step: int, header: fmt.StepHeader, needs: dict[str, set[str]], view: Any,
                      pulled: Pulled) -> bool:
        """Every host pulls, whole, the parts of the writers named for it in ``needs`` (``_writers_plan``)
        from the hosts that hold them, and a host that lacked the step adopts it from a keeper: the first
        half of a restore by the writers' parts, and the start-up pull's. Counted in ``pulled`` (with the
        copies found bad, which their holders removed); False when a part could not be brought (the
        caller plans by the rows)."""
        # Each part from its writer first, else from a host that keeps a peer copy of it, else blob by blob
        # from the hosts that hold its pieces (each blob asked of them in turn, most held first).
        sources = view.sources
        shares = {h: [(w, [x for x in sorted(sources[w], key=lambda x, w=w: x != w) if x != h]) for w in sorted(ws)]
                  for h, ws in needs.items() if ws}
        if shares:
            lacking = set(needs) - set(view.hosts)  # they adopt the step from a keeper once their parts arrived
            results = self._dispatch.peer_pull(step, {}, shares=shares,
                                               adopt=(header.digest, view.keepers) if lacking else None)
            for h, r in results.items():
                pulled.add("peer", r.pulled_bytes, r.pulled)
                pulled.skipped.extend(f"{h} <- {src}: blob {blob}: {cause}" for blob, src, cause in r.bad_copies)
                for blob, src, cause in r.bad_copies:
                    pulled.bad.setdefault(blob, []).append(f"{src}: {cause}")
                for blob, causes in r.failed:  # no holder had a good copy: why, holder by holder
                    pulled.bad.setdefault(blob, []).extend(f"{src}: {cause}" for src, cause in causes
                                                           if not _transport(cause))
            bad = {h: r.error or f"{len(r.failed)} blob(s) no holder had" for h, r in results.items()
                   if r.error or r.failed}
            if bad:
                log.warning("restore of step %d: the writers' parts could not be brought (%s); planning by the "
                            "manifest's rows", step, "; ".join(f"{h}: {w}" for h, w in sorted(bad.items())))
                return False
            if lacking or set(needs) & set(view.lost):
                # A host was refilled: the copies it held for its peers are gone too; make them again (by
                # the hosts' shares; the manifest is read in the background only if they cannot tell).
                self._replicate(CommittedStep(step, digest=header.digest,
                                              hosts=tuple(sorted(set(view.hosts) | lacking)),
                                              fetch=lambda: self._manifest(step, None, header.digest), header=header))
        return True

    def _same_layout(self, header: fmt.StepHeader, requests: list[LoadRequest]) -> bool:
        """Whether every request is a jax array asked for in the sharding it was saved with, on devices
        of the hosts that wrote them (``header.devices``): then each host's own part is exactly what it
        loads. O(arrays + devices); the boxes are compared only where the descriptions differ."""
        devices = header.devices
        if devices is None:  # saved by a version that did not record them
            return False
        try:
            if any(self._dispatch.host_of_device(d) != h for h, ids in devices.items() for d in ids):
                return False
        except MTCError:  # a device this topology does not have
            return False
        saved_on = {d for ids in devices.values() for d in ids}
        checked: dict[tuple, bool] = {}
        for r in requests:
            rec = r.record
            if rec.kind == "numpy" and r.sharding is None:  # every host wrote it whole: its own part has it
                continue
            if rec.kind != "jax" or r.sharding is None or rec.sharding is None or rec.prng_impl:
                return False
            key = (id(r.sharding), rec.shape, id(rec.sharding))
            ok = checked.get(key)
            if ok is None:
                desc = shardings.describe(r.sharding)
                ok = desc == rec.sharding
                if not ok:
                    saved = shardings.described_device_boxes(rec.sharding, rec.shape)
                    ok = saved is not None and saved == shardings.device_boxes(r.sharding, rec.shape)
                ok = ok and {d.id for d in r.sharding.device_set} <= saved_on
                checked[key] = ok
            if not ok:
                return False
        return True

    def _header_for(self, step: int, digest: str) -> fmt.StepHeader | None:
        """The header of the manifest ``digest`` of ``step`` (one line from a host), kept; None when no
        host gives it (an older format, the keepers gone): the step is then viewed by its blob rows."""
        header = self._headers.get(digest)
        if header is None:
            try:
                header = self._dispatch.manifest_header(step, digest)
            except MTCError as e:  # not kept: the keepers may answer next time
                log.info("step %d: no manifest header (%s); reading it by its rows", step, e)
                return None
            self._headers[digest] = header
            while len(self._headers) > 16:
                self._headers.pop(next(iter(self._headers)))
        return header

    def _manifest(self, step: int, backup_name: str | None, digest: str | None = None) -> fmt.StepManifest:
        if backup_name is not None:
            return self._dispatch.backup_manifest(backup_name)
        if digest is not None and digest in self._manifests:
            return self._manifests[digest]
        m = self._dispatch.manifest(step, digest)
        self._remember(m)
        return m

    def _manifest_for(self, step: int, digest: str) -> fmt.StepManifest | None:
        """The manifest of ``step`` with ``digest``, to read the inventory rows of hosts that
        committed a record (None when no host can give it)."""
        try:
            return self._manifest(step, None, digest)
        except MTCError as e:
            log.warning("step %d: no host could give its manifest %s (%s)", step, digest[:12], e)
            return None

    def _remember(self, m: fmt.StepManifest) -> None:
        # Manifests never change (a digest names one): a few are kept, so that an inventory does
        # not fetch the same one again.
        self._manifests[m.digest] = m
        while len(self._manifests) > 8:
            self._manifests.pop(next(iter(self._manifests)))

    def prefetch(self, closing: Callable[[], bool]) -> PrefetchReport | None:
        """Bring the newest restorable step local, in the layout it was saved with.

        The restore's first half, started when the manager is created: a replaced node refills
        from its peers, a job whose ramdisks are all gone downloads from the backup, while the
        training script builds and compiles its model. Raises what it could not do (the caller
        logs it: ``restore`` does it, or explains).
        """
        t0 = time.perf_counter()
        listing = self.backup_listing()
        step, backup_name, fallback, inv = self.choose_step(None, listing)
        view = inv.views.get(step) if backup_name is None else None
        header = self._backup_header(step, backup_name) if backup_name is not None else None
        parts = self._backup_parts(header, plan_target(header.as_manifest(), None)[0]) if header is not None else None
        if parts is not None:
            if closing():
                return None
            pulled = Pulled()
            pulled.add_backup(self._dispatch.backup_fetch_parts(backup_name, parts))
            return PrefetchReport(step=step, source=backup_name, bytes_by_tier=dict(pulled.bytes),
                                  blobs_by_tier=dict(pulled.blobs), seconds=time.perf_counter() - t0)
        # Every part is whole where it was written, or the writers that lost theirs are gone (an elastic
        # shrink; the restore reads their boxes from the twins' parts): nothing to bring.
        if view is not None and view.by_writers and not set(view.lost) & set(self._dispatch.hosts()):
            return PrefetchReport(step=step, source="cluster", bytes_by_tier={"peer": 0, "backup": 0},
                                  blobs_by_tier={"peer": 0, "backup": 0}, seconds=time.perf_counter() - t0)
        header = self._headers.get(view.manifest) if view is not None and view.by_writers and view.manifest else None
        if header is not None:  # a writer lost its part (a replaced node): the parts it reads, planned from the header
            needs = self._writers_plan(header, plan_target(header.as_manifest(), None)[0], view, True)
            if needs is not None:
                if closing():
                    return None
                pulled = Pulled()
                if self._pull_writers(step, header, needs, view, pulled):
                    return PrefetchReport(step=step, source="cluster", bytes_by_tier=dict(pulled.bytes),
                                          blobs_by_tier=dict(pulled.blobs), seconds=time.perf_counter() - t0)
        manifest = self._manifest(step, backup_name, view.manifest if view is not None and view.manifest else None)
        requests, _ = plan_target(manifest, None)  # the saved shardings (fails after a shrink: skipped)
        if closing():  # closed before anything moved: a job that did not want it
            return None
        pulled = Pulled()
        self._fetch_lacking(step, manifest, requests, backup_name, fallback, pulled, inv, _names(listing))
        return PrefetchReport(step=step, source=backup_name or "cluster", bytes_by_tier=dict(pulled.bytes),
                              blobs_by_tier=dict(pulled.blobs), seconds=time.perf_counter() - t0)

    def _fetch_lacking(self, step: int, manifest: fmt.StepManifest, requests: list[LoadRequest],
                       backup_name: str | None, fallback: str | None, pulled: Pulled,
                       inv: Inventory, backups: list[str], pull: bool = True) -> RestorePlan | None:
        """Every host pulls the blobs it lacks for its shards of ``requests``; returns the plan.

        A replaced node lacks its own shards; after an elastic resize any host may lack saved
        shards its target shards overlap. Planned per host, and counted per host: a blob two
        hosts need is two transfers. None when the inventories did not see the step. Without ``pull``
        (a reader, which reads each blob where it is), only blobs no host holds are fetched."""
        view = inv.views.get(step) if backup_name is None else None
        if backup_name is None and view is None:
            return None
        holders = view.by_name(manifest.sorted_blob_names()) if view is not None else None
        plan = make_plan(step, manifest, requests, self._dispatch.hosts(), self._dispatch.host_of_device, holders)
        if backup_name is not None:
            pulled.add_backup(self._backup_fetch(step, manifest, backup_name, plan.needs,
                                                 "ram and peer (no host holds this step)"))
            for h, blobs in plan.needs.items():
                pulled.got(h, blobs)
        else:
            held = plan.holders or {}
            if not pull and not self.read_only:
                self._give_manifest(step, manifest, {h for bs in plan.needs.values() for b in bs for h in held.get(b, ())})
            self._pull_lacking(step, manifest, plan if pull else dataclasses.replace(
                plan, needs={h: [b for b in bs if not held.get(b)] for h, bs in plan.needs.items()}),
                fallback, pulled, backups)
            if pull and (pulled.blobs["peer"] or pulled.blobs["backup"]):
                # A host was refilled: the copies it held for its peers are gone too; make them again.
                self._replicate(CommittedStep.of(manifest))
        return plan

    def _give_manifest(self, step: int, manifest: fmt.StepManifest, hosts: set[str]) -> None:
        """A reader reads from any holder, which may hold only a commit record and fetch the manifest
        from keepers that are gone with a stopped job: the head gives it (a refusal: other holders)."""
        todo = {h for h in hosts if (step, manifest.digest, h) not in self._given}
        for h, error in manifest_gift.give(self._dispatch, step, manifest, todo).items():
            if error:
                log.warning("step %d: could not give host %s the manifest: %s", step, h, error)
            else:
                self._given.add((step, manifest.digest, h))
    def _pull_lacking(self, step: int, manifest: fmt.StepManifest, plan: RestorePlan, fallback: str | None,
                      pulled: Pulled, backups: list[str]) -> None:
        """Hosts that lack blobs they need pull them from peers that hold them, verified.

        The load spreads over the holders; a bad or unreachable copy is skipped for the next
        holder. What no peer could give comes from the backup ``fallback`` (a backup of this
        step) when there is one, else from the newest other backups that hold them (blobs are shared
        by content: an unchanged array's blob is in the backup of an earlier step); otherwise
        CorruptBlobError names the array, the shard and the tiers tried. A host that lacked the step altogether (a replaced node) commits it again
        once it holds its blobs.
        """
        if plan.holders is None:
            return  # the inventories did not see this step: the load reads from where it is
        holders = {b: set(h) for b, h in plan.holders.items()}
        lacking = plan.lacking
        if not lacking:
            return
        failed: dict[tuple[str, str], list[str]] = {}
        corrupt: set[str] = set(pulled.bad)  # blobs of which some copy failed its hash
        unreachable: set[tuple[str, str]] = set()  # (host, blob) whose every try failed to connect or answer
        asked: dict[str, list[tuple[str, int, list[str]]]] = {}
        for h, rows in self._strategy.pulls(lacking, holders, manifest.blob_sizes()).items():
            for blob, nbytes, srcs in rows:
                if srcs:
                    asked.setdefault(h, []).append((blob, nbytes, srcs))
                else:
                    failed[(h, blob)] = ["no other host holds it"]
        if asked:
            log.info("restore of step %d: %d hosts pull %d blobs from peers", step, len(asked),
                     sum(len(r) for r in asked.values()))
            for h, res in self._dispatch.peer_pull(step, asked, manifest).items():
                if res.error:
                    for blob, _, _ in asked[h]:
                        failed[(h, blob)] = [f"{h} could not pull: {res.error}"]
                        unreachable.add((h, blob))
                    continue
                corrupt.update(b for b, _, _ in res.bad_copies)
                pulled.add("peer", res.pulled_bytes, res.pulled)
                pulled.skipped.extend(f"{h} <- {src}: blob {blob}: {cause}" for blob, src, cause in res.bad_copies)
                for blob, causes in res.failed:
                    # (with the copies this restore found bad before: their holders removed them since)
                    failed[(h, blob)] = [f"{src}: {cause}" for src, cause in causes] + pulled.bad.get(blob, [])
                    if blob not in corrupt and causes and all(_transport(c) for _, c in causes):
                        unreachable.add((h, blob))
                pulled.got(h, [b for b, _, _ in asked[h] if b not in res.failed_blobs])
        if not failed:
            return
        if fallback is None:
            if set(failed) <= unreachable:  # nobody could be reached: busy or down, not corrupt
                (h, blob), causes = min(failed.items())
                raise HostUnreachableError(
                    f"step {step}: host {h} could not reach any peer that holds blob {blob} ({'; '.join(causes)})"
                    f"{f' and {len(failed) - 1} more' if len(failed) > 1 else ''}: the holders are busy or "
                    "unreachable, the copies are not known to be bad; retry the restore")
            self._fetch_from_other_backups(step, manifest, failed, pulled, backups)
            return
        log.warning("restore of step %d: %d blobs have no good copy on any peer; fetching them from backup %s",
                    step, len(failed), fallback)
        fetch: dict[str, list[str]] = {}
        for h, blob in failed:
            fetch.setdefault(h, []).append(blob)
        pulled.add_backup(self._backup_fetch(step, manifest, fallback, fetch,
                                             "ram (not on the hosts that need it), peer (no good copy)"))
        for h, blobs in fetch.items():
            pulled.got(h, blobs)

    def _backup_fetch(self, step: int, manifest: fmt.StepManifest, name: str, needs: dict[str, list[str]],
                      tried: str) -> dict[str, dict]:
        """Hosts fetch ``needs`` from backup ``name``; a corrupt copy there is the last tier failing, so
        the error names the array and the shard, as when no peer had a good copy."""
        try:
            return self._dispatch.backup_fetch(name, needs)
        except CorruptBlobError as e:
            where = {sh.blob: (rec.key, sh.box) for rec in manifest.arrays for sh in rec.shards}
            bad = [b for b in re.findall(r"[0-9a-f]{32}", str(e)) if b in where]
            if not bad:
                raise
            key, box = where[bad[0]]
            raise CorruptBlobError(
                f"step {step}: array {key!r} shard {fmt.box_str(box)} (blob {bad[0]}) has no good copy; tiers "
                f"tried: {tried}, backup {name} (its copy is corrupt: {e}). Restore an older step (all_steps()) "
                "or pin another backup (`mtc restore-version set NAME`)") from e

    def _fetch_from_other_backups(self, step: int, manifest: fmt.StepManifest,
                                  failed: dict[tuple[str, str], list[str]], pulled: Pulled, backups: list[str]) -> None:
        """No backup of ``step``: fetch each failed blob from the newest backup that lists it."""
        source = {blob: name for name, blobs in self._find_in_backups(step, {b for _, b in failed}, backups).items()
                  for blob in blobs}
        without = {k: v for k, v in failed.items() if k[1] not in source}
        if without:
            raise self._no_good_copy(step, manifest, without)
        fetch: dict[str, dict[str, list[str]]] = {}
        for h, blob in failed:
            fetch.setdefault(source[blob], {}).setdefault(h, []).append(blob)
        log.warning("restore of step %d: %d blobs have no good copy on any peer and there is no backup of this "
                    "step; fetching them from backups %s, which hold the same bytes", step, len(failed), sorted(fetch))
        hosts: set[str] = set()
        for name, needs in fetch.items():
            pulled.add_backup(self._backup_fetch(step, manifest, name, needs,
                                                 "ram (not on the hosts that need it), peer (no good copy)"))
            for h, blobs in needs.items():
                pulled.got(h, blobs)
                hosts.add(h)
        # A replaced host commits the step again once it holds its blobs; its peer pull, which does that,
        # failed, and a backup of another step is not this step's manifest: an empty pull with the
        # manifest commits it, so its load finds the step and it keeps the blobs.
        for h, error in manifest_gift.give(self._dispatch, step, manifest, hosts).items():
            if error:
                raise MTCError(f"restore of step {step}: host {h} holds the blobs it lacked but could not commit "
                               f"the step: {error}; retry the restore")

    def _no_good_copy(self, step: int, manifest: fmt.StepManifest,
                      failed: dict[tuple[str, str], list[str]]) -> CorruptBlobError:
        where = {sh.blob: (rec.key, sh.box) for rec in manifest.arrays for sh in rec.shards}
        (host, blob), causes = min(failed.items(), key=lambda kv: (where[kv[0][1]][0], kv[0]))
        key, box = where[blob]
        backup = ("no backup of this step" if self._config.base_output_directory
                  else "not configured (set base_output_directory)")
        more = f"; {len(failed) - 1} more (host, blob) pairs have no good copy either" if len(failed) > 1 else ""
        return CorruptBlobError(
            f"step {step}: array {key!r} shard {fmt.box_str(box)} (blob {blob}) has no good copy for host {host}; "
            f"tiers tried: ram (not on {host}), peer ({'; '.join(causes)}), backup ({backup}){more}. "
            "Restore an older step (all_steps()) or a backup")


def _hosts_note(inv: Inventory) -> str:
    """``inv.note()`` without the backup root's part (the error about the listing says that)."""
    return dataclasses.replace(inv, backup_unreachable=None).note()


def _names(listing: dict) -> list[str]:
    """Backup names of a listing, newest first."""
    return [b["name"] for b in listing.get("backups", [])]
