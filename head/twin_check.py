"""The twin check: data-parallel replicas of one box of an array must hold the same bytes.

Blobs are named by the hash of their bytes, so the hosts that hold replicas of one box (the same
box of the same array under a replicated or partially replicated sharding, or the host copies of
a numpy leaf) must name the same blob. Phase 1's answers already carry every host's names, so
across hosts the check reads no bytes: ``compare`` groups the names of the hosts' parts by
(array, box). Two names for one box is silent data corruption on some host (a flipped bit in one
replica), named at save time with the array, the box, and the hosts and devices of each copy.

Replicas that no host writes (several on one host: its sidecar writes one; in cluster mode the
head sends one copy of each box to every host that holds it) are compared only with
``twin_check_hash``: ``hash_replicas`` hashes them while ``save`` blocks (once it returns the
training step may overwrite them), one pass over their bytes.

A step whose replicas disagree is never committed: it is not one state, and readers refuse a step
manifest whose hosts name different blobs for one box. ``twin_check=warn`` logs it, reports it
(``SaveReport.twin_mismatches``, ``committed=False``) and training goes on with the newest good
step kept; ``fail`` also fails the save (``TwinMismatchError``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Iterable

import numpy as np

from mtc.head.reports import SaveReport
from mtc.shared import format as fmt
from mtc.shared.buffers import byte_view
from mtc.shared.errors import ManifestError, SaveError
from mtc.shared.hashing import blob_name

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TwinCopy:
    """One content of a box: its blob name, the hosts whose copy it is, and those copies' devices
    (none for a numpy leaf; without ``twin_check_hash``, every device of the host holding the box)."""

    blob: str
    hosts: tuple[str, ...]
    devices: tuple[int, ...] = ()

    def __str__(self) -> str:
        devices = f" (devices {', '.join(map(str, self.devices))})" if self.devices else ""
        return f"{self.blob} on {', '.join(self.hosts)}{devices}"


@dataclasses.dataclass(frozen=True)
class TwinMismatch:
    """Replicas of one box of one array that hold different bytes: the copies, most held first."""

    array: str  # the leaf's path in the state
    box: fmt.Box  # ((start, stop), ...) per dimension
    copies: tuple[TwinCopy, ...]

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(sorted({h for c in self.copies for h in c.hosts}))

    def __str__(self) -> str:
        return f"array {self.array!r} box {fmt.box_str(self.box)}: " + " != ".join(map(str, self.copies))


class TwinMismatchError(SaveError):
    """Data-parallel replicas of a box hold different bytes: the step was not committed.

    ``mismatches``: every box found (``TwinMismatch``); ``report``: under ``twin_check=warn``, the
    save's report (the save is skipped, not failed); None under ``fail``.
    """

    def __init__(self, message: str, *, step: int, mismatches: Iterable[TwinMismatch],
                 report: SaveReport | None = None):
        self.mismatches = tuple(mismatches)
        hosts: dict[str, str] = {}
        for m in self.mismatches:
            for h in m.hosts:
                hosts.setdefault(h, str(m))
        super().__init__(message, step=step, hosts=hosts)
        self.report = report


def hash_replicas(leaves: Iterable[Any]) -> dict[int, dict[fmt.Box, dict[int, str]]]:
    """The hash pass of ``twin_check_hash``: leaf index -> box -> {device id: blob name} for every
    replica of a box held by several devices, but the first (the copy that is written, whose name
    its host reports). Only replicas in the head's own memory (CPU devices) are hashed: reading an
    accelerator's copy back to the head would cost a transfer per replica."""
    out: dict[int, dict[fmt.Box, dict[int, str]]] = {}
    for leaf in leaves:
        if leaf.kind != "jax":
            continue
        seen: set[fmt.Box] = set()
        counts: dict[fmt.Box, int] = {}
        for box in leaf.device_boxes.values():
            counts[box] = counts.get(box, 0) + 1
        for shard in leaf.value.addressable_shards:
            box = leaf.device_boxes[shard.device.id]
            if counts[box] < 2:
                continue
            if box not in seen:
                seen.add(box)
                continue
            if shard.device.platform != "cpu":
                continue
            data = np.ascontiguousarray(np.asarray(shard.data))
            out.setdefault(leaf.index, {}).setdefault(box, {})[int(shard.device.id)] = blob_name(byte_view(data))
    return out


def _rows(parts: list[tuple[str, bytes]]) -> list[tuple[tuple[str, ...], list]]:
    """(hosts, their shard rows (array, box, blob, nbytes)) from the hosts' answers to phase 1.

    Hosts whose rows are the same bytes (data-parallel twins: host h of every slice, when their
    copies agree) are read once, so a job with many slices reads about one slice's rows.
    """
    groups: dict[bytes, list[tuple[str, bytes]]] = {}
    for host, data in parts:
        data = bytes(data)
        at = data.find(b'"rows":')  # the rows' fields come last in a part (mtc-host/1: "shards")
        at = data.find(b'"shards":') if at < 0 else at
        groups.setdefault(data[at:] if at >= 0 else data, []).append((host, data))
    out = []
    for members in groups.values():
        host, data = members[0]
        try:
            part = fmt.PartColumns.from_json(data, source=f"host {host}'s answer to phase 1")
        except ManifestError as e:
            raise ManifestError(f"host {host}'s answer to phase 1 is not its host manifest ({e})") from None
        if part.host != host:
            raise ManifestError(f"host {host}'s answer to phase 1 is not its host manifest (it is host {part.host}'s)")
        rows = zip(part.array.tolist(), map(part.boxes.__getitem__, part.box.tolist()), part.blob_names(),
                   part.nbytes.tolist())
        out.append((tuple(h for h, _ in members), list(rows)))
    return out


