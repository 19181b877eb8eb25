"""Blob files: content-addressed under ``blobs/<32-hex>``, written through temp files, read verified.

Blob writes may run from several threads at once: a finished temp file is published with a
hard link, which cannot overwrite, so among racing writers of one blob exactly one wins and a
committed file is never replaced under a reader. Reads and maps register the file by inode
(``mtc.sidecar.ram.readers``) so that it is never recycled while in use.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import shutil
import stat
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from mtc.shared.buffers import byte_view
from mtc.shared.errors import CorruptBlobError, InsufficientSpaceError
from mtc.shared.hashing import blob_name, new_hasher
from mtc.sidecar.ram import readers
from mtc.sidecar.ram.common import (FREE_PREFIX, HUGE_PAGE, TMP_PREFIX, check_name, open_blob, temp_name, temp_path,
                                    valid_name)
from mtc.sidecar.ram.mapped import Landing, MapCache
from mtc.sidecar.ram.pool import FreePool

# Large enough that syscall overhead vanishes; small enough that hashing a chunk right after
# reading it finds it still in cache.
_WRITE_CHUNK = 64 << 20
_READ_CHUNK = 4 << 20

NoSpace = Callable[[str, "int | None", "int | None", OSError], InsufficientSpaceError]


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
    if size >= HUGE_PAGE:
        os.ftruncate(fd, size)


class BlobFiles:
    """The blobs of one store in ``directory``; ``pool`` supplies files to overwrite in place,
    ``no_space(what, step, needed, err)`` makes the error of a write that ran out of space."""

    def __init__(self, directory: Path, *, pool: FreePool, round: Callable[[int], int], no_space: NoSpace,
                 maps: MapCache | None = None):
        self.directory = directory
        self._dir_s = str(directory)  # per-save paths are joined as strings
        self.pool = pool
        self.maps = maps if maps is not None else MapCache()
        self.round = round
        self._no_space = no_space

    def path(self, name: str) -> Path:
        """The file of blob ``name``; the name is validated first (ValueError if malformed)."""
        return self.directory / check_name(name)

    def has(self, name: str) -> bool:
        """True when blob ``name`` is committed in this store (ValueError for a malformed name)."""
        try:
            return stat.S_ISREG(os.stat(f"{self._dir_s}/{check_name(name)}").st_mode)
        except OSError as e:  # as Path.is_file: absent is False, other errors are errors
            if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.EBADF, errno.ELOOP):
                return False
            raise

    def size(self, name: str) -> int:
        """Size in bytes of blob ``name``; FileNotFoundError when absent."""
        path = self.path(name)
        try:
            return path.stat().st_size
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, f"blob {name} is not in the ramdisk", str(path)) from None

    def names(self) -> set[str]:
        """Names of all committed blobs (temp files excluded)."""
        return {n for n in os.listdir(self.directory) if valid_name(n)}

    def missing_bytes(self, blobs: dict[str, int]) -> int:
        """Bytes of ``blobs`` ({name: nbytes}) not already present: what a step would add.

        Each size is rounded up to the filesystem block (a tmpfs page), as it is allocated.
        """
        return sum(self.round(n) for name, n in blobs.items() if not self.has(name))

    @contextlib.contextmanager
    def reading(self, name: str) -> Iterator[tuple[int, int, tuple[int, int]]]:
        """Open committed blob ``name`` for reading, registered so that it is not recycled.

        Yields (fd, size, key); raises FileNotFoundError when the blob is not there. The file
        is registered first (this process's collection) and locked shared (``flock``: another
        process's, see ``readers.rename_unless_mapped``), and its name checked after, so a
        collection that moves it to the free pool either sees the reader (and unlinks it instead)
        or has already moved it (and the name check fails): a read never hashes a file that is
        being rewritten as another blob, which would drop a good copy as corrupt.
        """
        path = self.path(name)
        for _ in range(3):
            fd = open_blob(path)  # FileNotFoundError: not there (or not a regular file: not a copy)
            try:
                st = os.fstat(fd)
                key = (st.st_dev, st.st_ino)
                readers.acquire(key)
                try:
                    try:  # released when ``fd`` closes
                        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                        locked = True
                    except OSError:  # another process is moving it to its pool right now: look again
                        locked = False
                    try:
                        now = os.stat(path)
                    except FileNotFoundError:
                        now = None
                    if locked and now is not None and (now.st_dev, now.st_ino) == key:
                        yield fd, st.st_size, key
                        return
                finally:
                    readers.release(key)
            finally:
                os.close(fd)
            if now is None:
                break
        raise FileNotFoundError(errno.ENOENT, f"blob {name} is not in the ramdisk", str(path))

    def publish(self, tmp: str | Path, final: str | Path) -> bool:
        """Move a finished temp file to its final name; False if the blob already existed."""
        try:
            os.link(tmp, final)
        except FileExistsError:
            return False
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                raise
            if os.path.exists(final):
                return False
            os.replace(tmp, final)  # filesystem without hard links: same bytes, so replacing is harmless
            return True
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return True

    def land(self, size: int, *, cold_ok: bool = False) -> Landing:
        """A temp file of ``size`` bytes, mapped for writing (``mtc.sidecar.ram.mapped``).

        A pool file of that size when there is one (its pages, and usually its map, exist), else
        a new file. With ``cold_ok``, a file without a warm map (a new one, or a pool file never
        mapped) is mapped lazily and handed out cold: the writer fills it with ``Landing.fill``.
        Otherwise its space is allocated and its map populated now: an OSError (ENOSPC) here,
        never a SIGBUS later.
        """
        tmp = temp_name(self.directory)
        taken = self.pool.take(size)
        if taken is not None:
            fd, path = taken
            try:
                os.rename(path, tmp)
            except BaseException:
                os.close(fd)
                raise
        else:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            try:
                st = os.fstat(fd)
                cold = cold_ok and not self.maps.is_warm(st)
                if cold:
                    if st.st_size != size:
                        os.ftruncate(fd, size)  # sparse: the fill's pwrite allocates (within_size: _presize)
                        st = os.fstat(fd)
                elif st.st_size != size or st.st_blocks * 512 < size:
                    os.posix_fallocate(fd, 0, size)  # sets the size too (huge=within_size pages: _presize)
                    st = os.fstat(fd)
                m = self.maps.get(fd, st, tmp, populate=not cold)
            finally:
                os.close(fd)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        return Landing(tmp, size, np.frombuffer(m, np.uint8), st, cold=cold)

    def publish_landed(self, landing: Landing, name: str) -> bool:
        """Publish a filled landing as blob ``name`` (its hash: the caller hashed the buffer).

        False when the blob already existed: the landing's file is dropped then (dedupe).
        """
        final = self.directory / check_name(name)
        landing.done = True
        added = self.publish(landing.tmp, final)
        if added:
            self.maps.moved(landing.st, final)
        else:
            self.maps.forget(landing.st)
        return added

    def write(self, data, *, name: str | None = None) -> tuple[str, bool]:
        """Store ``data`` (bytes-like or C-contiguous ndarray: its raw bytes) as a blob.

        ``name`` is trusted as the precomputed hash when given. Returns (name, written);
        written is False when the blob was already present (nothing is written then).
        A free-pool file of the same size is overwritten when there is one; it is published
        only once completely written, like a new file. Raises InsufficientSpaceError (temp
        file removed) when the ramdisk fills up.
        """
        mv = byte_view(data)
        name = blob_name(mv) if name is None else check_name(name)
        final = f"{self._dir_s}/{name}"
        if os.path.exists(final):
            return name, False
        n = mv.nbytes
        retried = False
        while True:
            taken = self.pool.take(n) if n else None
            if taken is not None:
                fd, tmp = taken
            else:
                tmp = temp_path(self._dir_s)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
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
                    if not retried and self.pool.drain():
                        retried = True  # the pool held the space: free it, write anew
                        continue
                    raise self._no_space(f"blob {name}", None, n, e) from e
                raise
            return name, self.publish(tmp, final)

    def read_into(self, name: str, out) -> None:
        """Read blob ``name`` into ``out`` (writable buffer or ndarray of exactly its size).

        Raises CorruptBlobError when the blob is missing, has another size, or its bytes do
        not hash to its name; ``out`` holds garbage then.
        """
        path = self.path(name)
        mv = byte_view(out)
        if mv.readonly:
            raise TypeError(f"read_into needs a writable buffer for blob {name}")
        hasher = new_hasher()
        try:
            with self.reading(name) as (fd, size, _):
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

    def verify(self, name: str) -> bool:
        """True when blob ``name`` is present and its bytes hash to its name."""
        try:
            with self.reading(name) as (fd, size, _):
                return _hash_fd(fd, size) == name
        except FileNotFoundError:
            return False

    def map(self, name: str, nbytes: int | None = None) -> np.ndarray:
        """Blob ``name`` as a verified uint8 array that maps the file (no copy).

        The mapping is private (copy-on-write): writes to the array never reach the file. The
        file is registered as in use and locked shared for as long as the mapping lives, so no
        process recycles it and the array never changes under its holder (a collection unlinks it instead; its
        pages are freed when the last array using them goes). Raises CorruptBlobError when
        the blob is missing, is not ``nbytes`` long, or does not hash to its name; OSError
        when it cannot be mapped (the caller reads it instead).
        """
        path = self.path(name)
        try:
            with self.reading(name) as (fd, size, key):
                if nbytes is not None and size != nbytes:
                    raise CorruptBlobError(f"blob {name} at {path} has {size} bytes, but the reader expects "
                                           f"{nbytes}: wrong size, not using it")
                if size == 0:
                    return np.empty(0, np.uint8)
                m = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                readers.hold_while_mapped(m, key, fd, path)  # released when it is unmapped
        except FileNotFoundError:
            raise CorruptBlobError(f"blob {name} is missing from the ramdisk ({path})") from None
        actual = blob_name(m)
        if actual != name:
            raise CorruptBlobError(f"blob {name} at {path} is corrupt: its bytes hash to {actual}")
        return np.frombuffer(m, np.uint8)

    def open_temp(self, size: int | None = None) -> tuple[int, Path]:
        """A new temp file in ``blobs/`` for receiving a blob: (fd open for writing, path).

        The fd is open for reading too, so that the caller may map it (``huge_pages``).
        Write the bytes, close the fd, then call :meth:`finalize_temp` (or
        :meth:`discard_temp` on failure). With ``size`` (the exact number of bytes that
        will be written), a free-pool file of that size is reused when there is one: its
        pages are overwritten in place, which is much cheaper than allocating new ones.
        """
        if size is not None:
            reused = self.reuse_temp(size)
            if reused is not None:
                return reused
        return self.new_temp(size)

    def reuse_temp(self, size: int) -> tuple[int, Path] | None:
        """:meth:`open_temp` from a free-pool file of exactly ``size`` bytes; None when there is none.
        Quick (no allocation): a caller may hold a lock around it."""
        if not self.pool.enabled:
            return None
        taken = self.pool.take(int(size))
        if taken is None:
            return None
        fd, path = taken
        tmp = temp_name(self.directory)
        os.rename(path, tmp)  # a plain temp name: finalize/discard accept it
        return fd, tmp

    def new_temp(self, size: int | None = None) -> tuple[int, Path]:
        """:meth:`open_temp` as a new file, its ``size`` bytes allocated now when given."""
        tmp = temp_name(self.directory)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        if size is not None:
            try:
                _presize(fd, int(size))
            except BaseException:
                os.close(fd)
                self.discard_temp(tmp)
                raise
        return fd, tmp

    def _check_temp(self, temp_path) -> Path:
        tmp = Path(temp_path)
        if tmp.parent != self.directory or not tmp.name.startswith(TMP_PREFIX) or tmp.name.startswith(FREE_PREFIX):
            raise ValueError(f"{tmp} is not a temp blob of the ramdisk {self.directory.parent} (use open_temp)")
        return tmp

    def discard_temp(self, temp_path) -> None:
        """Remove a temp file from :meth:`open_temp` (a failed transfer)."""
        with contextlib.suppress(FileNotFoundError):
            self._check_temp(temp_path).unlink()

    def finalize_temp(self, temp_path, name: str, verify: bool = True) -> bool:
        """Commit a received temp file as blob ``name``; returns whether it was added.

        With ``verify`` (the default) the bytes are hashed first; a mismatch removes the
        temp file and raises CorruptBlobError. False when the blob was already present.
        """
        tmp = self._check_temp(temp_path)
        try:
            check_name(name)
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
            self.discard_temp(tmp)
            raise
        return self.publish(tmp, self.directory / name)

    def put_file(self, name: str, src_path: str | os.PathLike) -> bool:
        """Copy the file ``src_path`` in as blob ``name``, verified; returns whether it was added."""
        check_name(name)
        if self.has(name):
            return False
        retried = False
        while True:
            fd, tmp = self.open_temp()
            os.close(fd)
            try:
                shutil.copyfile(src_path, tmp)  # sendfile on Linux: no copy through Python
            except BaseException as e:
                self.discard_temp(tmp)
                if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                    if not retried and self.pool.drain():
                        retried = True  # the free pool held the space
                        continue
                    raise self._no_space(f"blob {name}", None, os.stat(src_path).st_size, e) from e
                raise
            return self.finalize_temp(tmp, name, verify=True)

    def allocated(self, names: Iterable[str]) -> int:
        """Bytes the filesystem holds for the blobs ``names`` that exist (st_blocks)."""
        total = 0
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                total += (self.directory / name).stat().st_blocks * 512
        return total
