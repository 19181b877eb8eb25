"""What every mtc document uses: ``Box`` (the part of an array a shard covers) and its helpers, the
names of dtypes (``dtype_name`` / ``dtype_from_name``), and the JSON helpers of the readers and
writers (``canonical_json``, ``doc_digest``, ``load_json``, ``expect``, ``box_from_doc``)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import ml_dtypes
import numpy as np

from mtc.shared.errors import ManifestError

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


# --- the readers' JSON helpers -------------------------------------------------------------


def canonical_json(doc: dict) -> bytes:
    """``doc`` as compact JSON with sorted keys: the bytes its digest and checksum are taken over."""
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()


def doc_digest(doc: dict) -> str:
    """SHA-256 (hex) of ``doc``'s canonical JSON: the ``"digest"`` a step manifest's header carries."""
    return hashlib.sha256(canonical_json(doc)).hexdigest()


def load_json(data: bytes | str, source: str) -> dict:
    """The JSON object in ``data``; ManifestError naming ``source`` if it is not JSON or not an object."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ManifestError(f"{source} is not valid JSON: {e}") from None
    expect(isinstance(doc, dict), source, "top level is not a JSON object")
    return doc


def expect(cond: bool, source: str, what: str) -> None:
    """Raise ManifestError ("``source`` is invalid: ``what``") unless ``cond``."""
    if not cond:
        raise ManifestError(f"{source} is invalid: {what}")


def box_from_doc(box: Any, where: str) -> Box:
    """The box a document lists as ``[[start, stop], ...]``; ManifestError naming ``where`` if malformed."""
    expect(isinstance(box, list), where, "box is not a list")
    out = []
    for pair in box:
        if not (type(pair) is list and len(pair) == 2 and type(pair[0]) is int and type(pair[1]) is int
                and 0 <= pair[0] <= pair[1]):
            expect(False, where, f"box entry {pair!r} is not [start, stop]")
        out.append((pair[0], pair[1]))
    return tuple(out)
