"""``RamStore``: one host's RAM tier, made of its parts: blob files, step catalog, landings, space.

The store makes the parts and hands each its collaborators; callers use the parts directly for what
is one part's work (``store.blobs``: ``mtc.sidecar.ram.blobs``; ``store.catalog``: the step files,
``mtc.sidecar.ram.steps``; ``store.landings`` and ``store.arrivals``: ``mtc.sidecar.ram.ledger``;
``store.space`` and ``store.pins``: what fits, retention, garbage collection,
``mtc.sidecar.ram.space``). The store itself keeps what spans parts under its one metadata lock:
the layout, commits (a step file, then retention), repairs, deletes, a wipe.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import stat
import threading
from pathlib import Path

from mtc.shared import format as fmt
from mtc.shared import ramdisk
from mtc.shared.errors import CorruptBlobError, MTCError, StepNotFoundError
from mtc.sidecar.ram.blobs import BlobFiles
from mtc.sidecar.ram.common import TMP_PREFIX, check_name, check_step, no_space, page_rounder
from mtc.sidecar.ram.mapped import MapCache
from mtc.sidecar.ram.ledger import Arrivals, Landings
from mtc.sidecar.ram.pool import FreePool
from mtc.sidecar.ram.space import Pins, StoreSpace
from mtc.sidecar.ram.steps import BlobsOf, StepCatalog, parse_step

log = logging.getLogger(__name__)

_LAYOUT = ("blobs", "pending", "steps")


class RamStore:
    """One host's blob store and committed steps under ``root`` (see ``mtc.sidecar.ram``).

    ``max_to_keep`` is the number of committed steps kept (``local_max_to_keep``; later
    ``space.max_to_keep``). ``blobs_of`` extracts the blob names from a step manifest or a host
    manifest. ``free_pool`` keeps collected blob files for reuse (``mtc.sidecar.ram.pool``).

    Attributes:
        root: the store's folder on the ramdisk.
        blobs: the blob files (``BlobFiles``): write, publish, read verified, map, temp files.
        catalog: the step files (``StepCatalog``): pending host manifests and commits. Read it
            directly; what changes it goes through the store (``write_pending``, ``commit``, ...).
        landings: the mapped temp blob files handed out to saves (``Landings``).
        arrivals: the peer copies being received now (``Arrivals``), which a save short of room drops.
        pins: the names kept out of garbage collection (``Pins``).
        space: what fits, retention and garbage collection (``StoreSpace``).
        mount: the ramdisk's mount (``ramdisk.describe``), None where unknown.
        huge_pages: whether the ramdisk maps files in 2 MiB pages.
    """

    def __init__(self, root: str | os.PathLike, *, max_to_keep: int = 2,
                 blobs_of: BlobsOf = fmt.collect_blob_names, free_pool: bool = True):
        if isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1:
            raise ValueError(f"max_to_keep (local_max_to_keep) must be an integer >= 1, got {max_to_keep!r}")
        self.root = Path(root)
        self._root_s = str(self.root)
        self._lock = threading.RLock()  # serialises metadata: commit, prune, gc, check_space, ...
        self._make_dirs()
        round_ = page_rounder(self.root)
        no_room = functools.partial(no_space, self.root)
        self._maps = MapCache()
        self._pool = FreePool(self.root / "blobs", enabled=free_pool, round=round_, maps=self._maps)
        self.blobs = BlobFiles(self.root / "blobs", pool=self._pool, round=round_, no_space=no_room, maps=self._maps)
        self.catalog = StepCatalog(self.root, blobs_of=blobs_of, no_space=no_room)
        self.arrivals = Arrivals()  # peer copies being received: they yield to local saves (space)
        self.pins = Pins(self._lock)
        self.space = StoreSpace(self.root, max_to_keep=max_to_keep, lock=self._lock, catalog=self.catalog,
                                blobs=self.blobs, pool=self._pool, maps=self._maps, arrivals=self.arrivals,
                                pins=self.pins, round=round_)
        self.landings = Landings(self.root, self.blobs, self._maps, self.space.fits)
        self._remove_leftovers()
        self.mount = ramdisk.describe(self.root)  # None where unknown (no /proc)
        # On a tmpfs with 2 MiB pages, mapping a file costs a fault per 2 MiB: receivers write
        # straight into the map (mtc.sidecar.peer). With 4 KiB pages a map is far slower than write().
        self.huge_pages = self.mount is not None and self.mount.huge in ("always", "within_size")

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
        pending = self.catalog.pending_root
        dirs = [self.blobs.directory, self.catalog.steps_root] + [p for p in pending.iterdir() if p.is_dir()]
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

    def read_blob(self, name: str) -> bytes:
        """The verified bytes of blob ``name`` (CorruptBlobError if missing or corrupt)."""
        try:
            size = self.blobs.size(name)
        except FileNotFoundError:
            raise CorruptBlobError(f"blob {name} is missing from the ramdisk ({self.blobs.path(name)})") from None
        buf = bytearray(size)
        self.blobs.read_into(name, buf)
        return bytes(buf)

    def scrub_blob(self, name: str) -> str:
        """Check blob ``name`` and remove it when its bytes no longer hash to its name.

        Returns ``"ok"``, ``"removed"`` (it was corrupt: the file is unlinked, so this host
        stops counting as a holder and replication makes a good copy again) or ``"missing"``.
        A file mapped or open elsewhere keeps its pages until they are released.
        """
        check_name(name)
        with self._lock:
            if self.blobs.verify(name):
                return "ok"
            try:
                self.blobs.path(name).unlink()
            except FileNotFoundError:
                return "missing"
        log.warning("blob %s in %s was corrupt; removed it (a good copy comes back from a peer or the backup)",
                    name, self.root)
        return "removed"

    def close(self) -> None:
        """Remove every unpublished landing and let go of the kept maps (the service is closing).

        A map still used by an array (a staged save) lives until that array goes."""
        self.landings.drop_all()
        self._maps.clear()

    # --- steps -------------------------------------------------------------------------

    def write_pending(self, step: int, host_manifest: bytes) -> None:
        """Write (atomically, replacing) the phase-1 host manifest of ``step``."""
        step = check_step(step)
        with self._lock:
            self.catalog.write_pending(step, host_manifest)

    def commit(self, step: int, step_manifest: bytes) -> list[int]:
        """Make ``step`` visible: write steps/<step>.json atomically, last; then prune.

        The manifest must be JSON whose "step" equals ``step`` (ManifestError otherwise).
        Returns the committed steps after the prune.
        """
        step = check_step(step)
        data = bytes(step_manifest)
        parse_step(data, step, f"commit of step {step}")
        with self._lock:
            self.catalog.write_commit(step, data)
            # Pool files this step's writes did not take do not fit what is saved now: free
            # them, so that the pool holds what the next save can reuse (usually nothing here).
            self._pool.drain()
            kept, dropped, collected = self.space.retain()
        # One line per commit: what became visible, what retention and collection removed.
        log.info("ramdisk %s: committed step %d%s%s", self.root, step,
                 f"; removed step{'s' if len(dropped) > 1 else ''} {', '.join(map(str, dropped))} "
                 f"(local_max_to_keep={self.space.max_to_keep})" if dropped else "",
                 f"; {collected.words()}" if collected.count else "")
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
            if not self.catalog.path(step).exists() or step in self.catalog.committed():
                return False
            self.catalog.write_commit(step, data)
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
            if not self.catalog.path(step).exists():
                return False
            self.catalog.write_commit(step, data)
        return True

    def upgrade_step(self, step: int, step_manifest: bytes, digest: str) -> None:
        """Replace the commit record of ``step`` (``fmt.CommitRecord``) by the whole step manifest
        whose digest the record names. Only that record is ever replaced: a file that holds
        anything else now (a manifest already, another record) stays as it is.

        StepNotFoundError when the step's file is gone or cannot be read (pruned or aborted
        meanwhile); what writing the manifest raises (``InsufficientSpaceError``, OSError) passes."""
        step = check_step(step)
        data = bytes(step_manifest)
        parse_step(data, step, f"upgrade of step {step}")
        with self._lock:
            try:
                current = self.catalog.read(step)
            except StepNotFoundError:
                raise
            except (MTCError, OSError) as e:
                raise StepNotFoundError(f"step {step} in the ramdisk {self.root} cannot be read: {e}") from e
            rec = fmt.CommitRecord.parse(current)
            if rec is not None and rec.digest == digest:
                self.catalog.write_commit(step, data)

    def unreadable_steps(self, *, listed: bool = False) -> list[int]:
        """Steps whose file is in steps/ but unreadable (see ``StepCatalog.unreadable``); with
        ``listed``, as of the caller's last ``catalog.committed()`` (no new listing)."""
        with self._lock:
            if not listed:
                self.catalog.committed()
            return self.catalog.unreadable()

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.catalog.committed()
        return steps[-1] if steps else None

    def delete_step(self, step: int) -> bool:
        """Remove committed ``step`` and its pending manifest, then collect garbage.

        Returns True when there was something to remove.
        """
        step = check_step(step)
        with self._lock:
            existed = self.catalog.exists(step)
            self.catalog.remove(step)
            self.space.gc()
            return existed

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
