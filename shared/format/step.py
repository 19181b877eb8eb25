"""Step manifests (``mtc/3``, and ``mtc/2`` / ``mtc/1`` still read): ``ShardRecord``, ``ArrayRecord``,
``StepManifest``, ``StepHeader`` (its first line alone), ``encode_step`` (a manifest from its arrays and the hosts' parts) and
``check_step_bytes`` (the cheap checks of a keeper), with the parsers behind ``StepManifest.from_json``."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Iterable

import msgspec
import numpy as np

from mtc.shared import collector
from mtc.shared import shardings as shardings_lib
from mtc.shared.errors import ManifestError
from mtc.shared.format.base import (Box, box_from_doc, box_intersect, box_shape, box_str, canonical_json, doc_digest,
                                    dtype_from_name, expect, load_json)
from mtc.shared.format.host import HostManifest, HostShard, PartColumns, check_box_order, split_names
from mtc.shared.hashing import HASH_NAME, blob_name, is_blob_name

# mtc/3: a header line and one line per host part (see mtc.shared.format). Its "digest" is SHA-256 over the
# header's canonical JSON, which holds each part's xxh3-128 and length, so it covers every byte.
# mtc/2 (one document, "digest" over the rest) and mtc/1 (no digest) are still read.
FORMAT = "mtc/3"
_FORMAT_V2 = "mtc/2"
_FORMAT_V1 = "mtc/1"


class ShardRecord(msgspec.Struct, frozen=True, gc=False):
    """One saved shard: its box in the global array, its blob and the devices that held it.

    (A msgspec ``Struct``, not a dataclass: a whole manifest makes one per shard, and a Struct is
    made several times faster.)"""

    box: Box
    blob: str
    nbytes: int
    devices: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class ArrayRecord:
    """One leaf of the saved tree.

    kind: ``"jax"`` (a jax.Array, sharded), ``"numpy"`` (a host numpy array, saved as one
    blob) or ``"scalar"`` (a Python scalar, kept in the manifest as ``value``).
    """

    key: str
    kind: str
    dtype: str | None = None
    shape: tuple[int, ...] = ()
    sharding: dict | None = None
    shards: tuple[ShardRecord, ...] = ()
    value: Any = None
    # A typed PRNG key array (``jax.random.key``): the blobs hold its key data (``dtype`` and
    # ``shape`` are those of ``jax.random.key_data``, whose last dimensions are ``prng_key_shape``),
    # and restore wraps them again with the impl named here ("threefry2x32", "rbg", "unsafe_rbg").
    prng_impl: str | None = None
    prng_key_shape: tuple[int, ...] = ()

    @property
    def np_dtype(self) -> np.dtype:
        return dtype_from_name(self.dtype)

    @property
    def logical_shape(self) -> tuple[int, ...]:
        """The shape the user sees: without the key data dimensions of a PRNG key array."""
        return self.shape[: len(self.shape) - len(self.prng_key_shape)] if self.prng_impl else self.shape

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.np_dtype.itemsize


@dataclasses.dataclass(frozen=True)
class StepManifest:
    """The commit of one step: every array, its shards and their blobs.

    ``parts`` names the host parts it was assembled from, as (host, xxh3-128 of the part's
    bytes), when it was read from (or built as) an ``mtc/3`` document.
    """

    step: int
    arrays: tuple[ArrayRecord, ...]
    tree: Any
    created: float = 0.0
    topology: dict = dataclasses.field(default_factory=dict)
    fingerprint: dict = dataclasses.field(default_factory=dict)
    parts: tuple[tuple[str, str], ...] = dataclasses.field(default=(), compare=False)
    part_blobs: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)  # host -> its part's blobs

    def blob_sizes(self) -> dict[str, int]:
        return dict(self._blob_sizes)

    @functools.cached_property
    def _blob_sizes(self) -> dict[str, int]:  # (made once: a whole manifest has millions of rows)
        table = self.__dict__.get("_table")
        with collector.paused():
            if table is not None:  # read from parts: from the columns, no shard record made
                return table.blob_sizes()
            return {s.blob: s.nbytes for a in self.arrays for s in a.shards}

    def blob_names(self) -> set[str]:
        return set(self._blob_sizes)

    def blobs_among(self, names: Iterable[str]) -> set[str]:
        """Those of ``names`` that are blobs of this step (no copy of the step's names)."""
        sizes = self._blob_sizes
        return {n for n in names if n in sizes}

    def blob_sizes_for(self, wants: Mapping[str, Sequence[Box] | None]) -> dict[str, int]:
        """The blobs (and their sizes) a host reads to load ``wants``: array key -> the boxes of it
        that it loads (None: the whole array). The blobs of the shards whose boxes overlap one of
        those; every shard of an array with an empty dimension (nothing to overlap); none of an array
        not named."""
        out: dict[str, int] = {}
        for a in self.arrays:
            if a.key not in wants or a.kind == "scalar":
                continue
            boxes = wants[a.key]
            whole = boxes is None or 0 in a.shape
            for sh in a.shards:
                if whole or any(box_intersect(sh.box, b) is not None for b in boxes):
                    out[sh.blob] = sh.nbytes
        return out

    def sorted_blob_names(self) -> list[str]:
        """Every blob name of the step, sorted (the order an inventory's bitmaps are over); made
        once. From the parts' columns where the manifest was read from them (a sort of 16-byte keys,
        not of a million strings)."""
        names = self.__dict__.get("_sorted_names")
        if names is None:
            table = self.__dict__.get("_table")
            if table is not None:  # one row per shard: every blob of the step, replicas once
                names = _sorted_unique([table.blob])
            else:
                names = sorted(self._blob_sizes)
            self.__dict__["_sorted_names"] = names
        return list(names)

    def part_blob_names(self, host: str) -> list[str]:
        """The sorted blob names of ``host``'s part (empty when it wrote none)."""
        parts = self.part_blobs
        if isinstance(parts, _PartBlobs):
            return parts.sorted_names(host)
        return sorted(parts.get(host, ()))

    @property
    def nbytes(self) -> int:
        return sum(self._blob_sizes.values())

    @functools.cached_property
    def _encoded(self) -> tuple[bytes, str]:
        # One part with every shard: how a manifest made in memory (not by a save) is written.
        rows = []
        for i, a in enumerate(self.arrays):
            rows.extend(HostShard(i, s.box, s.blob, s.nbytes) for s in a.shards)
        part = HostManifest(self.step, "*", tuple(rows)).to_json()
        listed = {i: [(s.box, s.devices) for s in a.shards] for i, a in enumerate(self.arrays)
                  if a.kind == "jax" and not _devices_derivable(a)}
        return encode_step(step=self.step, arrays=self.arrays, tree=self.tree, created=self.created,
                           topology=self.topology, fingerprint=self.fingerprint, parts=[("*", part)],
                           listed_boxes=listed)

    @functools.cached_property
    def digest(self) -> str:
        """SHA-256 of the header (which holds a hash of every part): what every reader checks,
        and what the hosts' copies of one step are compared by."""
        return self._encoded[1]

    def to_json(self) -> bytes:
        """The document (for one read from bytes: exactly those bytes)."""
        if self.local_part is not None:
            raise ManifestError(f"step {self.step}: a partial view of the manifest (host {self.local_part}'s part, "
                                "or the header only) is never written or sent; read the whole manifest")
        return self._encoded[0]

    @property
    def local_part(self) -> str | None:
        """The host whose part alone this holds (``local_view``), or None for a whole manifest."""
        return self.__dict__.get("_local_part")

    @classmethod
    def local_view(cls, header: bytes, host: str, part: bytes, *, source: str = "manifest") -> "StepManifest":
        """A host's view of an ``mtc/3`` manifest from its header line and the host's own part:
        every array, with only the shards of that part. The header is checked against its
        digest and the part against its hash in the header, so the view's ``digest`` is the
        whole manifest's; coverage is not checked (the other parts are not here). Enough to read
        the host's own shards (a restore onto the same topology) without the other parts, which
        grow with hosts x shards; never written or sent (``to_json`` refuses)."""
        return cls.parts_view(header, {host: part}, source=source)

    @classmethod
    def parts_view(cls, header: bytes, parts: Mapping[str, bytes], *, source: str = "manifest") -> "StepManifest":
        """``local_view`` over the parts of several hosts (host -> its part's bytes): what a host reads by
        after a resize, the writers' parts whose boxes its new devices overlap."""
        header = bytes(header)
        expect(b"\n" not in header, source, "a header is one line")
        expect(len(parts) > 0, source, "a view of no part")
        doc = load_json(header, source)
        expect(doc.get("format") == FORMAT, source, f"format is {doc.get('format')!r}, expected {FORMAT!r}")
        m = _parse_v3(doc, b"", source, only={h: bytes(p) for h, p in parts.items()})
        m.__dict__["_local_part"] = ",".join(sorted(parts))
        return m

    @classmethod
    def from_json(cls, data: bytes | str, *, source: str = "manifest") -> "StepManifest":
        if isinstance(data, str):
            data = data.encode()
        data = bytes(data)
        first, rest = _first_line(data)
        doc = load_json(first, source)
        with collector.paused():  # a whole manifest makes millions of objects, none of them cyclic garbage
            if doc.get("format") == FORMAT:
                m = _parse_v3(doc, rest, source)
            else:
                m = _parse_v2(load_json(data, source), source)
        # Read bytes are written back as they are: their digest is the one the hosts compare.
        if "digest" in m.__dict__:  # (an mtc/1 document has none: it is written anew as mtc/3)
            m.__dict__["_encoded"] = (data, m.digest)
        return m


@dataclasses.dataclass(frozen=True)
class StepHeader:
    """The header line of an ``mtc/3`` step manifest, read alone: the arrays (without shards), the
    tree, the topology and one (host, part digest) per host part. What a restore onto the topology
    that saved the step needs on the head: each host reads its own part, so the head never parses a
    shard row (``StepHeader.from_line``: O(arrays + hosts), checked against its digest).

    ``devices`` (host -> the device ids whose shards it wrote) is in the topology of steps saved by
    this version and later; None for older ones (a restore then reads the whole manifest)."""

    step: int
    digest: str
    arrays: tuple[ArrayRecord, ...]
    tree: Any
    parts: tuple[tuple[str, str], ...]
    topology: dict
    fingerprint: dict
    created: float = 0.0
    listed: frozenset = frozenset()  # keys of arrays whose boxes the manifest lists (not derivable)

    @property
    def devices(self) -> dict[str, tuple[int, ...]] | None:
        devs = self.topology.get("devices")
        return {h: tuple(ids) for h, ids in devs.items()} if isinstance(devs, dict) else None

    def as_manifest(self) -> StepManifest:
        """A ``StepManifest`` of the arrays without shards (a restore's requests are planned from it);
        never written (``to_json`` refuses), and its ``digest`` is the whole manifest's."""
        m = StepManifest(step=self.step, arrays=self.arrays, tree=self.tree, created=self.created,
                         topology=self.topology, fingerprint=self.fingerprint, parts=self.parts)
        m.__dict__["digest"] = self.digest
        m.__dict__["_local_part"] = "(header only)"
        return m

    @classmethod
    def from_line(cls, line: bytes, *, source: str = "manifest header") -> "StepHeader":
        """The header from its line (the first of the manifest's bytes; the rest is ignored)."""
        line = bytes(line).partition(b"\n")[0]
        doc = load_json(line, source)
        expect(doc.get("format") == FORMAT, source, f"format is {doc.get('format')!r}, expected {FORMAT!r}")
        digest, step = _checked_header(doc, source)
        table, docs, metas = doc.get("shardings"), doc.get("arrays"), doc.get("parts")
        expect(isinstance(table, list), source, "'shardings' is missing or not a list")
        expect(isinstance(docs, list), source, "'arrays' is missing or not a list")
        expect(isinstance(metas, list) and all(isinstance(m, dict) and isinstance(m.get("host"), str)
                                               and isinstance(m.get("digest"), str) for m in metas),
               source, "'parts' is missing or malformed")
        for i, desc in enumerate(table):
            shardings_lib.check_desc(desc, f"{source}: shardings[{i}]")
        arrays, listed = [], set()
        for i, a in enumerate(docs):
            where = f"{source}: arrays[{i}]"
            expect(isinstance(a, dict), where, "not an object")
            if a.get("boxes") is not None:
                listed.add(a.get("key"))
            idx = a.get("sharding")
            expect(idx is None or (isinstance(idx, int) and 0 <= idx < len(table)), where,
                   f"sharding {idx!r} is not an index of 'shardings'")
            shallow = {k: v for k, v in a.items() if k not in ("sharding", "boxes")}
            if a.get("kind") != "scalar":
                shallow.update(sharding=None if idx is None else table[idx], shards=None)
            arrays.append(_array_from_doc(shallow, where, require_cover=False))
        keys = [r.key for r in arrays]
        expect(len(set(keys)) == len(keys), source, "duplicate array keys")
        topology = doc.get("topology") or {}
        expect(isinstance(topology, dict), source, "'topology' is not an object")
        devs = topology.get("devices")
        expect(devs is None or (isinstance(devs, dict) and all(
            isinstance(ids, list) and all(isinstance(d, int) for d in ids) for ids in devs.values())),
            source, "'topology.devices' is not host -> [device ids]")
        return cls(step=step, digest=digest, arrays=tuple(arrays), tree=doc.get("tree"),
                   parts=tuple((m["host"], m["digest"]) for m in metas), topology=dict(topology),
                   fingerprint=dict(doc.get("fingerprint") or {}), created=float(doc.get("created", 0.0)),
                   listed=frozenset(listed))


def _devices_derivable(a: ArrayRecord) -> bool:
    """Whether the devices of every shard of ``a`` follow from its sharding description."""
    derived = shardings_lib.described_device_boxes(a.sharding, a.shape)
    if derived is None:
        return False
    by_box: dict[Box, list[int]] = {}
    for dev, box in derived.items():
        by_box.setdefault(box, []).append(dev)
    return all(tuple(sorted(s.devices)) == tuple(sorted(by_box.get(s.box, ()))) or not s.devices for s in a.shards)


def encode_step(*, step: int, arrays: Iterable[ArrayRecord], tree: Any, created: float, topology: dict,
                fingerprint: dict, parts: Iterable[tuple[str, bytes]],
                listed_boxes: dict[int, list[tuple[Box, Iterable[int]]]] | None = None) -> tuple[bytes, str]:
    """An ``mtc/3`` step manifest from its arrays (their shards are not read) and host parts.

    ``parts`` are (host, host manifest bytes as the host wrote them); they are hashed and
    appended, never parsed, so this costs O(arrays + hosts) plus one pass over the bytes.
    ``listed_boxes`` (array index -> [(box, devices)]) is for arrays whose devices cannot be
    derived from their sharding. Returns (bytes, digest); ``encode_step_segments`` the same
    bytes unjoined.
    """
    segments, digest = encode_step_segments(step=step, arrays=arrays, tree=tree, created=created, topology=topology,
                                            fingerprint=fingerprint, parts=parts, listed_boxes=listed_boxes)
    return b"".join(segments), digest


def encode_step_segments(*, step: int, arrays: Iterable[ArrayRecord], tree: Any, created: float, topology: dict,
                         fingerprint: dict, parts: Iterable[tuple[str, bytes]],
                         listed_boxes: dict[int, list[tuple[Box, Iterable[int]]]] | None = None
                         ) -> tuple[list[bytes], str]:
    """``encode_step``'s manifest as the buffers it is made of, in order, never joined (at thousands of
    hosts the manifest is hundreds of MiB, and its senders send buffers back to back): the header line
    first, then a newline and a host's part for each part. Returns (buffers, digest)."""
    table: list[dict] = []
    index: dict[bytes, int] = {}
    by_id: dict[int, int] = {}  # the same description object (one sharding, many arrays): not re-encoded
    docs = []
    for i, a in enumerate(arrays):
        doc: dict[str, Any] = {"key": a.key, "kind": a.kind}
        if a.kind == "scalar":
            doc["value"] = a.value
        else:
            doc.update(dtype=a.dtype, shape=list(a.shape))
            if a.sharding is not None:
                j = by_id.get(id(a.sharding))
                if j is None:
                    k = canonical_json(a.sharding)
                    if k not in index:
                        index[k] = len(table)
                        table.append(a.sharding)
                    j = by_id[id(a.sharding)] = index[k]
                doc["sharding"] = j
            if listed_boxes and i in listed_boxes:
                doc["boxes"] = [[[list(b) for b in box], sorted(int(d) for d in devs)] for box, devs in listed_boxes[i]]
            if a.prng_impl:
                doc.update(prng_impl=a.prng_impl, prng_key_shape=list(a.prng_key_shape))
        docs.append(doc)
    raw = []
    metas = []
    for host, data in parts:
        data = bytes(data)
        if b"\n" in data:
            raise ManifestError(f"the part of host {host} contains a newline; parts are single-line JSON")
        raw.append(data)
        metas.append({"host": host, "digest": blob_name(data), "bytes": len(data)})
    header = {"format": FORMAT, "hash": HASH_NAME, "step": step, "created": created, "fingerprint": fingerprint,
              "topology": topology, "tree": tree, "shardings": table, "arrays": docs, "parts": metas}
    digest = doc_digest(header)
    header["digest"] = digest
    segments = [canonical_json(header)]
    for data in raw:
        segments += (b"\n", data)
    return segments, digest


def check_step_bytes(data: bytes, *, source: str = "manifest") -> tuple[int, str, dict[str, str]]:
    """The cheap checks of an mtc/3 manifest: its header's digest and every part's hash and
    length; returns (step, digest, host -> part digest). What a keeper checks before it commits
    (one pass of hashing, no per-shard work); the full checks (coverage, equal replicas, every
    row) run when the manifest is read (``StepManifest.from_json``)."""
    data = bytes(data)
    first, rest = _first_line(data)
    doc = load_json(first, source)
    expect(doc.get("format") == FORMAT, source, f"format is {doc.get('format')!r}, expected {FORMAT!r}")
    digest = doc.pop("digest", None)
    expect(isinstance(digest, str) and digest == doc_digest(doc), source,
            "its header does not match its digest (changed after it was written); not using it")
    step, metas = doc.get("step"), doc.get("parts")
    expect(isinstance(step, int) and not isinstance(step, bool) and step >= 0, source,
            f"step {step!r} is not a non-negative integer")
    expect(isinstance(metas, list) and all(isinstance(m, dict) and isinstance(m.get("host"), str) for m in metas),
            source, "'parts' is missing or malformed")
    lines = _part_lines(rest, metas)
    expect(len(lines) == len(metas), source, f"it has {len(lines)} host parts, its header lists {len(metas)}")
    out = {}
    for meta, line in zip(metas, lines):
        expect(meta.get("bytes") == len(line) and meta.get("digest") == blob_name(line), source,
                f"the part of host {meta['host']} does not match its hash in the header (changed after it was written)")
        out[meta["host"]] = meta["digest"]
    return step, digest, out


@dataclasses.dataclass(frozen=True)
class StepBlobNames:
    """A step manifest's digest and every blob name it holds, sorted (``step_blob_names``)."""

    step: int
    digest: str
    names: list[str]


def step_blob_names(data: bytes, *, source: str = "manifest") -> StepBlobNames:
    """Every blob name of a step manifest, sorted, for a reader that needs the names alone (``mtc status
    --verify``): of an ``mtc/3`` manifest, from its parts' columns, after its header's digest and every
    part's hash and length are checked (``check_step_bytes``), with no shard record made and one name
    per distinct blob; an older format is read whole."""
    got = _blob_columns(data, source)
    if isinstance(got, StepManifest):
        return StepBlobNames(got.step, got.digest, got.sorted_blob_names())
    step, digest, cols = got
    return StepBlobNames(step, digest, _sorted_unique(_distinct_blobs(cols)))


def step_blobs_among(data: bytes, names: Iterable[str], *, source: str = "manifest") -> set[str]:
    """Those of ``names`` (blob names) that a step manifest holds, for a reader that asks after a few
    among millions (a restore looking in the backups of other steps for the blobs no host holds): read
    and checked as ``step_blob_names`` reads it, and a name made only for a row whose 64-bit key (both
    halves of its 16 bytes, mixed) is one of ``names``'s; an older format is read whole."""
    names = set(names)
    bad = next((n for n in names if not is_blob_name(n)), None)
    if bad is not None:
        raise ManifestError(f"{source}: {bad!r} is not a blob name")
    got = _blob_columns(bytes(data), source)
    if isinstance(got, StepManifest):
        return names & got.blob_names()
    _, _, cols = got
    blobs = [p.blob for p in cols]
    if not names or not blobs:
        return set()
    want = np.sort(_mixed(np.frombuffer(bytes.fromhex("".join(sorted(names))), np.uint64).reshape(-1, 2)))
    # A filter of the keys' low bits (a table in cache, about 256 slots per key asked after), then a binary
    # search for the few rows it lets through, then the names of the rows whose key is one of ``want``'s.
    bits = np.uint64(min(1 << 24, 1 << (256 * len(want)).bit_length()) - 1)
    table = np.zeros(int(bits) + 1, bool)
    table[want & bits] = True
    near = []
    for blob in blobs:  # (a part at a time)
        keys = _mixed(blob)
        rows = np.flatnonzero(table[keys & bits])
        at = np.searchsorted(want, keys[rows])
        at[at == len(want)] = 0
        near.append(blob[rows[want[at] == keys[rows]]])
    return names.intersection(split_names(np.concatenate(near)))


def _mixed(blob: np.ndarray, size: np.ndarray | None = None) -> np.ndarray:
    """One 64-bit key per blob name (rows of its 16 bytes), and its ``size`` where given, that every
    half changes: equal names (and sizes) have equal keys, and others seldom do."""
    out = blob[:, 1] * np.uint64(0x9E3779B97F4A7C15)
    out ^= blob[:, 0]
    if size is not None:
        out ^= size.view(np.uint64) * np.uint64(0xC2B2AE3D27D4EB4F)
    return out


def _blob_columns(data: bytes, source: str) -> "tuple[int, str, list[PartColumns]] | StepManifest":
    """(step, digest, each part's columns) of an ``mtc/3`` manifest, its header's digest and every
    part's hash, length, step and host checked; an older format read whole (a ``StepManifest``)."""
    data = bytes(data)
    head, rest = _first_line(data)
    try:
        first = load_json(head, source)
    except ManifestError:  # (an older document over several lines: read whole, which says what is wrong)
        first = None
    if not isinstance(first, dict) or first.get("format") != FORMAT:
        return StepManifest.from_json(data, source=source)
    step, digest, hosts = check_step_bytes(data, source=source)
    lines = _part_lines(rest, first["parts"]) if hosts else []
    blobs = []
    for j, (host, line) in enumerate(zip(hosts, lines)):
        part = PartColumns.from_json(line, source=f"{source}: part {j} (host {host})", check_boxes=False)
        expect(part.step == step and part.host == host, f"{source}: part {j}",
               f"it is the part of host {part.host} step {part.step}, the header says host {host} step {step}")
        blobs.append(part)
    return step, digest, blobs


def _first_line(data: bytes) -> tuple[bytes, memoryview]:
    """(the first line of ``data``, a view of the rest): the parts are not copied (at thousands of hosts
    they are hundreds of MiB)."""
    i = data.find(b"\n")
    if i < 0:
        return data, memoryview(b"")
    return data[:i], memoryview(data)[i + 1:]


def _part_lines(rest: memoryview, metas: list) -> list:
    """The parts' lines of ``rest`` (what follows the header), as views, cut at the lengths the header
    gives when they account for every byte and a newline is between each two; else split at the
    newlines (which then disagree with the header, and the caller says so)."""
    if not len(rest):
        return []
    sizes = [m.get("bytes") if isinstance(m, dict) else None for m in metas]
    if all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in sizes) and \
            sum(sizes) + len(sizes) - 1 == len(rest):
        lines, at = [], 0
        for n in sizes:
            if at and rest[at - 1] != 0x0A:
                break
            lines.append(rest[at:at + n])
            at += n + 1
        else:
            return lines
    return bytes(rest).split(b"\n")


