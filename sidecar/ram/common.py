"""Names, limits and messages shared by the parts of the RAM tier."""

from __future__ import annotations

import errno
import itertools
import os
import secrets
from pathlib import Path

import numpy as np

from mtc.shared.errors import InsufficientSpaceError
from mtc.shared.hashing import HEX_LEN, check_blob_name, is_blob_name
from mtc.shared.requests import MAX_STEP  # noqa: F401 (a step names files with 12 digits)
from mtc.shared.safe_files import UntrustedFileError, open_regular

TMP_PREFIX = ".tmp-"
FREE_PREFIX = TMP_PREFIX + "free-"
HUGE_PAGE = 2 << 20  # a tmpfs huge page (x86-64, arm64 with 4 KiB base pages)


def format_binary_bytes(n: int) -> str:
    """``n`` bytes in binary units with two decimals, e.g. ``"1.20 GiB"``."""
    if abs(n) < 1024:
        return f"{int(n)} B"
    value = n / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def valid_name(name) -> bool:
    # The length check also refuses "<32 hex>\n", which a `$`-anchored regex lets through.
    return is_blob_name(name) and len(name) == HEX_LEN


def check_name(name) -> str:
    if not valid_name(name):
        check_blob_name(name)  # raises ValueError with the standard message
        raise ValueError(f"invalid blob name {name!r}: expected {HEX_LEN} lowercase hex digits")
    return name


def check_step(step) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or not 0 <= step <= MAX_STEP:
        raise ValueError(f"invalid step {step!r}: expected an integer in [0, {MAX_STEP}]")
    return int(step)


# Temp names: a random prefix drawn once per process, then a counter (no getrandom per name).
# They only have to differ from each other; every creator opens with O_EXCL.
_TEMP_PREFIX = secrets.token_hex(4)
_temp_counter = itertools.count()


def temp_name(directory: Path, tag: str = "") -> Path:
    """A fresh temp file name in ``directory`` (never looks like committed data)."""
    return Path(temp_path(str(directory), tag))


def temp_path(directory: str, tag: str = "") -> str:
    """``temp_name`` as a string (no Path to build: for the per-save writes)."""
    return f"{directory}/{TMP_PREFIX}{tag}{_TEMP_PREFIX}{next(_temp_counter) & 0xFFFFFFFF:08x}"


def file_key(st: os.stat_result) -> tuple:
    """What identifies one version of a file that is only ever replaced atomically (a new inode)."""
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size


def read_fd(fd: int, size: int) -> bytes:
    """The rest of the regular file open at ``fd``, whose size (fstat) is ``size``."""
    chunks = []
    while True:
        want = max(size, 0) + 1
        got = os.read(fd, want)
        if got:
            chunks.append(got)
        if len(got) < want:  # a regular file reads short only at its end (an empty read: at it)
            return b"".join(chunks) if len(chunks) != 1 else chunks[0]
        size = 1 << 16


def read_file(path: str | os.PathLike, max_bytes: int, what: str = "file") -> tuple[bytes, tuple]:
    """The bytes of a small file and its ``file_key``, with raw calls (open, fstat, read, close):
    a buffered open adds a tty check, seeks and a second fstat to each. The file must be a regular
    one reached without a link, of at most ``max_bytes`` (``mtc.shared.safe_files``): else an
    UntrustedFileError (an OSError) naming ``what``."""
    fd = open_regular(path, what)
    try:
        st = os.fstat(fd)
        if st.st_size > max_bytes:
            raise UntrustedFileError(f"{what} {os.fspath(path)} has {st.st_size} bytes, more than the {max_bytes} "
                                     "one of its kind may have; it is not read (remove it)")
        return read_fd(fd, st.st_size), file_key(st)
    finally:
        os.close(fd)


def replace_file(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` as ``path`` (mode 0600) through a temporary beside it, renamed over it: whatever
    was at the temporary's name (a link planted there) is removed first, not written through."""
    path = Path(path)
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}-{os.getpid()}")
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def open_blob(path: str | os.PathLike) -> int:
    """A read-only descriptor of a blob's file; FileNotFoundError when the name is not a regular
    file reached without a link (a link or a FIFO planted under a blob's name: not a copy here)."""
    try:
        return open_regular(path, "blob")
    except UntrustedFileError as e:
        raise FileNotFoundError(errno.ENOENT, str(e), os.fspath(path)) from None


def free_bytes(root: Path) -> int:
    st = os.statvfs(root)
    return st.f_bavail * st.f_frsize


def no_space(root: Path, what: str, step: int | None, needed: int | None, err: OSError) -> InsufficientSpaceError:
    """The error for a write of ``what`` that ran out of ramdisk (its partial file removed)."""
    free = free_bytes(root)
    need = f"{format_binary_bytes(needed)} ({needed} bytes)" if needed is not None else "more space"
    step_s = f"step {step}" if step is not None else "a step"
    return InsufficientSpaceError(
        f"ramdisk {root} is full while writing {what} of {step_s}: needed {need}, "
        f"{format_binary_bytes(free)} ({free} bytes) free ({err.strerror}); the partial file was removed. "
        f"Make the ramdisk larger: see `mtc size --params ... --hosts ...`, or lower local_max_to_keep")


def page_rounder(path: Path):
    """A function that rounds a byte count up to ``path``'s filesystem block (a tmpfs page),
    as the filesystem allocates it."""
    block = os.statvfs(path).f_frsize or 1
    return lambda n: -(-int(n) // block) * block
