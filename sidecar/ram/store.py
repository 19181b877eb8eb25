"""``RamStore``: the facade over one host's blob files, free pool and step catalog."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from mtc.shared import format as fmt
from mtc.shared import ramdisk
from mtc.shared.errors import CorruptBlobError, InsufficientSpaceError, ManifestError, MTCError
from mtc.sidecar.ram.blobs import BlobFiles
from mtc.sidecar.ram.common import (TMP_PREFIX, check_name, check_step, format_bytes, free_bytes, no_space,
                                    page_rounder)
from mtc.sidecar.ram.landing import LANDING_MIN, Landing, LandingBatch, MapCache, MapWarmer, discard, is_no_space
from mtc.sidecar.ram.pool import POOL_MIN, FreePool
from mtc.sidecar.ram.steps import BlobsOf, StepCatalog, parse_step

log = logging.getLogger(__name__)

_LAYOUT = ("blobs", "pending", "steps")


class RamStore:
    """One host's blob store and committed steps under ``root`` (see ``mtc.sidecar.ram``).

    ``max_to_keep`` is the number of committed steps kept (``local_max_to_keep``).
    ``blobs_of`` extracts the blob names from a step manifest or a host manifest.
    ``free_pool`` keeps collected blob files for reuse (``mtc.sidecar.ram.pool``).
    """

    def __init__(self, root: str | os.PathLike, *, max_to_keep: int = 2,
                 blobs_of: BlobsOf = fmt.collect_blob_names, free_pool: bool = True):
        if isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1:
            raise ValueError(f"max_to_keep (local_max_to_keep) must be an integer >= 1, got {max_to_keep!r}")
        self.root = Path(root)
        self._root_s = str(self.root)
        self.max_to_keep = max_to_keep
        self._lock = threading.RLock()  # serialises metadata: commit, prune, gc, check_space, ...
        self._pins: Counter[str] = Counter()
        self._make_dirs()
        round_ = page_rounder(self.root)
        self._round = round_
        self._maps = MapCache()
        self._landing_since = self._landing_done = 0.0  # monotonic: last landing handed out, last published
        self.warmer = MapWarmer(self._maps, self._landing_now)
        self._pool = FreePool(self.root / "blobs", enabled=free_pool, round=round_, maps=self._maps)
        self._blobs = BlobFiles(self.root / "blobs", pool=self._pool, round=round_, no_space=self._no_space,
                                maps=self._maps)
        self._landings: dict[int, Landing] = {}  # by buffer address: the landings not yet published
        self._landing_lock = threading.Lock()
        self.landed_bytes = 0  # bytes published from landings, in total (one copy per save: for tests, status)
        self.filled_bytes = 0  # of which from cold landings, written with Landing.fill
        self._catalog = StepCatalog(self.root, blobs_of=blobs_of, no_space=self._no_space)
        self._remove_leftovers()
        self.mount = ramdisk.describe(self.root)  # None where unknown (no /proc)
        # On a tmpfs with 2 MiB pages, mapping a file costs a fault per 2 MiB: receivers write
        # straight into the map (mtc.sidecar.peer). With 4 KiB pages a map is far slower than write().
        self.huge_pages = self.mount is not None and self.mount.huge in ("always", "within_size")

    @property
    def free_pool(self) -> bool:
        return self._pool.enabled

    def _no_space(self, what: str, step: int | None, needed: int | None, err: OSError) -> InsufficientSpaceError:
        return no_space(self.root, what, step, needed, err)

    # --- layout ------------------------------------------------------------------------

    def _make_dirs(self) -> None:
        # Least privilege: only this process's user may read the weights (0700 folders, 0600 files).
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.root.chmod(0o700)
        for d in _LAYOUT:
            (self.root / d).mkdir(mode=0o700, exist_ok=True)
            (self.root / d).chmod(0o700)

    def _missing_dirs(self) -> list[str]:
        out = []
        for d in _LAYOUT:
            try:
                if stat.S_ISDIR(os.stat(os.path.join(self._root_s, d)).st_mode):
                    continue
            except OSError:
                pass
            out.append(d)
        return out

    def check_layout(self) -> bool:
        """Re-create the layout if the ramdisk was emptied under this process; True when it was.

        An operator's ``rm -rf``, a remounted tmpfs or a node agent can empty the ramdisk while
        the sidecar runs. Its steps and blobs are gone then (the head restores them from peers
        or the backup); what must not happen is that every later save fails on the missing
        folders until the daemon restarts. So: notice, say so, start again empty, carry on.
        """
        missing = self._missing_dirs()
        if not missing:
            return False
        with self._lock:
            missing = self._missing_dirs()
            if not missing:
                return False
            self._pool.forget()
            self._maps.clear()  # their files are gone: a kept map would hold the pages
            self._make_dirs()
        log.warning("ramdisk %s was emptied under this sidecar (%s gone): re-created it empty; the steps and "
                    "blobs it held are lost here and come back from peers or the backup", self.root,
                    ", ".join(f"{d}/" for d in missing))
        return True

    def _remove_leftovers(self) -> None:
        # A writer killed mid-way leaves temp files; they were never visible, so they go.
        pending = self._catalog.pending_root
        dirs = [self._blobs.directory, self._catalog.steps_root] + [p for p in pending.iterdir() if p.is_dir()]
        removed = 0
        for d in dirs:
            for p in d.iterdir():
                if p.name.startswith(TMP_PREFIX):
                    with contextlib.suppress(FileNotFoundError):
                        p.unlink()
                    removed += 1
        if removed:
            log.info("ramdisk %s: removed %d leftover temp files from an interrupted writer", self.root, removed)

    # --- blobs -------------------------------------------------------------------------

    def blob_path(self, name: str) -> Path:
        """The file of blob ``name``; the name is validated first (ValueError if malformed)."""
        return self._blobs.path(name)

    def has_blob(self, name: str) -> bool:
        """True when blob ``name`` is committed in this store (ValueError for a malformed name)."""
        return self._blobs.has(name)

    def blob_size(self, name: str) -> int:
        """Size in bytes of blob ``name``; FileNotFoundError when absent."""
        return self._blobs.size(name)

    def list_blobs(self) -> set[str]:
        """Names of all committed blobs (temp files excluded)."""
        return self._blobs.names()

    def missing_bytes(self, blobs: dict[str, int]) -> int:
        """Bytes of ``blobs`` ({name: nbytes}) not already present: what a step would add.

        Each size is rounded up to the filesystem block (a tmpfs page), as it is allocated.
        """
        return self._blobs.missing_bytes(blobs)

    @contextlib.contextmanager
    def pin(self, names: Iterable[str]) -> Iterator[None]:
        """Keep ``names`` out of garbage collection while the context is open.

        For blobs written before anything references them (between ``write_blob`` and
        ``write_pending``, or received from a peer): pin first, then write.
        """
        names = [check_name(n) for n in names]
        with self._lock:
            self._pins.update(names)
        try:
            yield
        finally:
            with self._lock:
                pins = self._pins
                for n in names:  # no zero counts kept
                    c = pins.get(n, 0)
                    if c > 1:
                        pins[n] = c - 1
                    else:
                        pins.pop(n, None)

    def write_blob(self, data, *, name: str | None = None) -> tuple[str, bool]:
        """Store ``data`` (bytes-like or C-contiguous ndarray: its raw bytes) as a blob.

        ``name`` is trusted as the precomputed hash when given. Returns (name, written);
        written is False when the blob was already present (nothing is written then).
        A free-pool file of the same size is overwritten when there is one; it is published
        only once completely written, like a new file. Raises InsufficientSpaceError (temp
        file removed) when the ramdisk fills up.
        """
        return self._blobs.write(data, name=name)

    # --- landings (one copy per save: mtc.sidecar.ram.landing) ----------------------------

    def land(self, sizes: Iterable[int], *, cold_ok: bool = False) -> LandingBatch:
        """Mapped temp blob files to fill in place, one per size (None: not landed, see below).

        With ``cold_ok`` the writer can fill a landing with ``Landing.fill`` (``pwrite``): a
        landing whose map is not warm is then handed out cold (``Landing.cold``) and must be
        filled that way; without it, every landing is allocated and mapped now, to be written
        through its buffer (a socket's ``recv_into``).

        Sizes under ``LANDING_MIN`` are not landed. When the others do not all fit as new blobs
        now (free space plus pool files of their sizes), none is: the caller then stages in its
        own memory and ``write_shards`` hashes first, so that blobs already present need no
        space (the space check before any byte is written). Fill each buffer, then publish it
        with :meth:`publish_landed`; close the batch to remove what was not published.
        """
        sizes = [int(n) for n in sizes]
        big = [n for n in sizes if n >= LANDING_MIN]
        if not big or not self.fits(big):
            return LandingBatch([None] * len(sizes))
        out: list[Landing | None] = []
        try:
            for n in sizes:
                out.append(self._blobs.land(n, cold_ok=cold_ok) if n >= LANDING_MIN else None)
        except BaseException as e:
            for x in out:
                if x is not None:
                    self._maps.forget(x.st)
            discard([x for x in out if x is not None])
            if not isinstance(e, OSError):
                raise
            # No room after all (another writer took it), or no map (vm.max_map_count): the
            # shards are staged in memory and written instead; the save goes on.
            (log.info if is_no_space(e) else log.warning)(
                "ramdisk %s: cannot land %d shards (%s); staging them in memory", self.root, len(big), e)
            return LandingBatch([None] * len(sizes))
        with self._landing_lock:
            for x in out:
                if x is not None:
                    self._landings[x.address] = x
            self._landing_since = time.monotonic()
        return LandingBatch(out, self._drop_landings)

    def _landing_now(self) -> bool:
        """Whether a save is landing: landings were handed out after the last one was published
        (for at most a minute: a save of nothing but duplicates publishes none)."""
        since = self._landing_since
        return since > self._landing_done and time.monotonic() - since < 60.0

    def landed(self, data) -> Landing | None:
        """The unpublished landing whose buffer ``data`` (an ndarray) is exactly, else None."""
        if not isinstance(data, np.ndarray) or not data.flags.c_contiguous:
            return None
        with self._landing_lock:
            x = self._landings.get(data.ctypes.data) if data.size else None
        return x if x is not None and x.size == data.nbytes and not x.done else None

    def publish_landed(self, landing: Landing, name: str) -> bool:
        """Publish a filled landing as blob ``name``, its hash; False when the blob was there already.

        Like ``write_blob``, a writer that may race a commit pins ``name`` first.
        """
        with self._landing_lock:
            if landing.done or self._landings.pop(landing.address, None) is not landing:
                raise ValueError(f"landing {landing.tmp} was already published or discarded")
            self._landing_done = time.monotonic()
        added = self._blobs.publish_landed(landing, name)
        if added:
            with self._landing_lock:
                self.landed_bytes += landing.size
                self.filled_bytes += landing.size if landing.filled else 0
            if landing.cold:  # its map comes back from the pool warm, later (mtc.sidecar.ram.landing)
                self.warmer.submit(landing.st)
        return added

    def _drop_landings(self, landings: list[Landing]) -> None:
        with self._landing_lock:
            self._landing_done = time.monotonic()
            for x in landings:
                if self._landings.get(x.address) is x:
                    del self._landings[x.address]
        for x in landings:
            self._maps.forget(x.st)
        discard(landings)

    def close(self) -> None:
        """Remove every unpublished landing and let go of the kept maps (the service is closing).

        A map still used by an array (a staged save) lives until that array goes."""
        with self._landing_lock:
            landings = list(self._landings.values())
        self._drop_landings(landings)
        self._maps.clear()

    def read_blob_into(self, name: str, out) -> None:
        """Read blob ``name`` into ``out`` (writable buffer or ndarray of exactly its size).

        Raises CorruptBlobError when the blob is missing, has another size, or its bytes do
        not hash to its name; ``out`` holds garbage then.
        """
        self._blobs.read_into(name, out)

    def read_blob(self, name: str) -> bytes:
        """The verified bytes of blob ``name`` (CorruptBlobError if missing or corrupt)."""
        try:
            size = self.blob_size(name)
        except FileNotFoundError:
            raise CorruptBlobError(f"blob {name} is missing from the ramdisk ({self.blob_path(name)})") from None
        buf = bytearray(size)
        self.read_blob_into(name, buf)
        return bytes(buf)

    def verify_blob(self, name: str) -> bool:
        """True when blob ``name`` is present and its bytes hash to its name."""
        return self._blobs.verify(name)

    def scrub_blob(self, name: str) -> str:
        """Check blob ``name`` and remove it when its bytes no longer hash to its name.

        Returns ``"ok"``, ``"removed"`` (it was corrupt: the file is unlinked, so this host
        stops counting as a holder and replication makes a good copy again) or ``"missing"``.
        A file mapped or open elsewhere keeps its pages until they are released.
        """
        check_name(name)
        with self._lock:
            if self.verify_blob(name):
                return "ok"
            try:
                self.blob_path(name).unlink()
            except FileNotFoundError:
                return "missing"
        log.warning("blob %s in %s was corrupt; removed it (a good copy comes back from a peer or the backup)",
                    name, self.root)
        return "removed"

    def map_blob(self, name: str, nbytes: int | None = None) -> np.ndarray:
        """Blob ``name`` as a verified uint8 array that maps the file (no copy).

        The mapping is private (copy-on-write): writes to the array never reach the file. The
        file is registered as in use for as long as the mapping lives, so it is never recycled
        and the array never changes under its holder (a collection unlinks it instead; its
        pages are freed when the last array using them goes). Raises CorruptBlobError when
        the blob is missing, is not ``nbytes`` long, or does not hash to its name; OSError
        when it cannot be mapped (the caller reads it instead).
        """
        return self._blobs.map(name, nbytes)

    def open_temp_blob(self, size: int | None = None) -> tuple[int, Path]:
        """A new temp file in ``blobs/`` for receiving a blob: (fd open for writing, path).

        The fd is open for reading too, so that the caller may map it (``huge_pages``).
        Write the bytes, close the fd, then call :meth:`finalize_temp_blob` (or
        :meth:`discard_temp_blob` on failure). With ``size`` (the exact number of bytes that
        will be written), a free-pool file of that size is reused when there is one: its
        pages are overwritten in place, which is much cheaper than allocating new ones.
        """
        return self._blobs.open_temp(size)

    def discard_temp_blob(self, temp_path) -> None:
        """Remove a temp file from :meth:`open_temp_blob` (a failed transfer)."""
        self._blobs.discard_temp(temp_path)

    def finalize_temp_blob(self, temp_path, name: str, verify: bool = True) -> bool:
        """Commit a received temp file as blob ``name``; returns whether it was added.

        With ``verify`` (the default) the bytes are hashed first; a mismatch removes the
        temp file and raises CorruptBlobError. False when the blob was already present.
        """
        return self._blobs.finalize_temp(temp_path, name, verify)

    def put_blob_file(self, name: str, src_path: str | os.PathLike) -> bool:
        """Copy the file ``src_path`` in as blob ``name``, verified; returns whether it was added."""
        return self._blobs.put_file(name, src_path)

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
            steps = self.committed_steps()
            keep = max(1, self.max_to_keep - 1)
            drop = steps[:-keep] if len(steps) > keep else []
            kept = steps[len(drop):]
            live_pending = self._catalog.live_pending(kept)
            try:
                live = self._catalog.live_blobs(kept, live_pending, self._pins)
            except ManifestError as e:
                log.error("ramdisk %s: cannot free space safely: %s", self.root, e)
                live = None
            reclaim = self._pool.stats()[1]
            if live is not None:
                reclaim += self._blobs.allocated(self.list_blobs() - live)
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
            self._gc_locked(frozenset(), want=want)
            free = free_bytes(self.root)
            if needed - self._pool.reuse(sizes) > free:
                raise self._space_error(step, needed, free, 0)

    def _space_error(self, step: int, needed: int, free: int, reclaim: int) -> InsufficientSpaceError:
        return InsufficientSpaceError(
            f"step {step} does not fit in the ramdisk {self.root}: it needs {format_bytes(needed)} "
            f"({needed} bytes), {format_bytes(free)} ({free} bytes) are free, and removing the old steps "
            f"that local_max_to_keep={self.max_to_keep} allows would free only {format_bytes(reclaim)} more. "
            f"Nothing of step {step} was written. Make the ramdisk larger: see "
            f"`mtc size --params ... --hosts ...`, or lower local_max_to_keep")

    # --- steps -------------------------------------------------------------------------

    def write_pending(self, step: int, host_manifest: bytes) -> None:
        """Write (atomically, replacing) the phase-1 host manifest of ``step``."""
        step = check_step(step)
        with self._lock:
            self._catalog.write_pending(step, host_manifest)

    def read_pending(self, step: int) -> bytes | None:
        """The phase-1 host manifest of ``step``, or None if there is none."""
        return self._catalog.read_pending(step)

    def pending_steps(self) -> list[int]:
        """Steps with a phase-1 host manifest, ascending."""
        return self._catalog.pending_steps()

    def commit(self, step: int, step_manifest: bytes) -> list[int]:
        """Make ``step`` visible: write steps/<step>.json atomically, last; then prune.

        The manifest must be JSON whose "step" equals ``step`` (ManifestError otherwise).
        Returns the committed steps after the prune.
        """
        step = check_step(step)
        data = bytes(step_manifest)
        parse_step(data, step, f"commit of step {step}")
        with self._lock:
            self._catalog.write_commit(step, data)
            # Pool files this step's writes did not take do not fit what is saved now: free
            # them, so that the pool holds what the next save can reuse (usually nothing here).
            self._pool.drain()
            kept, dropped, collected = self._prune_locked()
        # One line per commit: what became visible, what retention and collection removed.
        log.info("ramdisk %s: committed step %d%s%s", self.root, step,
                 f"; removed step{'s' if len(dropped) > 1 else ''} {', '.join(map(str, dropped))} "
                 f"(local_max_to_keep={self.max_to_keep})" if dropped else "", collected)
        return kept

    def repair_step(self, step: int, step_manifest: bytes) -> bool:
        """Rewrite steps/<step>.json from a good copy when the file is there but unreadable; True if so.

        A damaged step file (bit rot, a stray write) hides the step on this host: its blobs stop
        counting as copies and the next garbage collection frees them, though the step is whole.
        A step that was pruned (no file) is never brought back.
        """
        step = check_step(step)
        data = bytes(step_manifest)
        parse_step(data, step, f"repair of step {step}")
        with self._lock:
            if not self._catalog.path(step).exists() or step in self._catalog.committed():
                return False
            self._catalog.write_commit(step, data)
        log.warning("ramdisk %s: the file of committed step %d was damaged; rewrote it from the manifest this "
                    "sidecar committed", self.root, step)
        return True

    def rewrite_step(self, step: int, data: bytes) -> bool:
        """Rewrite the file of committed ``step`` with ``data`` (what this sidecar committed for it);
        False when the step is no longer there (pruned or aborted meanwhile)."""
        step = check_step(step)
        data = bytes(data)
        parse_step(data, step, f"rewrite of step {step}")
        with self._lock:
            if not self._catalog.path(step).exists():
                return False
            self._catalog.write_commit(step, data)
        return True

    def upgrade_step(self, step: int, step_manifest: bytes, digest: str) -> bool:
        """Replace the commit record of ``step`` (``fmt.CommitRecord``) by the whole step manifest
        whose digest the record names; True if replaced. Only a record is ever replaced."""
        step = check_step(step)
        data = bytes(step_manifest)
        parse_step(data, step, f"upgrade of step {step}")
        with self._lock:
            try:
                current = self._catalog.read(step)
            except (MTCError, OSError):
                return False
            rec = fmt.CommitRecord.parse(current)
            if rec is None or rec.digest != digest:
                return False
            self._catalog.write_commit(step, data)
        return True

    def committed_steps(self) -> list[int]:
        """Committed steps, ascending. Malformed files in steps/ are ignored (with a warning).

        Each step file is parsed once per version (inode, mtime, size): step files are only
        ever replaced atomically, so an unchanged key means unchanged bytes.
        """
        return self._catalog.committed()

    def unreadable_steps(self, *, listed: bool = False) -> list[int]:
        """Steps whose file is in steps/ but unreadable (see ``StepCatalog.unreadable``); with
        ``listed``, as of the caller's last ``committed_steps`` (no new listing)."""
        with self._lock:
            if not listed:
                self._catalog.committed()
            return self._catalog.unreadable()

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.committed_steps()
        return steps[-1] if steps else None

    def read_step(self, step: int) -> bytes:
        """The step manifest of committed ``step`` (StepNotFoundError if not committed)."""
        return self._catalog.read(step)

    def delete_step(self, step: int) -> bool:
        """Remove committed ``step`` and its pending manifest, then collect garbage.

        Returns True when there was something to remove.
        """
        step = check_step(step)
        with self._lock:
            existed = self._catalog.exists(step)
            self._catalog.remove(step)
            self._gc_locked(frozenset())
            return existed

    def prune(self) -> None:
        """Keep the newest ``max_to_keep`` steps, drop stale pending manifests, then gc()."""
        with self._lock:
            _, dropped, collected = self._prune_locked()
        for s in dropped:
            log.info("ramdisk %s: removed step %d (local_max_to_keep=%d)", self.root, s, self.max_to_keep)
        if collected:
            log.info("ramdisk %s: %s", self.root, collected.lstrip("; "))

    def _prune_locked(self) -> tuple[list[int], list[int], str]:
        """``prune`` under the lock, from one listing of steps/ and pending/: (steps kept, steps
        removed, what garbage collection removed, as words for a log line: "" for nothing)."""
        steps = self.committed_steps()
        drop = steps[:-self.max_to_keep] if len(steps) > self.max_to_keep else []
        dirs = self._catalog.pending_dirs()
        for s in drop:
            self._catalog.remove(s, pending=dirs.pop(s, None) is not None)
        kept = steps[len(drop):]
        self._catalog.remove_stale_pending(self._catalog.live_pending(kept, dirs), dirs)
        collected = []
        self._gc_locked(frozenset(), recycle=True, steps=kept, pending=dirs, report=collected)
        return kept, drop, collected[0] if collected else ""

    # --- garbage -----------------------------------------------------------------------

    def gc(self, extra_live: Iterable[str] = frozenset()) -> int:
        """Delete blobs that no committed step, pending manifest, pin or ``extra_live`` uses.

        Returns the number of bytes freed. If a manifest cannot be parsed, nothing is deleted
        (an error is logged): deleting blindly could destroy a good step.
        """
        with self._lock:
            return self._gc_locked(frozenset(extra_live))

    def _gc_locked(self, extra_live: frozenset, *, recycle: bool = False, want: Counter | None = None,
                   steps: list[int] | None = None, pending: dict | None = None, report: list | None = None) -> int:
        """Collect unused blobs; returns their bytes.

        With ``recycle``, collected files go to the free pool up to the bytes of the newest
        step; with ``want`` ({size: count}, decremented), up to that many files of each size.
        The rest are unlinked. ``steps`` and ``pending`` are the committed steps and the
        ``pending_dirs`` as the caller listed them under this lock (else they are listed here).
        With ``report``, what was removed is appended to it as words instead of logged.
        """
        steps = self.committed_steps() if steps is None else steps
        dirs = self._catalog.pending_dirs() if pending is None else pending
        try:
            live = self._catalog.live_blobs(steps, sorted(dirs), self._pins, dirs)
        except ManifestError as e:
            log.error("ramdisk %s: garbage collection skipped, a manifest is unreadable: %s", self.root, e)
            return 0
        live |= extra_live
        garbage = self.list_blobs() - live
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
                elif recycle and self.free_pool and st.st_size >= POOL_MIN:
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
        if count:
            words = (f"garbage collection removed {count} blob{'s' if count != 1 else ''}, {format_bytes(freed)} "
                     f"({pooled} kept in the free pool)")
            if report is not None:
                report.append("; " + words)
            else:
                log.info("ramdisk %s: %s", self.root, words)
        return freed

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

    def wipe(self) -> None:
        """Remove everything under root (a replaced node), leaving an empty store."""
        with self._lock:
            self._pool.drain()
            self._maps.clear()
            for p in self.root.iterdir():
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()
            self._make_dirs()

    def usage(self) -> dict:
        """Bytes and counts: blob_bytes, blob_count, free_bytes, total_bytes, committed/pending steps.

        ``free_pool_bytes``/``free_pool_count``: collected files kept for reuse, which
        ``check_space`` frees when a step needs their space; ``reclaimable_bytes`` is
        ``free_bytes`` plus the pool.
        """
        blob_bytes = count = 0
        for name in self.list_blobs():
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
            "committed_steps": self.committed_steps(),
            "pending_steps": self.pending_steps(),
        }
