"""What filesystem holds a ramdisk directory, and whether its page size slows mtc down.

A tmpfs allocates, fills and maps its pages one at a time. With the default 4 KiB pages,
writing a blob into a tmpfs costs per-page work that 2 MiB pages avoid: a raw 1 GiB write ran
about 2.6x as fast with 2 MiB pages as with 4 KiB ones (the raw write of
``bench/bench_save_restore.py``, on each kind of tmpfs), and a peer fetch between two daemons
reached 0.38-0.45x of a raw loopback copy between memory buffers with 4 KiB pages against
0.71-0.89x on a tmpfs mounted ``huge=within_size`` (``bench/bench_peer.py``). So the ramdisk
should be a tmpfs with ``huge=within_size``; ``mount -o remount,huge=within_size DIR`` changes a
live mount. Blob files are sized before their first write (``RamStore``) so that
``within_size`` gives them huge pages on kernels that only look at the file size.

``describe(path)`` reads ``/proc/self/mountinfo``; ``advice(path)`` is the one line a sidecar
logs at start and ``mtc size --ramdisk`` prints, or None when there is nothing to fix.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Mount", "advice", "advice_for", "describe"]

MOUNTINFO = "/proc/self/mountinfo"


@dataclass(frozen=True)
class Mount:
    """The mount that holds a directory: where, which filesystem, its superblock options."""

    mountpoint: str
    fstype: str
    options: dict[str, str] = field(default_factory=dict)

    @property
    def is_tmpfs(self) -> bool:
        return self.fstype == "tmpfs"

    @property
    def huge(self) -> str:
        """The tmpfs ``huge=`` policy (``never`` when the mount does not say), "" if not a tmpfs."""
        return self.options.get("huge", "never") if self.is_tmpfs else ""


def _unescape(field_: str) -> str:
    # mountinfo writes space, tab, newline and backslash as 3-digit octal escapes
    out, i = [], 0
    while i < len(field_):
        code = field_[i + 1:i + 4]
        if field_[i] == "\\" and len(code) == 3 and code.isdigit():
            out.append(chr(int(code, 8)))
            i += 4
        else:
            out.append(field_[i])
            i += 1
    return "".join(out)


def _parse_options(text: str) -> dict[str, str]:
    opts = {}
    for item in text.split(","):
        if item:
            key, _, value = item.partition("=")
            opts[key] = value
    return opts


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts of a ``/proc/<pid>/mountinfo`` text, in its order (later ones stack on top)."""
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 2:
            continue
        options = _parse_options(fields[5]) if len(fields) > 5 else {}
        options.update(_parse_options(tail[2]) if len(tail) > 2 else {})
        mounts.append(Mount(_unescape(fields[4]), tail[0], options))
    return mounts


def describe(path: str | os.PathLike, mountinfo: str | None = None) -> Mount | None:
    """The mount holding ``path`` (which need not exist yet), or None where unknown."""
    if mountinfo is None:
        try:
            mountinfo = Path(MOUNTINFO).read_text()
        except OSError:
            return None  # not Linux, or no /proc: nothing to say
    real = os.path.realpath(path)  # symlinks resolved as far as the path exists
    best: Mount | None = None
    for m in parse_mountinfo(mountinfo):
        mp = m.mountpoint.rstrip("/") or "/"
        if real == mp or real.startswith(mp + "/") or mp == "/":
            if best is None or len(mp) >= len(best.mountpoint.rstrip("/") or "/"):
                best = m  # the longest match; on a tie the later mount is the one on top
    return best


def advice(path: str | os.PathLike, mountinfo: str | None = None) -> str | None:
    """One line on what would make ``path`` a faster ramdisk, or None when it is fine or unknown."""
    m = describe(path, mountinfo)
    return None if m is None else advice_for(path, m)


def advice_for(path: str | os.PathLike, m: Mount) -> str | None:
    """``advice`` for ``path`` held by mount ``m`` (already described)."""
    if not m.is_tmpfs:
        return (f"ramdisk {path} is not a tmpfs but {m.fstype} (mounted at {m.mountpoint}): local checkpoints "
                "go to that device at its speed. Point "
                "local_checkpoint_directory at a tmpfs (an emptyDir with medium: Memory in Kubernetes)")
    if m.huge in ("never", "deny", "advise", ""):  # mtc does not madvise: "advise" means small pages
        return (f"ramdisk {path} is a tmpfs at {m.mountpoint} with 4 KiB pages (huge={m.huge}): saves and peer "
                "copies into it pay per-page costs that 2 MiB pages avoid (peer fetch 0.38-0.45x vs 0.71-0.89x of a "
                f"raw socket copy in bench/bench_peer.py). Remount it: mount -o remount,huge=within_size {m.mountpoint}")
    return None


def is_no_space(e: BaseException) -> bool:
    """Whether ``e`` is a write that found the ramdisk (or the user's quota on it) full."""
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)
