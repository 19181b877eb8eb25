"""The commit policy and the values the tiers share, on the head's ground floor (it imports only
``mtc.shared``): which hosts keep each step's whole manifest (``choose_keepers``: the manager decides
and passes them to the transport's ``commit``), phase 2's two messages (``commit_messages``), and a
committed step as replication, the backup and the restore receive it (``CommittedStep``)."""

from __future__ import annotations

import threading
from typing import Callable

from mtc.shared import format as fmt
from mtc.shared import protocol

__all__ = ["CommittedStep", "choose_keepers", "commit_messages"]


def choose_keepers(hosts: list[str], slice_of: Callable[[str], int], step: int, count: int) -> list[str]:
    """The hosts that keep the whole manifest of ``step``: ``count`` of them, on distinct slices
    while there are slices left, starting at a host that moves with the step so that the
    keeping (and the fetches of the other hosts) spreads over all hosts."""
    if not hosts:
        return []
    order = sorted(hosts)
    start = step % len(order)
    order = order[start:] + order[:start]
    out: list[str] = []
    seen: set[int] = set()
    for h in order:  # one per slice first
        if len(out) < count and slice_of(h) not in seen:
            out.append(h)
            seen.add(slice_of(h))
    for h in order:  # then any
        if len(out) < count and h not in out:
            out.append(h)
    return out


def commit_messages(hosts: list[str], keepers: list[str], peers: dict[str, str]) -> tuple[set[str], list[list[str]]]:
    """Phase 2's two messages for ``keepers`` (``choose_keepers``): (the hosts that get the whole
    manifest, the keepers named to the others as [host, peer address]). When a keeper has no peer
    address the others could fetch from, or there are no others, every host gets the whole manifest."""
    if len(set(keepers)) >= len(set(hosts)) or any(h not in peers for h in keepers):
        return set(hosts), []
    return set(keepers), [[h, peers[h]] for h in keepers]


class CommittedStep:
    """A committed step whose manifest is read from its bytes when first needed, once.

    Phase 2 ends with the manifest's bytes (the save's: its buffers, never joined unless it is read);
    reading them grows with the step's shards, so the save thread hands them over unread and the first
    background task that needs the manifest (replication, the backup) reads it: the next save does not
    wait for that.
    """

    def __init__(self, step: int, data: bytes | protocol.Gathered | None = None, *, digest: str = "",
                 hosts: tuple[str, ...] = (), manifest: fmt.StepManifest | None = None,
                 fetch: Callable[[], fmt.StepManifest] | None = None,
                 header: fmt.StepHeader | None = None):
        if sum(x is not None for x in (data, manifest, fetch)) != 1:
            raise ValueError("CommittedStep needs exactly one of the manifest's bytes, the manifest and a way to "
                             "fetch it")
        self.step = step
        self.digest = digest or (manifest.digest if manifest is not None else "")
        self.hosts = tuple(hosts)  # the hosts that committed it (every share of it is one of theirs)
        self._data = data
        self._manifest = manifest
        self._fetch = fetch  # a step restored by its writers' parts: the head has not read its manifest
        self._header = header
        self._lock = threading.Lock()

    @classmethod
    def of(cls, manifest: fmt.StepManifest) -> "CommittedStep":
        return cls(manifest.step, manifest=manifest)

    @property
    def header(self) -> fmt.StepHeader | None:
        """The manifest's header line (arrays, shardings, who wrote which devices), read alone; None where
        it is not at hand (a step given by its manifest, or written by an older version)."""
        with self._lock:
            self._read_header()
            return self._header

    def _read_header(self) -> None:
        if self._header is None and self._data is not None:
            try:
                data = self._data
                first = data.buffers[0] if isinstance(data, protocol.Gathered) else data  # (the header line first)
                self._header = fmt.StepHeader.from_line(bytes(first).partition(b"\n")[0],
                                                        source=f"step {self.step} manifest header")
            except Exception:  # an older format, or bytes that do not read: the manifest's reader says why
                pass

    @property
    def manifest(self) -> fmt.StepManifest:
        with self._lock:
            if self._manifest is None:
                self._read_header()  # (its bytes are dropped once read)
                data = self._data
                if isinstance(data, protocol.Gathered):
                    data = data.join()
                self._manifest = (self._fetch() if data is None else
                                  fmt.StepManifest.from_json(data, source=f"step {self.step} manifest"))
                self._data = None
            return self._manifest
