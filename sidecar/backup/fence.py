"""One finalize at a time per backup root: the next one waits until an older one has stopped.

A finalize makes a backup visible (its manifest, after checking that every blob it names is in the
store) and prunes: it deletes the manifests beyond the newest ``max_to_keep`` and every blob none of
the kept ones names. Two at once are unsafe. When the head gives up on a finalize (its call timed out,
its connection broke) the host may keep running it, and the head's next finalize runs beside it, on
another host or another connection. The first one's retention, working from the backups it listed
before the next backup's blobs were uploaded, deletes those blobs, and the next backup is listed as
complete without them. The head's lease does not stop it: both come from the same head.

So a finalize announces itself with a marker object, ``finalizing/<generation>.<backup name>.<host>.
<process>.<attempt>`` (its order: the head's generation, then the backup's step and time), and keeps it
alive: it rewrites the marker every ``BEAT_S`` while it runs (a beat), and it stops (before its next
bucket operation) once no beat got through for ``LEASE_S``. A marker whose content stays the same for
``DEAD_AFTER_S`` (more than twice the lease) is a finalize that cannot do anything more: it died with its
host or its daemon, or it was never one (a file planted there, a head whose clock ran ahead and died).
Then:

- before it reads or writes anything else, a finalize waits until every older finalize's marker is gone.
  An older finalize that sees the newer marker stops with ``BackupSupersededError`` (nothing more made
  visible, nothing more pruned) and removes its marker once its last operation returned. A marker of this
  host from an earlier process is removed at once (that finalize died with its daemon); a dead one (above)
  is removed once it is known to be dead, and one that stays ``ABANDONED_AFTER_S`` although it beats (a
  finalize stuck in a store operation) is removed too;
- a newer finalize that is alive (its marker changed while this one looked) stops this one before it starts;
  a dead one is removed. So no marker holds up the next backup for longer than ``DEAD_AFTER_S``, and none
  that no finalize keeps alive stops one, whatever generation it names;
- while it runs, it checks again before its bucket operations (at most every ``CHECK_EVERY_S``; safety
  does not rest on how often, since the newer one waits) that its own marker is still there and that no
  newer finalize of its head's generation (the head's next backup) announced itself; a newer finalize of a
  generation beyond its own stops it once that marker is seen to beat (a newer head's, on hosts this one's
  head no longer reaches); one that never beats waits for this one like any newer one, and cannot stop it;
- it removes its marker when it ends, however it ends.

Finalizes of the same backup (same generation and name) are equivalent and run side by side: the
manifest is create-only, and the one that finds it written checks that it holds the same bytes.

Anyone who can write the bucket can write under ``finalizing/`` too, and a marker that someone keeps
rewriting looks alive. So with a job key (``mtc.shared.job_key``) every marker's content carries a tag
over its name and content, and a marker whose tag does not check is no finalize: it is never waited
for, never stops one, and is counted and warned about once (``job_key.rejected``); a finalize never
gives way to anything but a marker this job signed. A finalize that does give way says which marker
made it, and ``superseded`` counts them: a backup that was not made is not harmless.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import re
import threading
import time
import uuid

from mtc.shared import backup_layout as layout
from mtc.shared import job_key
from mtc.shared.errors import BackupSupersededError
from mtc.shared.objstore.store import ObjectNotFoundError, ObjectStore, TransientStoreError, UntrustedObjectError

log = logging.getLogger(__name__)

# A running finalize rewrites its marker this often, and stops once no rewrite got through for LEASE_S.
BEAT_S = 0.5
LEASE_S = 2.5
# A marker whose content did not change for this long is dead (more than twice LEASE_S: by then, its
# finalize, if it still runs, has stopped starting bucket operations).
DEAD_AFTER_S = 6.0
# An older finalize still there after this long, although it beats, is stuck (a store operation that does
# not return): its marker is removed, and it stops at its next check.
ABANDONED_AFTER_S = 120.0
# How often a running finalize looks for a newer one (a listing of finalizing/).
CHECK_EVERY_S = 1.0
POLL_S = 0.2
# A check that cannot list within this (the store unreachable) lets the operation go on: the newer
# finalize waits for this one's marker, so safety does not depend on the check.
CHECK_DEADLINE_S = 5.0
RELEASE_DEADLINE_S = 30.0
RELEASE_TRIES, RELEASE_PAUSE_S = 12, 10.0  # then in the background: about an hour with GCS's deadline
PROCESS = uuid.uuid4().hex[:12]  # this process: a marker of this host from another one is a dead finalize
KIND = "finalize marker"
MAX_MARKER_BYTES = 16 << 10
superseded: collections.Counter[str] = collections.Counter()  # why -> finalizes that gave way (metrics)

_MARKER_RE = re.compile(r"(\d{20})\.(\d{8}T\d{6}Z-step-\d{12})\.([A-Za-z0-9_-]+)\.([0-9a-f]{12})\.([0-9a-f]{12})")


@dataclasses.dataclass(frozen=True)
class Marker:
    obj: str
    generation: int
    backup: str
    host: str
    process: str

    @property
    def key(self) -> tuple[int, int, str]:
        """The finalize order: the head's generation, then the backup's step and time."""
        return (self.generation, *layout.order_key(self.backup))

    def describe(self) -> str:
        return f"the finalize of backup {self.backup} on host {self.host} (head generation {self.generation})"


def host_part(host: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", host) or "_"


def parse_marker(obj: str) -> Marker | None:
    m = _MARKER_RE.fullmatch(obj[len(layout.FINALIZING):]) if obj.startswith(layout.FINALIZING) else None
    if m is None:
        return None
    return Marker(obj, int(m.group(1)), m.group(2), m.group(3), m.group(4))


def list_markers(store: ObjectStore) -> list[Marker]:
    return [m for m in map(parse_marker, store.list(layout.FINALIZING)) if m is not None]


def sweep_dead(store: ObjectStore, host: str) -> None:
    """Remove this host's markers left by an earlier process (its finalize died with that daemon)."""
    for m in list_markers(store):
        if m.host == host_part(host) and m.process != PROCESS:
            log.warning("backup: removing the marker of %s, left by an earlier process of this host", m.describe())
            store.delete(m.obj)


