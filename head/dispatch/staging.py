"""Host staging: the device-to-host copy that ``save()`` waits for, and where it lands.

Both dispatchers copy every unique shard once (so that a train step that donates its inputs
cannot touch what is being written), on several threads: ``np.copyto`` releases the GIL, and
one thread does not reach memory bandwidth. The destination is what makes it the only copy:
in colocated mode on a CPU backend, the sidecar's mapped ramdisk files (``mtc.shared.landing_zones``),
which it publishes as blobs where they lie; otherwise (cluster mode, which then sends them, and
shards the sidecar does not land) reused, 64-byte aligned buffers of ``HostStaging``, which
become CPU jax.Arrays without another copy.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np

from mtc.shared.buffers import aligned_empty

# Copies run on this many threads, in chunks of _COPY_CHUNK bytes so the threads share evenly.
_THREADS = max(1, min(4, os.cpu_count() or 1))
_COPY_CHUNK = 8 << 20


class HostStaging:
    """Reused staging buffers, keyed by (leaf key, box), and a parallel copier.

    Per save: ``buffer(...)`` for every shard (marks it live), ``copy_all(pairs)``, then
    ``end()`` drops buffers the save did not use (a leaf that disappeared or changed shape).
    """

    def __init__(self, threads: int = _THREADS):
        self._buffers: dict[tuple, np.ndarray] = {}
        self._live: set = set()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="mtc-stage") if threads > 1 else None

    def buffer(self, key: tuple, shape: tuple, dtype: Any) -> np.ndarray:
        self._live.add(key)
        buf = self._buffers.get(key)
        if buf is None or buf.shape != tuple(shape) or buf.dtype != np.dtype(dtype):
            buf = self._buffers[key] = aligned_empty(tuple(shape), dtype)
        return buf

    def copy_all(self, copies: list[tuple[np.ndarray, np.ndarray]],
                 fills: list[Callable[[np.ndarray], bool] | None] | None = None) -> list[int]:
        """np.copyto(dst, src) for each pair, split in chunks over the staging threads.

        Where ``fills[i]`` is given, copy ``i`` is done by ``fills[i](src)`` instead (a cold
        landing, written with ``write()`` on one thread, largest first); returns the indices of
        the fills that declined (no room): their ``dst`` was not written.
        """
        fills = fills if fills is not None else [None] * len(copies)
        whole = sorted((i for i, f in enumerate(fills) if f is not None), key=lambda i: -copies[i][1].nbytes)
        jobs = []
        total = sum(copies[i][1].nbytes for i in whole)
        for (dst, src), fill in zip(copies, fills):
            if fill is not None:
                continue
            if not (dst.size and dst.flags.c_contiguous and src.flags.c_contiguous and dst.nbytes == src.nbytes
                    and dst.dtype == src.dtype):
                jobs.append((dst, src))
                continue
            d, s = dst.reshape(-1).view(np.uint8), src.reshape(-1).view(np.uint8)
            for a in range(0, d.size, _COPY_CHUNK):
                jobs.append((d[a:a + _COPY_CHUNK], s[a:a + _COPY_CHUNK]))
            total += d.size
        declined: list[int] = []

        def fill(i: int) -> None:
            if not fills[i](np.ascontiguousarray(copies[i][1])):
                declined.append(i)

        if self._pool is None or total < 2 * _COPY_CHUNK:
            for i in whole:
                fill(i)
            for dst, src in jobs:
                np.copyto(dst, src)
        else:
            # The fills first (each a whole file), then the chunks, which even out the threads.
            futures = [self._pool.submit(fill, i) for i in whole]
            futures += [self._pool.submit(np.copyto, dst, src) for dst, src in jobs]
            for f in futures:
                f.result()
        return sorted(declined)

    def end(self) -> None:
        for key in set(self._buffers) - self._live:
            del self._buffers[key]
        self._live = set()

    def close(self) -> None:
        self._buffers.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
