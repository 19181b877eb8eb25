"""The on-disk and on-the-wire formats: step manifests, host manifests, dtypes, index boxes.

A **step manifest** says which blobs make up a step and how they assemble into arrays; it is
the commit of a step: written last, atomically. Format ``mtc/3`` (docs/architecture.md, Formats) is JSON Lines:
line 1 is the *header* (the arrays, each named sharding once, the tree, and one
``{"host", "digest", "bytes"}`` entry per host part, with a ``"digest"`` of the header itself);
each following line is one **host manifest** (a *part*): the shards one sidecar wrote in phase
1, exactly as it wrote them. The head builds a step manifest without reading the parts (it
hashes and concatenates them), so its work per save grows with arrays and hosts, not shards.
Which devices held a shard is derived from the named sharding, not listed per shard.
``mtc/2`` and ``mtc/1`` (one JSON document with every shard inline) are still read.

Everything read from disk or the network goes through ``from_json``, which validates the
document and says what is wrong.

The documents live in modules of their own, and every public name is importable from here:
``format_step`` (step manifests), ``format_host`` (host manifests, commit records) and
``format_base`` (boxes, dtype names, the JSON helpers). This module reads step files whatever
their format (``step_format``, ``step_digest``, ``collect_blob_names``).
"""

from __future__ import annotations

import json
from typing import Any, Iterable

from mtc.shared.errors import ManifestError
from mtc.shared.format_base import _digest  # noqa: F401  (tests re-sign documents they alter with fmt._digest)
from mtc.shared.format_base import (Box, box_from_index, box_intersect, box_shape, box_slices, box_str,
                                    dtype_from_name, dtype_name)
from mtc.shared.format_host import COMMIT_FORMAT, HOST_FORMAT, CommitRecord, HostManifest, HostShard
from mtc.shared.format_step import (FORMAT, ArrayRecord, ShardRecord, StepManifest, check_step_bytes,
                                    encode_step)
from mtc.shared.hashing import is_blob_name

__all__ = [
    "COMMIT_FORMAT", "FORMAT", "HOST_FORMAT", "ArrayRecord", "Box", "CommitRecord", "HostManifest", "HostShard",
    "ShardRecord", "StepManifest", "box_from_index", "box_intersect", "box_shape", "box_slices", "box_str",
    "check_step_bytes", "collect_blob_names", "dtype_from_name", "dtype_name", "encode_step", "step_digest",
    "step_format",
]


def _header_str(data: bytes, key: str) -> str | None:
    """A string field of a step file's first line (a manifest's header, or a commit record), read
    cheaply: no digest or part is checked; None if it is not there."""
    try:
        doc = json.loads(bytes(data).partition(b"\n")[0])
    except (ValueError, UnicodeDecodeError):
        return None
    v = doc.get(key) if isinstance(doc, dict) else None
    return v if isinstance(v, str) else None


def step_format(data: bytes) -> str | None:
    """The format a step file names (see ``_header_str``)."""
    return _header_str(data, "format")


def step_digest(data: bytes) -> str | None:
    """The digest a step file claims (see ``_header_str``)."""
    return _header_str(data, "digest")


def collect_blob_names(data: bytes) -> set[str]:
    """Blob names a manifest keeps alive (garbage collection): the shard rows of a host manifest or
    of an mtc/3 step manifest's parts, else every string under any key named ``"blob"``, at any
    depth (older step manifests).

    Manifests on disk are untrusted: bytes that are not JSON, or a name that is not a blob name
    (which would reach the filesystem), raise ManifestError.
    """
    data = bytes(data)
    first, _, rest = data.partition(b"\n")
    try:
        doc = json.loads(first if rest else data)
        parts = [json.loads(line) for line in rest.split(b"\n")] if rest else []
    except (ValueError, UnicodeDecodeError) as e:
        raise ManifestError(f"manifest is not valid JSON ({e}); cannot tell which blobs it uses") from None
    names: set[str] = set()
    if isinstance(doc, dict) and doc.get("format") == COMMIT_FORMAT:
        try:
            parts = [json.loads(doc.get("part") or "{}")]
        except (ValueError, TypeError) as e:
            raise ManifestError(f"commit record's part is not valid JSON ({e}); cannot tell which blobs it uses") from None
    if isinstance(doc, dict) and doc.get("format") in (FORMAT, COMMIT_FORMAT):
        doc = {"format": HOST_FORMAT, "shards": [row for p in parts if isinstance(p, dict)
                                                 for row in (p.get("shards") or [])]}

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
