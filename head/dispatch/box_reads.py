"""Which hosts can fill each target box of a restore, from the saved shards and where their blobs are:
the reads a transport's load runs (the cluster mode's, ``cluster/reads.py``) and the restore plan
counts with (``restore.plan``). Plain values from ``mtc.shared.format``: unit-tested without processes."""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Mapping, Sequence

from mtc.shared import format as fmt

__all__ = ["BoxRead", "box_reads", "shard_holders"]


@dataclasses.dataclass(frozen=True)
class BoxRead:
    """One read of a restore: ``region`` of array ``key`` from the first of ``candidates`` that
    answers, into the target box ``box`` at ``region``'s place in it."""

    key: str
    box: fmt.Box  # the target box being assembled
    region: fmt.Box  # what is read: the whole box, or the part of it one saved shard covers
    candidates: tuple[str, ...]

    @property
    def whole(self) -> bool:
        return self.region == self.box

    def offsets(self) -> tuple[slice, ...]:
        """Where ``region`` lies inside ``box`` (index the box's buffer with it)."""
        return tuple(slice(a - t0, z - t0) for (a, z), (t0, _) in zip(self.region, self.box))


def shard_holders(shard: fmt.ShardRecord, holders: Mapping[str, Iterable[str]] | None,
                  host_of_device: Callable[[int], str | None], hosts: Sequence[str]) -> list[str]:
    """Hosts that hold a saved shard now, the host of its devices first (all hosts if unknown).

    ``holders`` (blob -> hosts: the inventories, plus what a restore pulled or fetched)
    overrides the device mapping: after an elastic resize device ``d`` may sit on another host
    than the one that wrote its shard. ``host_of_device`` answers None for a device that is gone.
    """
    have = holders.get(shard.blob) if holders is not None else None
    have = set(have) if have is not None else None
    out = []
    for d in shard.devices:
        h = host_of_device(d)
        if h is not None and h not in out and (have is None or h in have):
            out.append(h)
    for h in sorted(have or ()):
        if h not in out:
            out.append(h)
    return out or list(hosts)


def box_reads(rec: fmt.ArrayRecord, box: fmt.Box, owners: Sequence[str], hosts: Sequence[str],
              holders: Mapping[str, Iterable[str]] | None,
              host_of_device: Callable[[int], str | None]) -> list[BoxRead]:
    """The reads that fill target ``box`` of ``rec``: one, from a host that holds every saved
    shard the box overlaps (its ``owners`` first), or one per overlapping shard from a holder
    of it (a resharded restore where no single host holds it all)."""
    needed: dict[fmt.Box, fmt.ShardRecord] = {}
    for s in rec.shards:
        if s.box not in needed and fmt.box_intersect(s.box, box) is not None:
            needed[s.box] = s
    held = {b: set(shard_holders(s, holders, host_of_device, hosts)) for b, s in needed.items()}
    order = list(dict.fromkeys([*owners, *hosts]))
    whole = tuple(h for h in order if all(h in hs for hs in held.values()))
    if whole:
        return [BoxRead(rec.key, box, box, whole)]
    return [BoxRead(rec.key, box, fmt.box_intersect(b, box), tuple(h for h in order if h in held[b]))
            for b in needed]