def _parse_v2(doc: dict, source: str) -> StepManifest:
    digest = doc.pop("digest", None)
    expect(doc.get("format") in (_FORMAT_V2, _FORMAT_V1), source,
            f"format is {doc.get('format')!r}, expected {FORMAT!r} (written by another mtc version?)")
    expect(doc.get("hash") == HASH_NAME, source, f"hash is {doc.get('hash')!r}, expected {HASH_NAME!r}")
    step = doc.get("step")
    expect(isinstance(step, int) and step >= 0, source, f"step {step!r} is not a non-negative integer")
    arrays = doc.get("arrays")
    expect(isinstance(arrays, list), source, "'arrays' is missing or not a list")
    records = tuple(_array_from_doc(a, f"{source}: arrays[{i}]") for i, a in enumerate(arrays))
    keys = [r.key for r in records]
    expect(len(set(keys)) == len(keys), source, "duplicate array keys")
    # Last, so that a malformed document gets its precise error. mtc/1 had no digest (read only).
    if digest is not None or doc["format"] == _FORMAT_V2:
        expect(isinstance(digest, str) and digest == doc_digest(doc), source,
                "its content does not match its digest (changed after it was written); not using it")
    m = StepManifest(step=step, arrays=records, tree=doc.get("tree"), created=float(doc.get("created", 0.0)),
                     topology=dict(doc.get("topology") or {}), fingerprint=dict(doc.get("fingerprint") or {}))
    if digest is not None:
        m.__dict__["digest"] = digest
    return m