def signed_doc(key: job_key.JobKey, obj: str, doc: dict) -> bytes:
    """A marker's content: ``doc`` with the job key's tag over ``obj`` and ``doc`` (no tag with no key)."""
    body = json.dumps(doc, sort_keys=True).encode()
    tag = key.sign(KIND, obj, body)
    return body if tag is None else json.dumps({"doc": doc, "tag": tag}, sort_keys=True).encode()


def genuine(key: job_key.JobKey, m: "Marker", content: bytes) -> bool:
    """Whether ``content`` of marker ``m`` was written by a finalize of this job (always, with no key)."""
    if not key.enabled:
        return True
    try:
        outer = json.loads(content)
        body = json.dumps(outer["doc"], sort_keys=True).encode()
        tag = outer["tag"]
    except (ValueError, TypeError, KeyError, RecursionError):
        body, tag = content, None
    verdict = key.check(KIND, m.obj, body, tag)
    if verdict != job_key.OK:
        job_key.refuse(KIND, m.obj, verdict, what_happens="no finalize waits for it or gives way to it")
        return False
    return True


class _Watch:
    """What this finalize saw of other finalizes' markers: whether each one is alive (its content changed
    while looked at), dead (unchanged for ``DEAD_AFTER_S``), forged (not signed by this job: never a
    finalize), or not known yet."""

    def __init__(self, store: ObjectStore, key: job_key.JobKey | None = None):
        self._store = store
        self._key = key or job_key.JobKey.none()
        self._seen: dict[str, tuple[bytes, float]] = {}  # marker -> (content, when that content was first read)
        self.alive: set[str] = set()
        self.listed: dict[str, float] = {}  # marker -> when it was first listed

    def look(self, m: Marker) -> str | None:
        """"alive", "dead", "gone" (removed meanwhile), "forged" (not this job's), or None (not known yet, or
        could not be read now)."""
        self.listed.setdefault(m.obj, time.monotonic())
        try:
            content = self._store.get_bytes(m.obj, max_bytes=MAX_MARKER_BYTES)
        except ObjectNotFoundError:
            return "gone"
        except UntrustedObjectError:
            return "forged" if self._key.enabled else None
        except TransientStoreError:
            return None
        if not genuine(self._key, m, content):
            return "forged"
        now = time.monotonic()  # after the read: the content is at least as new as this moment's
        seen = self._seen.get(m.obj)
        if seen is None or seen[0] != content:
            if seen is not None:
                self.alive.add(m.obj)
            self._seen[m.obj] = (content, now)
            return "alive" if m.obj in self.alive else None
        return "dead" if now - seen[1] >= DEAD_AFTER_S else ("alive" if m.obj in self.alive else None)


