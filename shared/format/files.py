"""What any step file says (a step manifest of any format, or a commit record), read without
parsing it as a manifest: the format and digest it names (``step_format``, ``step_digest``) and the
blobs it keeps alive (``collect_blob_names``)."""

from __future__ import annotations

import json
from typing import Any, Iterable

from mtc.shared.errors import ManifestError
from mtc.shared.format.host import COMMIT_FORMAT, HOST_FORMAT, HOST_FORMAT_V1, PartColumns
from mtc.shared.format.step import FORMAT
from mtc.shared.hashing import is_blob_name


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
    lines = rest.split(b"\n") if rest else []
    if isinstance(doc, dict) and doc.get("format") == COMMIT_FORMAT:
        try:
            lines = [str(doc.get("part") or "{}").encode()]
            parts = [json.loads(lines[0])]
        except (ValueError, TypeError) as e:
            raise ManifestError(f"commit record's part is not valid JSON ({e}); cannot tell which blobs it uses") from None
    elif isinstance(doc, dict) and doc.get("format") == HOST_FORMAT:
        lines, parts = [data], [doc]
    if isinstance(doc, dict) and doc.get("format") in (FORMAT, COMMIT_FORMAT, HOST_FORMAT):
        rows = []
        for line, p in zip(lines, parts):
            if isinstance(p, dict) and p.get("format") == HOST_FORMAT:  # columns: the names are bytes
                names.update(PartColumns.from_json(line, source="host manifest").blob_names())
            elif isinstance(p, dict) and p.get("format") == HOST_FORMAT_V1:
                rows.extend(p.get("shards") or [])
            else:  # a part this version cannot read: its blobs are not known, so none is collected
                raise ManifestError(f"a part of format {p.get('format') if isinstance(p, dict) else p!r:.40} "
                                    f"(written by another mtc version?); cannot tell which blobs it uses")
        doc = {"format": HOST_FORMAT_V1, "shards": rows}

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

    if isinstance(doc, dict) and doc.get("format") == HOST_FORMAT_V1:
        for row in doc.get("shards", []):
            names.add(row[2] if isinstance(row, list) and len(row) > 2 else repr(row))
    else:
        walk(doc)
    for n in names:
        if not is_blob_name(n):
            raise ManifestError(f"manifest names blob {n!r:.80}, which is not a blob name")
    return names