def _checked_header(doc: dict, source: str) -> tuple[str, int]:
    """(digest, step) of an mtc/3 header ``doc`` (its "digest" popped), checked: the digest covers the rest,
    the hash is mtc's, the step a non-negative integer."""
    digest = doc.pop("digest", None)
    expect(isinstance(digest, str) and digest == doc_digest(doc), source,
           "its header does not match its digest (changed after it was written); not using it")
    expect(doc.get("hash") == HASH_NAME, source, f"hash is {doc.get('hash')!r}, expected {HASH_NAME!r}")
    step = doc.get("step")
    expect(isinstance(step, int) and not isinstance(step, bool) and step >= 0, source,
           f"step {step!r} is not a non-negative integer")
    return digest, step


def _parse_v3(doc: dict, rest: memoryview | bytes, source: str, only: dict[str, bytes] | None = None) -> StepManifest:
    digest, step = _checked_header(doc, source)
    table = doc.get("shardings")
    expect(isinstance(table, list), source, "'shardings' is missing or not a list")
    for i, desc in enumerate(table):
        shardings_lib.check_desc(desc, f"{source}: shardings[{i}]")
    docs, metas = doc.get("arrays"), doc.get("parts")
    expect(isinstance(docs, list), source, "'arrays' is missing or not a list")
    expect(isinstance(metas, list), source, "'parts' is missing or not a list")
    if only is None:
        lines = _part_lines(rest, metas)
        expect(len(lines) == len(metas), source, f"it has {len(lines)} host parts, its header lists {len(metas)}")
        pairs = list(zip(metas, lines))
    else:  # a view of some hosts' parts only (see StepManifest.parts_view)
        pairs = [(meta, only[meta["host"]]) for meta in metas if isinstance(meta, dict) and isinstance(meta.get("host"), str) and meta["host"] in only]
        for host in only:
            n = sum(1 for meta, _ in pairs if meta["host"] == host)
            expect(n == 1, source, f"its header lists {n} parts of host {host}, not one")
    # The header's arrays, then their shards from every part (equal boxes from several hosts are
    # replicas: one record, and they must name the same blob).
    derived: dict = {}  # (sharding index, shape) -> its device boxes: every layer's arrays share a few
    heads = [_array_head(a, table, f"{source}: arrays[{i}]", derived) for i, a in enumerate(docs)]
    cols, parts, hosts = [], [], []
    for j, (meta, line) in enumerate(pairs):
        where = f"{source}: part {j}"
        expect(isinstance(meta, dict) and isinstance(meta.get("host"), str), where, "its header entry is malformed")
        host = meta["host"]
        expect(meta.get("bytes") == len(line) and meta.get("digest") == blob_name(line), where,
                f"the part of host {host} does not match its hash in the header (changed after it was written)")
        part = PartColumns.from_json(line, source=f"{where} (host {host})", check_boxes=False)
        expect(part.step == step and part.host == host, where,
                f"it is the part of host {part.host} step {part.step}, the header says host {host} step {step}")
        cols.append(part)
        parts.append((host, meta["digest"]))
        hosts.append(host)
    records, table = _shards_from_columns(heads, cols, hosts, source, whole=only is None)
    part_blobs = _PartBlobs(dict(zip(hosts, cols)))
    keys = [r.key for r in records]
    expect(len(set(keys)) == len(keys), source, "duplicate array keys")
    m = StepManifest(step=step, arrays=tuple(records), tree=doc.get("tree"), created=float(doc.get("created", 0.0)),
                     topology=dict(doc.get("topology") or {}), fingerprint=dict(doc.get("fingerprint") or {}),
                     parts=tuple(parts), part_blobs=part_blobs)
    m.__dict__["digest"] = digest
    m.__dict__["_table"] = table
    return m


