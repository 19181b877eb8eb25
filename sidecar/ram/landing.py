"""Landings: blob files mapped for a writer that fills them in place (one copy per save).

A save's bytes land straight in ramdisk pages. ``RamStore.land(sizes)`` takes a free-pool file
of each size (a collected blob of a pruned step: its pages exist) or makes a new, fallocated
one, maps it shared and writable, and hands the map out as a uint8 buffer. The writer fills it:
the head's staging copy in colocated mode on a CPU backend (the sidecar runs in the head's
process; ``mtc.shared.landing``), or the daemon's socket receive in cluster mode. Then
``write_shards`` recognises the buffer by its address, hashes the mapped pages and publishes the
file under its content name (``RamStore.publish_landed``). Nothing is copied a second time.

Mapping a file costs a page fault per page, more than the copy itself on a tmpfs with 4 KiB
pages. So maps are kept (``MapCache``): a landed file becomes a blob, is collected into the
pool when its step is pruned and is landed in again two saves later, still mapped, with its page
tables in place. A map follows its file's path through those renames; ``MapCache.sweep`` (run
by garbage collection, before any free-space figure is read) drops the map of a file that was
unlinked, so that a deleted file's pages are never held.

Safety: a landing is only ever a pool file (never read or mapped by a restore: see
``FreePool.recycle``) or a new file; its space is taken before the first byte (fallocate for a
new file: a write through a map past a full tmpfs would be SIGBUS, not ENOSPC). Landings are
temp files until published; ``LandingBatch.close`` removes those a failed save did not publish.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

# Shards smaller than this are not landed: for them a map costs more syscalls than it saves
# copying (the caller copies them into a reused buffer and the store writes them).
LANDING_MIN = 64 << 10

# At most this many maps are kept (each is one of the process's vm.max_map_count areas, 65530
# by default); past it a landing's map goes when the arrays using it do.
MAX_KEPT_MAPS = 16384

Key = tuple[int, int]


def _key(st: os.stat_result) -> Key:
    return st.st_dev, st.st_ino


class MapCache:
    """Shared, writable maps of blob files by (st_dev, st_ino), each with the path its file has now.

    ``get`` returns the map of a file (creating it, populated, on a miss); ``moved`` follows a
    rename; ``sweep`` drops the maps whose file is gone from its path.
    """

    def __init__(self):
        self._maps: dict[Key, tuple[mmap.mmap, Path]] = {}
        self._lock = threading.Lock()

    def get(self, fd: int, st: os.stat_result, path: Path) -> mmap.mmap:
        key = _key(st)
        with self._lock:
            hit = self._maps.get(key)
        if hit is not None and len(hit[0]) == st.st_size:
            self.moved(st, path)
            return hit[0]
        # MAP_POPULATE: every page table entry in one call instead of a fault per page.
        m = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        with self._lock:
            if len(self._maps) < MAX_KEPT_MAPS or key in self._maps:
                self._maps[key] = (m, Path(path))
        return m

    def moved(self, st: os.stat_result, path: Path) -> None:
        """The file of ``st`` is now at ``path`` (no-op when it has no map)."""
        key = _key(st)
        with self._lock:
            hit = self._maps.get(key)
            if hit is not None:
                self._maps[key] = (hit[0], Path(path))

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
        for key, (_, path) in items:
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


class Landing:
    """One mapped temp blob file of ``size`` bytes; ``buffer`` is the uint8 view to fill."""

    __slots__ = ("tmp", "size", "buffer", "st", "done")

    def __init__(self, tmp: Path, size: int, buffer: np.ndarray, st: os.stat_result):
        self.tmp, self.size, self.buffer, self.st = tmp, size, buffer, st
        self.done = False

    @property
    def address(self) -> int:
        return self.buffer.ctypes.data


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

    def close(self) -> None:
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close([x for x in self.landings if x is not None and not x.done])

    def __enter__(self) -> "LandingBatch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def is_no_space(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


def discard(landings: Iterable[Landing]) -> None:
    for x in landings:
        x.done = True
        with contextlib.suppress(FileNotFoundError):
            os.unlink(x.tmp)
