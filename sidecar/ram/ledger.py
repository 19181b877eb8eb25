"""``Landings``: a store's ledger of the landings it handed out and has not yet published.

``mapped`` is the mechanism (mapped temp blob files, the kept maps, the warmer); this is the
bookkeeping ``RamStore`` keeps over it: which landings are open (by buffer address, so that
``write_shards`` recognises a buffer), publishing and dropping them, the bytes published and
whether a save is landing now (the warmer holds off meanwhile). It has its own lock and state,
so it lives apart from the store's metadata (steps, pool, garbage collection).

``Arrivals`` is the same kind of ledger for the peer copies being received now: each with a
way to drop it, so that a local save short of room can take back what they hold.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from mtc.sidecar.ram.blobs import BlobFiles
from mtc.shared.ramdisk import is_no_space
from mtc.sidecar.ram.mapped import LANDING_MIN, Landing, LandingBatch, MapCache, MapWarmer, discard

log = logging.getLogger(__name__)


class Landings:
    """The open landings of one store (see ``land``).

    ``fits(sizes)`` says whether new blobs of those sizes fit now (``StoreSpace.fits``).
    """

    def __init__(self, root: Path, blobs: BlobFiles, maps: MapCache, fits: Callable[[list[int]], bool]):
        self.root = root
        self._blobs = blobs
        self._maps = maps
        self._fits = fits
        self._since = self._done = 0.0  # monotonic: last landing handed out, last published
        self.warmer = MapWarmer(maps, self.now)
        self._open: dict[int, Landing] = {}  # by buffer address: the landings not yet published
        self._lock = threading.Lock()
        self.landed_bytes = 0  # bytes published from landings, in total (one copy per save: for tests, status)
        self.filled_bytes = 0  # of which from cold landings, written with Landing.fill

    def land(self, sizes: Iterable[int], *, cold_ok: bool = False) -> LandingBatch:
        """Mapped temp blob files to fill in place, one per size (None: not landed, see below).

        With ``cold_ok`` the writer can fill a landing with ``Landing.fill`` (``pwrite``): a
        landing whose map is not warm is then handed out cold (``Landing.cold``) and must be
        filled that way; without it, every landing is allocated and mapped now, to be written
        through its buffer (a socket's ``recv_into``).

        Sizes under ``LANDING_MIN`` are not landed. When the others do not all fit as new blobs
        now (free space plus pool files of their sizes), none is: the caller then stages in its
        own memory and ``write_shards`` hashes first, so that blobs already present need no
        space (the space check before any byte is written). Fill each buffer, then publish it
        with :meth:`publish`; close the batch to remove what was not published.
        """
        sizes = [int(n) for n in sizes]
        big = [n for n in sizes if n >= LANDING_MIN]
        if not big or not self._fits(big):
            return LandingBatch([None] * len(sizes))
        out: list[Landing | None] = []
        try:
            for n in sizes:
                out.append(self._blobs.land(n, cold_ok=cold_ok) if n >= LANDING_MIN else None)
        except BaseException as e:
            for x in out:
                if x is not None:
                    self._maps.forget(x.st)
            discard([x for x in out if x is not None])
            if not isinstance(e, OSError):
                raise
            # No room after all (another writer took it), or no map (vm.max_map_count): the
            # shards are staged in memory and written instead; the save goes on.
            (log.info if is_no_space(e) else log.warning)(
                "ramdisk %s: cannot land %d shards (%s); staging them in memory", self.root, len(big), e)
            return LandingBatch([None] * len(sizes))
        with self._lock:
            for x in out:
                if x is not None:
                    self._open[x.address] = x
            self._since = time.monotonic()
        return LandingBatch(out, self._drop)

    def now(self) -> bool:
        """Whether a save is landing: landings were handed out after the last one was published
        (for at most a minute: a save of nothing but duplicates publishes none)."""
        since = self._since
        return since > self._done and time.monotonic() - since < 60.0

    def landed(self, data) -> Landing | None:
        """The unpublished landing whose buffer ``data`` (an ndarray) is exactly, else None."""
        if not isinstance(data, np.ndarray) or not data.flags.c_contiguous:
            return None
        with self._lock:
            x = self._open.get(data.ctypes.data) if data.size else None
        return x if x is not None and x.size == data.nbytes and not x.done else None

    def publish(self, landing: Landing, name: str) -> bool:
        """Publish a filled landing as blob ``name``, its hash; False when the blob was there already.

        Like ``BlobFiles.write``, a writer that may race a commit pins ``name`` first.
        """
        with self._lock:
            if landing.done or self._open.pop(landing.address, None) is not landing:
                raise ValueError(f"landing {landing.tmp} was already published or discarded")
            self._done = time.monotonic()
        added = self._blobs.publish_landed(landing, name)
        if added:
            with self._lock:
                self.landed_bytes += landing.size
                self.filled_bytes += landing.size if landing.filled else 0
            if landing.cold:  # its map comes back from the pool warm, later (mtc.sidecar.ram.mapped)
                self.warmer.submit(landing.st)
        return added

    def _drop(self, landings: list[Landing]) -> None:
        with self._lock:
            self._done = time.monotonic()
            for x in landings:
                if self._open.get(x.address) is x:
                    del self._open[x.address]
        for x in landings:
            self._maps.forget(x.st)
        discard(landings)

    def drop_all(self) -> None:
        """Remove every unpublished landing (the store is closing)."""
        with self._lock:
            landings = list(self._open.values())
        self._drop(landings)


class Arrival:
    """One peer copy being received: its blob, its temp file (once open), and whether a local save
    took its room back (``yielded``)."""

    def __init__(self, name: str, drop: Callable[[], None]):
        self.name = name
        self.path: Path | None = None  # set by the receiver once the temp file is open
        self.yielded = False
        self._drop = drop

    def held(self) -> int:
        """Bytes the filesystem holds for its temp file now."""
        try:
            return os.stat(self.path).st_blocks * 512 if self.path is not None else 0
        except FileNotFoundError:
            return 0

    def drop(self) -> None:
        self.yielded = True  # before the drop: the receiver reads it once its socket fails
        with contextlib.suppress(OSError):
            self._drop()


class Arrivals:
    """The peer copies a store is receiving now (``receiving``); ``yield_all`` drops them."""

    def __init__(self):
        self._cond = threading.Condition()
        self._open: set[Arrival] = set()

    @contextlib.contextmanager
    def receiving(self, name: str, drop: Callable[[], None]) -> Iterator[Arrival]:
        """Register a peer copy of blob ``name`` being received, for as long as the context is open.

        ``drop()`` makes the receive fail soon (it shuts the transfer's socket down); a save that
        is short of room calls it (``StoreSpace.check_space``), and the context's value (an
        ``Arrival``) then says ``yielded``. Close the context only after the temp file is published
        or removed: ``yield_all`` waits for that.
        """
        arrival = Arrival(name, drop)
        with self._cond:
            self._open.add(arrival)
        try:
            yield arrival
        finally:
            with self._cond:
                self._open.discard(arrival)
                self._cond.notify_all()

    def take(self, arrival: Arrival, taker: Callable[[], tuple[int, Path] | None]) -> int | None:
        """Give ``arrival`` a free-pool file from ``taker`` (quick: it allocates nothing); returns
        the file's descriptor, or None when ``taker`` found none. Under the lock that
        :meth:`settled` holds, so no reader sees a pool file taken but not yet held by its copy.
        A new file needs no lock (its allocation may take a while): a save that checks its room
        before the file is registered never counted it as free either, it only yields less."""
        with self._cond:
            taken = taker()
            if taken is None:
                return None
            fd, arrival.path = taken
        return fd

    @contextlib.contextmanager
    def settled(self) -> Iterator[None]:
        """While open, no copy is between taking a free-pool file and holding it (``take``):
        the pool's bytes and :meth:`held` read inside count each file once."""
        with self._cond:
            yield

    def held(self) -> int:
        """Bytes the copies being received hold now."""
        with self._cond:
            arrivals = list(self._open)
        return sum(a.held() for a in arrivals)

    def yield_all(self, timeout: float) -> list[str]:
        """Drop every copy being received and wait (``timeout`` seconds at most) until their temp
        files are gone; returns their blob names."""
        with self._cond:
            dropped = list(self._open)
            for a in dropped:  # under the lock: a copy still registered, so its socket is still its own
                a.drop()
            self._cond.wait_for(lambda: not any(a in self._open for a in dropped), timeout)
        return [a.name for a in dropped]
