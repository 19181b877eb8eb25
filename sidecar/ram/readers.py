"""Blob files that this process is reading or has mapped, by (st_dev, st_ino), across all stores.

Two stores of one root in a process share it. Garbage collection never recycles such a file
into the free pool (it unlinks it instead), so a restored array that maps a blob never changes.
"""

from __future__ import annotations

import collections
import threading
import weakref
from collections import Counter

_in_use: Counter = Counter()
_lock = threading.Lock()
# Keys of mappings that went away. A mapping's finaliser runs wherever the garbage collector
# does, possibly in a thread that holds _lock, so it must not take the lock: it queues the key
# (deque.append is atomic) and whoever takes the lock next applies the queue.
_unmapped: collections.deque = collections.deque()

Key = tuple[int, int]


def _decrement(key: Key) -> None:
    _in_use[key] -= 1
    if _in_use[key] <= 0:
        del _in_use[key]


class _Registry:
    """``with registry:`` holds the in-use registry, with every finished mapping released."""

    def __enter__(self) -> Counter:
        _lock.acquire()
        while _unmapped:  # only ever emptied under the lock
            _decrement(_unmapped.popleft())
        return _in_use

    def __exit__(self, *exc) -> None:
        _lock.release()


registry = _Registry()


def acquire(key: Key) -> None:
    with registry as held:
        held[key] += 1


def release(key: Key) -> None:
    with registry:
        _decrement(key)


def hold_while_mapped(mapping, key: Key) -> None:
    """Keep ``key`` registered for as long as ``mapping`` (an mmap) lives."""
    acquire(key)
    weakref.finalize(mapping, _unmapped.append, key)


def in_use() -> set[Key]:
    """(st_dev, st_ino) of the blob files this process reads or maps now (for tests, status)."""
    with registry as held:
        return set(held)
