"""Which host's part each target device reads, from the manifest's header alone (no shard row).

The header describes each array's saved named sharding once and says which host wrote the shards
of which devices (``topology.devices``). So where every saved box lies is arithmetic: a named
sharding cuts each dimension into equal chunks, and a saved box is a tuple of chunk indices. A
target box overlaps, in each dimension, the chunks from ``start // chunk`` to ``(stop - 1) //
chunk``; each of those was written by the hosts whose devices held it (data-parallel twins wrote
the same one). A host that holds a writer's part whole (the writer itself, as its inventory says, or a
host that keeps a peer copy of it) can serve them.

- ``cover``: every saved box has a writer whose part some host holds whole, so the step is
  restorable from the writers' parts whatever the target (a host that lost its part, a slice that
  is gone: a data-parallel twin wrote the same boxes, or a peer keeps a copy of the part).
- ``loads``: for a restore's requests, what each host will load: the arrays of each target (sharding,
  shape) and the boxes of them on its devices, so that a host that reads from the backup downloads
  only the blobs of a writer's part that it loads.
- ``copies``: on how few failure domains some saved box is held, counting twins and peer copies.
- ``twins``: the writers that wrote exactly the same boxes (data-parallel replicas: equal shares), so
  that a writer that cannot be asked is known to hold what its twins hold.
- ``designated``: the blobs of a writer's part that fall to it when the writers share the step's
  unique boxes out among themselves (a backup's uploads, the backup scrub): each box to one writer.
- ``plan``: for a restore's requests (an elastic resize, another mesh, or the saving topology with
  a host that lost its part), which writers' parts each reading host needs besides its own. The
  restore pulls those parts whole from their holders, then every host reads its boxes from its
  ramdisk by the step manifest it keeps.

Both cost O(distinct (sharding, shape) x devices); None / False where the header cannot say (an
older step without ``topology.devices``, boxes the manifest lists, a box whose parts no host holds
whole): the restore then plans from the rows as before.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Collection, Iterable, Iterator, Mapping, Sequence

from mtc.shared import shardings
from mtc.shared.errors import ManifestError
from mtc.shared.format.base import Box, canonical_json
from mtc.shared.format.step import ArrayRecord, StepHeader, StepManifest

__all__ = ["Grid", "copies", "cover", "designated", "loads", "plan", "saved_grid", "twins"]


class Grid:
    """The saved boxes of one (sharding description, shape): the chunk size of each dimension, and
    chunk index -> the devices whose shard it was."""

    __slots__ = ("chunk", "writers")

    def __init__(self, chunk: tuple[int, ...], writers: dict[tuple[int, ...], list[int]]):
        self.chunk = chunk
        self.writers = writers

    def pieces(self, box: Box) -> Iterable[tuple[int, ...]]:
        """The chunk indices that ``box`` overlaps."""
        return itertools.product(*(range(a // c, (b - 1) // c + 1) for (a, b), c in zip(box, self.chunk)))


def saved_grid(desc: Mapping | None, shape: Sequence[int]) -> Grid | None:
    boxes = shardings.described_device_boxes(desc, tuple(shape))
    if not boxes:
        return None
    chunk = tuple(b - a for a, b in next(iter(boxes.values())))
    if any(c <= 0 for c in chunk):  # an empty dimension: nothing to plan by
        return None
    writers: dict[tuple[int, ...], list[int]] = {}
    for dev, box in boxes.items():
        writers.setdefault(tuple(a // c for (a, _), c in zip(box, chunk)), []).append(dev)
    return Grid(chunk, writers)


def _writer_of(header: StepHeader) -> dict[int, str] | None:
    devices = header.devices
    if devices is None:
        return None
    return {d: h for h, ids in devices.items() for d in ids}


def _grids(header: StepHeader) -> dict:
    """The grids of a header's arrays, kept with it: ``cover`` (the step's choice) and ``plan`` (its
    restore) read the same ones."""
    return header.__dict__.setdefault("_writers_grids", {})


def _grid_of(rec: ArrayRecord, listed: frozenset, grids: dict) -> Grid | None:
    if rec.kind != "jax" or rec.sharding is None or rec.prng_impl or rec.key in listed:
        return None
    key = (id(rec.sharding), tuple(rec.shape))
    if key not in grids:
        grids[key] = saved_grid(rec.sharding, rec.shape)
    return grids[key]


def _saved_grids(header: StepHeader) -> Iterator[Grid | None]:
    """Each distinct grid of the header's sharded arrays, once; None for an array whose boxes the header
    does not give (listed boxes, a PRNG key array). Scalars and host numpy leaves have none."""
    grids = _grids(header)
    seen: set[int] = set()
    for rec in header.arrays:
        if rec.kind in ("scalar", "numpy"):  # no data / written whole by every host
            continue
        g = _grid_of(rec, header.listed, grids)
        if g is None:
            yield None
        elif id(g) not in seen:
            seen.add(id(g))
            yield g


def cover(header: StepHeader, holders: Mapping[str, Collection[str]]) -> bool:
    """Whether every saved box of the step was written by a host whose part some host holds whole now
    (``holders``: writer -> those hosts: the writer itself, or a host that keeps a peer copy of its
    part): then the step restores from those parts, whatever the target."""
    writer_of = _writer_of(header)
    if writer_of is None or not any(holders.values()):
        return False
    return all(g is not None and all(any(holders.get(writer_of.get(d)) for d in devs) for devs in g.writers.values())
               for g in _saved_grids(header))


def copies(header: StepHeader, holders: Mapping[str, Collection[str]], domain_of: Callable[[str], Any],
           pieces: Mapping[str, Mapping[str, Sequence[bool]]] | None = None) -> int | None:
    """The fewest failure domains (``domain_of(host)``: its slice) on which some saved box of the step is in
    a part held whole: of the box's writers (data-parallel twins wrote the same box), each counts the hosts
    that hold its part whole (``holders``: itself, the keepers of peer copies). What ``mtc status`` shows
    as a step's copies where a writer lost its part, from the header: O(distinct (sharding, shape) x
    devices). None where the header cannot say (as ``cover``). A writer whose part is held in ``pieces``
    (host -> its bitmap over the part's blobs) counts, for each of its boxes, the fewest domains on which
    any blob of the part is held (a lower bound: the bitmaps do not say which blob is which box)."""
    writer_of = _writer_of(header)
    if writer_of is None:
        return None
    floor = {}  # pieced writer -> the fewest domains that hold any one blob of its part
    for w, by_host in (pieces or {}).items():
        held_in: dict[Any, list[bool]] = {}  # domain -> which of the part's blobs its hosts hold
        for h, bits in by_host.items():
            dom = domain_of(h)
            held_in[dom] = [a or b for a, b in zip(held_in.get(dom, bits), bits)]
        floor[w] = min((sum(col) for col in zip(*held_in.values())), default=0)
    counts = []
    if any(rec.kind == "numpy" for rec in header.arrays):  # every writer wrote those whole
        counts.append(len({domain_of(h) for hs in holders.values() for h in hs}))
    for g in _saved_grids(header):
        if g is None:
            return None
        counts.extend(max(len({domain_of(h) for d in devs for h in holders.get(writer_of.get(d), ())}),
                          max((floor.get(writer_of.get(d), 0) for d in devs), default=0))
                      for devs in g.writers.values())
    return min(counts, default=0)


def twins(header: StepHeader) -> dict[str, tuple[str, ...]] | None:
    """writer -> the other writers that wrote exactly its boxes (data-parallel replicas, whose parts
    are equal: the save's twin check compares them), from the header: O(distinct (sharding, shape) x
    devices). None where the header cannot say (as ``cover``). Host numpy leaves, which every writer
    wrote whole, and scalars, which have no blob, do not tell writers apart."""
    writer_of = _writer_of(header)
    if writer_of is None:
        return None
    signature: dict[str, list[frozenset]] = {w: [] for w in header.devices or {}}
    for g in _saved_grids(header):
        if g is None:
            return None
        wrote: dict[str, set] = {}
        for chunk, devs in g.writers.items():
            for d in devs:
                wrote.setdefault(writer_of.get(d), set()).add(chunk)
        for w, sig in signature.items():
            sig.append(frozenset(wrote.get(w, ())))
    groups: dict[tuple, list[str]] = {}
    for w, sig in signature.items():
        groups.setdefault(tuple(sig), []).append(w)
    return {w: tuple(x for x in group if x != w) for group in groups.values() for w in group}


def plan(header: StepHeader, requests: Sequence[Any], holders: Mapping[str, Collection[str]],
         host_of_device: Callable[[int], str | None], readers: Sequence[str],
         pieced: Collection[str] = ()) -> dict[str, set[str]] | None:
    """reading host -> the writers whose parts it needs and does not hold (empty: the parts it holds have
    all it reads), for ``requests`` (``LoadRequest``s planned from the header); None where the header
    cannot say (the restore reads the rows). ``holders``: writer -> the hosts that hold its part whole
    (itself, or a peer copy's keeper), from the inventories. ``readers`` are the hosts that load host
    numpy leaves (every host); one that holds no part whole reads them from another writer's. The holders
    of the ``pieced`` writers hold pieces of their parts (``StepView.pieces``): the blobs are there, so the
    boxes count as held, but each host that reads one pulls the part."""
    writer_of = _writer_of(header)
    available = sorted((w for w, hs in holders.items() if hs), key=lambda w: (w in pieced, w))
    if writer_of is None or not available:
        return None
    held_by: dict[str, set[str]] = {}  # host -> the writers whose parts it holds whole
    for w, hs in holders.items():
        if w not in pieced:
            for h in hs:
                held_by.setdefault(h, set()).add(w)
    needs: dict[str, set[str]] = {h: set() for h in readers}
    grids = _grids(header)
    # Per (grid, chunk): the writers of that chunk whose parts some host holds, as a set, and the one a
    # reader that holds none of them pulls. Computed once: a chunk has as many writers as there are
    # data-parallel replicas (slices), and every reader of it checks its few held parts against the set.
    chunk_writers: dict[tuple[int, tuple[int, ...]], tuple[frozenset, str] | None] = {}
    targets: dict[tuple, dict[int, Box]] = {}
    planned: set[tuple] = set()
    host_numpy = False
    for r in requests:
        rec = r.record
        if rec.kind == "numpy" and r.sharding is None:
            host_numpy = True
            continue
        g = _grid_of(rec, header.listed, grids) if r.sharding is not None else None
        if g is None:
            return None
        tkey = (id(r.sharding), tuple(rec.shape))
        boxes = targets.get(tkey)
        if boxes is None:  # a jax sharding, or its description (a planner that has no such devices)
            boxes = targets[tkey] = (shardings.described_device_boxes(r.sharding, tuple(rec.shape))
                                     if isinstance(r.sharding, Mapping) else
                                     shardings.device_boxes(r.sharding, tuple(rec.shape)))
            if boxes is None:
                return None
        if (id(g), tkey) in planned:  # another array of the same saved and target boxes: the same needs
            continue
        planned.add((id(g), tkey))
        for dev, box in boxes.items():
            reader = host_of_device(dev)
            if reader is None:
                return None
            mine = needs.setdefault(reader, set())
            have = held_by.get(reader, ())
            for piece in g.pieces(box):
                key = (id(g), piece)
                if key not in chunk_writers:
                    devs = g.writers.get(piece, ())
                    ws = [writer_of[d] for d in devs if holders.get(writer_of.get(d))]
                    chunk_writers[key] = (frozenset(ws), ws[0]) if ws else None
                found = chunk_writers[key]
                if found is None:
                    return None
                wset, first = found
                if any(w in wset for w in have) or any(w in wset for w in mine):
                    continue
                mine.add(reader if reader in wset else first)  # its own part, where it wrote the chunk
    if host_numpy:  # every writer wrote those whole: a reader that holds no part reads another's
        for h in readers:
            if not held_by.get(h) and not needs[h]:
                needs[h].add(available[0])
    return needs


def loads(requests: Sequence[Any], host_of_device: Callable[[int], str | None],
          readers: Sequence[str]) -> dict[str, list[tuple[list[str], list[Box] | None]]] | None:
    """reading host -> what it will load for ``requests`` (``LoadRequest``s): (the keys of the arrays
    of one target sharding and shape, the boxes of them on its devices), and (the keys of the host
    numpy leaves, None: whole, on every host of ``readers``). O(distinct (sharding, shape) x devices
    + arrays); None where a target's boxes cannot be known (a device of no host)."""
    groups: dict[tuple, tuple[list[str], dict[str, set[Box]]]] = {}
    whole: list[str] = []
    for r in requests:
        rec = r.record
        if rec.kind == "scalar":  # no blob: its value is in the header
            continue
        if r.sharding is None:
            whole.append(rec.key)
            continue
        tkey = (id(r.sharding), tuple(rec.shape))
        group = groups.get(tkey)
        if group is None:
            boxes = (shardings.described_device_boxes(r.sharding, tuple(rec.shape)) if isinstance(r.sharding, Mapping)
                     else shardings.device_boxes(r.sharding, tuple(rec.shape)))
            if boxes is None:
                return None
            by_host: dict[str, set[Box]] = {}
            for dev, box in boxes.items():
                host = host_of_device(dev)
                if host is None:
                    return None
                by_host.setdefault(host, set()).add(box)
            group = groups[tkey] = ([], by_host)
        group[0].append(rec.key)
    out: dict[str, list[tuple[list[str], list[Box] | None]]] = {h: [] for h in readers}
    for keys, by_host in groups.values():
        for host, boxes in by_host.items():
            out.setdefault(host, []).append((keys, sorted(boxes)))
    if whole:
        for wants in out.values():
            wants.append((whole, None))
    return out



def designated(view: StepManifest, writer: str, part: str | None = None) -> list[str]:
    """The blobs of ``writer``'s part (``view`` holds its rows) that fall to it when the writers share a
    step's unique boxes out among themselves with no plan from the head (a backup's uploads, the backup
    scrub): of the devices that held a box (its sharding's description), the one its blob's name picks
    (spreading the boxes over the data-parallel replicas) names the writer; a numpy leaf, which every
    writer wrote, falls to the writer its name picks; a box its description does not give (an unusual
    sharding), to every writer of it. Which writer held which device is the header's
    ``topology.devices``; ManifestError without it (a step saved by an older version). With ``part``,
    the blobs that fall to ``writer`` among the rows of that host's part (a data-parallel twin of a writer
    gone from the step wrote the same boxes: it uploads the writer's share for it)."""
    devices = view.topology.get("devices")
    if not isinstance(devices, dict) or not devices:
        raise ManifestError(f"step {view.step} records no devices per host (saved by an older version)")
    host_of = {int(d): h for h, ids in devices.items() for d in ids}
    hosts = sorted(devices)
    mine = view.part_blobs.get(part or writer, frozenset()) if view.part_blobs else frozenset()
    out: set[str] = set()
    holders: dict[tuple, dict] = {}  # (description, shape) -> box -> devices that held it, sorted
    described: dict[int, str] = {}  # id of a description -> its text (a header shares one per sharding)
    for rec in view.arrays:
        boxes = None
        if rec.kind == "jax" and rec.sharding is not None and rec.shards:
            text = described.get(id(rec.sharding))
            if text is None:  # (a mesh lists every device: once per description, not per shard)
                text = described[id(rec.sharding)] = canonical_json(rec.sharding)
            key = (text, rec.shape)
            boxes = holders.get(key)
            if boxes is None:
                boxes = {}
                for dev, box in (shardings.described_device_boxes(rec.sharding, rec.shape) or {}).items():
                    boxes.setdefault(box, []).append(dev)
                boxes = holders[key] = {b: sorted(ds) for b, ds in boxes.items()}
        for sh in rec.shards:
            if sh.blob not in mine:
                continue
            pick = int(sh.blob[:8], 16)
            if boxes is None:
                if hosts[pick % len(hosts)] == writer:
                    out.add(sh.blob)
                continue
            devs = boxes.get(sh.box)
            if not devs or host_of.get(devs[pick % len(devs)]) == writer:
                out.add(sh.blob)
    return sorted(out)
