"""``StoreSpace``: the room in a ``RamStore``: what fits, making room, retention, garbage collection.

The one part of the store that decides what goes. It owns the retention (``max_to_keep``) and
works over the parts ``RamStore`` (``mtc.sidecar.ram.store``) gives it: the step catalog, the blob
files, the free pool, the kept maps, the peer copies arriving and the pins (``Pins``: names kept
out of garbage collection), under the store's one metadata lock.

Local saves come before incoming peer copies. A copy being received takes room only as its
bytes arrive (``mtc.sidecar.peer.wire``), and when a save is short of room even after what
retention allows, every copy being received is dropped (``Arrivals``): the save goes on, and
the senders retry later, as replication does anyway.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable, Iterator

from mtc.shared.errors import InsufficientSpaceError, ManifestError
from mtc.sidecar.ram.blobs import BlobFiles
from mtc.sidecar.ram.common import check_name, check_step, format_binary_bytes, free_bytes
from mtc.sidecar.ram.mapped import MapCache
from mtc.sidecar.ram.ledger import Arrivals
from mtc.sidecar.ram.pool import POOL_MIN, FreePool
from mtc.sidecar.ram.steps import StepCatalog

log = logging.getLogger(__name__)

# How long a save that takes back the room of incoming peer copies waits for their temp files to go.
_YIELD_WAIT_S = 5.0


class Pins:
    """Blob names kept out of garbage collection while a writer or reader holds them (counted).

    Changed under the store's lock, which every collection holds from its listing of what is live
    to its last unlink: a name pinned before its blob is written is never collected.
    """

    def __init__(self, lock: threading.RLock):
        self._lock = lock
        self._counts: Counter[str] = Counter()

    @contextlib.contextmanager
    def hold(self, names: Iterable[str]) -> Iterator[None]:
        """Keep ``names`` out of garbage collection while the context is open.

        For blobs written before anything references them (between ``BlobFiles.write`` and
        ``RamStore.write_pending``, or received from a peer): pin first, then write.
        """
        names = [check_name(n) for n in names]
        with self._lock:
            self._counts.update(names)
        try:
            yield
        finally:
            with self._lock:
                counts = self._counts
                for n in names:  # no zero counts kept
                    c = counts.get(n, 0)
                    if c > 1:
                        counts[n] = c - 1
                    else:
                        counts.pop(n, None)

    def names(self) -> set[str]:
        """The pinned names now (call it holding the store's lock, as a collection does)."""
        return set(self._counts)


@dataclasses.dataclass(frozen=True)
class Collected:
    """What one garbage collection did: ``count`` blobs removed, ``freed`` bytes, ``pooled`` of
    them kept in the free pool; or nothing, ``skipped`` saying why (a manifest it could not read:
    deleting blindly could destroy a good step)."""

    freed: int = 0
    count: int = 0
    pooled: int = 0
    skipped: str | None = None

    def words(self) -> str:
        """What was removed, as words for a log line; "" when nothing was."""
        if not self.count:
            return ""
        return (f"garbage collection removed {self.count} blob{'s' if self.count != 1 else ''}, "
                f"{format_binary_bytes(self.freed)} ({self.pooled} kept in the free pool)")


class StoreSpace:
    """Space accounting, retention and garbage collection of one ``RamStore``.

    Attributes:
        max_to_keep: the number of committed steps kept (the head's ``local_max_to_keep``).
    """

    def __init__(self, root: Path, *, max_to_keep: int, lock: threading.RLock, catalog: StepCatalog,
                 blobs: BlobFiles, pool: FreePool, maps: MapCache, arrivals: Arrivals, pins: Pins,
                 round: Callable[[int], int]):
        """``lock``: the store's metadata lock; ``round``: a size rounded up to what the
        filesystem allocates for it (a tmpfs page)."""
        self.root = root
        self.max_to_keep = max_to_keep
        self._lock = lock
        self._catalog = catalog
        self._blobs = blobs
        self._pool = pool
        self._maps = maps
        self._arrivals = arrivals
        self._pins = pins
        self._round = round

    # --- space -------------------------------------------------------------------------

    def fits(self, sizes: Iterable[int]) -> bool:
        """Whether new blobs of ``sizes`` bytes fit now, all of them, without freeing anything.

        Free-pool files of those sizes count: they are overwritten in place.
        """
        sizes = [int(n) for n in sizes]
        return sum(self._round(n) for n in sizes) - self._pool.reuse(sizes) <= free_bytes(self.root)

    def check_space(self, needed_bytes: int, *, step: int, sizes: Iterable[int] | None = None) -> None:
        """Make sure ``needed_bytes`` fit before any byte of ``step`` is written.

        If they do not fit, frees what policy allows (the free pool, the oldest committed
        steps beyond ``max_to_keep - 1``, which the commit would remove anyway, then their
        blobs), but only when that is enough; otherwise nothing is deleted and
        InsufficientSpaceError says what is needed, what is free and how to fix it. The newest
        step is never removed. ``sizes`` (the byte sizes of the blobs to be written) lets
        collected files of those sizes stay in the free pool, to be overwritten in place,
        instead of being freed and allocated again.
        """
        needed = int(needed_bytes)
        if needed < 0:
            raise ValueError(f"needed_bytes must be >= 0, got {needed_bytes!r}")
        step = check_step(step)
        sizes = [int(n) for n in sizes] if sizes is not None else []
        with self._lock:
            free = free_bytes(self.root)
            if needed - self._pool.reuse(sizes) <= free:
                return
            steps = self._catalog.committed()
            keep = max(1, self.max_to_keep - 1)
            drop = steps[:-keep] if len(steps) > keep else []
            kept = steps[len(drop):]
            live_pending = self._catalog.live_pending(kept)
            try:
                live = self._catalog.live_blobs(kept, live_pending, self._pins.names())
            except ManifestError as e:
                log.error("ramdisk %s: cannot free space safely: %s", self.root, e)
                live = None
            with self._arrivals.settled():  # a copy's room counts once: in the pool, or held by the copy
                reclaim = self._pool.stats()[1]
                held = self._arrivals.held()
            if live is not None:
                reclaim += self._blobs.allocated(self._blobs.names() - live)
            if free + reclaim < needed <= free + reclaim + held:
                names = self._arrivals.yield_all(_YIELD_WAIT_S)
                free = free_bytes(self.root)
                log.warning("ramdisk %s: dropped %d incoming peer cop%s (%s) to make room for step %d: local "
                            "saves come first; the senders retry later", self.root, len(names),
                            "y" if len(names) == 1 else "ies", ", ".join(n[:12] for n in names), step)
            if free + reclaim < needed:
                raise self._space_error(step, needed, free, reclaim)
            for s in drop:
                log.info("ramdisk %s: removing step %d early to make room for step %d "
                         "(local_max_to_keep=%d)", self.root, s, step, self.max_to_keep)
                self._catalog.remove(s)
            self._catalog.remove_stale_pending(live_pending)
            # Pool files (old and newly collected) that blobs of this step will overwrite stay;
            # the others are freed. Either way the space counts: reused or free.
            want = Counter(n for n in sizes if n >= POOL_MIN)
            self._pool.drain(want)
            self._log(self._collect(frozenset(), want=want))
            free = free_bytes(self.root)
            if needed - self._pool.reuse(sizes) > free:
                raise self._space_error(step, needed, free, 0)

    def _space_error(self, step: int, needed: int, free: int, reclaim: int) -> InsufficientSpaceError:
        return InsufficientSpaceError(
            f"step {step} does not fit in the ramdisk {self.root}: it needs {format_binary_bytes(needed)} "
            f"({needed} bytes), {format_binary_bytes(free)} ({free} bytes) are free, and removing the old steps "
            f"that local_max_to_keep={self.max_to_keep} allows would free only {format_binary_bytes(reclaim)} more. "
            f"Nothing of step {step} was written. Make the ramdisk larger: see "
            f"`mtc size --params ... --hosts ...`, or lower local_max_to_keep")

    # --- retention -----------------------------------------------------------------------

    def prune(self) -> None:
        """Keep the newest ``max_to_keep`` steps, drop stale pending manifests, then gc()."""
        _, dropped, collected = self.retain()
        for s in dropped:
            log.info("ramdisk %s: removed step %d (local_max_to_keep=%d)", self.root, s, self.max_to_keep)
        self._log(collected)

    def retain(self) -> tuple[list[int], list[int], Collected]:
        """``prune`` without its log lines (the caller says it: a commit, in one line), from one
        listing of steps/ and pending/ under the lock: (steps kept, steps removed, what garbage
        collection did)."""
        with self._lock:
            steps = self._catalog.committed()
            drop = steps[:-self.max_to_keep] if len(steps) > self.max_to_keep else []
            dirs = self._catalog.pending_dirs()
            for s in drop:
                self._catalog.remove(s, pending=dirs.pop(s, None) is not None)
            kept = steps[len(drop):]
            self._catalog.remove_stale_pending(self._catalog.live_pending(kept, dirs), dirs)
            return kept, drop, self._collect(frozenset(), recycle=True, steps=kept, pending=dirs)

    # --- garbage -----------------------------------------------------------------------

    def gc(self, extra_live: Iterable[str] = frozenset()) -> Collected:
        """Delete blobs that no committed step, pending manifest, pin or ``extra_live`` uses.

        If a manifest cannot be parsed, nothing is deleted (``Collected.skipped`` says why, and an
        error is logged): deleting blindly could destroy a good step.
        """
        with self._lock:
            collected = self._collect(frozenset(extra_live))
        self._log(collected)
        return collected

    def _log(self, collected: Collected) -> None:
        if collected.count:
            log.info("ramdisk %s: %s", self.root, collected.words())

    def _collect(self, extra_live: frozenset, *, recycle: bool = False, want: Counter | None = None,
                 steps: list[int] | None = None, pending: dict | None = None) -> Collected:
        """Collect unused blobs; says what it removed (the caller logs it), or why it removed nothing.

        With ``recycle``, collected files go to the free pool up to the bytes of the newest
        step; with ``want`` ({size: count}, decremented), up to that many files of each size.
        The rest are unlinked. ``steps`` and ``pending`` are the committed steps and the
        ``pending_dirs`` as the caller listed them under this lock (else they are listed here).
        An unreadable manifest is logged here, as an error, whoever collects.
        """
        steps = self._catalog.committed() if steps is None else steps
        dirs = self._catalog.pending_dirs() if pending is None else pending
        try:
            live = self._catalog.live_blobs(steps, sorted(dirs), self._pins.names(), dirs)
        except ManifestError as e:
            log.error("ramdisk %s: garbage collection skipped, a manifest is unreadable: %s", self.root, e)
            return Collected(skipped=f"a manifest is unreadable: {e}")
        live |= extra_live
        garbage = self._blobs.names() - live
        cap = None  # the pool's bound: worked out for the first file big enough to be pooled
        freed = count = pooled = 0
        directory = str(self._blobs.directory)
        for name in garbage:
            path = f"{directory}/{name}"
            try:
                st = os.stat(path)
                if want is not None and want[st.st_size] > 0 and self._pool.recycle(path, st, None):
                    want[st.st_size] -= 1
                    pooled += 1
                elif recycle and self._pool.enabled and st.st_size >= POOL_MIN:
                    if cap is None:
                        cap = self._pool_cap(steps)
                    if self._pool.recycle(path, st, cap):
                        pooled += 1
                    else:
                        os.unlink(path)
                else:
                    os.unlink(path)
            except FileNotFoundError:
                continue
            freed += st.st_size
            count += 1
        self._maps.sweep()  # maps of files unlinked here (or by anyone) would hold their pages
        return Collected(freed=freed, count=count, pooled=pooled)

    def _pool_cap(self, steps: list[int]) -> int:
        """The free pool's bound: the most bytes of blobs any kept step holds here.

        Not only the newest step's: when a step commits, the copies this host keeps for its
        peers (replication) have not arrived yet, while an older kept step holds them; the next
        step's copies are received into those pool files (overwriting pages, not allocating).
        """
        best = 0
        for step in steps:
            try:
                names = self._catalog.blobs_in(self._catalog.path(step))
            except (OSError, ManifestError):
                continue
            total = 0
            for name in names:
                with contextlib.suppress(FileNotFoundError):
                    total += self._round((self._blobs.directory / name).stat().st_size)
            best = max(best, total)
        return best

    # --- usage ---------------------------------------------------------------------------

    def usage(self) -> dict:
        """Bytes and counts: blob_bytes, blob_count, free_bytes, total_bytes, committed/pending steps.

        ``free_pool_bytes``/``free_pool_count``: collected files kept for reuse, which
        ``check_space`` frees when a step needs their space; ``reclaimable_bytes`` is
        ``free_bytes`` plus the pool.
        """
        blob_bytes = count = 0
        for name in self._blobs.names():
            with contextlib.suppress(FileNotFoundError):
                blob_bytes += (self._blobs.directory / name).stat().st_size
                count += 1
        st = os.statvfs(self.root)
        pool_count, pool_bytes = self._pool.stats()
        return {
            "blob_bytes": blob_bytes,
            "blob_count": count,
            "free_bytes": st.f_bavail * st.f_frsize,
            "free_pool_bytes": pool_bytes,
            "free_pool_count": pool_count,
            "reclaimable_bytes": st.f_bavail * st.f_frsize + pool_bytes,
            "total_bytes": st.f_blocks * st.f_frsize,
            "committed_steps": self._catalog.committed(),
            "pending_steps": self._catalog.pending_steps(),
        }