class _PartBlobs(Mapping):
    """host -> the blob names of its part (a frozenset), made the first time a host's is asked for:
    a whole manifest has millions of names, and most readers ask for one host's or none."""

    def __init__(self, parts: dict[str, "PartColumns"]):
        self._parts, self._made = parts, {}

    def __getitem__(self, host: str) -> frozenset:
        names = self._made.get(host)
        if names is None:
            names = self._made[host] = frozenset(self._parts[host].blob_names())
        return names

    def sorted_names(self, host: str) -> list[str]:
        part = self._parts.get(host)
        return [] if part is None else _sorted_unique([part.blob])

    def __iter__(self):
        return iter(self._parts)

    def __len__(self) -> int:
        return len(self._parts)


def _sorted_unique(blobs: list[np.ndarray]) -> list[str]:
    """The distinct blob names of ``blobs`` ((n, 2) uint64 arrays of their 16 bytes), sorted as
    strings: the bytes read big-endian order the same as their lowercase hex. Sorted by their first 8
    bytes (names are hashes: distinct names share them about never, and a sort of one key is several
    times faster than of two); by both halves where two distinct names do."""
    every = np.concatenate(blobs) if len(blobs) > 1 else blobs[0] if blobs else np.zeros((0, 2), np.uint64)
    if not len(every):
        return []
    keys = every.view(">u8")  # the same bytes as big-endian numbers, on any machine
    first = keys[:, 0].astype(np.uint64)
    order = np.argsort(first)
    ordered = every[order]
    differ = (ordered[1:] != ordered[:-1]).any(axis=1)
    lead = first[order]
    if (differ & (lead[1:] == lead[:-1])).any():  # two distinct names with the same first 8 bytes
        order = np.lexsort((keys[:, 1], keys[:, 0]))
        ordered = every[order]
        differ = (ordered[1:] != ordered[:-1]).any(axis=1)
    keep = np.ones(len(ordered), bool)
    keep[1:] = differ
    return split_names(ordered[keep])


