"""A local directory as an object store (the embedded default backup backend).

Unlike the ramdisk, this is durable storage: every write goes to a temporary file in the
destination directory, is fsynced, then renamed into place (os.replace) or, for
create-only writes, hard-linked (os.link fails if the name exists, so of two concurrent
writers exactly one creates the object); the directory is fsynced after. Temporary files
start with "." and are never listed (object names cannot start with ".").
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import uuid
from pathlib import Path

from mtc.shared.safe_files import UntrustedFileError, open_regular
from mtc.shared.objstore.store import (
    MAX_SMALL_OBJECT_BYTES,
    FatalStoreError,
    ObjectNotFoundError,
    ObjectStore,
    TransientStoreError,
    UntrustedObjectError,
    validate_name,
    validate_prefix,
)

logger = logging.getLogger(__name__)

_TMP_PREFIX = ".mtc-tmp-"
_COPY_CHUNK = 64 << 20
# A listing that failed with these may succeed later (out of file descriptors or memory, busy).
_TRANSIENT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN, errno.EBUSY, errno.EINTR,
                               errno.ETIMEDOUT})


class LocalStore(ObjectStore):
    """Objects as files under `root` (created if missing, unless `create` is false: a reader that
    must leave no folder behind; a root that is not there then lists as empty)."""

    def __init__(self, root: str | os.PathLike[str], *, create: bool = True):
        self.root = Path(root).absolute()
        self.url = self.root.as_uri() + "/"
        if not create:
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise FatalStoreError(f"cannot create the backup directory {self.root}: {e}") from e

    def _path(self, name: str) -> Path:
        return self.root / validate_name(name)

    # -- writes -------------------------------------------------------------------------

    def put_file(self, name: str, path: str, *, if_absent: bool = False) -> bool:
        self._check_guard()
        dest = self._path(name)
        if if_absent and dest.exists():
            return False
        with open(path, "rb") as src:
            size = os.fstat(src.fileno()).st_size
            return self._commit(dest, lambda out: _copy_fd(src.fileno(), out.fileno(), size), if_absent)

    def put_bytes(self, name: str, data: bytes, *, if_absent: bool = False) -> bool:
        self._check_guard()
        dest = self._path(name)
        if if_absent and dest.exists():
            return False
        return self._commit(dest, lambda out: out.write(data), if_absent)

    def _commit(self, dest: Path, write, if_absent: bool) -> bool:
        """Write through `write(fileobj)` into a temp file beside `dest`, then publish it."""
        try:
            created = self._makedirs(dest.parent)
        except OSError as e:
            raise FatalStoreError(f"cannot create {dest.parent} in {self.url}: {e}") from e
        tmp = dest.parent / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
        try:
            with open(tmp, "xb") as out:
                write(out)
                out.flush()
                os.fsync(out.fileno())
            if if_absent:
                try:
                    os.link(tmp, dest)
                except FileExistsError:
                    return False
                finally:
                    os.unlink(tmp)
            else:
                os.replace(tmp, dest)
            _fsync_dir(dest.parent)
            for d in created:
                _fsync_dir(d.parent)
            return True
        except BaseException as e:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            if isinstance(e, OSError) and not isinstance(e, FatalStoreError):
                raise FatalStoreError(f"cannot write {dest} in {self.url}: {e}") from e
            raise

    def _makedirs(self, d: Path) -> list[Path]:
        """Create `d` and missing parents under the root; return those created, deepest first."""
        created = []
        while not d.is_dir():
            created.append(d)
            d = d.parent
        for c in reversed(created):
            try:
                c.mkdir()
            except FileExistsError:
                if not c.is_dir():
                    raise FatalStoreError(
                        f"cannot store under {c}: a file of that name is in the way (objects "
                        "cannot be both a name and a prefix of another name in a local store)"
                    ) from None
        return created

    # -- reads --------------------------------------------------------------------------

    def _open_object(self, name: str) -> int:
        """A descriptor of the regular file behind ``name``: never through a link, never a FIFO or a
        device (anyone who can write the root could put one there), found without blocking."""
        path = self._path(name)
        try:
            return open_regular(path, "object")
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise self._missing(name) from None
        except UntrustedFileError as e:
            raise UntrustedObjectError(f"{e} (in {self.url}; not used)") from None

    def get_to_file(self, name: str, path: str) -> int:
        self._check_guard()
        fd = self._open_object(name)
        with os.fdopen(fd, "rb") as src, open(path, "wb") as out:
            size = os.fstat(src.fileno()).st_size
            _copy_fd(src.fileno(), out.fileno(), size)
        return size

    def get_bytes(self, name: str, *, max_bytes: int = MAX_SMALL_OBJECT_BYTES) -> bytes:
        self._check_guard()
        fd = self._open_object(name)
        with os.fdopen(fd, "rb") as src:
            if os.fstat(src.fileno()).st_size > max_bytes or len(data := src.read(max_bytes + 1)) > max_bytes:
                raise UntrustedObjectError(f"object {name!r} in {self.url} is larger than {max_bytes} bytes, more than "
                                           "mtc writes there; it was not read")
            return data

    def get_range(self, name: str, offset: int, length: int) -> bytes:
        self._check_guard()
        if offset < 0 or length < 0:
            raise ValueError(f"a range of {name!r} starts at {offset} and has {length} bytes: neither may be negative")
        fd = self._open_object(name)
        try:
            return os.pread(fd, length, offset)
        finally:
            os.close(fd)

    def exists(self, name: str) -> bool:
        self._check_guard()
        return _regular(self._path(name)) is not None

    def size(self, name: str) -> int | None:
        self._check_guard()
        st = _regular(self._path(name))
        return None if st is None else st.st_size

    def list(self, prefix: str = "") -> list[str]:
        self._check_guard()
        validate_prefix(prefix)
        # Walk only the directory the prefix is inside of, then filter by string prefix
        # (GCS semantics: "backups/2026" matches "backups/2026-01-01T...json").
        base = prefix.rpartition("/")[0]
        top = self.root / base if base else self.root
        out = []

        def failed(e: OSError) -> None:
            # os.walk skips a directory it cannot read: a listing would come back short, or empty, and
            # read as "no such objects" (no backups). Only a directory that is not there is empty.
            if isinstance(e, FileNotFoundError):
                return
            kind = TransientStoreError if e.errno in _TRANSIENT_ERRNOS else FatalStoreError
            raise kind(f"cannot list {prefix!r} in {self.url}: {e}") from e

        for dirpath, dirnames, filenames in os.walk(top, onerror=failed):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel = os.path.relpath(dirpath, self.root)
            rel = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            for f in filenames:
                if f.startswith("."):
                    continue  # temp files of writes in flight
                name = rel + f
                if name.startswith(prefix):
                    out.append(name)
        out.sort()
        return out

    def delete(self, name: str) -> None:
        self._check_guard()
        p = self._path(name)
        try:
            os.unlink(p)
        except (FileNotFoundError, NotADirectoryError):
            return
        _fsync_dir(p.parent)

    def _missing(self, name: str) -> ObjectNotFoundError:
        return ObjectNotFoundError(f"object {name!r} does not exist in {self.url}")


def _regular(p: Path) -> os.stat_result | None:
    """The status of ``p`` when it is a regular file (not a link to one), else None."""
    try:
        st = os.lstat(p)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def _copy_fd(src: int, dst: int, size: int) -> None:
    """Copy `size` bytes in the kernel where it can (copy_file_range, then sendfile),
    else through a buffer."""
    done = 0
    for fn in (_copy_file_range, _sendfile):
        try:
            while done < size:
                n = fn(src, dst, done, min(_COPY_CHUNK, size - done))
                if n == 0:
                    raise OSError(errno.EIO, f"source file shrank while copying ({done} of {size} bytes)")
                done += n
            return
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise
    os.lseek(src, done, os.SEEK_SET)
    os.lseek(dst, done, os.SEEK_SET)
    while done < size:
        buf = os.read(src, min(_COPY_CHUNK, size - done))
        if not buf:
            raise OSError(errno.EIO, f"source file shrank while copying ({done} of {size} bytes)")
        view = memoryview(buf)
        while view:
            view = view[os.write(dst, view) :]
        done += len(buf)


def _copy_file_range(src: int, dst: int, offset: int, count: int) -> int:
    if not hasattr(os, "copy_file_range"):
        raise OSError(errno.ENOSYS, "no copy_file_range")
    return os.copy_file_range(src, dst, count, offset, offset)


def _sendfile(src: int, dst: int, offset: int, count: int) -> int:
    # sendfile writes at the output's file position; keep it in step with `offset`.
    os.lseek(dst, offset, os.SEEK_SET)
    return os.sendfile(dst, src, offset, count)


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
