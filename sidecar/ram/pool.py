"""The free pool: collected blob files kept under ``blobs/.tmp-free-*`` for reuse.

Garbage collection renames collected files into the pool instead of unlinking them, and a
blob write of exactly a pool file's size overwrites that file in place. On tmpfs,
overwriting pages that exist is ~2x faster than first-touch writes, and the unlink (freeing
the pages) leaves the commit's critical path. Pool files are temp files: never visible as
blobs, removed when a store opens, counted as reclaimable space.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable

from mtc.sidecar.ram import readers
from mtc.sidecar.ram.common import temp_name
from mtc.sidecar.ram.mapped import MapCache

# Collected files smaller than this are unlinked, not pooled: cheap to free and to write anew.
POOL_MIN = 64 << 10


class FreePool:
    """Pool files by exact byte size. ``round`` gives a size as allocated (whole pages)."""

    def __init__(self, directory: Path, *, enabled: bool, round: Callable[[int], int],
                 maps: MapCache | None = None):
        self.directory = directory
        self._maps = maps if maps is not None else MapCache()  # landing maps follow their files in and out
        self.enabled = bool(enabled)
        self._round = round
        self._files: dict[int, list[Path]] = {}
        self._bytes = 0  # allocated bytes of the pool files
        self._lock = threading.Lock()

    def take(self, size: int) -> tuple[int, Path] | None:
        """A pool file of exactly ``size`` bytes, open for writing at offset 0; None if none."""
        while True:
            with self._lock:
                paths = self._files.get(size)
                if not paths:
                    return None
                path = paths.pop()
                if not paths:
                    del self._files[size]
                self._bytes -= self._round(size)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)  # read too: a receiver may map it
            except FileNotFoundError:
                continue  # removed meanwhile (another store opened this root)
            st = os.fstat(fd)
            if st.st_size == size and st.st_nlink == 1:
                return fd, path
            os.close(fd)
            self._maps.forget(st)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def reuse(self, sizes: Iterable[int]) -> int:
        """Bytes of blobs of ``sizes`` that pool files would take in place (each file once)."""
        want = Counter(int(n) for n in sizes)
        if not want:
            return 0
        with self._lock:
            have = {n: len(ps) for n, ps in self._files.items()}
        return sum(min(c, have.get(n, 0)) * self._round(n) for n, c in want.items())

    def stats(self) -> tuple[int, int]:
        """(files, allocated bytes) in the pool."""
        with self._lock:
            return sum(len(ps) for ps in self._files.values()), self._bytes

    def forget(self) -> None:
        """Drop every pool file from the books without touching the disk (its files are gone)."""
        with self._lock:
            self._files.clear()
            self._bytes = 0

    def drain(self, keep: Counter | None = None) -> int:
        """Unlink pool files, except up to ``keep[size]`` files of each size; returns bytes freed.

        ``keep`` is decremented by the files kept.
        """
        doomed = []
        with self._lock:
            for size in list(self._files):
                paths = self._files[size]
                n = min(len(paths), keep[size]) if keep is not None else 0
                if keep is not None:
                    keep[size] -= n
                doomed.extend(paths[n:])
                self._bytes -= (len(paths) - n) * self._round(size)
                if n:
                    del paths[n:]
                else:
                    del self._files[size]
        freed = 0
        for p in doomed:
            with contextlib.suppress(FileNotFoundError):
                st = os.stat(p)
                freed += st.st_blocks * 512
                os.unlink(p)
                self._maps.forget(st)  # a kept map would hold the pages
        return freed

    def recycle(self, path: str | Path, st: os.stat_result, cap: int | None) -> bool:
        """Move the collected blob file ``path`` into the pool; False if it must be unlinked.

        Refused when the file is small, has other links, would take the pool over ``cap``
        bytes, or is read by this process or mapped by any process right now (a restored array
        may be a map of it: ``readers``).
        """
        size = st.st_size
        if not self.enabled or size < POOL_MIN or st.st_nlink != 1:
            return False
        alloc = self._round(size)
        with self._lock:
            if cap is not None and self._bytes + alloc > cap:
                return False
            dst = temp_name(self.directory, "free-")
            with readers.registry as held:
                key = (st.st_dev, st.st_ino)
                if key in held or not readers.rename_unless_mapped(path, dst, key):
                    return False
            self._files.setdefault(size, []).append(dst)
            self._bytes += alloc
        self._maps.moved(st, dst)
        return True