def _box_ids(cols: list["PartColumns"]) -> tuple[list[np.ndarray], list[Box]]:
    """Per part, its rows' box ids in one numbering of the step's distinct boxes; and those boxes."""
    index: dict[Box, int] = {}
    ids = [np.array([index.setdefault(b, len(index)) for b in p.boxes] or [0], np.int64)[p.box] for p in cols]
    return ids, list(index)


def _parts_first_rows(cols: list["PartColumns"], ids: list[np.ndarray], n_boxes: int, span: int
                      ) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    """(each part's (array, box) keys, ``_first_rows`` of the parts by them): ``ids`` per part its
    rows' box ids (``_box_ids``), ``n_boxes`` how many there are (at least 1)."""
    keys = [p.array.astype(np.int64) * n_boxes + g for p, g in zip(cols, ids)]
    return keys, _first_rows(keys, [p.blob for p in cols], [p.nbytes for p in cols], span)


def _distinct_blobs(cols: list["PartColumns"]) -> list[np.ndarray]:
    """The parts' blob columns with one row per shard (array and box) where every replica of it names
    one blob (``_first_rows``): at thousands of hosts data-parallel replicas are most of the rows, and
    what sorts the names is fewer rows. Every row where they do not (the whole read refuses such a
    step; its names are all there)."""
    if not cols:
        return []
    ids, boxes = _box_ids(cols)
    n_boxes = max(1, len(boxes))
    span = (max((int(p.array.max()) for p in cols if len(p)), default=0) + 1) * n_boxes
    _, firsts = _parts_first_rows(cols, ids, n_boxes, span)
    if firsts is None:
        return [p.blob for p in cols]
    return [p.blob[r] for p, r in zip(cols, firsts)]


