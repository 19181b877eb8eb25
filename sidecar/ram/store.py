"""``RamStore``: the facade over one host's blob files, free pool, step catalog and landings.

Its space accounting, retention and garbage collection are in ``mtc.sidecar.ram.space``; the
landings it handed out, in ``mtc.sidecar.ram.landings``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import threading
from collections import Counter
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from mtc.shared import format as fmt
from mtc.shared import ramdisk
from mtc.shared.errors import CorruptBlobError, InsufficientSpaceError, MTCError
from mtc.sidecar.ram.blobs import BlobFiles
from mtc.sidecar.ram.common import TMP_PREFIX, check_name, check_step, no_space, page_rounder
from mtc.sidecar.ram.landing import Landing, LandingBatch, MapCache, MapWarmer
from mtc.sidecar.ram.landings import Arrivals, Landings
from mtc.sidecar.ram.pool import FreePool
from mtc.sidecar.ram.space import StoreSpace
from mtc.sidecar.ram.steps import BlobsOf, StepCatalog, parse_step

log = logging.getLogger(__name__)

_LAYOUT = ("blobs", "pending", "steps")


class RamStore(StoreSpace):
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
        self._pool = FreePool(self.root / "blobs", enabled=free_pool, round=round_, maps=self._maps)
        self._blobs = BlobFiles(self.root / "blobs", pool=self._pool, round=round_, no_space=self._no_space,
                                maps=self._maps)
        self._landings = Landings(self.root, self._blobs, self._maps, self.fits)
        self._arrivals = Arrivals()  # peer copies being received: they yield to local saves (space)
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

    # --- landings (one copy per save: mtc.sidecar.ram.landing, kept by mtc.sidecar.ram.landings) --

    @property
    def warmer(self) -> MapWarmer:
        return self._landings.warmer

    @property
    def landed_bytes(self) -> int:
        """Bytes published from landings, in total (one copy per save: for tests, status)."""
        return self._landings.landed_bytes

    @property
    def filled_bytes(self) -> int:
        """Of ``landed_bytes``, those from cold landings, written with ``Landing.fill``."""
        return self._landings.filled_bytes

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
        return self._landings.land(sizes, cold_ok=cold_ok)

    def landed(self, data) -> Landing | None:
        """The unpublished landing whose buffer ``data`` (an ndarray) is exactly, else None."""
        return self._landings.landed(data)

    def publish_landed(self, landing: Landing, name: str) -> bool:
        """Publish a filled landing as blob ``name``, its hash; False when the blob was there already.

        Like ``write_blob``, a writer that may race a commit pins ``name`` first.
        """
        return self._landings.publish(landing, name)

    def close(self) -> None:
        """Remove every unpublished landing and let go of the kept maps (the service is closing).

        A map still used by an array (a staged save) lives until that array goes."""
        self._landings.drop_all()
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
        file is registered as in use and locked shared for as long as the mapping lives, so no
        process recycles it and the array never changes under its holder (a collection unlinks it instead; its
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
