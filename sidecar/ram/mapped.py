"""Landings: blob files mapped for a writer that fills them in place (one copy per save).

A save's bytes land straight in ramdisk pages. ``Landings.land(sizes)`` takes a free-pool file
of each size (a collected blob of a pruned step: its pages exist) or makes a new, fallocated
one, maps it shared and writable, and hands the map out as a uint8 buffer. The writer fills it:
the head's staging copy in colocated mode on a CPU backend (the sidecar runs in the head's
process; ``mtc.shared.landing_zones``), or the daemon's socket receive in cluster mode. Then
``write_shards`` recognises the buffer by its address, hashes the mapped pages and publishes the
file under its content name (``Landings.publish``). Nothing is copied a second time.

Mapping a file costs a page fault per page, more than the copy itself on a tmpfs with 4 KiB
pages. So maps are kept (``MapCache``): a landed file becomes a blob, is collected into the
pool when its step is pruned and is landed in again two saves later, still mapped, with its page
tables in place. A map follows its file's path through those renames; ``MapCache.sweep`` (run
by garbage collection, before any free-space figure is read) drops the map of a file that was
unlinked, so that a deleted file's pages are never held.

A map is only cheap once its page tables exist: a copy into a new file's map, or into a file whose
map was never filled in, takes a fault per 4 KiB page from user space (4-20x the cost of
``write()`` of the same bytes, which allocates the pages inside the kernel). So such a landing is
*cold*: its writer fills it with :meth:`Landing.fill` (``pwrite`` from the source, hashing each
chunk as it goes), not through its map, and the map is made without populating it. Once published,
the file's map is filled in later, in the background (``MapWarmer``: ``MADV_POPULATE_WRITE``, or a
``MAP_POPULATE`` remap where the kernel lacks it), so that when the file comes back from the pool
its landing is warm and the save is one memcpy.

Safety: a landing is only ever a pool file (never read or mapped by a restore: see
``FreePool.recycle``) or a new file; its space is taken before the first byte (fallocate for a
new warm file; a cold landing is filled with ``pwrite``, which gets ENOSPC: a write through a map
past a full tmpfs would be SIGBUS). Landings are temp files until published;
``LandingBatch.close`` removes those a failed save did not publish.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from mtc.shared.buffers import aligned_empty, byte_view
from mtc.shared.hashing import new_hasher
from mtc.shared.protocol import Sink
from mtc.shared.ramdisk import is_no_space

log = logging.getLogger(__name__)

# Shards smaller than this are not landed: for them a map costs more syscalls than it saves
# copying (the caller copies them into a reused buffer and the store writes them).
LANDING_MIN = 64 << 10

# At most this many maps are kept (each is one of the process's vm.max_map_count areas, 65530
# by default); past it a landing's map goes when the arrays using it do.
MAX_KEPT_MAPS = 16384

# A cold landing is written in chunks of this size: large enough that syscalls vanish, small
# enough that each is still in cache when it is written after being hashed.
FILL_CHUNK = 8 << 20

Key = tuple[int, int]


def _key(st: os.stat_result) -> Key:
    return st.st_dev, st.st_ino


class MapCache:
    """Shared, writable maps of blob files by (st_dev, st_ino), each with the path its file has now
    and whether its page tables are filled in (warm).

    ``get`` returns the map of a file (creating it on a miss: populated, or lazily with
    ``populate=False``); ``moved`` follows a rename; ``sweep`` drops the maps whose file is gone
    from its path; ``warm`` fills in a lazy map's page tables.
    """

    def __init__(self):
        self._maps: dict[Key, tuple[mmap.mmap, Path, bool]] = {}
        self._lock = threading.Lock()

    def get(self, fd: int, st: os.stat_result, path: Path, *, populate: bool = True) -> mmap.mmap:
        key = _key(st)
        with self._lock:
            hit = self._maps.get(key)
        if hit is not None and len(hit[0]) == st.st_size:
            self.moved(st, path)
            return hit[0]
        # MAP_POPULATE: every page table entry in one call instead of a fault per page.
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        m = mmap.mmap(fd, st.st_size, flags=flags)
        with self._lock:
            if len(self._maps) < MAX_KEPT_MAPS or key in self._maps:
                self._maps[key] = (m, Path(path), populate)
        return m

    def is_warm(self, st: os.stat_result) -> bool:
        """Whether the file of ``st`` has a kept map with its page tables in place."""
        with self._lock:
            hit = self._maps.get(_key(st))
        return hit is not None and hit[2] and len(hit[0]) == st.st_size

    def warm(self, key: Key, between: Callable[[], None] | None = None) -> bool:
        """Fill in the page tables of the kept map of ``key`` (a no-op when it is warm or gone);
        whether a map was warmed. Its file's pages must exist (a published blob's do).
        ``between()`` runs before each piece (the warmer holds off there while a save lands)."""
        for _ in range(3):  # the fallback opens the file by its path: follow a rename under it
            with self._lock:
                hit = self._maps.get(key)
            if hit is None or hit[2]:
                return False
            m, path, _ = hit
            warm = _populate(m, path, key, between)
            if warm is not None:
                break
            with self._lock:
                now = self._maps.get(key)
            if now is None or now[1] == path:
                return False
        else:
            return False
        with self._lock:
            now = self._maps.get(key)
            if now is not None and now[0] is m:
                self._maps[key] = (warm, now[1], True)
        return True

    def moved(self, st: os.stat_result, path: Path) -> None:
        """The file of ``st`` is now at ``path`` (no-op when it has no map)."""
        key = _key(st)
        with self._lock:
            hit = self._maps.get(key)
            if hit is not None:
                self._maps[key] = (hit[0], Path(path), hit[2])

    def forget(self, st: os.stat_result) -> None:
        with self._lock:
            self._maps.pop(_key(st), None)

    def clear(self) -> None:
        with self._lock:
            self._maps.clear()

    def sweep(self) -> int:
        """Drop the maps of files no longer at their path (unlinked, or replaced); returns how many."""
        with self._lock:
            items = list(self._maps.items())
        dead = []
        for key, (_, path, _) in items:
            try:
                alive = _key(os.stat(path)) == key
            except FileNotFoundError:
                alive = False
            if not alive:
                dead.append(key)
        with self._lock:
            for key in dead:
                self._maps.pop(key, None)
        return len(dead)

    def __len__(self) -> int:
        return len(self._maps)


# MADV_POPULATE_WRITE (Linux 5.14): page tables filled in, writable, without touching the bytes.
# Python 3.11's mmap module does not name it.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_madvise_ok = True  # until the kernel refuses it once
WARM_CHUNK = 4 << 20  # populated per call: ~2 ms of page tables at 4 KiB pages
WARM_DELAY = 0.25  # seconds the warmer waits after a submission, so that a save's own phases go first
_libc = ctypes.CDLL(None, use_errno=True)  # its calls release the GIL


def _madvise(m: mmap.mmap, advice: int, between: Callable[[], None] | None = None) -> None:
    """madvise(2) over the whole of ``m``, in ``WARM_CHUNK`` pieces, without the GIL.

    ``mmap.madvise`` holds the GIL for the whole call (0.2 s per GiB here: every Python thread
    of the process would stall). And populating holds the process's mmap lock: in pieces, an
    allocation or a map made meanwhile (by training, or by the next save) waits for one piece,
    not for the file."""
    view = np.frombuffer(m, np.uint8)  # ValueError when the map is closed
    try:
        base, size = view.ctypes.data, view.nbytes
        for off in range(0, size, WARM_CHUNK):
            if between is not None:
                between()
            n = min(WARM_CHUNK, size - off)
            if _libc.madvise(ctypes.c_void_p(base + off), ctypes.c_size_t(n), ctypes.c_int(advice)):
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err))
    finally:
        del view


def _populate(m: mmap.mmap, path: Path, key: Key, between=None) -> mmap.mmap | None:
    """Fill in the page tables of map ``m`` of the file at ``path``: the warm map (``m``, or a new
    map of the file where the kernel refuses MADV_POPULATE_WRITE: logged once), or None when it
    cannot be done (the map was closed, the file is gone or changed)."""
    global _madvise_ok
    if _madvise_ok:
        try:
            _madvise(m, MADV_POPULATE_WRITE, between)
            return m
        except ValueError:  # closed
            return None
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                return None  # EFAULT/ENOMEM: not possible now; it stays lazy
            _madvise_ok = False
            log.info("this kernel refuses MADV_POPULATE_WRITE (%s); ramdisk maps are warmed with a "
                     "MAP_POPULATE remap instead", e.strerror or e)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if _key(st) != key or st.st_size != len(m):
            return None
        return mmap.mmap(fd, len(m), flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


class MapWarmer:
    """Fills in the page tables of lazily made maps in the background, one at a time, on one
    thread at the lowest CPU priority, so that training and the saves' own copies go first; it
    holds off while ``paused()`` (a save is landing), checked between pieces."""

    def __init__(self, maps: MapCache, paused: Callable[[], bool] = lambda: False):
        self._maps = maps
        self._paused = paused  # true while a save is landing: the warmer waits between pieces
        self._queue: list[Key] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._busy = False
        self._last = 0.0  # when the last map was submitted (monotonic)
        self.warmed = 0  # maps warmed, in total (for tests)

    def submit(self, st: os.stat_result) -> None:
        with self._cond:
            self._queue.append(_key(st))
            self._last = time.monotonic()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="mtc-map-warmer", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only (Linux)
        while True:
            with self._cond:
                while not self._queue:
                    self._busy = False
                    self._cond.notify_all()
                    if not self._cond.wait(timeout=30):
                        self._thread = None
                        return
                key = self._queue.pop(0)
                self._busy = True
                wait = self._last + WARM_DELAY - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            if self._maps.warm(key, self._hold):
                self.warmed += 1

    def _hold(self) -> None:
        while self._paused():
            time.sleep(0.005)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted map is warmed (tests, benchmarks); whether it finished."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)


class Landing:
    """One mapped temp blob file of ``size`` bytes; ``buffer`` is the uint8 view to fill.

    A cold landing (``cold``) is filled with :meth:`fill`, not through ``buffer``; ``name`` is
    then the hash of what was written (when the fill hashed)."""

    __slots__ = ("tmp", "size", "buffer", "st", "done", "cold", "filled", "name")

    def __init__(self, tmp: Path, size: int, buffer: np.ndarray, st: os.stat_result, cold: bool = False):
        self.tmp, self.size, self.buffer, self.st, self.cold = tmp, size, buffer, st, cold
        self.done = self.filled = False
        self.name: str | None = None

    @property
    def address(self) -> int:
        return self.buffer.ctypes.data

    def fill(self, src, *, hash: bool = True) -> None:
        """Write ``src`` (``size`` bytes) into the file with ``pwrite``; the kernel allocates the
        pages: no fault per page from user space. OSError (ENOSPC) when the ramdisk is full.

        With ``hash``, each chunk is hashed as it goes (still in cache), so ``name`` is known
        without another pass: for 4 KiB pages, where hashing the file later through its map would
        fault its pages in one by one. On 2 MiB pages that costs a fault per 2 MiB, and leaving
        the hash to the publisher (off the path the caller waits on) is cheaper."""
        mv = byte_view(src)
        if mv.nbytes != self.size:
            raise ValueError(f"landing {self.tmp} holds {self.size} bytes, the source has {mv.nbytes}")
        hasher = new_hasher() if hash else None
        fd = os.open(self.tmp, os.O_WRONLY | os.O_CLOEXEC)
        try:
            off = 0
            while off < self.size:
                chunk = mv[off:off + FILL_CHUNK]
                if hasher is not None:
                    hasher.update(chunk)
                n = len(chunk)
                done = 0
                while done < n:
                    done += os.pwrite(fd, chunk[done:], off + done)
                off += n
        finally:
            os.close(fd)
        self.filled = True
        self.name = hasher.hexdigest() if hasher is not None else None


_local = threading.local()


def thread_buffer(size: int) -> memoryview:
    """This thread's receive buffer of ``size`` bytes, reused: a fresh one per payload would cost
    its page faults (the peer receive and ``LandingSink`` take theirs here)."""
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = {}
    buf = bufs.get(size)
    if buf is None:
        buf = bufs[size] = memoryview(bytearray(size))
    return buf


class LandingSink(Sink):
    """A cold landing as a payload a socket streams into (``mtc.shared.protocol.Sink``): each
    chunk is received into this thread's reused buffer, hashed there and written with
    ``pwrite``, so the kernel allocates the file's pages (no fault per page through the map)."""

    def __init__(self, landing: Landing):
        self.landing = landing
        self.buffer = landing.buffer

    def receive(self, read, n: int) -> int:
        x = self.landing
        if n != x.size:
            raise ValueError(f"landing {x.tmp} holds {x.size} bytes, the payload has {n}")
        chunk = thread_buffer(FILL_CHUNK)
        hasher = new_hasher()
        fd = os.open(x.tmp, os.O_RDWR | os.O_CLOEXEC)
        try:
            got = 0
            while got < n:
                k = read(chunk[:min(len(chunk), n - got)])
                if k == 0:
                    return got
                part = chunk[:k]
                hasher.update(part)  # still in cache: it just arrived
                try:
                    done = 0
                    while done < k:
                        done += os.pwrite(fd, part[done:], got + done)
                except OSError as e:
                    if not is_no_space(e):
                        raise
                    return self._spill(fd, read, got, part, n, e)
                got += k
        finally:
            os.close(fd)
        x.filled = True
        x.name = hasher.hexdigest()
        return got

    def _spill(self, fd: int, read, got: int, part: memoryview, n: int, err: OSError) -> int:
        """The ramdisk filled up under the receive (another writer took the room): the payload
        goes on into memory instead, what was written already read back, so the connection stays
        usable and the request is served as if it had not landed (the store's own space check
        then decides). The landing's file is removed when its batch closes."""
        log.info("ramdisk full while receiving into %s (%s); receiving the rest into memory", self.landing.tmp, err)
        buf = aligned_empty((n,), np.uint8)
        mv = memoryview(buf)
        done = 0
        while done < got:
            done += os.preadv(fd, [mv[done:got]], done)
        mv[got:got + len(part)] = part
        got += len(part)
        while got < n:
            k = read(mv[got:n])
            if k == 0:
                break
            got += k
        self.buffer = buf
        return got


class LandingBatch:
    """The landings of one save part (or one received request): one buffer or None per size.

    None marks a size that was not landed (too small, or no room for every shard as a new blob:
    the caller stages that one, or all of them, in its own memory and the store writes it).
    ``close()`` removes the landings that were not published (a failed save).
    """

    def __init__(self, landings: Sequence[Landing | None], on_close=None):
        self.landings = list(landings)
        self._on_close = on_close

    @property
    def buffers(self) -> list[np.ndarray | None]:
        return [None if x is None else x.buffer for x in self.landings]

    @property
    def landed(self) -> bool:
        return any(x is not None for x in self.landings)

    def receivers(self) -> list:
        """Where a socket receives each payload: a cold landing's ``LandingSink`` (written with
        ``pwrite``), a landing's buffer, or None for a size not landed (the caller gives a buffer)."""
        return [None if x is None else LandingSink(x) if x.cold else x.buffer for x in self.landings]

    def close(self) -> None:
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close([x for x in self.landings if x is not None and not x.done])

    def __enter__(self) -> "LandingBatch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def discard(landings: Iterable[Landing]) -> None:
    for x in landings:
        x.done = True
        with contextlib.suppress(FileNotFoundError):
            os.unlink(x.tmp)
