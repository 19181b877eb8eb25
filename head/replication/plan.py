"""Where the peer tier's copies go: the replication plan, restore pulls, and what inventories say.

The head has the global view (every host's inventory, the topology), so it plans; each
receiving sidecar executes its part (``mtc.sidecar.replication``): it pulls from the holders
the plan names, verifying every copy. Plans are pure functions of their inputs, separate from
doing them, so they are unit-tested on their own and can be re-made after any failure.

Rule: every blob on at least ``replication_factor`` failure domains: slices
when the topology has more than one, hosts when it has one. Copies that exist already count
(data-parallel twins in other slices, copies made for an earlier step), so a multi-slice
data-parallel job plans no transfer at all.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections import Counter
from typing import Any, Callable, Collection, Iterable, Mapping, NamedTuple, Sequence

from mtc.head.dispatch.interface import HostInventory, StepHolding
from mtc.shared import collector
from mtc.shared import format as fmt
from mtc.shared import protocol
from mtc.shared.format import writers

log = logging.getLogger(__name__)

__all__ = ["ReplicationStrategy", "StepView", "Transfer", "covered_by_shares", "plan_shares", "step_views",
           "summarize", "whole_by_parts"]


class Transfer(NamedTuple):
    """One copy to make: ``dst`` pulls ``blob`` (``nbytes``) from ``src``."""

    blob: str
    src: str
    dst: str
    nbytes: int


def _sizes(manifest: fmt.StepManifest | Mapping[str, int]) -> dict[str, int]:
    return manifest.blob_sizes() if isinstance(manifest, fmt.StepManifest) else dict(manifest)


class ReplicationStrategy:
    """Plans copies so that each blob lives on ``factor`` failure domains.

    ``topology`` arguments map host id -> slice, in ring order (the cluster spec's order).
    """

    def __init__(self, factor: int):
        if type(factor) is not int or factor < 1:
            raise ValueError(f"replication factor must be an integer >= 1, got {factor!r}")
        self.factor = factor

    @staticmethod
    def domain_of(topology: Mapping[str, int]) -> Callable[[str], tuple]:
        """host -> its failure domain in ``topology``: its slice, or itself when there is one slice."""
        if len(set(topology.values())) > 1:
            return lambda h: ("slice", topology[h])
        return lambda h: ("host", h)

    def copies(self, hosts: Iterable[str], topology: Mapping[str, int]) -> int:
        """How many failure domains ``hosts`` cover (hosts outside ``topology`` do not count)."""
        domain = self.domain_of(topology)
        return len({domain(h) for h in hosts if h in topology})

    def domains(self, topology: Mapping[str, int]) -> int:
        """Failure domains of ``topology``: its slices, or its hosts when it has one slice."""
        return self.copies(topology, topology)

    def plan(self, manifest: fmt.StepManifest | Mapping[str, int], holders: Mapping[str, Iterable[str]],
             topology: Mapping[str, int], *, targets: Iterable[str] | None = None) -> list[Transfer]:
        """The copies that bring every blob of ``manifest`` to ``factor`` domains.

        ``manifest`` is a step manifest (or {blob: nbytes}); ``holders`` maps blob -> hosts that
        hold a copy; ``targets`` are the hosts that may receive copies (default: all of
        ``topology``; the caller leaves out hosts that are down or lack the step). Largest blobs
        are placed first, each from its least busy holder to the least loaded eligible host of a
        domain that lacks it (ties: the next host around the ring from the source), so the
        bytes spread evenly. A blob with no holder, or no eligible host left, is left short:
        :meth:`shortfall` reports it.
        """
        sizes = _sizes(manifest)
        ring = {h: i for i, h in enumerate(topology)}
        n = max(1, len(ring))
        allowed = set(topology) if targets is None else set(targets) & set(topology)
        domain = self.domain_of(topology)
        incoming: Counter[str] = Counter()
        outgoing: Counter[str] = Counter()
        out: list[Transfer] = []
        for blob in sorted(sizes, key=lambda b: (-sizes[b], b)):
            have = [h for h in sorted(set(holders.get(blob, ())), key=lambda h: ring.get(h, n)) if h in ring]
            if not have:
                continue
            covered = {domain(h) for h in have}
            while len(covered) < self.factor:
                cands = [h for h in ring if h in allowed and domain(h) not in covered]
                if not cands:
                    break
                src = min(have, key=lambda h: (outgoing[h], ring[h]))
                dst = min(cands, key=lambda h: (incoming[h], (ring[h] - ring[src]) % n))
                size = int(sizes[blob])
                out.append(Transfer(blob, src, dst, size))
                incoming[dst] += size
                outgoing[src] += size
                have.append(dst)
                covered.add(domain(dst))
        return out

    def shortfall(self, manifest: fmt.StepManifest | Mapping[str, int], holders: Mapping[str, Iterable[str]],
                  topology: Mapping[str, int]) -> dict[str, int]:
        """blob -> copies (domains) it still lacks, for the blobs below ``factor``."""
        out = {}
        for blob in _sizes(manifest):
            c = self.copies(holders.get(blob, ()), topology)
            if c < self.factor:
                out[blob] = self.factor - c
        return out

    @staticmethod
    def pulls(lacking: Mapping[str, Iterable[str]], holders: Mapping[str, Iterable[str]],
              sizes: Mapping[str, int]) -> dict[str, list[tuple[str, int, list[str]]]]:
        """Restore: for each host, its lacking blobs with the holders to try, in order.

        Each blob's first holder is the one with the fewest bytes assigned so far (the load
        spreads over holders); the other holders follow as fallbacks, least loaded first. A blob
        that no other host holds gets an empty list.
        """
        load: Counter[str] = Counter()
        out: dict[str, list[tuple[str, int, list[str]]]] = {}
        for dst in sorted(lacking):
            rows = []
            for blob in sorted(set(lacking[dst]), key=lambda b: (-sizes[b], b)):
                order = sorted((h for h in set(holders.get(blob, ())) if h != dst), key=lambda h: (load[h], h))
                if order:
                    load[order[0]] += int(sizes[blob])
                rows.append((blob, int(sizes[blob]), order))
            if rows:
                out[dst] = rows
        return out


# --- what the inventories say --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StepView:
    """One committed step across the hosts: who holds which of its blobs.

    ``holders[i]`` is the set of hosts that hold the i-th of the step's sorted blob names
    (hosts that have the step committed, as their inventories say).

    A view ``by_parts`` was made from the manifest's header alone: every host that wrote a part
    of the step holds that part whole, so every blob has a copy and no blob name was read. Its
    ``holders`` (and ``digest``) are read from the whole manifest only when asked for
    (``resolve``: the view as ``step_views`` makes it without the header), which a restore onto
    the hosts and shardings that saved the step never does.
    """

    step: int
    digest: str
    known: tuple[frozenset, ...] | None  # holders per sorted blob name; None: by parts, not read yet
    hosts: tuple[str, ...]  # hosts that have the step committed
    whole: tuple[str, ...] = ()  # those of them that hold all of their own share of it
    manifest: str = ""  # the digest of the step manifest these hosts agree on
    resolve: Callable[[], "StepView | None"] | None = dataclasses.field(default=None, compare=False, repr=False)
    part_blobs: int = 0  # by parts: the blobs of the hosts' own parts, in all (a blob two hosts wrote counts twice)
    # By writers: hosts that wrote a part of the step and do not hold it whole now (gone, or lost their
    # ramdisk), each of whose boxes another writer that holds its part whole wrote too (a data-parallel twin).
    lost: tuple[str, ...] = ()
    keepers: tuple[str, ...] = ()  # by parts / writers: hosts that keep the whole manifest (the others a record)
    # By parts / writers: writer -> the hosts that hold its part whole (itself; the keepers of peer copies).
    part_holders: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    # By writers: a lost writer whose part no host holds whole but whose every blob some host holds (the
    # pieces their inventories report) -> host -> its bitmap over the part's sorted blob names, most held
    # first. Those hosts are the sources of the part's blobs; none of them holds the part.
    pieces: Mapping[str, Mapping[str, Sequence[bool]]] = dataclasses.field(default_factory=dict, compare=False,
                                                                          repr=False)

    @property
    def sources(self) -> dict[str, tuple[str, ...]]:
        """writer -> the hosts to pull its part from: those that hold it whole, then those that hold pieces."""
        return {**self.part_holders, **{w: tuple(hs) for w, hs in self.pieces.items()}}

    @property
    def by_parts(self) -> bool:
        """Every part of the step is whole on the host that wrote it."""
        return self.known is None and not self.lost

    @property
    def by_writers(self) -> bool:
        """Every saved box is in a part that its writer holds whole (``mtc.shared.format.writers``)."""
        return self.known is None

    @functools.cached_property
    def full(self) -> "StepView | None":
        """This view with every blob's holders (a ``by_parts`` view reads the manifest for it once)."""
        if self.known is not None:
            return self
        return self.resolve() if self.resolve is not None else None

    @property
    def holders(self) -> tuple[frozenset, ...]:
        full = self.full
        return full.known if full is not None and full.known is not None else ()

    @property
    def restorable(self) -> bool:
        """Every blob has a copy on some host."""
        return self.known is None or all(self.known)

    def lacking(self, names: Sequence[str]) -> list[str] | None:
        """The blobs no host holds, given the step's sorted blob names; None if they are not this step's."""
        full = self.full
        if full is None or full.known is None:
            return None
        if len(names) != len(full.known) or protocol.blob_list_digest(names) != full.digest:
            return None
        return [b for b, hs in zip(names, full.known) if not hs]

    @collector.paused()  # a set per blob: millions of containers on a large job
    def by_name(self, names: Sequence[str]) -> dict[str, set[str]] | None:
        """blob -> holders, given the step's sorted blob names; None if they are not this step's."""
        full = self.full
        if full is None or full.known is None:
            return None
        if len(names) != len(full.known) or protocol.blob_list_digest(names) != full.digest:
            return None
        return {b: set(hs) for b, hs in zip(names, full.known)}


