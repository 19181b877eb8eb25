"""The on-disk and on-the-wire formats: step manifests, host manifests, dtypes, index boxes.

A **step manifest** says which blobs make up a step and how they assemble into arrays. It is
JSON (``"format": "mtc/2"``, with a ``"digest"`` of its own content) and is the commit of a step: it is written last, atomically.
A **host manifest** is what one sidecar answers after phase 1 of a save: the blobs it wrote.

Everything read from disk or the network goes through ``from_json``, which validates the
document and says what is wrong.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from typing import Any, Iterable

import ml_dtypes
import numpy as np

from mtc.shared.errors import ManifestError
from mtc.shared.hashing import HASH_NAME, is_blob_name

# mtc/2 adds "digest": SHA-256 over the rest of the document, checked by every reader. mtc/1
# documents (no digest) are still read.
FORMAT = "mtc/2"
_FORMAT_V1 = "mtc/1"
HOST_FORMAT = "mtc-host/1"

# A box is the part of a global array that a shard covers: ((start, stop), ...) per dimension.
Box = tuple[tuple[int, int], ...]

_ML_DTYPES = (
    "bfloat16",
    "float8_e3m4",
    "float8_e4m3",
    "float8_e4m3b11fnuz",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float6_e2m3fn",
    "float6_e3m2fn",
    "float4_e2m1fn",
    "int2",
    "int4",
    "uint2",
    "uint4",
)
_STD_KINDS = "biufc"


def dtype_name(dtype: Any) -> str:
    """A name for ``dtype`` that ``dtype_from_name`` turns back into the same dtype."""
    dt = np.dtype(dtype)
    for name in _ML_DTYPES:
        t = getattr(ml_dtypes, name, None)
        if t is not None and dt == np.dtype(t):
            return name
    if dt.kind not in _STD_KINDS or dt.byteorder == ">":
        raise ManifestError(f"dtype {dt!r} cannot be checkpointed: use a numeric or bool dtype")
    return dt.name


def dtype_from_name(name: str) -> np.dtype:
    """The dtype that ``dtype_name`` named; a clear error for an unknown name."""
    if name in _ML_DTYPES:
        t = getattr(ml_dtypes, name, None)
        if t is None:
            raise ManifestError(
                f"dtype {name!r} is not available in ml_dtypes {ml_dtypes.__version__}; "
                "install the ml_dtypes version the checkpoint was written with"
            )
        return np.dtype(t)
    try:
        dt = np.dtype(name)
    except TypeError:
        raise ManifestError(f"unknown dtype name {name!r} in manifest") from None
    if dt.kind not in _STD_KINDS:
        raise ManifestError(f"unknown dtype name {name!r} in manifest")
    return dt


def box_from_index(index: tuple, shape: tuple[int, ...]) -> Box:
    """Turn a tuple of slices (``Shard.index``) into a box of (start, stop) pairs."""
    box = []
    for sl, n in zip(index, shape):
        start, stop, step = sl.indices(n)
        if step != 1:
            raise ManifestError(f"strided shard index {sl} is not supported")
        box.append((start, stop))
    return tuple(box)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def box_slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(start, stop) for start, stop in box)


def box_intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes, or None when they do not overlap."""
    out = []
    for (a0, a1), (b0, b1) in zip(a, b):
        lo, hi = max(a0, b0), min(a1, b1)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def box_str(box: Box) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in box) + "]"


@dataclasses.dataclass(frozen=True)
class ShardRecord:
    """One saved shard: its box in the global array, its blob and the devices that held it."""

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
    """The commit of one step: every array, its shards and their blobs."""

    step: int
    arrays: tuple[ArrayRecord, ...]
    tree: Any
    created: float = 0.0
    topology: dict = dataclasses.field(default_factory=dict)
    fingerprint: dict = dataclasses.field(default_factory=dict)

    def blob_sizes(self) -> dict[str, int]:
        out = {}
        for a in self.arrays:
            for s in a.shards:
                out[s.blob] = s.nbytes
        return out

    def blob_names(self) -> set[str]:
        return set(self.blob_sizes())

    @property
    def nbytes(self) -> int:
        return sum(self.blob_sizes().values())

    def _doc(self) -> dict:
        return {
            "format": FORMAT,
            "hash": HASH_NAME,
            "step": self.step,
            "created": self.created,
            "fingerprint": self.fingerprint,
            "topology": self.topology,
            "tree": self.tree,
            "arrays": [_array_to_doc(a) for a in self.arrays],
        }

    @functools.cached_property
    def digest(self) -> str:
        """SHA-256 over the manifest's canonical JSON (without the digest): what every reader checks,
        and what the hosts' copies of one step are compared by."""
        return _digest(self._doc())

    def to_json(self) -> bytes:
        doc = self._doc()
        doc["digest"] = _digest(doc)
        return _canonical(doc)

    @classmethod
    def from_json(cls, data: bytes | str, *, source: str = "manifest") -> "StepManifest":
        doc = _load(data, source)
        digest = doc.pop("digest", None)
        _expect(doc.get("format") in (FORMAT, _FORMAT_V1), source,
                f"format is {doc.get('format')!r}, expected {FORMAT!r} (written by another mtc version?)")
        _expect(doc.get("hash") == HASH_NAME, source, f"hash is {doc.get('hash')!r}, expected {HASH_NAME!r}")
        step = doc.get("step")
        _expect(isinstance(step, int) and step >= 0, source, f"step {step!r} is not a non-negative integer")
        arrays = doc.get("arrays")
        _expect(isinstance(arrays, list), source, "'arrays' is missing or not a list")
        records = tuple(_array_from_doc(a, f"{source}: arrays[{i}]") for i, a in enumerate(arrays))
        keys = [r.key for r in records]
        _expect(len(set(keys)) == len(keys), source, "duplicate array keys")
        # Last, so that a malformed document gets its precise error. mtc/1 had no digest (read only).
        if digest is not None or doc["format"] == FORMAT:
            _expect(isinstance(digest, str) and digest == _digest(doc), source,
                    "its content does not match its digest (changed after it was written); not using it")
        return cls(
            step=step,
            arrays=records,
            tree=doc.get("tree"),
            created=float(doc.get("created", 0.0)),
            topology=dict(doc.get("topology") or {}),
            fingerprint=dict(doc.get("fingerprint") or {}),
        )