class FinalizeFence:
    """The marker of one finalize of ``name`` on ``host`` (see the module docstring).

    ``store`` carries the head's lease guard; ``plain`` is the same store without it, for the beats and
    for removing the marker (a finalize fenced off by a newer head keeps its marker alive until it has
    stopped, and still takes it away)."""

    def __init__(self, store: ObjectStore, plain: ObjectStore, name: str, host: str, generation: int | None,
                 *, key: job_key.JobKey | None = None):
        self._store, self._plain = store, plain
        self._key = key or job_key.JobKey.none()
        gen = int(generation or 0)
        obj = f"{layout.FINALIZING}{gen:020d}.{name}.{host_part(host)}.{PROCESS}.{uuid.uuid4().hex[:12]}"
        self.me = Marker(obj, gen, name, host_part(host), PROCESS)
        self._host = host
        self._checked = -float("inf")
        self._lock = threading.Lock()
        self._started = time.time()
        self._beat_ok = time.monotonic()  # when the last beat that got through was sent
        self._lost: str | None = None  # why this finalize may no longer run (its lease ran out)
        self._stop = threading.Event()
        self._beats: threading.Thread | None = None
        self._newer = _Watch(store, self._key)  # newer finalizes of other generations seen by check()

    def _doc(self, beat: int) -> bytes:
        return signed_doc(self._key, self.me.obj, {"backup": self.me.backup, "host": self._host, "pid": os.getpid(),
                                                   "started": self._started, "beat": beat})

    def announce(self) -> None:
        self._store.put_bytes(self.me.obj, self._doc(0), if_absent=True)
        # From its answer, not its start: no finalize read the marker before it was written (a late answer
        # is covered by DEAD_AFTER_S - LEASE_S), and an announce that waited out an outage may still run.
        self._beat_ok = time.monotonic()
        self._beats = threading.Thread(target=self._beat, name="mtc-backup-beat", daemon=True)
        self._beats.start()

    def _beat(self) -> None:
        beat = 0
        while not self._stop.wait(BEAT_S):
            beat += 1
            sent = time.monotonic()
            try:
                self._plain.with_deadline(LEASE_S).put_bytes(self.me.obj, self._doc(beat))
            except Exception as e:  # noqa: BLE001 - the lease decides below
                if self._expired():
                    log.warning("backup %s on host %s: its marker could not be rewritten for %.1f s (%s); the "
                                "finalize stops before its next bucket operation", self.me.backup, self._host,
                                LEASE_S, e)
                    return
                continue
            if self._stop.is_set():  # it landed after the end: the marker goes again
                try:
                    self._plain.with_deadline(RELEASE_DEADLINE_S).delete(self.me.obj)
                except Exception:  # noqa: BLE001 - the next finalize takes it for dead
                    pass
                return
            if self._expired():
                return  # it came back after the lease ran out: it renews nothing
            self._beat_ok = sent

    def _expired(self) -> bool:
        """Whether the lease ran out (for good: another finalize may have taken this one for dead since)."""
        if self._lost is None and time.monotonic() - self._beat_ok > LEASE_S:
            self._lost = (f"the finalize of backup {self.me.backup} on host {self._host} stopped: its marker "
                          f"{self.me.obj} could not be kept alive (no rewrite got through for {LEASE_S:.1f} s), so "
                          "another finalize may take it for dead; it makes nothing visible and prunes nothing more")
        return self._lost is not None

    def wait_turn(self) -> None:
        """Return once no older finalize runs (after announce); BackupSupersededError if a newer one does."""
        watch = _Watch(self._store, self._key)
        logged: set[str] = set()
        while True:
            markers = list_markers(self._store)
            self._judge_own(markers)
            now = time.monotonic()
            pending = []
            for m in markers:
                if m.key == self.me.key:
                    continue  # this one, or a finalize of the same backup (they may run side by side)
                if m.host == self.me.host and m.process != PROCESS:
                    self._remove(m, "left by an earlier process of this host")
                    continue
                state = watch.look(m)
                if state in ("gone", "forged"):
                    continue
                if state == "dead":
                    self._remove(m, f"unchanged for {DEAD_AFTER_S:.0f} s: no finalize keeps it alive (its host "
                                    "or daemon died, or no finalize ever wrote it)" + self._outside(m))
                elif m.key > self.me.key and state == "alive":
                    raise self._superseded(
                        "newer finalize running",
                        f"the finalize of backup {self.me.backup} on host {self._host} did not start: {m.describe()} "
                        f"runs (its marker {m.obj} is kept alive; the head gave up on this one). Backup "
                        f"{self.me.backup} was NOT made; the newer finalize makes its own backup visible, and if none "
                        "appears, that marker is not what it claims to be")
                elif m.key < self.me.key and now - watch.listed[m.obj] >= ABANDONED_AFTER_S:
                    self._remove(m, f"still there after {ABANDONED_AFTER_S:.0f} s: taken for a finalize stuck in a "
                                    "store operation")
                else:
                    pending.append(m)
            if not pending:
                self._checked = time.monotonic()
                return
            for m in pending:
                if m.obj not in logged:
                    logged.add(m.obj)
                    what = "has stopped" if m.key < self.me.key else "is known to run or to be dead"
                    log.warning("backup %s on host %s waits until %s %s", self.me.backup, self._host,
                                m.describe(), what)
            time.sleep(POLL_S)

    def _outside(self, m: Marker) -> str:
        if m.generation > self.me.generation:
            return (f"; its head generation {m.generation} is beyond this head's ({self.me.generation}): a file "
                    "planted there, or a head whose clock ran ahead")
        return ""

    def _remove(self, m: Marker, why: str) -> None:
        log.warning("backup %s on host %s: removing the marker of %s, %s", self.me.backup, self._host,
                    m.describe(), why)
        self._store.delete(m.obj)

    def check(self) -> None:
        """The guard before a bucket operation: BackupSupersededError once a newer finalize announced itself
        (see the module docstring), or once this one's marker is gone or could not be kept alive."""
        with self._lock:
            if self._expired():
                raise BackupSupersededError(self._lost)
            if time.monotonic() - self._checked < CHECK_EVERY_S:
                return
            try:
                markers = list_markers(self._store.with_deadline(CHECK_DEADLINE_S))
            except TransientStoreError:
                return  # cannot tell now; the operation itself meets the same store
            self._judge_own(markers)
            for m in markers:
                if m.key <= self.me.key:
                    continue
                state = self._newer.look(m)
                if state in ("forged", "gone"):
                    continue
                if m.generation <= self.me.generation or state == "alive":
                    raise self._superseded(
                        "newer finalize started",
                        f"the finalize of backup {self.me.backup} on host {self._host} stopped: {m.describe()} "
                        f"started meanwhile (marker {m.obj}; the head gave up on this one). Backup {self.me.backup} "
                        "was NOT made: nothing more is made visible or pruned by this finalize")
            self._checked = time.monotonic()

    def _superseded(self, why: str, message: str) -> BackupSupersededError:
        superseded[why] += 1
        log.warning("mtc: %s", message)
        return BackupSupersededError(message)

    def _judge_own(self, markers: list[Marker]) -> None:
        if self._expired():
            raise BackupSupersededError(self._lost)
        if self.me.obj not in {m.obj for m in markers}:
            raise BackupSupersededError(
                f"the finalize of backup {self.me.backup} on host {self._host} stopped: its marker "
                f"{self.me.obj} was removed by a newer finalize, which took it for dead; it makes nothing "
                "visible and prunes nothing more")

    def release(self) -> None:
        """Stop the beats and remove the marker; when the store does not answer (an outage), keep trying in
        the background (the next finalize takes the marker for dead after ``DEAD_AFTER_S`` meanwhile)."""
        self._stop.set()
        if self._beats is not None:
            self._beats.join(timeout=LEASE_S + 1.0)  # a beat in flight would write the marker again
        try:
            self._plain.with_deadline(RELEASE_DEADLINE_S).delete(self.me.obj)
        except Exception as e:  # noqa: BLE001 - retried below; the finalize's own outcome stands
            log.warning("backup %s on host %s: could not remove its marker %s yet (%s); trying again in the "
                        "background", self.me.backup, self._host, self.me.obj, e)
            threading.Thread(target=self._release_later, name="mtc-backup-fence", daemon=True).start()

    def _release_later(self) -> None:
        error: Exception | None = None
        for _ in range(RELEASE_TRIES):
            try:
                self._plain.delete(self.me.obj)  # the store's own retry deadline each time
                return
            except Exception as e:  # noqa: BLE001 - logged once the tries are spent
                error = e
                time.sleep(RELEASE_PAUSE_S)
        log.warning("backup %s on host %s: could not remove its marker %s (%s); the next finalize takes it "
                    "for dead after %.0f s", self.me.backup, self._host, self.me.obj, error, DEAD_AFTER_S)