def _first_rows(keys: list[np.ndarray], blobs: list[np.ndarray], sizes: list[np.ndarray], span: int
                ) -> list[np.ndarray] | None:
    """Per part (``keys``: each row's array and box as one number below ``span``; ``blobs``: (n, 2)
    uint64; ``sizes``), the rows that are the first of their key in the parts' order, where every row of
    a key names the blob and size of that first row; None where one does not, or where the keys span too
    many values for a table of them (the sort decides, and names the replica that differs).

    Streamed: one part at a time against a table of the first row's blob and size per key, so that the
    step's rows are never put in one table (at thousands of hosts, millions of rows: the fresh memory of
    that table and its temporaries cost more than the comparisons), and what is kept is one row per
    shard. The table holds a 64-bit mix of the blob's 16 bytes and the size (``_mixed``): a replica that
    differs yet mixes equal would take two blob names (hashes themselves) whose mixes collide. A part
    may hold a key twice (two of its devices hold one replica): the first row wins."""
    n = sum(len(k) for k in keys)
    if span > 2 * n + 4096:  # (a table no bigger than the sort's own temporaries)
        return None
    first = np.full(span, -1, np.int32 if n < 2**31 else np.int64)  # the key's first row, in its part
    mixed = np.empty(span, np.uint64)  # (written where ``first`` is)
    out = []
    for key, blob, size in zip(keys, blobs, sizes):
        h = _mixed(blob, size)
        rows = np.flatnonzero(first[key] < 0)
        if len(rows):
            new, back = key[rows[::-1]], rows[::-1]  # (assigned backwards: where a key repeats, the first row stays)
            first[new] = back
            mixed[new] = h[back]
            rows = rows[first[key[rows]] == rows]
        out.append(rows)
        if not np.array_equal(mixed[key], h):
            return None
    return out


def _one_row_per_box_sorted(key: np.ndarray, BL: np.ndarray, NB: np.ndarray,
                            differ: Callable[[int, int], None]) -> np.ndarray:
    """``_one_row_per_box`` by a stable sort of the keys: each row of a key compared with the row before
    it. Where one differs, ``differ(i, j)`` is called with the first such row in the parts' order and the
    first row of its key (it raises)."""
    n = len(key)
    order = np.argsort(key, kind="stable")  # stable: the first row of each box is the first part's
    ks = key[order]
    first = np.ones(n, bool)
    np.not_equal(ks[1:], ks[:-1], out=first[1:])
    del ks
    same = np.ones(n, bool)
    for col in (BL[:, 0], BL[:, 1], NB):
        c = col[order]
        same[1:] &= c[1:] == c[:-1]
    if not (same | first).all():
        lead = order[np.maximum.accumulate(np.where(first, np.arange(n), 0))]
        bad = (BL[order] != BL[lead]).any(axis=1) | (NB[order] != NB[lead])
        i = int(order[bad].min())
        differ(i, int(lead[np.flatnonzero(order == i)[0]]))
    return order[first]