def _key(host: str, row: Any) -> tuple[int, fmt.Box]:
    try:
        array, box, _, _ = row
        return array, tuple(map(tuple, box))
    except (TypeError, ValueError):
        raise ManifestError(f"host {host}'s answer to phase 1 has a malformed shard row {row!r:.100}") from None


def _mismatch(leaf: Any, box: fmt.Box, by_host: dict[str, str], hashed: dict[int, str],
              host_of: Callable[[int], str]) -> TwinMismatch | None:
    """The copies of one box, when they are not all one blob: each with the hosts that wrote it and
    the devices that hold it (a device not hashed holds the copy its host wrote)."""
    if len(set(by_host.values()) | set(hashed.values())) < 2:
        return None
    hosts: dict[str, set[str]] = {}
    devices: dict[str, set[int]] = {}
    for h, blob in by_host.items():
        hosts.setdefault(blob, set()).add(h)
    for dev, b in getattr(leaf, "device_boxes", {}).items():
        if b != box:
            continue
        h = host_of(dev)
        blob = hashed.get(dev, by_host.get(h))
        if blob is None:
            continue
        hosts.setdefault(blob, set()).add(h)
        devices.setdefault(blob, set()).add(int(dev))
    copies = [TwinCopy(b, tuple(sorted(hs)), tuple(sorted(devices.get(b, ())))) for b, hs in hosts.items()]
    copies.sort(key=lambda c: (-max(len(c.devices), len(c.hosts)), c.blob))
    return TwinMismatch(leaf.key, box, tuple(copies))


def compare(leaves: list[Any], parts: list[tuple[str, bytes]], hashed: dict[int, dict[fmt.Box, dict[int, str]]],
            host_of: Callable[[int], str]) -> list[TwinMismatch]:
    """Every box whose replicas name more than one blob: the hosts' names from their parts
    (``parts``: (host, its phase 1 answer)), and the names of the hash pass (``hashed``).

    One dictionary look-up per shard row; the hosts and devices of each copy are gathered only
    for the boxes that disagree.
    """
    if len(parts) < 2 and not hashed:
        return []  # one host and no hash pass: one copy of every box was written, nothing to compare
    rows = _rows(parts)
    first: dict[tuple[int, fmt.Box], str] = {}
    bad: set[tuple[int, fmt.Box]] = set()
    for hosts, shards in rows:
        try:
            for array, box, blob, _ in shards:
                key = (array, tuple(map(tuple, box)))
                if first.setdefault(key, blob) != blob:
                    bad.add(key)
        except (TypeError, ValueError):  # a row that is not [array, box, blob, nbytes]
            for row in shards:
                _key(hosts[0], row)
            raise
    for index, boxes in hashed.items():
        for box, names in boxes.items():
            written = first.get((index, box))
            if any(name != written for name in names.values()):
                bad.add((index, box))
    if not bad:
        return []
    by_key: dict[tuple[int, fmt.Box], dict[str, str]] = {k: {} for k in bad}
    for hosts, shards in rows:
        for row in shards:
            key = _key(hosts[0], row)
            if key in by_key:
                by_key[key].update((h, str(row[2])) for h in hosts)
    by_index = {leaf.index: leaf for leaf in leaves}
    host_of_device: dict[int, str] = {}

    def host_of_cached(dev: int) -> str:
        if dev not in host_of_device:
            host_of_device[dev] = host_of(dev)
        return host_of_device[dev]

    found = []
    for (index, box), by_host in by_key.items():
        leaf = by_index.get(index)
        if leaf is None:
            continue  # a part naming an array the state does not have: the keepers refuse it
        m = _mismatch(leaf, box, by_host, hashed.get(index, {}).get(box, {}), host_of_cached)
        if m is not None:
            found.append(m)
    found.sort(key=lambda m: (m.array, m.box))
    return found


def check(step: int, mode: str, leaves: list[Any], parts: list[tuple[str, bytes]],
          hashed: dict[int, dict[fmt.Box, dict[int, str]]], host_of: Callable[[int], str]) -> None:
    """Raise ``TwinMismatchError`` (after a warning under ``warn``) when replicas disagree."""
    if mode == "off":
        return
    found = compare(leaves, parts, hashed, host_of)
    if not found:
        return
    shown = "; ".join(map(str, found[:5])) + (f"; and {len(found) - 5} more" if len(found) > 5 else "")
    hosts = sorted({h for m in found for h in m.hosts})
    message = (f"data-parallel replicas disagree in {len(found)} box(es), silent data corruption on some host "
               f"({', '.join(hosts)}): {shown}. Step {step} is not committed. With more than two replicas, the "
               "copy the fewest devices hold points at the suspect host; take it out of the job and go on from the "
               "last good step")
    if mode == "warn":
        log.warning("save of step %d skipped: %s (twin_check=warn: training goes on; twin_check=fail makes the save "
                    "fail)", step, message)
        report = SaveReport(step=step, bytes_total=sum(leaf.nbytes for leaf in leaves), hosts=len(parts),
                            committed=False, twin_mismatches=tuple(found))
        raise TwinMismatchError(f"save of step {step} skipped: {message}", step=step, mismatches=found, report=report)
    raise TwinMismatchError(f"save of step {step} failed: {message} (twin_check=fail)", step=step, mismatches=found)
