"""The RAM tier: one host's content-addressed blob store and committed steps on its ramdisk.

Layout under ``root`` (= ``<local_checkpoint_directory>/mtc``)::

    blobs/<32-hex>                committed blobs: raw bytes, named by their xxh3-128
    blobs/.tmp-<random>           blob writes in progress (never look like committed data)
    blobs/.tmp-free-<random>      the free pool: collected blob files kept for reuse
    pending/<step:012d>/host.json phase-1 host manifest (keeps its blobs alive until commit)
    steps/<step:012d>.json        the commit: the step manifest, written last, atomically

A step is committed iff ``steps/<step>.json`` exists and parses as JSON whose ``"step"``
equals the number in the file name. Nothing else makes a step visible.

Concurrency: blob writes (``write_blob``, ``finalize_temp_blob``, ``put_blob_file``) may run
from several threads at once. Metadata operations (``commit``, ``prune``, ``gc``,
``check_space``, ``write_pending``, ``delete_step``, ``wipe``) are serialised by one lock.
Garbage collection spares blobs referenced by a kept step, by a pending host manifest, or
pinned with :meth:`RamStore.pin`; a caller that writes blobs while another thread may commit
(and so collect) pins the names first, until its host manifest is written. One process owns
a root at a time (opening a store removes leftover temp files).

Free pool: garbage collection renames collected blob files to ``blobs/.tmp-free-*`` instead
of unlinking them (up to the bytes of the newest step), and ``write_blob`` overwrites a pool
file of exactly the blob's size, then publishes it like a new file. On tmpfs, overwriting
pages that exist is ~2x faster than first-touch writes, and the unlink (freeing the pages)
leaves the commit's critical path. Pool files are temp files: never visible as blobs, removed
when a store opens, counted as reclaimable by ``check_space`` and ``usage``.
A file is never recycled while this process reads or maps it (``read_blob_into``,
``map_blob``, ``verify_blob`` register it by inode; collection unlinks such a file instead), so a
restored array that maps a blob never changes. Code that opens blob files itself (uploads,
peer sends) must keep the names pinned while the file is open.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import logging
import mmap
import os
import re
import secrets
import shutil
import threading
import weakref
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from mtc.shared import format as fmt
from mtc.shared.buffers import byte_view
from mtc.shared import ramdisk
from mtc.shared.errors import CorruptBlobError, InsufficientSpaceError, ManifestError, StepNotFoundError
from mtc.shared.hashing import HEX_LEN, blob_name, check_blob_name, is_blob_name, new_hasher

log = logging.getLogger(__name__)

__all__ = ["RamStore", "format_bytes"]

TMP_PREFIX = ".tmp-"
# Large enough that syscall overhead vanishes; small enough that hashing a chunk right after
# reading it finds it still in cache.
_WRITE_CHUNK = 64 << 20
_READ_CHUNK = 4 << 20
_HUGE_PAGE = 2 << 20  # a tmpfs huge page (x86-64, arm64 with 4 KiB base pages)
_STEP_FILE_RE = re.compile(r"^(\d{12})\.json$")
_STEP_DIR_RE = re.compile(r"^(\d{12})$")
_MAX_STEP = 10**12 - 1
_HOST_JSON = "host.json"

BlobsOf = Callable[[bytes], "set[str]"]

FREE_PREFIX = TMP_PREFIX + "free-"
# Collected files smaller than this are unlinked, not pooled: cheap to free and to write anew.
_POOL_MIN = 64 << 10

# Blob files that this process is reading or has mapped, by (st_dev, st_ino), across all stores
# (two stores of one root in a process share it). Collection never recycles such a file.
_in_use: Counter = Counter()
_in_use_lock = threading.Lock()
# Keys of mappings that went away. A mapping's finaliser runs wherever the garbage collector
# does, possibly in a thread that holds _in_use_lock, so it must not take the lock: it queues
# the key (deque.append is atomic) and whoever takes the lock next applies the queue.
_unmapped: collections.deque = collections.deque()


def _decrement(key: tuple[int, int]) -> None:
    _in_use[key] -= 1
    if _in_use[key] <= 0:
        del _in_use[key]


class _Registry:
    """``with _registry:`` holds the in-use registry, with every finished mapping released."""

    def __enter__(self) -> Counter:
        _in_use_lock.acquire()
        while _unmapped:  # only ever emptied under the lock
            _decrement(_unmapped.popleft())
        return _in_use

    def __exit__(self, *exc) -> None:
        _in_use_lock.release()


_registry = _Registry()


def _release(key: tuple[int, int]) -> None:
    with _registry:
        _decrement(key)


def in_use() -> set[tuple[int, int]]:
    """(st_dev, st_ino) of the blob files this process reads or maps now (for tests, status)."""
    with _registry as registry:
        return set(registry)


def format_bytes(n: int) -> str:
    """``n`` bytes in binary units with two decimals, e.g. ``"1.20 GiB"``."""
    if abs(n) < 1024:
        return f"{int(n)} B"
    value = n / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def _valid_name(name) -> bool:
    # The length check also refuses "<32 hex>\n", which a `$`-anchored regex lets through.
    return is_blob_name(name) and len(name) == HEX_LEN


def _check_name(name) -> str:
    if not _valid_name(name):
        check_blob_name(name)  # raises ValueError with the standard message
        raise ValueError(f"invalid blob name {name!r}: expected {HEX_LEN} lowercase hex digits")
    return name


def _check_step(step) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or not 0 <= step <= _MAX_STEP:
        raise ValueError(f"invalid step {step!r}: expected an integer in [0, {_MAX_STEP}]")
    return int(step)


def _hash_fd(fd: int, size: int) -> str:
    if size == 0:
        return blob_name(b"")
    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as m:
        return blob_name(m)


def _presize(fd: int, size: int) -> None:
    """Give a new blob file its final size before the first write (sparse: nothing allocated).

    A tmpfs mounted ``huge=within_size`` hands out 2 MiB pages only inside the file's size,
    which older kernels take from ``i_size`` alone: without this, a file written front to
    back would get 4 KiB pages there (``mtc.shared.ramdisk``).
    """
    if size >= _HUGE_PAGE:
        os.ftruncate(fd, size)


class RamStore:
    """One host's blob store and committed steps under ``root`` (see the module docstring).

    ``max_to_keep`` is the number of committed steps kept (``local_max_to_keep``).
    ``blobs_of`` extracts the blob names from a step manifest or a host manifest.
    ``free_pool`` keeps collected blob files for reuse (see the module docstring).
    """

    def __init__(self, root: str | os.PathLike, *, max_to_keep: int = 2,
                 blobs_of: BlobsOf = fmt.collect_blob_names, free_pool: bool = True):
        if isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1:
            raise ValueError(f"max_to_keep (local_max_to_keep) must be an integer >= 1, got {max_to_keep!r}")
        self.root = Path(root)
        self.max_to_keep = max_to_keep
        self._blobs_of = blobs_of
        self._blobs = self.root / "blobs"
        self._pending = self.root / "pending"
        self._steps = self.root / "steps"
        self._lock = threading.RLock()
        self._pins: Counter[str] = Counter()
        self._warned: set[str] = set()
        self.free_pool = bool(free_pool)
        # The free pool: exact byte size -> pool file paths; _pool_bytes is their allocation.
        self._pool: dict[int, list[Path]] = {}
        self._pool_bytes = 0
        self._pool_lock = threading.Lock()
        # Parsed manifests, keyed by file name and validated by (inode, mtime, size): files are
        # only ever replaced atomically (a new inode), never rewritten in place.
        self._step_ok: dict[str, tuple[tuple, str | None]] = {}
        self._blobs_cache: dict[Path, tuple[tuple, frozenset]] = {}
        self._make_dirs()
        self._remove_leftovers()
        self.mount = ramdisk.describe(self.root)  # None where unknown (no /proc)
        # On a tmpfs with 2 MiB pages, mapping a file costs a fault per 2 MiB: receivers write
        # straight into the map (mtc.sidecar.peer). With 4 KiB pages a map is far slower than write().
        self.huge_pages = self.mount is not None and self.mount.huge in ("always", "within_size")

    # --- layout ------------------------------------------------------------------------

    def _make_dirs(self) -> None:
        for d in (self._blobs, self._pending, self._steps):
            d.mkdir(parents=True, exist_ok=True)

    def _remove_leftovers(self) -> None:
        # A writer killed mid-way leaves temp files; they were never visible, so they go.
        dirs = [self._blobs, self._steps] + [p for p in self._pending.iterdir() if p.is_dir()]
        removed = 0
        for d in dirs:
            for p in d.iterdir():
                if p.name.startswith(TMP_PREFIX):
                    with contextlib.suppress(FileNotFoundError):
                        p.unlink()
                    removed += 1
        if removed:
            log.info("ramdisk %s: removed %d leftover temp files from an interrupted writer", self.root, removed)

    def _step_path(self, step: int) -> Path:
        return self._steps / f"{step:012d}.json"

    def _pending_dir(self, step: int) -> Path:
        return self._pending / f"{step:012d}"

    def _temp_name(self, directory: Path, tag: str = "") -> Path:
        return directory / f"{TMP_PREFIX}{tag}{secrets.token_hex(8)}"

    def _free_bytes(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def _no_space(self, what: str, step: int | None, needed: int | None, err: OSError) -> InsufficientSpaceError:
        free = self._free_bytes()
        need = f"{format_bytes(needed)} ({needed} bytes)" if needed is not None else "more space"
        step_s = f"step {step}" if step is not None else "a step"
        return InsufficientSpaceError(
            f"ramdisk {self.root} is full while writing {what} of {step_s}: needed {need}, "
            f"{format_bytes(free)} ({free} bytes) free ({err.strerror}); the partial file was removed. "
            f"Make the ramdisk larger: see `mtc size --params ... --hosts ...`, or lower local_max_to_keep")

    # --- free pool and readers -------------------------------------------------------------

    def _round(self, n: int) -> int:
        """``n`` bytes rounded up to the filesystem block (a tmpfs page), as allocated."""
        block = self._block_size()
        return -(-int(n) // block) * block

    def _block_size(self) -> int:
        block = getattr(self, "_block", None)
        if block is None:
            block = self._block = os.statvfs(self.root).f_frsize or 1
        return block

    def _pool_take(self, size: int) -> tuple[int, Path] | None:
        """A pool file of exactly ``size`` bytes, open for writing at offset 0; None if none."""
        while True:
            with self._pool_lock:
                paths = self._pool.get(size)
                if not paths:
                    return None
                path = paths.pop()
                if not paths:
                    del self._pool[size]
                self._pool_bytes -= self._round(size)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)  # read too: a receiver may map it
            except FileNotFoundError:
                continue  # removed meanwhile (another store opened this root)
            st = os.fstat(fd)
            if st.st_size == size and st.st_nlink == 1:
                return fd, path
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def _pool_reuse(self, sizes: Iterable[int]) -> int:
        """Bytes of blobs of ``sizes`` that pool files would take in place (each file once)."""
        want = Counter(int(n) for n in sizes)
        if not want:
            return 0
        with self._pool_lock:
            have = {n: len(ps) for n, ps in self._pool.items()}
        return sum(min(c, have.get(n, 0)) * self._round(n) for n, c in want.items())

    def _pool_stats(self) -> tuple[int, int]:
        """(files, allocated bytes) in the free pool."""
        with self._pool_lock:
            return sum(len(ps) for ps in self._pool.values()), self._pool_bytes

    def _drain_pool(self, keep: Counter | None = None) -> int:
        """Unlink pool files, except up to ``keep[size]`` files of each size; returns bytes freed.

        ``keep`` is decremented by the files kept.
        """
        doomed = []
        with self._pool_lock:
            for size in list(self._pool):
                paths = self._pool[size]
                n = min(len(paths), keep[size]) if keep is not None else 0
                if keep is not None:
                    keep[size] -= n
                doomed.extend(paths[n:])
                self._pool_bytes -= (len(paths) - n) * self._round(size)
                if n:
                    del paths[n:]
                else:
                    del self._pool[size]
        freed = 0
        for p in doomed:
            with contextlib.suppress(FileNotFoundError):
                freed += os.stat(p).st_blocks * 512
                os.unlink(p)
        return freed

    def _recycle(self, path: Path, st: os.stat_result, cap: int | None) -> bool:
        """Move the collected blob file ``path`` into the free pool; False if it must be unlinked.

        Refused when the file is small, has other links, would take the pool over ``cap``
        bytes, or is read or mapped by this process right now.
        """
        size = st.st_size
        if not self.free_pool or size < _POOL_MIN or st.st_nlink != 1:
            return False
        alloc = self._round(size)
        with self._pool_lock:
            if cap is not None and self._pool_bytes + alloc > cap:
                return False
            dst = self._temp_name(self._blobs, "free-")
            with _registry:
                if (st.st_dev, st.st_ino) in _in_use:
                    return False
                try:
                    os.rename(path, dst)
                except FileNotFoundError:
                    return False
            self._pool.setdefault(size, []).append(dst)
            self._pool_bytes += alloc
        return True

    @contextlib.contextmanager
    def _reading(self, name: str) -> Iterator[tuple[int, int, tuple[int, int]]]:
        """Open committed blob ``name`` for reading, registered so that it is not recycled.

        Yields (fd, size, key); raises FileNotFoundError when the blob is not there. The file
        is registered first and its name checked after, so a collection that moves it to the
        free pool either sees the registration (and unlinks it instead) or has already moved it
        (and the name check fails).
        """
        path = self.blob_path(name)
        for _ in range(3):
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)  # FileNotFoundError: not there
            try:
                st = os.fstat(fd)
                key = (st.st_dev, st.st_ino)
                with _registry:
                    _in_use[key] += 1
                try:
                    try:
                        now = os.stat(path)
                    except FileNotFoundError:
                        now = None
                    if now is not None and (now.st_dev, now.st_ino) == key:
                        yield fd, st.st_size, key
                        return
                finally:
                    _release(key)
            finally:
                os.close(fd)
            if now is None:
                break
        raise FileNotFoundError(errno.ENOENT, f"blob {name} is not in the ramdisk", str(path))

    # --- blobs -------------------------------------------------------------------------

    def blob_path(self, name: str) -> Path:
        """The file of blob ``name``; the name is validated first (ValueError if malformed)."""
        return self._blobs / _check_name(name)

    def has_blob(self, name: str) -> bool:
        """True when blob ``name`` is committed in this store (ValueError for a malformed name)."""
        return self.blob_path(name).is_file()

    def blob_size(self, name: str) -> int:
        """Size in bytes of blob ``name``; FileNotFoundError when absent."""
        path = self.blob_path(name)
        try:
            return path.stat().st_size
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, f"blob {name} is not in the ramdisk", str(path)) from None

    def list_blobs(self) -> set[str]:
        """Names of all committed blobs (temp files excluded)."""
        return {p.name for p in self._blobs.iterdir() if _valid_name(p.name)}

    def missing_bytes(self, blobs: dict[str, int]) -> int:
        """Bytes of ``blobs`` ({name: nbytes}) not already present: what a step would add.

        Each size is rounded up to the filesystem block (a tmpfs page), as it is allocated.
        """
        block = os.statvfs(self.root).f_frsize or 1
        return sum(-(-int(n) // block) * block for name, n in blobs.items() if not self.has_blob(name))

    @contextlib.contextmanager
    def pin(self, names: Iterable[str]) -> Iterator[None]:
        """Keep ``names`` out of garbage collection while the context is open.

        For blobs written before anything references them (between ``write_blob`` and
        ``write_pending``, or received from a peer): pin first, then write.
        """
        names = [_check_name(n) for n in names]
        with self._lock:
            self._pins.update(names)
        try:
            yield
        finally:
            with self._lock:
                self._pins.subtract(names)
                self._pins += Counter()  # drop zero counts

    def _publish(self, tmp: Path, final: Path) -> bool:
        """Move a finished temp file to its final name; False if the blob already existed.

        A hard link cannot overwrite, so among racing writers of one blob exactly one wins
        and the committed file is never replaced under a reader.
        """
        try:
            os.link(tmp, final)
        except FileExistsError:
            return False
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                raise
            if final.exists():
                return False
            os.replace(tmp, final)  # filesystem without hard links: same bytes, so replacing is harmless
            return True
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return True

    def write_blob(self, data, *, name: str | None = None) -> tuple[str, bool]:
        """Store ``data`` (bytes-like or C-contiguous ndarray: its raw bytes) as a blob.

        ``name`` is trusted as the precomputed hash when given. Returns (name, written);
        written is False when the blob was already present (nothing is written then).
        A free-pool file of the same size is overwritten when there is one (see the module
        docstring); it is published only once completely written, like a new file.
        Raises InsufficientSpaceError (temp file removed) when the ramdisk fills up.
        """
        mv = byte_view(data)
        name = blob_name(mv) if name is None else _check_name(name)
        final = self._blobs / name
        if final.exists():
            return name, False
        n = mv.nbytes
        retried = False
        while True:
            taken = self._pool_take(n) if n else None
            if taken is not None:
                fd, tmp = taken
            else:
                tmp = self._temp_name(self._blobs)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                try:
                    _presize(fd, n)
                    off = 0
                    while off < n:
                        off += os.write(fd, mv[off:off + _WRITE_CHUNK])
                finally:
                    os.close(fd)
            except BaseException as e:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                    if not retried and self._drain_pool():
                        retried = True  # the pool held the space: free it, write anew
                        continue
                    raise self._no_space(f"blob {name}", None, n, e) from e
                raise
            return name, self._publish(tmp, final)

    def read_blob_into(self, name: str, out) -> None:
        """Read blob ``name`` into ``out`` (writable buffer or ndarray of exactly its size).

        Raises CorruptBlobError when the blob is missing, has another size, or its bytes do
        not hash to its name; ``out`` holds garbage then.
        """
        path = self.blob_path(name)
        mv = byte_view(out)
        if mv.readonly:
            raise TypeError(f"read_blob_into needs a writable buffer for blob {name}")
        hasher = new_hasher()
        try:
            with self._reading(name) as (fd, size, _):
                if size != mv.nbytes:
                    raise CorruptBlobError(f"blob {name} at {path} has {size} bytes, but the reader expects "
                                           f"{mv.nbytes}: wrong size, not using it")
                off = 0
                while off < size:
                    got = os.readv(fd, [mv[off:off + _READ_CHUNK]])
                    if not got:
                        raise CorruptBlobError(f"blob {name} at {path} ended after {off} of {size} bytes "
                                               "(truncated while reading)")
                    hasher.update(mv[off:off + got])
                    off += got
        except FileNotFoundError:
            raise CorruptBlobError(f"blob {name} is missing from the ramdisk ({path})") from None
        actual = hasher.hexdigest()
        if actual != name:
            raise CorruptBlobError(f"blob {name} at {path} is corrupt: its bytes hash to {actual}")

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
        try:
            with self._reading(name) as (fd, size, _):
                return _hash_fd(fd, size) == name
        except FileNotFoundError:
            return False

    def scrub_blob(self, name: str) -> str:
        """Check blob ``name`` and remove it when its bytes no longer hash to its name.

        Returns ``"ok"``, ``"removed"`` (it was corrupt: the file is unlinked, so this host
        stops counting as a holder and replication makes a good copy again) or ``"missing"``.
        A file mapped or open elsewhere keeps its pages until they are released.
        """
        _check_name(name)
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
        path = self.blob_path(name)
        try:
            with self._reading(name) as (fd, size, key):
                if nbytes is not None and size != nbytes:
                    raise CorruptBlobError(f"blob {name} at {path} has {size} bytes, but the reader expects "
                                           f"{nbytes}: wrong size, not using it")
                if size == 0:
                    return np.empty(0, np.uint8)
                m = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                with _registry:
                    _in_use[key] += 1  # held by the mapping; released when it is unmapped
                weakref.finalize(m, _unmapped.append, key)
        except FileNotFoundError:
            raise CorruptBlobError(f"blob {name} is missing from the ramdisk ({path})") from None
        actual = blob_name(m)
        if actual != name:
            raise CorruptBlobError(f"blob {name} at {path} is corrupt: its bytes hash to {actual}")
        return np.frombuffer(m, np.uint8)

    def open_temp_blob(self, size: int | None = None) -> tuple[int, Path]:
        """A new temp file in ``blobs/`` for receiving a blob: (fd open for writing, path).

        The fd is open for reading too, so that the caller may map it (``huge_pages``).
        Write the bytes, close the fd, then call :meth:`finalize_temp_blob` (or
        :meth:`discard_temp_blob` on failure). With ``size`` (the exact number of bytes that
        will be written), a free-pool file of that size is reused when there is one: its
        pages are overwritten in place, which is much cheaper than allocating new ones.
        """
        tmp = self._temp_name(self._blobs)
        if size is not None and self.free_pool:
            taken = self._pool_take(int(size))
            if taken is not None:
                fd, path = taken
                os.rename(path, tmp)  # a plain temp name: finalize/discard accept it
                return fd, tmp
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        if size is not None:
            try:
                _presize(fd, int(size))
            except BaseException:
                os.close(fd)
                self.discard_temp_blob(tmp)
                raise
        return fd, tmp

    def _check_temp(self, temp_path) -> Path:
        tmp = Path(temp_path)
        if tmp.parent != self._blobs or not tmp.name.startswith(TMP_PREFIX) or tmp.name.startswith(FREE_PREFIX):
            raise ValueError(f"{tmp} is not a temp blob of the ramdisk {self.root} (use open_temp_blob)")
        return tmp

    def discard_temp_blob(self, temp_path) -> None:
        """Remove a temp file from :meth:`open_temp_blob` (a failed transfer)."""
        with contextlib.suppress(FileNotFoundError):
            self._check_temp(temp_path).unlink()

    def finalize_temp_blob(self, temp_path, name: str, verify: bool = True) -> bool:
        """Commit a received temp file as blob ``name``; returns whether it was added.

        With ``verify`` (the default) the bytes are hashed first; a mismatch removes the
        temp file and raises CorruptBlobError. False when the blob was already present.
        """
        tmp = self._check_temp(temp_path)
        try:
            _check_name(name)
            if verify:
                fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    actual = _hash_fd(fd, os.fstat(fd).st_size)
                finally:
                    os.close(fd)
                if actual != name:
                    raise CorruptBlobError(f"received copy of blob {name} is corrupt: it hashes to {actual}; "
                                           f"discarded {tmp}")
        except BaseException:
            self.discard_temp_blob(tmp)
            raise
        return self._publish(tmp, self._blobs / name)

    def put_blob_file(self, name: str, src_path: str | os.PathLike) -> bool:
        """Copy the file ``src_path`` in as blob ``name``, verified; returns whether it was added."""
        _check_name(name)
        if self.has_blob(name):
            return False
        retried = False
        while True:
            fd, tmp = self.open_temp_blob()
            os.close(fd)
            try:
                shutil.copyfile(src_path, tmp)  # sendfile on Linux: no copy through Python
            except BaseException as e:
                self.discard_temp_blob(tmp)
                if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                    if not retried and self._drain_pool():
                        retried = True  # the free pool held the space
                        continue
                    raise self._no_space(f"blob {name}", None, os.stat(src_path).st_size, e) from e
                raise
            return self.finalize_temp_blob(tmp, name, verify=True)

    # --- space -------------------------------------------------------------------------

    def fits(self, sizes: Iterable[int]) -> bool:
        """Whether new blobs of ``sizes`` bytes fit now, all of them, without freeing anything.

        Free-pool files of those sizes count: they are overwritten in place.
        """
        sizes = [int(n) for n in sizes]
        return sum(self._round(n) for n in sizes) - self._pool_reuse(sizes) <= self._free_bytes()

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
        step = _check_step(step)
        sizes = [int(n) for n in sizes] if sizes is not None else []
        with self._lock:
            free = self._free_bytes()
            if needed - self._pool_reuse(sizes) <= free:
                return
            steps = self.committed_steps()
            keep = max(1, self.max_to_keep - 1)
            drop = steps[:-keep] if len(steps) > keep else []
            kept = steps[len(drop):]
            live_pending = self._live_pending(kept)
            try:
                live = self._live_blobs(kept, live_pending)
            except ManifestError as e:
                log.error("ramdisk %s: cannot free space safely: %s", self.root, e)
                live = None
            reclaim = self._pool_stats()[1]
            if live is not None:
                for name in self.list_blobs() - live:
                    with contextlib.suppress(FileNotFoundError):
                        reclaim += (self._blobs / name).stat().st_blocks * 512
            if free + reclaim < needed:
                raise self._space_error(step, needed, free, reclaim)
            for s in drop:
                log.info("ramdisk %s: removing step %d early to make room for step %d "
                         "(local_max_to_keep=%d)", self.root, s, step, self.max_to_keep)
                self._remove_step(s)
            self._remove_stale_pending(live_pending)
            # Pool files (old and newly collected) that blobs of this step will overwrite stay;
            # the others are freed. Either way the space counts: reused or free.
            want = Counter(n for n in sizes if n >= _POOL_MIN)
            self._drain_pool(want)
            self._gc_locked(frozenset(), want=want)
            free = self._free_bytes()
            if needed - self._pool_reuse(sizes) > free:
                raise self._space_error(step, needed, free, 0)

    def _space_error(self, step: int, needed: int, free: int, reclaim: int) -> InsufficientSpaceError:
        return InsufficientSpaceError(
            f"step {step} does not fit in the ramdisk {self.root}: it needs {format_bytes(needed)} "
            f"({needed} bytes), {format_bytes(free)} ({free} bytes) are free, and removing the old steps "
            f"that local_max_to_keep={self.max_to_keep} allows would free only {format_bytes(reclaim)} more. "
            f"Nothing of step {step} was written. Make the ramdisk larger: see "
            f"`mtc size --params ... --hosts ...`, or lower local_max_to_keep")

    # --- pending (phase 1) ---------------------------------------------------------------

    def _atomic_write(self, final: Path, data: bytes, what: str, step: int) -> os.stat_result:
        """Write ``final`` atomically; returns its stat (the cache keys of ``committed_steps``)."""
        tmp = self._temp_name(final.parent, f"{final.name}-")
        try:
            with open(tmp, "xb") as f:
                f.write(memoryview(data))
                f.flush()
                st = os.fstat(f.fileno())
            os.replace(tmp, final)
            return st
        except BaseException as e:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise self._no_space(what, step, len(data), e) from e
            raise

    def write_pending(self, step: int, host_manifest: bytes) -> None:
        """Write (atomically, replacing) the phase-1 host manifest of ``step``."""
        step = _check_step(step)
        with self._lock:
            d = self._pending_dir(step)
            d.mkdir(exist_ok=True)
            self._atomic_write(d / _HOST_JSON, bytes(host_manifest), "the host manifest", step)

    def read_pending(self, step: int) -> bytes | None:
        """The phase-1 host manifest of ``step``, or None if there is none."""
        try:
            return (self._pending_dir(_check_step(step)) / _HOST_JSON).read_bytes()
        except FileNotFoundError:
            return None

    def _pending_dirs(self) -> dict[int, Path]:
        out = {}
        for p in self._pending.iterdir():
            m = _STEP_DIR_RE.match(p.name)
            if m and p.is_dir():
                out[int(m.group(1))] = p
        return out

    def pending_steps(self) -> list[int]:
        """Steps with a phase-1 host manifest, ascending."""
        return sorted(s for s, p in self._pending_dirs().items() if (p / _HOST_JSON).is_file())

    # --- commit (phase 2) and steps ------------------------------------------------------

    def commit(self, step: int, step_manifest: bytes) -> None:
        """Make ``step`` visible: write steps/<step>.json atomically, last; then prune.

        The manifest must be JSON whose "step" equals ``step`` (ManifestError otherwise).
        """
        step = _check_step(step)
        data = bytes(step_manifest)
        self._parse_step(data, step, f"commit of step {step}")
        with self._lock:
            st = self._atomic_write(self._step_path(step), data, "the step manifest", step)
            # Validated above: committed_steps need not parse it again.
            self._step_ok[self._step_path(step).name] = ((st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size), None)
            log.info("ramdisk %s: committed step %d", self.root, step)
            d = self._pending_dir(step)
            if d.exists():
                shutil.rmtree(d, ignore_errors=True)
            # Pool files this step's writes did not take do not fit what is saved now: free
            # them, so that the pool holds what the next save can reuse (usually nothing here).
            self._drain_pool()
            self.prune()

    @staticmethod
    def _parse_step(data: bytes, step: int, where: str) -> None:
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise ManifestError(f"{where}: the step manifest is not valid JSON ({e})") from None
        if not isinstance(doc, dict) or doc.get("step") != step or isinstance(doc.get("step"), bool):
            got = doc.get("step") if isinstance(doc, dict) else type(doc).__name__
            raise ManifestError(f"{where}: the step manifest must be a JSON object with \"step\": {step}, "
                                f"got {got!r}")

    def _warn_once(self, key: str, msg: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    def committed_steps(self) -> list[int]:
        """Committed steps, ascending. Malformed files in steps/ are ignored (with a warning).

        Each step file is parsed once per version (inode, mtime, size): step files are only
        ever replaced atomically, so an unchanged key means unchanged bytes.
        """
        out = []
        seen = {}
        for p in self._steps.iterdir():
            if p.name.startswith(TMP_PREFIX):
                continue
            m = _STEP_FILE_RE.match(p.name)
            if not m:
                self._warn_once(p.name, "ramdisk %s: ignoring %s in steps/: not a step file name", self.root, p)
                continue
            step = int(m.group(1))
            try:
                with open(p, "rb") as f:
                    st = os.fstat(f.fileno())
                    key = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
                    cached = self._step_ok.get(p.name)
                    if cached is not None and cached[0] == key:
                        error = cached[1]
                    else:
                        try:
                            self._parse_step(f.read(), step, str(p))
                            error = None
                        except ManifestError as e:
                            error = str(e)
                seen[p.name] = (key, error)
            except FileNotFoundError:
                continue  # removed meanwhile
            except OSError as e:
                error = str(e)
            if error is not None:
                self._warn_once(p.name, "ramdisk %s: ignoring %s: %s", self.root, p, error)
                continue
            out.append(step)
        self._step_ok = seen
        return sorted(out)

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.committed_steps()
        return steps[-1] if steps else None

    def read_step(self, step: int) -> bytes:
        """The step manifest of committed ``step`` (StepNotFoundError if not committed)."""
        step = _check_step(step)
        path = self._step_path(step)
        try:
            data = path.read_bytes()
            self._parse_step(data, step, str(path))
            return data
        except (FileNotFoundError, ManifestError):
            raise StepNotFoundError(f"step {step} is not committed in the ramdisk {self.root}; "
                                    f"committed steps: {self.committed_steps()}") from None

    def _remove_step(self, step: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._step_path(step).unlink()
        d = self._pending_dir(step)
        if d.exists():
            shutil.rmtree(d, ignore_errors=True)

    def delete_step(self, step: int) -> bool:
        """Remove committed ``step`` and its pending manifest, then collect garbage.

        Returns True when there was something to remove.
        """
        step = _check_step(step)
        with self._lock:
            existed = self._step_path(step).exists() or self._pending_dir(step).exists()
            self._remove_step(step)
            self._gc_locked(frozenset())
            return existed

    def _live_pending(self, steps: list[int]) -> list[int]:
        """Pending dirs that still matter: those of uncommitted steps newer than the newest."""
        newest = steps[-1] if steps else None
        return [p for p in self._pending_dirs() if newest is None or (p > newest and p not in steps)]

    def prune(self) -> None:
        """Keep the newest ``max_to_keep`` steps, drop stale pending manifests, then gc()."""
        with self._lock:
            steps = self.committed_steps()
            drop = steps[:-self.max_to_keep] if len(steps) > self.max_to_keep else []
            for s in drop:
                log.info("ramdisk %s: removing step %d (local_max_to_keep=%d)", self.root, s, self.max_to_keep)
                self._remove_step(s)
            self._remove_stale_pending(self._live_pending(steps[len(drop):]))
            self._gc_locked(frozenset(), recycle=True)

    def _remove_stale_pending(self, live_pending: list[int]) -> None:
        for p, d in self._pending_dirs().items():
            if p not in live_pending:
                shutil.rmtree(d, ignore_errors=True)

    def _blobs_in(self, path: Path) -> set[str]:
        # Cached per file version (inode, mtime, size): manifests are replaced, never rewritten.
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            key = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
            cached = self._blobs_cache.get(path)
            if cached is not None and cached[0] == key:
                return set(cached[1])
            data = f.read()
        try:
            names = frozenset(self._blobs_of(data))
        except ManifestError:
            raise
        except Exception as e:  # the callback's own parsing errors: untrusted bytes from disk
            raise ManifestError(f"{path}: cannot tell which blobs it uses ({e!r})") from None
        if len(self._blobs_cache) > 256:
            self._blobs_cache = {p: v for p, v in self._blobs_cache.items() if p.exists()}
        self._blobs_cache[path] = (key, names)
        return set(names)

    def _live_blobs(self, steps: list[int], pending: Iterable[int]) -> set[str]:
        live = set(self._pins)
        for s in steps:
            live |= self._blobs_in(self._step_path(s))
        dirs = self._pending_dirs()
        for p in pending:
            try:
                live |= self._blobs_in(dirs[p] / _HOST_JSON)
            except (FileNotFoundError, KeyError):
                pass
        return live

    def gc(self, extra_live: Iterable[str] = frozenset()) -> int:
        """Delete blobs that no committed step, pending manifest, pin or ``extra_live`` uses.

        Returns the number of bytes freed. If a manifest cannot be parsed, nothing is deleted
        (an error is logged): deleting blindly could destroy a good step.
        """
        with self._lock:
            return self._gc_locked(frozenset(extra_live))

    def _gc_locked(self, extra_live: frozenset, *, recycle: bool = False, want: Counter | None = None) -> int:
        """Collect unused blobs; returns their bytes.

        With ``recycle``, collected files go to the free pool up to the bytes of the newest
        step; with ``want`` ({size: count}, decremented), up to that many files of each size.
        The rest are unlinked.
        """
        steps = self.committed_steps()
        try:
            live = self._live_blobs(steps, sorted(self._pending_dirs()))
        except ManifestError as e:
            log.error("ramdisk %s: garbage collection skipped, a manifest is unreadable: %s", self.root, e)
            return 0
        live |= extra_live
        garbage = self.list_blobs() - live
        cap = self._pool_cap(steps) if recycle and garbage and self.free_pool else None
        freed = count = pooled = 0
        for name in garbage:
            path = self._blobs / name
            try:
                st = path.stat()
                if want is not None and want[st.st_size] > 0 and self._recycle(path, st, None):
                    want[st.st_size] -= 1
                    pooled += 1
                elif cap is not None and self._recycle(path, st, cap):
                    pooled += 1
                else:
                    path.unlink()
            except FileNotFoundError:
                continue
            freed += st.st_size
            count += 1
        if count:
            log.info("ramdisk %s: garbage collection removed %d blobs, %s (%d kept in the free pool)",
                     self.root, count, format_bytes(freed), pooled)
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
                names = self._blobs_in(self._step_path(step))
            except (OSError, ManifestError):
                continue
            total = 0
            for name in names:
                with contextlib.suppress(FileNotFoundError):
                    total += self._round((self._blobs / name).stat().st_size)
            best = max(best, total)
        return best

    def wipe(self) -> None:
        """Remove everything under root (a replaced node), leaving an empty store."""
        with self._lock:
            self._drain_pool()
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
                blob_bytes += (self._blobs / name).stat().st_size
                count += 1
        st = os.statvfs(self.root)
        pool_count, pool_bytes = self._pool_stats()
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