def _shards_from_columns(heads: list, cols: list["PartColumns"], hosts: list[str], source: str, whole: bool
                         ) -> tuple[list[ArrayRecord], "_ShardTable"]:
    """The arrays of ``heads`` with their shards, from the parts' columns, checked as one table (no
    Python object per row until the shards are made): every row names an array of the step, the
    rows of one box of one array (replicas) name one blob, every box fits its array and its size is
    its box's, and (``whole``) each array's boxes cover it."""
    n_heads = len(heads)
    G, gboxes = _box_ids(cols)  # per part, its rows' box ids in the step's numbering of its distinct boxes
    gindex = {b: g for g, b in enumerate(gboxes)}
    not_arrays = [i for i, (rec, _) in enumerate(heads) if rec.kind == "scalar"]
    for j, p in enumerate(cols):  # every row names an array of the step
        if len(p) and (int(p.array.max()) >= n_heads or not_arrays):
            bad = (p.array >= n_heads) | np.isin(p.array, not_arrays)
            if bad.any():
                i = int(np.argmax(bad))
                expect(False, f"{source}: part {j}",
                       f"shard of array #{int(p.array[i])}, which is not an array of this step")
    # The replicas of a box (equal array and box on several hosts) must name one blob of one size: the
    # parts streamed against a table of each box's first row; one row per shard is kept.
    keys, firsts = _parts_first_rows(cols, G, max(1, len(gboxes)), n_heads * max(1, len(gboxes)))
    if firsts is not None:
        UA = np.concatenate([p.array[r] for p, r in zip(cols, firsts)] or [np.zeros(0, np.uint32)])
        UG = np.concatenate([g[r] for g, r in zip(G, firsts)] or [np.zeros(0, np.int64)])
        UNB = np.concatenate([p.nbytes[r] for p, r in zip(cols, firsts)] or [np.zeros(0, np.int64)])
        UBL = np.concatenate([p.blob[r] for p, r in zip(cols, firsts)] or [np.zeros((0, 2), np.uint64)])
    else:  # (a replica differs, or too many keys for a table): the rows as one table, and the stable sort
        key = np.concatenate(keys or [np.zeros(0, np.int64)])  # says which replica differs
        A = np.concatenate([p.array for p in cols]) if cols else np.zeros(0, np.uint32)
        NB = np.concatenate([p.nbytes for p in cols] or [np.zeros(0, np.int64)])
        BL = np.concatenate([p.blob for p in cols]) if cols else np.zeros((0, 2), np.uint64)
        starts = np.cumsum([0] + [len(p) for p in cols])

        def part_of(row: int) -> int:
            return int(np.searchsorted(starts, row, side="right")) - 1

        def differ(i: int, j: int) -> None:
            g = int(key[i] % max(1, len(gboxes)))
            expect(False, f"{source}: part {part_of(i)}",
                   f"array {heads[int(A[i])][0].key!r} shard {box_str(gboxes[g])} has different contents on "
                   f"hosts {hosts[part_of(j)]} and {hosts[part_of(i)]} ({' != '.join(split_names(BL[[j, i]]))}); "
                   "replicas must be identical")

        u = _one_row_per_box_sorted(key, BL, NB, differ)
        UA, UG, UNB, UBL = A[u], key[u] % max(1, len(gboxes)), NB[u], BL[u]
        del key, A, NB, BL
    del keys
    # One row per shard, in the order of the records: by array, then by box.
    rank = np.empty(len(gboxes), np.int64)
    rank[sorted(range(len(gboxes)), key=gboxes.__getitem__)] = np.arange(len(gboxes))
    order = np.lexsort((rank[UG], UA))
    ua, ug, unb = UA[order].astype(np.int64), UG[order], UNB[order]
    # Each box fits its array's shape and its size is its elements' (boxes and shapes as padded tables).
    ndim = max([len(b) for b in gboxes] + [len(rec.shape) for rec, _ in heads] + [1])
    stops = np.zeros((len(gboxes), ndim), np.int64)
    box_nd = np.zeros(len(gboxes), np.int64)
    volume = np.zeros(len(gboxes), np.int64)
    for g, b in enumerate(gboxes):
        if not all(lo <= hi for lo, hi in b):  # (each distinct box once: the parts were read without it)
            j = next(j for j, p in enumerate(cols) if b in p.boxes)
            check_box_order(cols[j].boxes, f"{source}: part {j} (host {hosts[j]})")
        box_nd[g] = len(b)
        stops[g, :len(b)] = [hi for _, hi in b]
        volume[g] = math.prod(hi - lo for lo, hi in b)
    shapes = np.zeros((n_heads, ndim), np.int64)
    arr_nd = np.zeros(n_heads, np.int64)
    itemsize = np.zeros(n_heads, np.int64)
    for i, (rec, _) in enumerate(heads):
        if rec.kind != "scalar":
            arr_nd[i], itemsize[i] = len(rec.shape), rec.np_dtype.itemsize
            shapes[i, :len(rec.shape)] = rec.shape
    fits = _fits(box_nd, stops, arr_nd, shapes, ua, ug)
    want = volume[ug] * itemsize[ua]
    wrong = ~fits | (unb != want)
    if wrong.any():
        i = int(np.argmax(wrong))
        rec, box = heads[int(ua[i])][0], gboxes[int(ug[i])]
        where = f"{source}: array {rec.key!r}"
        expect(bool(fits[i]), where, f"box {box_str(box)} does not fit shape {list(rec.shape)}")
        expect(False, where, f"nbytes {int(unb[i])} does not match box {box_str(box)} of {rec.dtype} ({int(want[i])})")
    edges = np.searchsorted(ua, np.arange(n_heads + 1))
    bounds = edges.tolist()
    if whole:  # boxes of a jax sharding tile the array without overlap, so their volumes add up
        summed = np.concatenate([[0], np.cumsum(volume[ug])])
        per_array = (summed[edges[1:]] - summed[edges[:-1]]).tolist()
        for i, (rec, _) in enumerate(heads):
            total = math.prod(rec.shape)
            have = per_array[i]
            expect(rec.kind == "scalar" or total == 0 or have == total, f"{source}: array {rec.key!r}",
                   "its shards do not cover the whole array")
    table = _ShardTable(gboxes, UBL[order], unb, ug)
    owners_by_id: dict[int, dict[int, tuple[int, ...]]] = {}  # the heads share their owners by (sharding, shape)
    records = []
    for i, (rec, owners) in enumerate(heads):
        if rec.kind == "scalar":
            records.append(rec)
            continue
        og = owners_by_id.get(id(owners))
        if og is None:
            og = owners_by_id[id(owners)] = {gindex[b]: d for b, d in owners.items() if b in gindex}
        records.append(dataclasses.replace(rec, shards=_Shards(table, bounds[i], bounds[i + 1], og)))
    return records, table


class _ShardTable:
    """The shards of a manifest read from its parts, as columns, one row per shard in the order of the
    records (by array, then by box): the box (an index of ``boxes``), the blob (16 bytes) and its size.
    What the readers of the whole step want (``StepManifest.blob_sizes``, ``sorted_blob_names``) is
    made from the columns; a ``ShardRecord`` is made only for the arrays whose shards are asked for."""

    __slots__ = ("boxes", "blob", "nbytes", "box")

    def __init__(self, boxes: list[Box], blob: np.ndarray, nbytes: np.ndarray, box: np.ndarray):
        self.boxes, self.blob, self.nbytes, self.box = boxes, blob, nbytes, box

    def blob_sizes(self) -> dict[str, int]:
        return dict(zip(split_names(self.blob), self.nbytes.tolist()))


class _Shards(Sequence):
    """An array's shards (a sequence of ``ShardRecord``, as the tuple an ``ArrayRecord`` made in memory
    holds), made from its rows of a ``_ShardTable`` the first time they are read: a whole manifest has
    millions of shards, and most readers of it want a few arrays' or none (a reader that walks every
    shard makes them all, as before). Equal to the tuple of the same records; pickled as that tuple."""

    __slots__ = ("_table", "_lo", "_hi", "_owners", "_made")

    def __init__(self, table: _ShardTable, lo: int, hi: int, owners: dict[int, tuple[int, ...]]):
        self._table, self._lo, self._hi, self._owners, self._made = table, lo, hi, owners, None

    def _records(self) -> tuple[ShardRecord, ...]:
        made = self._made
        if made is None:
            t, lo, hi, og = self._table, self._lo, self._hi, self._owners
            boxes = t.boxes
            with collector.paused():
                made = tuple([ShardRecord(boxes[g], name, nb, og.get(g, ())) for g, name, nb in
                              zip(t.box[lo:hi].tolist(), split_names(t.blob[lo:hi]), t.nbytes[lo:hi].tolist())])
            self._made = made
        return made

    def __len__(self) -> int:
        return self._hi - self._lo

    def __getitem__(self, i):
        return self._records()[i]

    def __iter__(self):
        return iter(self._records())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (_Shards, tuple)):
            return self._records() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._records())

    def __add__(self, other: tuple) -> tuple:
        return self._records() + tuple(other)

    def __radd__(self, other: tuple) -> tuple:
        return tuple(other) + self._records()

    def __repr__(self) -> str:
        return repr(self._records())

    def __reduce__(self):
        return tuple, (self._records(),)