def _without_steps(inv: HostInventory, steps: set[int]) -> HostInventory:
    return dataclasses.replace(inv, steps=tuple(s for s in inv.steps if s.step not in steps))


def whole_by_parts(step: int, manifest: str, rows: Mapping[str, StepHolding],
                    header: Callable[[int, str], "fmt.StepHeader | None"]) -> bool:
    """Whether every host that wrote a part of ``step`` (its manifest's header says which) answered
    that it holds that part whole, under ``manifest``: O(hosts), no blob name read."""
    if not rows:
        return False
    h = header(step, manifest)
    if h is None or not h.parts:
        return False
    for host, _ in h.parts:
        s = rows.get(host)
        if s is None or s.manifest != manifest:
            return False
        if not holds_own_part(s):
            return False
    return True


def _part_holders(agreeing: Mapping[str, StepHolding], whole: set[str]) -> dict[str, tuple[str, ...]]:
    """writer -> the hosts that hold its part whole: itself (``whole``) and those that report a peer copy."""
    out: dict[str, set[str]] = {w: {w} for w in whole}
    for h, s in agreeing.items():
        for w in s.parts:
            out.setdefault(w, set()).add(h)
    return {w: tuple(sorted(hs)) for w, hs in out.items()}


def _pieced(agreeing: Mapping[str, StepHolding], holders: Mapping[str, Collection[str]]
            ) -> dict[str, dict[str, list[bool]]]:
    """writer -> host -> its bitmap, for the writers no host holds whole whose every blob some host holds,
    as the pieces of the hosts' inventory rows say (``StepHolding.pieces``); most held first."""
    got: dict[str, dict[str, list[bool]]] = {}
    for h, s in agreeing.items():
        for w, n, bits in s.pieces:
            if not holders.get(w):
                got.setdefault(w, {})[h] = protocol.decode_bitmap(bits, n)
    out = {}
    for w, by_host in got.items():
        if len({len(b) for b in by_host.values()}) == 1 and all(map(any, zip(*by_host.values()))):
            out[w] = dict(sorted(by_host.items(), key=lambda kv: (-sum(kv[1]), kv[0])))
    return out


