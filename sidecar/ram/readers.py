"""Blob files that are read or mapped, so that no collection recycles them under a reader.

In this process: a registry by (st_dev, st_ino), across all stores (two stores of one root in a
process share it). Across processes: a mapping also holds a shared ``flock`` on its file for
as long as it lives, and ``rename_unless_mapped`` (the only way a blob file enters the free
pool) takes the exclusive lock first. A restored array on a CPU backend is a private map of
its blob (``BlobFiles.map``): a file recycled and overwritten in place would change the
array's bytes, whichever process recycled it. Garbage collection unlinks such a file instead;
its pages go when the last array using them does.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import os
import resource
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

# Descriptors that hold a map's lock (one per live map). At most half the process's descriptor
# limit: past it a blob is read instead of mapped, so that sockets and files still open.
_lock_fds: set[int] = set()


def max_locked_maps() -> int:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return (1 << 20) if soft == resource.RLIM_INFINITY else soft // 2


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


def _unmap(key: Key, lock_fd: int | None) -> None:
    _unmapped.append(key)
    if lock_fd is not None:
        _lock_fds.discard(lock_fd)
        os.close(lock_fd)  # the last descriptor of the locked open file: the shared lock goes


def hold_while_mapped(mapping, key: Key, fd: int | None = None, path: str | os.PathLike | None = None) -> None:
    """Keep ``key`` registered for as long as ``mapping`` (an mmap of the file open as ``fd``) lives.

    With ``fd``, the file is also locked shared (``flock``) on a duplicate of ``fd`` that is
    closed with the mapping, which keeps garbage collection in other processes from recycling
    it (``rename_unless_mapped``); the lock dies with this process. Then ``path`` (where the
    file was opened) must still name it once locked: OSError otherwise, also when no descriptor
    is left (``max_locked_maps``) or the file is being recycled right now; the caller reads the
    blob instead."""
    lock_fd = None
    if fd is not None:
        with registry:  # the count and the reservation at once
            if len(_lock_fds) >= max_locked_maps():
                raise OSError(errno.EMFILE, f"{len(_lock_fds)} blob maps are open, half the descriptor limit "
                                            "(ulimit -n); reading the blob instead")
            lock_fd = os.dup(fd)  # OSError (EMFILE) when out of descriptors
            _lock_fds.add(lock_fd)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # EWOULDBLOCK: being recycled now
            if path is not None:
                try:
                    st = os.stat(path)
                    moved = (st.st_dev, st.st_ino) != key
                except FileNotFoundError:
                    moved = True
                if moved:  # recycled or removed before the lock was taken
                    raise OSError(errno.ESTALE, "the blob file was collected while it was being mapped", str(path))
        except BaseException:
            _lock_fds.discard(lock_fd)
            os.close(lock_fd)
            raise
    acquire(key)
    weakref.finalize(mapping, _unmap, key, lock_fd)


def rename_unless_mapped(path: str | os.PathLike, dst: str | os.PathLike, key: Key) -> bool:
    """Rename the file ``key`` at ``path`` to ``dst`` unless a process maps it (or it is gone,
    or ``path`` names another file now); whether it was renamed. Call it holding ``registry``
    (which answers for this process's readers)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # gone, or not ours to open (so not ours to lock): the caller unlinks it
        return False
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != key:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # mapped by some process (or no lock to be had): the caller unlinks it instead
            return False
        try:
            os.rename(path, dst)  # under the lock: a mapper that locks after this sees the name gone
        except FileNotFoundError:
            return False
        return True
    finally:
        os.close(fd)


def in_use() -> set[Key]:
    """(st_dev, st_ino) of the blob files this process reads or maps now (for tests, status)."""
    with registry as held:
        return set(held)
