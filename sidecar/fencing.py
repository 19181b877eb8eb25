"""One head at a time: the lease a sidecar keeps of the head that drives it (docs/architecture.md, "One head at a time").

A head claims every host when its manager starts, with a **generation** (a number larger than
any the hosts have seen) and who it is (host name, pid, start time). Each request that changes
a host (write, commit, abort, pulls, backups) carries the generation; a host refuses an older
one with ``FencedError``, which names the head that took over. So a second head on the same
hosts fences the first off, and a head restarted after kill -9 takes over without cleanup.

The lease lives on the ramdisk (``<root>/head.json``), next to the data it protects, so every
sidecar process of a host (and every colocated sidecar object of one process) sees the same
one; compare-and-set runs under ``flock`` on ``<root>/head.lock``. A ramdisk that lost its
lease (wiped) adopts the generation of the next request.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from mtc.shared.errors import FencedError, ProtocolError
from mtc.shared.safe_files import MAX_NOTE_BYTES
from mtc.sidecar.ram.common import file_key, read_file, replace_file

log = logging.getLogger(__name__)

LEASE_FILE = "head.json"
LOCK_FILE = "head.lock"


def describe_head(head: dict | None) -> str:
    if not head:
        return "a head whose identity this host did not record"
    return f"the head pid {head.get('pid')} on {head.get('host')}, started {head.get('started')}"


class HeadLease:
    """The generation and identity of the head that drives the ramdisk at ``root``."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self._path = self.root / LEASE_FILE
        self._lock_path = self.root / LOCK_FILE
        # (file key, parsed lease) of the last read: the file is only ever replaced (os.replace, a
        # new inode), so an unchanged key is an unchanged lease and one stat replaces the read.
        self._seen: tuple[tuple, dict] | None = None
        self._seen_lock = threading.Lock()

    @contextlib.contextmanager
    def _locked(self):
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def current(self) -> dict | None:
        """{"generation": int, "head": {...} or None}, or None when no head has claimed this ramdisk."""
        try:
            seen = self._seen
            if seen is not None and file_key(os.stat(self._path)) == seen[0]:
                return _copy(seen[1])
            data, key = read_file(self._path, MAX_NOTE_BYTES, "head's lease")
            doc = json.loads(data)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("ramdisk %s: unreadable %s (%s); treating it as unclaimed", self.root, LEASE_FILE, e)
            return None
        gen = doc.get("generation") if isinstance(doc, dict) else None
        if type(gen) is not int:
            log.warning("ramdisk %s: %s has no integer generation; treating it as unclaimed", self.root, LEASE_FILE)
            return None
        lease = {"generation": gen, "head": doc.get("head") if isinstance(doc.get("head"), dict) else None}
        with self._seen_lock:
            self._seen = (key, lease)
        return _copy(lease)

    def _write(self, generation: int, head: dict | None) -> None:
        replace_file(self._path, json.dumps({"generation": generation, "head": head}).encode())

    def claim(self, generation: int, head: dict) -> dict:
        """Take this ramdisk for ``head`` if ``generation`` is newer than the lease's; the lease after.

        A generation not newer than the current one is refused (``FencedError`` naming the holder):
        the head picks a larger one from the lease it is told about, or another head won the race.
        """
        _check_generation(generation)
        with self._locked():
            cur = self.current()
            if cur is not None and cur["generation"] >= generation:
                if cur["generation"] == generation and cur["head"] == head:
                    return cur  # the same head asking again (a retried request)
                if (cur["generation"] == generation and isinstance(head, dict) and head.get("closed")
                        and cur["head"] == {k: v for k, v in head.items() if k != "closed"}):
                    self._write(generation, head)  # the holder closed: the next head follows it, no takeover
                    return {"generation": generation, "head": head}
                raise FencedError(
                    f"cannot claim {self.root} for generation {generation}: {describe_head(cur['head'])} holds "
                    f"generation {cur['generation']}", current=cur)
            self._write(generation, head)
            if cur is not None and (cur["head"] or {}).get("closed"):
                log.info("ramdisk %s: %s follows %s, which closed (generation %d -> %d)", self.root,
                         describe_head(head), describe_head(cur["head"]), cur["generation"], generation)
            elif cur is not None:
                log.warning("ramdisk %s: %s takes over from %s, which did not close (generation %d -> %d)",
                            self.root, describe_head(head), describe_head(cur["head"]), cur["generation"], generation)
            return {"generation": generation, "head": head}

    def check(self, generation: Any, what: str) -> None:
        """Refuse ``what`` from a head older than the lease's; a newer generation is adopted."""
        if generation is None:
            cur = self.current()
            if cur is None:
                return  # never claimed: a tool or test driving a sidecar by hand
            raise FencedError(f"{what} carries no head generation, but {describe_head(cur['head'])} (generation "
                              f"{cur['generation']}) drives this host; only that head may change it", current=cur)
        _check_generation(generation)
        cur = self.current()
        if cur is not None and generation == cur["generation"]:
            return
        if cur is not None and generation < cur["generation"]:
            raise FencedError(
                f"{what} refused: this head (generation {generation}) was fenced off by {describe_head(cur['head'])} "
                f"(generation {cur['generation']}), which now drives these hosts; stop this head (its saves no "
                "longer count) or restart it to take over again", current=cur)
        with self._locked():  # newer: a lease lost with a wiped ramdisk, or a head that claimed meanwhile
            cur = self.current()
            if cur is None or generation > cur["generation"]:
                self._write(generation, cur["head"] if cur and cur["generation"] == generation else None)
            elif generation < cur["generation"]:
                raise FencedError(f"{what} refused: fenced off by {describe_head(cur['head'])} "
                                  f"(generation {cur['generation']})", current=cur)


def _copy(lease: dict) -> dict:
    """A caller's own copy of a cached lease."""
    return {"generation": lease["generation"], "head": None if lease["head"] is None else dict(lease["head"])}


def _check_generation(generation: Any) -> None:
    if type(generation) is not int or generation < 1:
        raise ProtocolError(f"head generation {generation!r:.40} is not an integer >= 1")
