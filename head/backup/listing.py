"""The backup listing a restore's choice reads (``Restorer``): which backups exist, and ``restore.version``.

A listing that fails never reads as "there are no backups". A restart during a bucket outage still
comes back from its ramdisks: a failed listing is a listing marked ``"unreachable"`` (why), and a
step the hosts hold can be chosen without it, with a warning. But where the answer depends on the
backups (the hosts hold no step, or not the one asked for: an elastic restore onto new hosts, every
ramdisk lost), the listing is asked again until a deadline, and if it still fails, the error says
that the backup root could not be listed and why, not that nothing is there (``BackupListingError``).
"""

from __future__ import annotations

import logging
import threading
import time

from mtc.head.dispatch.interface import Dispatcher
from mtc.shared.config import MTCConfig
from mtc.shared.errors import BackupListingError, HostUnreachableError
from mtc.shared.objstore.retry import Backoff, retry_call, retry_if
from mtc.shared.objstore.store import TransientStoreError

log = logging.getLogger("mtc.head.restore.restorer")

# What a listing that could not reach the store (or no host could be asked) raises on the way here.
_UNREACHABLE = (TransientStoreError, HostUnreachableError)
_RETRY_PAUSE_S = (0.5, 4.0)  # first and longest pause between the tries of a listing that is needed


class BackupLister:
    """Lists the backup root through any host, one listing at a time; remembers that the store was down."""

    def __init__(self, dispatch: Dispatcher, config: MTCConfig):
        self._dispatch = dispatch
        self._config = config
        self._store_down = False  # the last listing could not reach the store
        # One listing at a time: the start-up pull and the first latest_step() list at once; in cluster
        # mode the second waits for the first on the host's connection anyway, and must then see that
        # the first found the store down rather than wait out the whole deadline again.
        self._lock = threading.Lock()

    def listing(self, deadline_s: float, retry_deadline_s: float) -> dict:
        """The backups and ``restore.version``; while the store is unreachable, none, marked
        ``"unreachable"`` (why), with a warning: the caller decides whether it may go on without them.

        Asked with ``deadline_s`` to retry an unreachable store (``retry_deadline_s`` once a listing
        failed, until one gets through): a job that restarts during a bucket outage must come back
        from its ramdisks and peers, not wait out (or die of) the store's upload deadline. A bucket
        that answers with a refusal (missing, no permission) is an error at once.
        """
        if not self._config.base_output_directory:
            return {"backups": [], "restore_version": None}
        with self._lock:
            deadline = retry_deadline_s if self._store_down else deadline_s
            try:
                listing = self._dispatch.backup_listing(deadline_s=deadline)
            except _UNREACHABLE as e:
                self._store_down = True
                log.warning("backup root %s could not be listed within %.0f s (%s); going on with the steps on "
                            "the hosts where they suffice (restore.version, if any, is not read)",
                            self._config.backup_root, deadline, e)
                return {"backups": [], "restore_version": None, "unreachable": f"{type(e).__name__}: {e}"}
            self._store_down = False
            return listing

    def required(self, listing: dict, deadline_s: float, what: str, note: str = "") -> None:
        """Make ``listing`` a real one where the answer depends on the backups: a failed listing is
        asked again, with pauses, until ``deadline_s`` have passed (a store under load answers late or
        fails for a while); ``listing`` is updated in place, so the rest of the restore uses it.
        Still failing: BackupListingError naming the backup root, the cause and ``what`` was sought."""
        if "unreachable" not in listing:
            return
        cause, tries = listing["unreachable"], [1]
        t0 = time.monotonic()

        def one_try() -> dict:
            tries[0] += 1
            try:
                return self._dispatch.backup_listing(deadline_s=max(0.0, t0 + deadline_s - time.monotonic()))
            except _UNREACHABLE as e:
                log.info("backup root %s: listing try %d failed (%s: %s)", self._config.backup_root, tries[0],
                         type(e).__name__, e)
                raise

        with self._lock:
            try:
                fresh = retry_call(one_try, policy=retry_if(lambda e: isinstance(e, _UNREACHABLE)),
                                   deadline=deadline_s, backoff=Backoff(*_RETRY_PAUSE_S), what="backup listing")
            except _UNREACHABLE as e:
                cause = f"{type(e).__name__}: {e}"
            else:
                self._store_down = False
                listing.clear()
                listing.update(fresh)
                return
        tries = tries[0]
        raise BackupListingError(
            f"the backup root {self._config.backup_root} could not be listed ({cause}; {tries} tries, the last ones "
            f"over {deadline_s:.0f} s), so whether a backup holds {what} is not known (the hosts alone do not). "
            "Retry when the store answers (`mtc status --base-output-directory ... --run-name ...` lists it)"
            + note, root=self._config.backup_root, cause=cause)


def damaged_note(listing: dict) -> str:
    """What a restore's error adds about the damaged backups (a scrub marked them, or their manifest
    failed its checks): never chosen, or ""."""
    damaged = listing.get("damaged") or []
    if not damaged:
        return ""
    return ("; backups marked damaged by the backup scrub, or whose manifest fails its checks, never restored: "
            + "; ".join(f"{d['name']} ({d['why']})" for d in damaged[:3]) + (" ..." if len(damaged) > 3 else ""))


def without_backup(listing: dict, name: str, why: str) -> dict:
    """``listing`` with backup ``name`` moved to its ``damaged`` entries (a restore found it unusable)."""
    gone = [b for b in listing["backups"] if b["name"] == name]
    return {**listing, "backups": [b for b in listing["backups"] if b["name"] != name],
            "damaged": [*(listing.get("damaged") or []), *({**b, "why": why} for b in gone)]}
