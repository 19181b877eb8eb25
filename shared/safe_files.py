"""Reading files that someone else may have put there: a regular file, not through a link, bounded.

The ramdisks and a local backup root can be written by more principals than the job (another
container on the same volume, a shared directory). A name there may be a symbolic link to a secret
of this machine, a FIFO that blocks whoever opens it, a link to ``/dev/zero`` that never ends, or a
file far larger than its kind ever is. Every read of such a file goes through ``read_regular``:
opened without following a link in its last component (``O_NOFOLLOW``) and without blocking
(``O_NONBLOCK``: a FIFO opens at once and is then refused), checked to be a regular file
(``fstat``, on what was opened, not on the name), and read up to a limit that fits its kind.
"""

from __future__ import annotations

import errno
import os
import stat

from mtc.shared.errors import MTCError

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
# The most a step's manifest file may hold (the record of every shard: far more than a 4,096-host
# job's); a larger file on a ramdisk is not read.
MAX_MANIFEST_BYTES = GiB
# The most a small JSON note on a ramdisk may hold (the head's lease, the host note).
MAX_NOTE_BYTES = 64 * KiB


class UntrustedFileError(MTCError, OSError):
    """A file mtc reads from shared storage is not a regular file (a link, a FIFO, a device), is larger
    than its kind may be, or its text is not what its kind holds."""


def open_regular(path: str | os.PathLike, what: str = "file") -> int:
    """A read-only descriptor of ``path``, which must be a regular file reached without a link.

    FileNotFoundError passes through (a missing file is the caller's business); anything that is not
    a regular file is an UntrustedFileError naming ``what`` and the path.
    """
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UntrustedFileError(f"{what} {os.fspath(path)} is a symbolic link; mtc reads only regular files "
                                     "there (remove the link)") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedFileError(f"{what} {os.fspath(path)} is not a regular file ({_kind(st.st_mode)}); mtc "
                                     "reads only regular files there (remove it)")
        return fd  # O_NONBLOCK does nothing to a regular file's reads: left as it is (no extra calls)
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike, max_bytes: int, what: str = "file") -> bytes:
    """The content of the regular file ``path`` (see ``open_regular``), at most ``max_bytes``: a larger
    one is an UntrustedFileError, found without reading more than ``max_bytes + 1`` bytes."""
    fd = open_regular(path, what)
    try:
        if os.fstat(fd).st_size > max_bytes:
            raise _too_large(path, max_bytes, what)
        chunks, got = [], 0
        while True:
            chunk = os.read(fd, min(max_bytes + 1 - got, 8 * MiB))
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            got += len(chunk)
            if got > max_bytes:  # it grew while read
                raise _too_large(path, max_bytes, what)
    finally:
        os.close(fd)


def read_first_line(path: str | os.PathLike, max_bytes: int, what: str = "file") -> bytes:
    """The first line of the regular file ``path`` (see ``open_regular``), without its newline: the
    whole file when it has one line. A line longer than ``max_bytes`` is an UntrustedFileError; no more
    of the file is read than the line (in chunks of 1 MiB)."""
    fd = open_regular(path, what)
    try:
        chunks, got = [], 0
        while True:
            chunk = os.read(fd, min(max_bytes + 1 - got, MiB))
            cut = chunk.find(b"\n")
            if cut >= 0:
                chunk = chunk[:cut]
            chunks.append(chunk)
            got += len(chunk)
            if got > max_bytes:
                raise _too_large(path, max_bytes, what)
            if cut >= 0 or not chunk:
                return b"".join(chunks)
    finally:
        os.close(fd)


def read_text(path: str | os.PathLike, max_bytes: int, what: str = "file") -> str:
    """``read_regular`` decoded as UTF-8; bad bytes are an UntrustedFileError naming the file."""
    data = read_regular(path, max_bytes, what)
    return decode_text(data, f"{what} {os.fspath(path)}")


def decode_text(data: bytes, where: str) -> str:
    """``data`` as UTF-8 text; an UntrustedFileError naming ``where`` when it is not."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UntrustedFileError(f"{where} is not UTF-8 text (byte {e.start}: {data[e.start:e.start + 1]!r}); "
                                 "it was not written by mtc: fix or remove it") from None


def _too_large(path, max_bytes: int, what: str) -> UntrustedFileError:
    return UntrustedFileError(f"{what} {os.fspath(path)} is larger than {max_bytes} bytes, more than a {what} "
                              "ever holds; it was not read (remove it)")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"