def holds_own_part(s: StepHolding) -> bool:
    """Whether a host holds the whole of the part it wrote of a step, as its inventory row says."""
    return s.local_blobs == s.blobs if s.part else (bool(s.own) and s.own in s.copies)


@collector.paused()  # by rows: a set of holders per blob
def step_views(inventories: Mapping[str, HostInventory],
               resolve: Callable[[int, str], "fmt.StepManifest | None"] | None = None,
               header: Callable[[int, str], "fmt.StepHeader | None"] | None = None) -> dict[int, StepView]:
    """step -> StepView, from every reachable host's inventory.

    Hosts agree on a step's blob list (they committed the same manifest); if some did not
    (a digest differs), the version that the most hosts share is kept and the others ignored.
    A host that committed only a record reports its own part (``StepHolding.part``); those rows
    are read with the step's manifest, which ``resolve(step, digest)`` gives (None: it cannot,
    and such a host then holds nothing of the step as far as this view is concerned).

    With ``header(step, digest)`` (the manifest's header line, ``fmt.StepHeader``), a step whose
    every part is held whole by the host that wrote it is a ``by_parts`` view: restorable, and its
    blob rows are read only when asked for. The head's work is then O(hosts) per step.
    """
    if header is not None:
        out: dict[int, StepView] = {}
        rows: dict[int, dict[str, StepHolding]] = {}
        for host, inv in inventories.items():
            if not inv.error:
                for s in inv.steps:
                    rows.setdefault(s.step, {})[host] = s
        for step, by_host in sorted(rows.items()):
            votes = Counter(s.manifest for s in by_host.values())
            manifest = max(votes, key=lambda d: (votes[d], d))
            agreeing = {h: s for h, s in by_host.items() if s.manifest == manifest}
            keepers = tuple(sorted(h for h, s in agreeing.items() if not s.part))

            def full(step: int = step) -> StepView | None:
                return step_views(inventories, resolve).get(step)

            mine = {h for h, s in agreeing.items() if holds_own_part(s)}
            holders = _part_holders(agreeing, mine)
            if whole_by_parts(step, manifest, by_host, header):
                whole = tuple(sorted(h for h, s in agreeing.items() if s.local_blobs == s.blobs))
                out[step] = StepView(step, "", None, tuple(sorted(agreeing)), whole, manifest, resolve=full,
                                     part_blobs=sum(s.blobs for s in agreeing.values()), keepers=keepers,
                                     part_holders=holders)
                continue
            # Some writer lost its part: restorable from the parts alone where every box it wrote is in a
            # part some host holds whole (a data-parallel twin's, or a peer copy of its own).
            # Or the pieces of a lost writer's part that several hosts hold (a per-blob replication's copies).
            head = header(step, manifest) if holders else None
            if head is None or not head.parts:
                continue
            covered = writers.cover(head, holders)
            pieces = {} if covered else _pieced(agreeing, holders)
            if covered or pieces and writers.cover(head, {**holders, **pieces}):
                out[step] = StepView(step, "", None, tuple(sorted(agreeing)), tuple(sorted(mine)), manifest,
                                     resolve=full, part_blobs=sum(agreeing[h].blobs for h in mine),
                                     lost=tuple(sorted({p for p, _ in head.parts} - mine)), keepers=keepers,
                                     part_holders=holders, pieces=pieces)
        if out:
            rest = step_views({h: _without_steps(inv, set(out)) for h, inv in inventories.items()}, resolve)
            return dict(sorted({**rest, **out}.items()))
        return step_views(inventories, resolve)
    full: dict[int, dict[tuple[int, str, str], tuple[list[set[str]], list[str]]]] = {}
    parts: dict[int, dict[str, list[tuple[str, StepHolding]]]] = {}
    whole: dict[int, set[str]] = {}
    for host, inv in inventories.items():
        if inv.error:
            continue
        for s in inv.steps:
            if s.local_blobs == s.blobs:
                whole.setdefault(s.step, set()).add(host)
            if s.part:
                parts.setdefault(s.step, {}).setdefault(s.manifest, []).append((host, s))
                continue
            bits = protocol.decode_bitmap(s.held, s.step_blobs)
            sets, hosts = full.setdefault(s.step, {}).setdefault((s.step_blobs, s.digest, s.manifest),
                                                                 ([set() for _ in range(s.step_blobs)], []))
            hosts.append(host)
            for i, b in enumerate(bits):
                if b:
                    sets[i].add(host)
    out = {}
    for step in sorted(set(full) | set(parts)):
        by_key, by_part = full.get(step, {}), parts.get(step, {})
        votes: dict[str, int] = {}
        for (_, _, manifest), (_, hosts) in by_key.items():
            votes[manifest] = votes.get(manifest, 0) + len(hosts)
        for manifest, rows in by_part.items():
            votes[manifest] = votes.get(manifest, 0) + len(rows)
        # The version most hosts share; a host whose manifest differs (tampered, or from another save)
        # holds nothing of the step as far as restore is concerned.
        manifest = max(votes, key=lambda d: (votes[d], d))
        keys = [k for k in by_key if k[2] == manifest]
        key = max(keys, key=lambda k: (len(by_key[k][1]), k[1])) if keys else None
        sets, hosts = ([set(x) for x in by_key[key][0]], list(by_key[key][1])) if key else ([], [])
        digest = key[1] if key else ""
        rows = by_part.get(manifest, [])
        m = resolve(step, manifest) if rows and resolve is not None else None
        if rows and m is not None:
            names = m.sorted_blob_names()
            if key is None:
                sets, digest = [set() for _ in names], protocol.blob_list_digest(names)
            if len(names) == len(sets) and protocol.blob_list_digest(names) == digest:
                index = {n: i for i, n in enumerate(names)}
                for host, s in rows:
                    own = m.part_blob_names(host)
                    if len(own) != s.step_blobs or protocol.blob_list_digest(own) != s.digest:
                        log.warning("step %d: host %s's part does not match the manifest; not counting it", step, host)
                        continue
                    hosts.append(host)
                    for n, b in zip(own, protocol.decode_bitmap(s.held, s.step_blobs)):
                        if b:
                            sets[index[n]].add(host)
        elif rows:
            log.info("step %d: %d hosts committed a record and the manifest is not at hand; not counting them",
                     step, len(rows))
        if not hosts:
            continue
        others = sorted({h for k, (_, hs) in by_key.items() if k != key for h in hs}
                        | {h for d, rs in by_part.items() if d != manifest for h, _ in rs})
        if others:
            log.warning("step %d: hosts disagree on its manifest; using the one of %s, not the one of %s",
                        step, sorted(hosts), others)
        out[step] = StepView(step, digest, tuple(frozenset(x) for x in sets), tuple(sorted(hosts)),
                             tuple(sorted(whole.get(step, set()) & set(hosts))), manifest)
    return out


