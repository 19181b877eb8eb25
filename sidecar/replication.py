"""The receiving side of the peer tier: pull listed blobs from peers into this host's ramdisk.

The head plans (``mtc.head.replication.plan``: which blob goes from which holder to which host,
for replication after a save and for a restore onto a host that lacks blobs); the receiving
sidecar executes its part here. Each pull names the blob, its size and the holders to try in
order. A copy counts only once it hashes to its name (``PeerClient.get``); a bad copy or an
unreachable holder is skipped for the next holder, and what could not be pulled from any is
reported blob by blob, with the cause at each holder.

Blobs are pinned while the pull runs, so a concurrent garbage collection does not take them
before a step references them (the caller makes one reference them: the step is committed
here already for replication, or adopted after a restore pull).

A pull of a step that failed (a full ramdisk, blobs no holder could give) is remembered per step
until a later pull of that step succeeds, and reported in the inventory (``pull_notes``): the
head retries in the background, and ``mtc status``, another process, can tell why a step still
lacks its copies.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Mapping, Sequence

from mtc.shared import protocol
from mtc.shared.errors import (
    ConfigError,
    CorruptBlobError,
    HostUnreachableError,
    InsufficientSpaceError,
    ProtocolError,
)
from mtc.shared.host_reports import PullResult
from mtc.shared.requests import Pull  # one blob to fetch: its name, size and holders (checked on decode)
from mtc.sidecar.peer import BadCopyError, PeerClient
from mtc.sidecar.ram import RamStore, format_binary_bytes
from mtc.sidecar.ram.common import free_bytes

log = logging.getLogger(__name__)

__all__ = ["Pull", "held_bits", "pull_blobs", "pull_notes"]

# store -> {step: (why its last pull failed, time.monotonic() then)}; a store of a closed service goes with it.
_NOTES: "weakref.WeakKeyDictionary[RamStore, dict[int, tuple[str, float]]]" = weakref.WeakKeyDictionary()
_NOTES_LOCK = threading.Lock()
_NOTES_KEPT = 8  # steps with a note, per store (the newest failures)


def pull_notes(store: RamStore) -> tuple[tuple[int, str, float], ...]:
    """The steps whose last pull on this host failed, and why, for the inventory
    (``HostInventory.pull_failures``): (step, why, seconds ago) per step."""
    now = time.monotonic()
    with _NOTES_LOCK:
        notes = sorted(_NOTES.get(store, {}).items())
    return tuple((s, why, round(now - t, 1)) for s, (why, t) in notes)


def _note(store: RamStore, step: int | None, why: str | None) -> None:
    """Remember (``why``) or forget (None) that the last pull of ``step`` here failed."""
    if step is None:
        return
    with _NOTES_LOCK:
        notes = _NOTES.setdefault(store, {})
        if why is None:
            notes.pop(step, None)
            return
        notes[step] = (why, time.monotonic())
        for s in sorted(notes)[:-_NOTES_KEPT]:
            del notes[s]


def held_bits(step_blobs: set[str], have: set[str]) -> dict:
    """The inventory fields that say which of a step's blobs this host holds.

    ``{"step_blobs": n, "digest": ..., "held": bitmap}``: one bit per blob of the step's sorted
    names, so the head can tell, for every blob, which hosts hold a copy.
    """
    names = sorted(step_blobs)
    return {"step_blobs": len(names), "digest": protocol.blob_list_digest(names),
            "held": protocol.encode_bitmap([n in have for n in names])}


def pull_blobs(store: RamStore, token: str, pulls: Sequence[Pull], peers: Mapping[str, str], *,
               host_id: str = "host", streams_per_holder: int = 2, threads: int = 8,
               timeout_s: float = 60.0, step: int | None = None) -> dict:
    """Fetch every blob of ``pulls`` that ``store`` lacks from its holders; verified.

    A ramdisk that cannot take them all raises InsufficientSpaceError naming what is still to come,
    what is free and what it lacks. With ``step``, a failure is
    remembered for the inventory (``pull_notes``) until a pull of that step succeeds.

    Runs in rounds: in round k each missing blob is asked of its k-th holder, so the load
    spreads as the plan spread it. Each holder's blobs go over ``streams_per_holder``
    connections at once (one stream leaves the sender's and the receiver's cores taking turns;
    two keep both busy), at most ``threads`` in all. Returns what it did (``PullResult``: the
    blobs and bytes fetched, those held before, those no holder had a good copy of with the cause
    at each holder, the copies that failed their hash and those removed at their holder).
    """
    t0 = time.perf_counter()
    todo: dict[str, Pull] = {}
    already = 0
    for p in pulls:
        if p.blob in todo:
            continue
        if store.blobs.has(p.blob):
            already += 1
        else:
            todo[p.blob] = p
    tried: dict[str, list[tuple[str, str]]] = {b: [] for b in todo}
    bad: list[list[str]] = []
    scrubbed: list[list[str]] = []  # [blob, holder]: corrupt copies their holders removed
    try:
        with store.pins.hold(todo):
            pulled, pulled_bytes = _rounds(store, token, todo, peers, tried, bad, scrubbed, streams_per_holder,
                                           threads, timeout_s)
    except InsufficientSpaceError as e:
        raise _no_room(store, host_id, step, todo, e) from e
    failed = tuple((b, tuple(tried[b])) for b in todo if tried[b] and len(tried[b]) >= len(todo[b].sources)
                   and not store.blobs.has(b))
    _note(store, step, (f"{len(failed)} blob(s) no holder could give, e.g. {failed[0][0]}: "
                        + "; ".join(f"{h}: {c}" for h, c in failed[0][1])) if failed else None)
    out = PullResult(host_id, pulled=pulled, pulled_bytes=pulled_bytes, already=already, failed=failed,
                     bad_copies=tuple(tuple(r) for r in bad), removed_bad_copies=tuple(tuple(r) for r in scrubbed),
                     seconds=time.perf_counter() - t0)
    log.info("- peer pull; host=%s; duration=%.3fs; %d blobs, %d bytes @ %.2f GB/s; %d held already, %d failed, "
             "%d bad copies skipped", host_id, out.seconds, pulled, pulled_bytes,
             pulled_bytes / max(out.seconds, 1e-9) / 1e9, already, len(failed), len(bad))
    for blob, causes in failed:
        log.warning("host %s: no good copy of blob %s from any peer: %s", host_id, blob,
                    "; ".join(f"{h}: {c}" for h, c in causes))
    return out


def _rounds(store: RamStore, token: str, todo: dict[str, Pull], peers: Mapping[str, str],
            tried: dict[str, list[tuple[str, str]]], bad: list, scrubbed: list, streams_per_holder: int,
            threads: int, timeout_s: float) -> tuple[int, int]:
    """The rounds of ``pull_blobs`` (see there): (blobs, bytes) pulled; ``tried``, ``bad`` and
    ``scrubbed`` are filled in."""
    pulled = pulled_bytes = 0
    pending = list(todo)
    rnd = 0
    while pending:
        by_src: dict[str, list[Pull]] = {}
        for b in pending:
            by_src.setdefault(todo[b].sources[rnd], []).append(todo[b])
        lanes = [(src, lane) for src, ps in by_src.items() for lane in _split(ps, streams_per_holder)]
        failed_now: list[str] = []
        workers = max(1, min(threads, len(lanes)))
        with ThreadPoolExecutor(workers, thread_name_prefix="mtc-peer-pull") as pool:
            futures = [(src, pool.submit(_pull_from, store, token, src, peers.get(src), lane, timeout_s))
                       for src, lane in lanes]
            for src, fut in futures:
                n, nbytes, failures = fut.result()
                pulled += n
                pulled_bytes += nbytes
                for blob, cause, corrupt, removed in failures:
                    tried[blob].append((src, cause))
                    if corrupt:
                        bad.append([blob, src, cause])
                    if removed:
                        scrubbed.append([blob, src])
                    failed_now.append(blob)
        rnd += 1
        pending = [b for b in failed_now if rnd < len(todo[b].sources)]
    return pulled, pulled_bytes


def _no_room(store: RamStore, host_id: str, step: int | None, todo: dict[str, Pull],
             e: InsufficientSpaceError) -> InsufficientSpaceError:
    """The error for pulls this host's ramdisk cannot take: what is still to come, what is free,
    what it lacks (the head reports it as the reason the step is short of copies); remembered."""
    left = [p.size for b, p in todo.items() if not store.blobs.has(b)]
    need, free = sum(left), free_bytes(store.root)
    what = f"step {step}" if step is not None else "a step"
    why = (f"ramdisk {store.root} is full: {len(left)} blob(s) of {what} ({format_binary_bytes(need)}) still to come, "
           f"{format_binary_bytes(free)} free, it lacks {format_binary_bytes(max(need - free, 1))}")
    _note(store, step, why)
    return InsufficientSpaceError(
        f"host {host_id}: {why}. Free room on it, or size the ramdisks for the peer copies too "
        "(`mtc size --peer-copies 1`)")


def _split(pulls: list[Pull], n: int) -> list[list[Pull]]:
    """``pulls`` dealt into at most ``n`` lists of about equal bytes (largest first)."""
    lanes: list[list[Pull]] = [[] for _ in range(max(1, min(n, len(pulls))))]
    load = [0] * len(lanes)
    for p in sorted(pulls, key=lambda p: -p.size):
        i = load.index(min(load))
        lanes[i].append(p)
        load[i] += p.size
    return lanes


def _pull_from(store: RamStore, token: str, src: str, address: str | None, pulls: list[Pull],
               timeout_s: float) -> tuple[int, int, list[tuple[str, str, bool, bool]]]:
    """Fetch ``pulls`` from one holder over one connection.

    Returns (blobs, bytes, [(blob, cause, the copy was corrupt, the holder removed it)]).
    """
    if address is None:
        return 0, 0, [(p.blob, "no peer address for this host (not reachable from the head?)", False, False)
                      for p in pulls]
    n = nbytes = 0
    failures: list[tuple[str, str, bool, bool]] = []
    with PeerClient(address, token, peer=src, timeout_s=timeout_s) as client:
        for i, p in enumerate(pulls):
            try:
                nbytes += client.get(store, p.blob, size=p.size)
                n += 1
            except CorruptBlobError as e:  # this copy is bad (or gone); the connection still serves
                log.warning("%s", e)
                cause, removed = f"CorruptBlobError: {e}", False
                if isinstance(e, BadCopyError):
                    note, removed = _repair(client, src, p.blob)
                    cause += note
                failures.append((p.blob, cause, isinstance(e, BadCopyError), removed))
            except (HostUnreachableError, ProtocolError, ConfigError) as e:
                # The holder is gone or refuses us: the rest of its list goes to the next holders.
                cause = f"{type(e).__name__}: {e}"
                log.warning("host %s unreachable for pulls: %s", src, e)
                failures.extend((q.blob, cause, False, False) for q in pulls[i:])
                break
            except InsufficientSpaceError:
                raise  # no holder can help: the ramdisk of this host is full
    return n, nbytes, failures


def _repair(client: PeerClient, src: str, blob: str) -> tuple[str, bool]:
    """Ask holder ``src`` to check the copy of ``blob`` that failed its hash here: (note, removed).

    A copy bad at its source is removed there, so the holder stops counting as one and the
    next replication makes a good copy again; a copy damaged on the way is left alone.
    """
    try:
        state = client.verify(blob)
    except (CorruptBlobError, HostUnreachableError, ProtocolError, ConfigError) as e:
        return f" (could not ask {src} to check its copy: {type(e).__name__})", False
    if state == "removed":
        log.warning("host %s held a corrupt copy of blob %s and removed it", src, blob)
        return f" ({src} found its copy corrupt and removed it)", True
    return (f" ({src}'s copy checks out: damaged in transit)" if state == "ok" else
            f" ({src} no longer holds it)"), False