@dataclasses.dataclass(frozen=True)
class HostShard:
    """One shard one host wrote in phase 1."""

    array: int
    box: Box
    blob: str
    nbytes: int


@dataclasses.dataclass(frozen=True)
class HostManifest:
    """A sidecar's answer to phase 1 of a save: the shards it wrote, by blob."""

    step: int
    host: str
    shards: tuple[HostShard, ...]
    written_bytes: int = 0
    seconds: float = 0.0

    def blob_names(self) -> set[str]:
        return {s.blob for s in self.shards}

    def to_json(self) -> bytes:
        doc = {
            "format": HOST_FORMAT,
            "step": self.step,
            "host": self.host,
            "written_bytes": self.written_bytes,
            "seconds": self.seconds,
            "shards": [[s.array, [list(b) for b in s.box], s.blob, s.nbytes] for s in self.shards],
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes | str, *, source: str = "host manifest") -> "HostManifest":
        doc = _load(data, source)
        _expect(doc.get("format") == HOST_FORMAT, source, f"format is {doc.get('format')!r}, expected {HOST_FORMAT!r}")
        step, host = doc.get("step"), doc.get("host")
        _expect(isinstance(step, int) and step >= 0, source, f"step {step!r} is not a non-negative integer")
        _expect(isinstance(host, str), source, "host is not a string")
        shards = []
        for i, row in enumerate(doc.get("shards") or []):
            where = f"{source}: shards[{i}]"
            _expect(isinstance(row, list) and len(row) == 4, where, "expected [array, box, blob, nbytes]")
            array, box, blob, nbytes = row
            _expect(isinstance(array, int) and array >= 0, where, "array index is not an integer")
            _expect(is_blob_name(blob), where, f"blob name {blob!r} is malformed")
            _expect(isinstance(nbytes, int) and nbytes >= 0, where, "nbytes is not a non-negative integer")
            shards.append(HostShard(array, _box_from_doc(box, where), blob, nbytes))
        return cls(step, host, tuple(shards), int(doc.get("written_bytes", 0)), float(doc.get("seconds", 0.0)))


def collect_blob_names(data: bytes) -> set[str]:
    """Blob names a manifest keeps alive (garbage collection): a host manifest's shard rows, else
    every string under any key named ``"blob"``, at any depth (step and backup manifests).

    Manifests on disk are untrusted: bytes that are not JSON, or a name that is not a blob name
    (which would reach the filesystem), raise ManifestError.
    """
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ManifestError(f"manifest is not valid JSON ({e}); cannot tell which blobs it uses") from None
    names: set[str] = set()

    def strings(v: Any) -> Iterable[str]:
        if isinstance(v, str):
            yield v
        elif isinstance(v, (list, dict)):
            for x in (v.values() if isinstance(v, dict) else v):
                yield from strings(x)

    def walk(v: Any) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                if k == "blob":
                    names.update(strings(x))
                else:
                    walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)

    if isinstance(doc, dict) and doc.get("format") == HOST_FORMAT:
        for row in doc.get("shards", []):
            names.add(row[2] if isinstance(row, list) and len(row) > 2 else repr(row))
    else:
        walk(doc)
    for n in names:
        if not is_blob_name(n):
            raise ManifestError(f"manifest names blob {n!r:.80}, which is not a blob name")
    return names


# --- helpers -------------------------------------------------------------------------------


def _canonical(doc: dict) -> bytes:
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()


