"""Backup scheduling and upload assignment, as values.

``backup_due`` says whether a committed step is due for a backup under the config's interval;
``assign_uploads`` gives each unique blob of a step to one of the hosts that hold it, largest
first to the least loaded, so that uploads spread over every host; ``assign_scrub`` spreads the
blobs a backup scrub re-hashes the same way (a backup without a part index), ``assign_parts`` says
which writers' parts each host reads to scrub one that has it. They are plain functions of plain values, unit-tested
without processes; the manager calls them and the dispatcher runs the uploads.
"""

from __future__ import annotations

import heapq
from typing import Callable, Sequence

from mtc.shared import format as fmt
from mtc.shared.config import MTCConfig


def backup_due(config: MTCConfig, step: int, last: tuple[int, float] | None, now: float) -> bool:
    """Whether ``step`` is due: the first committed step at once, then every N steps (step
    boundaries crossed) or every N minutes since the last one started (``last`` = (step, time))."""
    if not config.backup_enabled:
        return False
    if last is None:
        return True
    last_step, last_t = last
    if config.multi_tier_checkpointing_backup_interval_steps:
        n = config.multi_tier_checkpointing_backup_interval_steps
        return step // n > last_step // n
    return now - last_t >= config.multi_tier_checkpointing_backup_interval_minutes * 60


def assign_uploads(manifest: fmt.StepManifest, hosts: Sequence[str],
                   host_of_device: Callable[[int], str]) -> dict[str, list[str]]:
    """host -> the blobs it uploads: each unique blob once, by a host that holds it (any host when
    none of its holders is among ``hosts``), largest first to the least loaded holder."""
    holders: dict[str, set[str]] = {}
    sizes: dict[str, int] = {}
    for rec in manifest.arrays:
        for sh in rec.shards:
            sizes[sh.blob] = sh.nbytes
            holders.setdefault(sh.blob, set()).update(host_of_device(d) for d in sh.devices)
    load = {h: 0 for h in hosts}
    out: dict[str, list[str]] = {h: [] for h in load}
    for blob in sorted(sizes, key=lambda b: (-sizes[b], b)):
        cands = sorted(holders[blob] & set(load)) or sorted(load)
        host = min(cands, key=lambda h: (load[h], h))
        load[host] += sizes[blob]
        out[host].append(blob)
    return out


def assign_scrub(sizes: dict[str, int], hosts: Sequence[str]) -> dict[str, list[str]]:
    """host -> the backup blobs it checks: each blob once, largest first to the least loaded host,
    so that every host reads about as many bytes (and the cap holds per host)."""
    out: dict[str, list[str]] = {h: [] for h in hosts}
    load = [(0, h) for h in sorted(out)]  # a heap of (bytes so far, host): O(blobs x log hosts)
    heapq.heapify(load)
    for blob in sorted(sizes, key=lambda b: (-sizes[b], b)):
        n, host = heapq.heappop(load)
        out[host].append(blob)
        heapq.heappush(load, (n + sizes[blob], host))
    return out


def assign_parts(writers: Sequence[str], hosts: Sequence[str]) -> dict[str, list[str]]:
    """host -> the writers whose parts of a backup it reads for the scrub: each writer its own, the parts
    of writers that are not among ``hosts`` (a resized job) spread over those that are, in turn."""
    out: dict[str, list[str]] = {}
    present = set(hosts)
    order = sorted(present)
    for w in writers:
        if w in present:
            out.setdefault(w, []).append(w)
    for i, w in enumerate(sorted(w for w in writers if w not in present)):
        if order:
            out.setdefault(order[i % len(order)], []).append(w)
    return out
