"""The backup scrub on the head: check the newest backups' blobs in the store, repair, mark.

A backup is hashed when it is written and when it is restored; a blob that rots in the bucket in
between would be found only on the day it is needed. ``scrub_backups`` has the hosts re-hash the
blobs of the newest backups (each blob by one host, ``assign_scrub``), at a bandwidth cap per host,
then:

- a bad or missing blob is re-uploaded by a host whose ramdisk holds a good copy (its name is its
  content's hash, so the good bytes overwrite the bad object), and checked again;
- with ``ramdisk``, each host first hashes its ramdisk copies of those blobs and removes a corrupt one
  (a good copy comes back by replication or a restore), so that no repair reads it;
- a backup with a blob no host could repair is marked damaged (``damaged/<backup>.json``): the
  backup listing leaves it out, so restore never chooses it, and ``mtc status`` says why;
- a mark is a claim found in the store, which anyone who can write there can make: the marked
  backups among the newest are checked again with the others (``targets``), and the mark of one
  found whole is removed, so that no planted or stale mark hides a good backup from restore;
- each host is given each blob's size (from the manifests): an object of another size is bad
  without being downloaded, so that no object stored under a blob's name can fill a ramdisk.

What the store says (a mark's why) is printed without its control characters (``printable``).

``ScrubLoop`` runs it every ``backup_scrub_interval_s`` in the background; ``mtc verify --backup``
runs it on demand. Both run on the sidecars (``backup_scrub``): the head only coordinates.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable, Sequence

from mtc.head.backup.plan import assign_parts, assign_scrub
from mtc.head.dispatch.interface import Dispatcher
from mtc.shared import backup_layout as layout
from mtc.shared import format as fmt
from mtc.shared.config import MTCConfig
from mtc.shared.errors import ConfigError, MTCError

log = logging.getLogger(__name__)


def printable(text: object, limit: int = 400) -> str:
    """``text`` with its control and other non-printable characters escaped, at most ``limit``
    characters: what the store says, safe to print."""
    out = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"
                  for c in str(text)[: limit + 1])
    return out if len(out) <= limit else out[:limit] + "..."


@dataclasses.dataclass(frozen=True)
class BackupScrub:
    """What the scrub found in one backup."""

    name: str
    step: int
    checked: int  # blobs of the backup hashed in the store
    bad: tuple[str, ...] = ()  # corrupt or missing in the store
    repaired: tuple[str, ...] = ()  # of ``bad``, re-uploaded from a host's good copy
    damaged: str = ""  # why it was marked damaged (a bad blob no host could repair)
    marked_before: str = ""  # why an earlier mark (or a planted one) said it was damaged: checked again
    cleared: bool = False  # that mark was removed: every blob is whole now

    @property
    def ok(self) -> bool:
        return not self.damaged


@dataclasses.dataclass(frozen=True)
class ScrubReport:
    backups: tuple[BackupScrub, ...] = ()
    already_damaged: tuple[dict, ...] = ()  # marked backups older than those checked: {"name", "step", "why"}
    bytes: int = 0  # read from the store by the check
    seconds: float = 0.0
    error: str | None = None  # why the scrub stopped (the next one tries again)
    ramdisk_checked: int = 0  # ramdisk copies hashed (with ``ramdisk``)
    ramdisk_removed: dict = dataclasses.field(default_factory=dict)  # host -> its corrupt copies, removed

    @property
    def bad_blobs(self) -> int:
        return sum(len(b.bad) for b in self.backups)

    @property
    def repaired_blobs(self) -> int:
        return sum(len(b.repaired) for b in self.backups)


def scrub_backups(dispatch: Dispatcher, *, backups: int, bytes_per_s: float | None = None,
                  names: Sequence[str] | None = None, ramdisk: bool = False) -> ScrubReport:
    """Scrub the newest ``backups`` backups (or those ``names``); see the module docstring."""
    t0 = time.monotonic()
    listing = dispatch.backup_listing()
    listed = {b["name"]: b for b in listing["backups"]}
    damaged_before = {d["name"]: {**d, "why": printable(d.get("why", ""))} for d in listing.get("damaged", [])}
    if names:
        unknown = [n for n in names if n not in listed and n not in damaged_before]
        if unknown:
            raise ConfigError(f"backup {unknown[0]} is not in the backup root (backups: {list(listed)[:5]}); "
                              "name one that `mtc status` or `mtc restore-version show` lists")
        targets = [listed.get(n) or damaged_before[n] for n in dict.fromkeys(names)]
    else:
        targets = _targets(listing["backups"], list(damaged_before.values()), backups)
    # A backup with a part index is scrubbed by parts: the head reads its header (O(arrays + hosts)), and
    # each host reads its own part (a writer gone from a resized job: another host reads its part) and
    # hashes the blobs that fall to it, as the uploads shared the unique boxes out. An older one: its
    # whole manifest, its blobs assigned one by one.
    headers: dict[str, fmt.StepHeader] = {}
    manifests: dict[str, fmt.StepManifest] = {}
    hosts = dispatch.hosts()
    plans: dict[str, dict] = {}
    for b in targets:
        name = b["name"]
        try:
            header = dispatch.backup_header(name)
            if header is None or header.devices is None:
                manifests[name] = dispatch.backup_manifest(name)
            else:
                headers[name], plans[name] = header, assign_parts([h for h, _ in header.parts], hosts)
        except MTCError as e:
            if name not in damaged_before:
                raise
            log.warning("backup scrub: backup %s is marked damaged and its manifest cannot be read (%s); "
                        "its mark stays", name, e)
    targets = [b for b in targets if b["name"] in manifests or b["name"] in headers]
    work: dict[str, dict] = {}
    for name, plan in plans.items():
        for h, ws in plan.items():
            work.setdefault(h, {}).setdefault("parts", []).append((name, ws))
    sizes: dict[str, int] = {}
    for m in manifests.values():  # (from each manifest's columns: no shard record is made)
        sizes.update(m.blob_sizes())
    for h, bl in assign_scrub(sizes, hosts).items():
        if bl:
            work.setdefault(h, {}).update(blobs=bl, sizes={b: sizes[b] for b in bl})
    if ramdisk:
        if sizes:
            for h in hosts:
                work.setdefault(h, {})["ramdisk"] = sorted(sizes)
        for w in work.values():
            if "parts" in w:
                w["ramdisk_parts"] = True
    found = dispatch.backup_scrub(work, bytes_per_s) if work else {}
    bad = {b for r in found.values() for b in [*r.get("bad", []), *r.get("missing", [])]}
    # Per backup: what was hashed, what was bad (a blob of several backups counts in each).
    in_backup: dict[str, set[str]] = {name: set() for name in headers}
    counted: dict[str, int] = {name: 0 for name in headers}
    for r in found.values():
        for name, got in r.get("backups", {}).items():
            if name in in_backup:
                in_backup[name].update(got.get("bad", ()))
                counted[name] += int(got.get("checked", 0))
    for name, m in manifests.items():
        in_backup[name] = m.blob_names() & bad
        counted[name] = len(m.blob_names())
    reporters = sorted(h for h, r in found.items() if r.get("bad") or r.get("missing"))
    repaired = _repair(dispatch, reporters + [h for h in hosts if h not in reporters], bad,
                       bytes_per_s) if bad else set()
    marks: dict[str, str] = {}
    if bad - repaired:
        after = dispatch.backup_listing()  # a backup pruned meanwhile lost its blobs
        still = {b["name"] for b in [*after["backups"], *after.get("damaged", [])]}
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        for name, its_bad in in_backup.items():
            lost = sorted(its_bad - repaired)
            if lost and name in still:
                marks[name] = (f"{len(lost)} blob(s) corrupt or missing in the store ({lost[0]}"
                               f"{', ...' if len(lost) > 1 else ''}), found by the backup scrub at {when}; "
                               "no host holds a good copy to repair it")
        if marks:
            dispatch.backup_scrub({hosts[0]: {"damaged": marks}}, bytes_per_s)
    clear = [n for n, its_bad in in_backup.items() if n in damaged_before and not its_bad - repaired]
    cleared = set(dispatch.backup_scrub({hosts[0]: {"clear": clear}}, bytes_per_s)[hosts[0]].get("cleared", [])
                  ) if clear else set()
    out = []
    for b in targets:
        its_bad = in_backup[b["name"]]
        before = damaged_before[b["name"]]["why"] if b["name"] in damaged_before else ""
        out.append(BackupScrub(b["name"], b["step"], counted[b["name"]], tuple(sorted(its_bad)),
                               tuple(sorted(its_bad & repaired)), marks.get(b["name"], ""),
                               before, b["name"] in cleared))
    checked = {b["name"] for b in targets}
    report = ScrubReport(tuple(out), tuple(d for n, d in damaged_before.items() if n not in checked),
                         sum(r.get("bytes", 0) for r in found.values()),
                         time.monotonic() - t0,
                         ramdisk_checked=sum(r.get("ramdisk_checked", 0) for r in found.values()),
                         ramdisk_removed={h: r["ramdisk_removed"] for h, r in found.items()
                                          if r.get("ramdisk_removed")})
    log.info("- backup scrub; %d backups, %d blobs, %d bytes in %.3fs; %d bad, %d repaired, %d marked damaged, "
             "%d marks cleared", len(out), sum(b.checked for b in out), report.bytes, report.seconds,
             report.bad_blobs, report.repaired_blobs, len(marks), len(cleared))
    return report


def _targets(good: Sequence[dict], marked: Sequence[dict], backups: int) -> list[dict]:
    """The newest backups, until ``backups`` unmarked ones: the marked ones among them are checked
    again (with fewer unmarked backups than that, every marked one)."""
    unmarked = {b["name"] for b in good}
    out: list[dict] = []
    for b in sorted([*good, *marked], key=lambda b: layout.order_key(b["name"]), reverse=True):
        if sum(x["name"] in unmarked for x in out) >= backups:
            break
        out.append(b)
    return out


def _repair(dispatch: Dispatcher, hosts: Sequence[str], bad: set[str], bytes_per_s: float | None) -> set[str]:
    """Ask the hosts in turn to re-upload the bad blobs they hold good copies of; the blobs repaired."""
    repaired: set[str] = set()
    for h in hosts:
        left = sorted(bad - repaired)
        if not left:
            break
        try:
            repaired |= set(dispatch.backup_scrub({h: {"repair": left}}, bytes_per_s)[h].get("repaired", []))
        except MTCError as e:  # another host may hold them
            log.warning("backup scrub: host %s could not repair blobs (%s)", h, e)
    return repaired


class ScrubLoop:
    """Scrubs the backups every ``backup_scrub_interval_s`` on a thread of its own (``start``/``close``)."""

    def __init__(self, dispatch: Dispatcher, config: MTCConfig):
        self._dispatch, self._config = dispatch, config
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_report: ScrubReport | None = None
        self.listeners: list[Callable[[ScrubReport], None]] = []  # each scrub's report (metrics)

    def start(self) -> None:
        """Start the loop when backups are on and the interval is not 0; safe to call twice."""
        if self._thread is None and self._config.backup_enabled and self._config.backup_scrub_interval_s > 0:
            self._thread = threading.Thread(target=self._loop, name="mtc-backup-scrub", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._config.backup_scrub_interval_s):
            self.run_once()

    def run_once(self) -> ScrubReport:
        try:
            report = scrub_backups(self._dispatch, backups=self._config.backup_scrub_backups,
                                   bytes_per_s=self._config.backup_scrub_bytes_per_s,
                                   ramdisk=self._config.backup_scrub_ramdisk)
        except Exception as e:  # noqa: BLE001 - a scrub that fails never stops training; the next one retries
            if self._stop.is_set():
                return ScrubReport(error="closed")
            report = ScrubReport(error=f"{type(e).__name__}: {e}")
            log.warning("backup scrub failed (the next one, in %.0f s, tries again): %s",
                        self._config.backup_scrub_interval_s, e)
        self.last_report = report
        for listener in self.listeners:
            listener(report)
        return report

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)  # a scrub in flight ends with the dispatcher's connections