def _shares(inventories: Mapping[str, HostInventory], step: int, manifest: str, hosts: Sequence[str],
            twins: Mapping[str, Sequence[str]] | None = None) -> tuple[dict[str, str], dict[str, set[str]]] | None:
    """(host -> its share's digest, share digest -> hosts that hold that share whole), for the
    saving ``hosts``; None when some saving host does not report its share under ``manifest``.
    A share is held whole by a host that committed a record of it and holds all of it, and by a
    host that lists it among the shares it holds whole (``StepHolding.copies``: a host that keeps
    the whole manifest lists its own share and the copies it keeps for others).

    A saving host that did not answer (down, or its ramdisk lost) is told apart by the header when
    ``twins`` says which writers wrote exactly its boxes (``fmt.writers.twins``): its share is theirs.
    Without an answering twin its part is a share of its own, held whole by the hosts that list it
    among the parts they hold (``StepHolding.parts``: the keepers of its peer copies). A part that no
    host lists is a share held by no host while its writer is down (no copy of it can be made before it
    is back; the others' shares can); of a writer that answered without it (its ramdisk lost), it
    leaves the shares unable to tell (None: its blobs may be spread over hosts, which the rows find)."""
    share: dict[str, str] = {}
    whole: dict[str, set[str]] = {}
    listed: dict[str, set[str]] = {}  # writer -> the hosts that list its part among those they hold whole
    for host, inv in inventories.items():
        if inv.error:
            continue
        for s in inv.steps:
            if s.step == step and s.manifest == manifest and s.own:
                share[host] = s.own
                if s.part and s.local_blobs == s.blobs:  # a record host: its counts are over its share
                    whole.setdefault(s.own, set()).add(host)
                for d in s.copies:
                    whole.setdefault(d, set()).add(host)
                for w in s.parts:
                    listed.setdefault(w, set()).add(host)
    if not hosts:
        return None
    for h in hosts:
        if h in share:
            continue
        twin = next((t for t in (twins or {}).get(h, ()) if t in share), None)
        if twin is not None:
            share[h] = share[twin]
        elif twins is not None and listed.get(h):
            share[h] = f"part of {h}"
            whole[share[h]] = listed[h]
        elif twins is not None and (h not in inventories or inventories[h].error):
            share[h] = f"part of {h}"  # down, and no other host holds its part whole: no holder now
        else:
            return None
    return share, whole