def _fits(box_nd: np.ndarray, stops: np.ndarray, arr_nd: np.ndarray, shapes: np.ndarray, ua: np.ndarray,
          ug: np.ndarray) -> np.ndarray:
    """Per row (array ``ua``, box ``ug``): whether the box has its array's rank and fits in its shape.
    Checked once per distinct shape and box, then looked up per row (a step has few shapes and boxes,
    and millions of rows), unless that table would be larger than the rows."""
    kinds, shape_of = np.unique(np.column_stack([arr_nd, shapes]), axis=0, return_inverse=True)
    shape_of = shape_of.reshape(-1)
    if len(kinds) * len(stops) > 4 * len(ua) + 1024:
        return (box_nd[ug] == arr_nd[ua]) & (stops[ug] <= shapes[ua]).all(axis=1)
    table = (box_nd[None, :] == kinds[:, :1]) & (stops[None, :, :] <= kinds[:, None, 1:]).all(axis=2)
    return table[shape_of[ua], ug]


def _array_head(doc: Any, table: list, where: str,
                derived_boxes: dict | None = None) -> tuple[ArrayRecord, dict[Box, tuple[int, ...]]]:
    """An mtc/3 header entry: the record without shards, and box -> devices that held it
    (``derived_boxes``: a cache of the latter by (sharding index, shape), for one manifest)."""
    expect(isinstance(doc, dict), where, "not an object")
    idx = doc.get("sharding")
    sharding = None
    if idx is not None:
        expect(isinstance(idx, int) and 0 <= idx < len(table), where, f"sharding {idx!r} is not an index of 'shardings'")
        sharding = table[idx]
    shallow = {k: v for k, v in doc.items() if k not in ("sharding", "boxes")}
    rec = _array_from_doc({**shallow, "sharding": sharding, "shards": None} if doc.get("kind") != "scalar" else doc,
                          where, require_cover=False)
    owners: dict[Box, list[int]] = {}
    if rec.kind != "jax":
        return rec, {}
    listed = doc.get("boxes")
    if listed is not None:
        expect(isinstance(listed, list), where, "'boxes' is not a list")
        for row in listed:
            expect(isinstance(row, list) and len(row) == 2 and isinstance(row[1], list)
                    and all(isinstance(d, int) for d in row[1]), where, "'boxes' rows are [box, [device ids]]")
            owners[box_from_doc(row[0], where)] = sorted(row[1])
    else:
        key = (idx, rec.shape)
        if derived_boxes is not None and key in derived_boxes:
            return rec, derived_boxes[key]
        derived = shardings_lib.described_device_boxes(sharding, rec.shape)
        for dev, box in (derived or {}).items():
            owners.setdefault(box, []).append(dev)
        if derived_boxes is not None:
            derived_boxes[key] = out = {b: tuple(sorted(ds)) for b, ds in owners.items()}
            return rec, out
    return rec, {b: tuple(sorted(ds)) for b, ds in owners.items()}


def _array_from_doc(doc: Any, where: str, *, require_cover: bool = True) -> ArrayRecord:
    expect(isinstance(doc, dict), where, "not an object")
    key, kind = doc.get("key"), doc.get("kind")
    expect(isinstance(key, str), where, "key is not a string")
    where = f"{where} ({key})"
    expect(kind in ("jax", "numpy", "scalar"), where, f"kind {kind!r} is not jax, numpy or scalar")
    if kind == "scalar":
        value = doc.get("value")
        expect(isinstance(value, dict) and "type" in value, where, "scalar value is not tagged")
        return ArrayRecord(key=key, kind=kind, value=value)
    dtype = doc.get("dtype")
    expect(isinstance(dtype, str), where, "dtype is missing")
    dt = dtype_from_name(dtype)
    shape = doc.get("shape")
    expect(isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape), where,
            f"shape {shape!r} is not a list of non-negative integers")
    shards = []
    for i, s in enumerate(doc.get("shards") or []):
        sw = f"{where}: shards[{i}]"
        expect(isinstance(s, dict), sw, "not an object")
        box = box_from_doc(s.get("box"), sw)
        expect(len(box) == len(shape) and all(b <= n for (_, b), n in zip(box, shape)), sw,
                f"box {box} does not fit shape {shape}")
        expect(is_blob_name(s.get("blob")), sw, f"blob name {s.get('blob')!r} is malformed")
        nbytes = s.get("nbytes")
        want = int(np.prod(box_shape(box), dtype=np.int64)) * dt.itemsize
        expect(nbytes == want, sw, f"nbytes {nbytes!r} does not match box {box_str(box)} of {dtype} ({want})")
        devices = tuple(s.get("devices") or ())
        shards.append(ShardRecord(box, s["blob"], nbytes, devices))
    if require_cover:
        expect(_covers(shape, [s.box for s in shards]), where, "shards do not cover the whole array")
    impl, key_shape = doc.get("prng_impl"), doc.get("prng_key_shape", [])
    if impl is not None:
        expect(isinstance(impl, str) and impl, where, f"prng_impl {impl!r} is not a PRNG impl name")
        expect(kind == "jax", where, "a PRNG key array must be of kind jax")
        expect(isinstance(key_shape, list) and all(isinstance(n, int) and n > 0 for n in key_shape)
                and len(key_shape) <= len(shape) and shape[len(shape) - len(key_shape):] == key_shape, where,
                f"prng_key_shape {key_shape!r} is not the trailing part of shape {shape}")
        expect(dtype == "uint32", where, f"PRNG key data has dtype {dtype}, expected uint32")
    return ArrayRecord(key=key, kind=kind, dtype=dtype, shape=tuple(shape),
                       sharding=doc.get("sharding"), shards=tuple(shards),
                       prng_impl=impl, prng_key_shape=tuple(key_shape) if impl else ())


def _covers(shape: list[int], boxes: Iterable[Box]) -> bool:
    total = math.prod(shape)
    if total == 0:
        return True
    covered = sum(math.prod(b - a for a, b in box) for box in set(boxes))
    # Boxes of a jax sharding tile the array without overlap, so their volumes add up.
    return covered == total