def _digest(doc: dict) -> str:
    return hashlib.sha256(_canonical(doc)).hexdigest()


def _load(data: bytes | str, source: str) -> dict:
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ManifestError(f"{source} is not valid JSON: {e}") from None
    _expect(isinstance(doc, dict), source, "top level is not a JSON object")
    return doc


def _expect(cond: bool, source: str, what: str) -> None:
    if not cond:
        raise ManifestError(f"{source} is invalid: {what}")


def _box_from_doc(box: Any, where: str) -> Box:
    _expect(isinstance(box, list), where, "box is not a list")
    out = []
    for pair in box:
        _expect(
            isinstance(pair, list) and len(pair) == 2 and all(isinstance(v, int) for v in pair)
            and 0 <= pair[0] <= pair[1],
            where, f"box entry {pair!r} is not [start, stop]",
        )
        out.append((pair[0], pair[1]))
    return tuple(out)


def _array_to_doc(a: ArrayRecord) -> dict:
    doc: dict[str, Any] = {"key": a.key, "kind": a.kind}
    if a.kind == "scalar":
        doc["value"] = a.value
        return doc
    doc.update(
        dtype=a.dtype,
        shape=list(a.shape),
        sharding=a.sharding,
        shards=[
            {"box": [list(b) for b in s.box], "blob": s.blob, "nbytes": s.nbytes, "devices": list(s.devices)}
            for s in a.shards
        ],
    )
    if a.prng_impl:
        doc.update(prng_impl=a.prng_impl, prng_key_shape=list(a.prng_key_shape))
    return doc


def _array_from_doc(doc: Any, where: str) -> ArrayRecord:
    _expect(isinstance(doc, dict), where, "not an object")
    key, kind = doc.get("key"), doc.get("kind")
    _expect(isinstance(key, str), where, "key is not a string")
    where = f"{where} ({key})"
    _expect(kind in ("jax", "numpy", "scalar"), where, f"kind {kind!r} is not jax, numpy or scalar")
    if kind == "scalar":
        value = doc.get("value")
        _expect(isinstance(value, dict) and "type" in value, where, "scalar value is not tagged")
        return ArrayRecord(key=key, kind=kind, value=value)
    dtype = doc.get("dtype")
    _expect(isinstance(dtype, str), where, "dtype is missing")
    dt = dtype_from_name(dtype)
    shape = doc.get("shape")
    _expect(isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape), where,
            f"shape {shape!r} is not a list of non-negative integers")
    shards = []
    for i, s in enumerate(doc.get("shards") or []):
        sw = f"{where}: shards[{i}]"
        _expect(isinstance(s, dict), sw, "not an object")
        box = _box_from_doc(s.get("box"), sw)
        _expect(len(box) == len(shape) and all(b <= n for (_, b), n in zip(box, shape)), sw,
                f"box {box} does not fit shape {shape}")
        _expect(is_blob_name(s.get("blob")), sw, f"blob name {s.get('blob')!r} is malformed")
        nbytes = s.get("nbytes")
        want = int(np.prod(box_shape(box), dtype=np.int64)) * dt.itemsize
        _expect(nbytes == want, sw, f"nbytes {nbytes!r} does not match box {box_str(box)} of {dtype} ({want})")
        devices = tuple(s.get("devices") or ())
        shards.append(ShardRecord(box, s["blob"], nbytes, devices))
    _expect(_covers(shape, [s.box for s in shards]), where, "shards do not cover the whole array")
    impl, key_shape = doc.get("prng_impl"), doc.get("prng_key_shape", [])
    if impl is not None:
        _expect(isinstance(impl, str) and impl, where, f"prng_impl {impl!r} is not a PRNG impl name")
        _expect(kind == "jax", where, "a PRNG key array must be of kind jax")
        _expect(isinstance(key_shape, list) and all(isinstance(n, int) and n > 0 for n in key_shape)
                and len(key_shape) <= len(shape) and shape[len(shape) - len(key_shape):] == key_shape, where,
                f"prng_key_shape {key_shape!r} is not the trailing part of shape {shape}")
        _expect(dtype == "uint32", where, f"PRNG key data has dtype {dtype}, expected uint32")
    return ArrayRecord(key=key, kind=kind, dtype=dtype, shape=tuple(shape),
                       sharding=doc.get("sharding"), shards=tuple(shards),
                       prng_impl=impl, prng_key_shape=tuple(key_shape) if impl else ())


def _covers(shape: list[int], boxes: Iterable[Box]) -> bool:
    total = int(np.prod(shape, dtype=np.int64))
    if total == 0:
        return True
    seen = set()
    covered = 0
    for box in boxes:
        if box in seen:
            continue
        seen.add(box)
        covered += int(np.prod(box_shape(box), dtype=np.int64))
    # Boxes of a jax sharding tile the array without overlap, so their volumes add up.
    return covered == total