def covered_by_shares(inventories: Mapping[str, HostInventory], step: int, manifest: str, hosts: Iterable[str],
                      strategy: ReplicationStrategy, topology: Mapping[str, int],
                      twins: Mapping[str, Sequence[str]] | None = None) -> bool:
    """Whether every blob of ``step`` has its copies already, as the hosts' shares say.

    Needs no step manifest (its reading grows with the shards; this grows with the hosts): the
    blobs of a step are the union of the own shares of ``hosts``, the hosts that saved it; a
    share is on every host that reports the same share digest (``StepHolding.own``:
    data-parallel twins) and holds it whole, and on every host that keeps a copy of it
    (``StepHolding.copies``). True when each share is so on ``strategy.factor`` failure
    domains, as in a multi-slice data-parallel job right after a save. False when that is not
    so or cannot be told (a saving host unreachable whose share ``twins`` (``fmt.writers.twins``, from
    the header) and the hosts' lists of parts cannot tell, or reporting the step under another
    manifest ``digest``, or from an older sidecar).
    """
    hosts = list(hosts)
    got = _shares(inventories, step, manifest, hosts, twins)
    if got is None:
        return False
    share, whole = got
    needed = {share[h] for h in hosts}  # each distinct share once
    return all(strategy.copies(whole.get(d, ()), topology) >= strategy.factor for d in needed)


