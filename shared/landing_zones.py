"""In-process landing zones: where the head's staging copy lands when the sidecar shares its process.

On a CPU backend, colocated Python runs the sidecar in the head's process (docs/architecture.md, "The seam"),
and the head must copy the state out of the device buffers before ``save`` returns (a train
step may donate them). That copy can go straight into the ramdisk pages the sidecar will publish
as blobs, instead of into anonymous staging buffers that the sidecar would then copy again. The
sidecar registers a ``LandingZone`` for its ramdisk root here; the head looks it up by the same
root. Neither imports the other: this module is their contract, and it holds plain buffers.

On Pathways the sidecar runs in another process, nothing is registered in the head's, and the
head stages as before (``jax.device_put`` to the colocated CPU devices is the copy).
"""

from __future__ import annotations

import os
import threading
from typing import Callable, Protocol, Sequence

import numpy as np


class LandingZone(Protocol):
    """The sidecar side of the seam (``mtc.sidecar.colocated``)."""

    def reserve(self, sizes: Sequence[int]) -> list[np.ndarray | None]:
        """One writable, page-aligned uint8 buffer of exactly each size, or None for a size the
        caller must stage in its own memory (small shards, or a ramdisk without room for every
        shard as a new blob). Reserving again releases what the previous call reserved and the
        sidecar did not write."""

    def filler(self, buffer: np.ndarray) -> Callable[[np.ndarray], bool] | None:
        """For a buffer of the last ``reserve`` that must not be copied into (a cold landing: a
        new file, whose pages a copy through the map would fault in one by one), the function that
        fills it from a source of the same bytes with ``write()``: True when done, False when the
        ramdisk had no room (the caller then stages that shard in its own memory). None for a
        buffer to copy into."""

    def release(self) -> None:
        """Give back what the last ``reserve`` handed out and was not written (a failed stage)."""


_zones: dict[str, LandingZone] = {}
_lock = threading.Lock()


def _key(root: str | os.PathLike) -> str:
    return os.path.realpath(os.fspath(root))


def register(root: str | os.PathLike, zone: LandingZone) -> None:
    with _lock:
        _zones[_key(root)] = zone


def unregister(root: str | os.PathLike, zone: LandingZone) -> None:
    with _lock:
        if _zones.get(_key(root)) is zone:
            del _zones[_key(root)]


def find(root: str | os.PathLike) -> LandingZone | None:
    """The zone of the sidecar serving ``root`` in this process, if one does."""
    with _lock:
        return _zones.get(_key(root))
