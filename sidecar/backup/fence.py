"""One finalize at a time per backup root: the next one waits until an older one has stopped.

A finalize makes a backup visible (its manifest, after checking that every blob it names is in the
store) and prunes: it deletes the manifests beyond the newest ``max_to_keep`` and every blob none of
the kept ones names. Two at once are unsafe. When the head gives up on a finalize (its call timed out,
its connection broke) the host may keep running it, and the head's next finalize runs beside it, on
another host or another connection. The first one's retention, working from the backups it listed
before the next backup's blobs were uploaded, deletes those blobs, and the next backup is listed as
complete without them. The head's lease does not stop it: both come from the same head.

So a finalize announces itself with a marker object, ``finalizing/<generation>.<backup name>.<host>.
<process>.<attempt>`` (its order: the head's generation, then the backup's step and time), and then:

- before it reads or writes anything else it waits until every older finalize's marker is gone. An
  older finalize sees the newer marker before its next bucket operation, stops with
  ``BackupSupersededError`` (nothing more made visible, nothing more pruned) and removes its marker once
  its last operation returned. A marker of this host from an earlier process is removed at once (that
  finalize died with its daemon); one that stays ``ABANDONED_AFTER_S`` is taken for a finalize that died
  with its host, and removed;
- it checks again before its bucket operations (at most every ``CHECK_EVERY_S``; safety does not rest on
  how often, since the newer one waits) that no newer finalize announced itself and that its own marker
  is still there;
- it removes its marker when it ends, however it ends.

Finalizes of the same backup (same generation and name) are equivalent and run side by side: the
manifest is create-only, and the one that finds it written checks that it holds the same bytes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import threading
import time
import uuid

from mtc.shared import backup_layout as layout
from mtc.shared.errors import BackupSupersededError
from mtc.shared.objstore.store import ObjectStore, TransientStoreError

log = logging.getLogger(__name__)

# A marker older than this finalize that stays this long is a finalize that died with its host.
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


class FinalizeFence:
    """The marker of one finalize of ``name`` on ``host`` (see the module docstring).

    ``store`` carries the head's lease guard; ``plain`` is the same store without it, for removing
    the marker (a finalize fenced off by a newer head still takes its marker away)."""

    def __init__(self, store: ObjectStore, plain: ObjectStore, name: str, host: str, generation: int | None):
        self._store, self._plain = store, plain
        gen = int(generation or 0)
        obj = f"{layout.FINALIZING}{gen:020d}.{name}.{host_part(host)}.{PROCESS}.{uuid.uuid4().hex[:12]}"
        self.me = Marker(obj, gen, name, host_part(host), PROCESS)
        self._host = host
        self._checked = -float("inf")
        self._lock = threading.Lock()

    def announce(self) -> None:
        doc = {"backup": self.me.backup, "host": self._host, "pid": os.getpid(), "started": time.time()}
        self._store.put_bytes(self.me.obj, json.dumps(doc).encode(), if_absent=True)

    def wait_turn(self) -> None:
        """Return once no older finalize runs (after announce); BackupSupersededError if a newer one does."""
        first_seen: dict[str, float] = {}
        logged: set[str] = set()
        while True:
            markers = list_markers(self._store)
            self._judge(markers)
            now = time.monotonic()
            older = []
            for m in markers:
                if m.key == self.me.key:
                    continue  # this one, or a finalize of the same backup (they may run side by side)
                if m.host == self.me.host and m.process != PROCESS:
                    why = "left by an earlier process of this host"
                elif now - first_seen.setdefault(m.obj, now) >= ABANDONED_AFTER_S:
                    why = f"still there after {ABANDONED_AFTER_S:.0f} s: taken for a finalize that died with its host"
                else:
                    older.append(m)
                    continue
                log.warning("backup %s on host %s: removing the marker of %s, %s", self.me.backup, self._host,
                            m.describe(), why)
                self._store.delete(m.obj)
            if not older:
                self._checked = time.monotonic()
                return
            for m in older:
                if m.obj not in logged:
                    logged.add(m.obj)
                    log.warning("backup %s on host %s waits until %s has stopped", self.me.backup, self._host,
                                m.describe())
            time.sleep(POLL_S)

    def check(self) -> None:
        """The guard before a bucket operation: BackupSupersededError once a newer finalize announced itself."""
        with self._lock:
            if time.monotonic() - self._checked < CHECK_EVERY_S:
                return
            try:
                markers = list_markers(self._store.with_deadline(CHECK_DEADLINE_S))
            except TransientStoreError:
                return  # cannot tell now; the operation itself meets the same store
            self._judge(markers)
            self._checked = time.monotonic()

    def _judge(self, markers: list[Marker]) -> None:
        newer = [m for m in markers if m.key > self.me.key]
        if newer:
            raise BackupSupersededError(
                f"the finalize of backup {self.me.backup} on host {self._host} stopped: {newer[0].describe()} "
                "started meanwhile (the head gave up on this one); it makes nothing visible and prunes nothing "
                "more, the newer one does")
        if self.me.obj not in {m.obj for m in markers}:
            raise BackupSupersededError(
                f"the finalize of backup {self.me.backup} on host {self._host} stopped: its marker "
                f"{self.me.obj} was removed by a newer finalize, which took it for dead; it makes nothing "
                "visible and prunes nothing more")

    def release(self) -> None:
        """Remove the marker; when the store does not answer (an outage), keep trying in the background,
        so that the next finalize waits for the bucket, not ``ABANDONED_AFTER_S``."""
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
                    "for dead after %.0f s", self.me.backup, self._host, self.me.obj, error, ABANDONED_AFTER_S)