def plan_shares(inventories: Mapping[str, HostInventory], step: int, manifest: str, hosts: Sequence[str],
                strategy: ReplicationStrategy, topology: Mapping[str, int], *, targets: Iterable[str],
                twins: Mapping[str, Sequence[str]] | None = None) -> dict[str, list[tuple[str, list[str]]]] | None:
    """The copies to make, share by share: dst -> [(owner host, holders to pull from)].

    O(hosts): a share is named by one host that saved it (its owner), and the receiving host
    lists the share's blobs from its own copy of the manifest. Each share short of
    ``strategy.factor`` failure domains goes to the next domain around the ring that lacks it,
    to the host at the owner's position there (the next position when that host is not one of
    ``targets``), so every host receives about one share per missing copy. A share that no
    host holds whole is left out (its blobs may still be on several hosts: the per-blob plan
    finds them). None when the shares cannot be told (see ``covered_by_shares``): then the
    caller plans per blob.
    """
    got = _shares(inventories, step, manifest, list(hosts), twins)
    if got is None:
        return None
    share, whole = got
    domain = strategy.domain_of(topology)
    allowed = set(targets)
    order: list = []  # the domains in ring order
    members: dict = {}  # domain -> its hosts, in ring order
    position: dict[str, int] = {}  # host -> its index among its domain's hosts
    for h in topology:
        dom = domain(h)
        if dom not in members:
            members[dom] = []
            order.append(dom)
        position[h] = len(members[dom])
        members[dom].append(h)
    index = {dom: i for i, dom in enumerate(order)}
    ring = {h: i for i, h in enumerate(topology)}
    owners: dict[str, str] = {}
    for h in sorted((h for h in hosts if h in ring), key=ring.__getitem__):
        owners.setdefault(share[h], h)
    out: dict[str, list[tuple[str, list[str]]]] = {}
    for d, owner in owners.items():
        have = sorted((h for h in whole.get(d, ()) if h in ring), key=lambda h: (h != owner, ring[h]))
        if not have:
            continue
        covered = {domain(h) for h in have}
        start, p = index[domain(owner)], position[owner]
        for k in range(len(order)):  # the owner's own domain first: it lacks the share where the owner is down
            if len(covered) >= strategy.factor:
                break
            dom = order[(start + k) % len(order)]
            if dom in covered:
                continue
            hs = members[dom]
            dst = next((hs[(p + j) % len(hs)] for j in range(len(hs)) if hs[(p + j) % len(hs)] in allowed), None)
            if dst is None:
                continue
            out.setdefault(dst, []).append((owner, have))
            covered.add(dom)
    return out


def summarize(view: StepView, strategy: ReplicationStrategy, topology: Mapping[str, int]) -> dict[str, Any]:
    """{"restorable", "replicated", "min_copies"} of one step (copies counted in failure domains)."""
    copies = [strategy.copies(hs, topology) for hs in view.holders]
    low = min(copies) if copies else strategy.domains(topology)
    return {"restorable": view.restorable, "replicated": low >= strategy.factor, "min_copies": low}
