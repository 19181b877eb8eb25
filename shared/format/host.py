"""Host manifests (``mtc-host/1``: the shards one sidecar wrote in phase 1 of a save) and commit
records (``mtc-commit/1``: how a host that does not keep the whole step manifest commits a step)."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Annotated, Any

import msgspec

from mtc.shared.format.base import Box, box_from_doc, canonical_json, expect, load_json
from mtc.shared.hashing import blob_name, is_blob_name

HOST_FORMAT = "mtc-host/1"
COMMIT_FORMAT = "mtc-commit/1"


_Count = Annotated[int, msgspec.Meta(ge=0)]


class HostShard(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One shard one host wrote in phase 1: a row of its part, ``[array, box, blob, nbytes]``.

    A row is decoded and checked by msgspec in C (``HostManifest.from_json``): a whole step's
    manifest has one per shard and host, millions on a large job. The bounds hold for what is
    read; a row made here is not checked."""

    array: _Count
    box: tuple[tuple[_Count, _Count], ...]
    blob: Annotated[str, msgspec.Meta(min_length=32, max_length=32)]  # and lowercase hex: checked per part
    nbytes: _Count


class _PartDoc(msgspec.Struct, gc=False):
    """An ``mtc-host/1`` document as the fast reader takes it (the rest of a part's checks follow)."""

    format: str
    step: _Count
    host: str
    shards: list[HostShard] = []
    written_bytes: int = 0
    seconds: float = 0.0


_PART_DECODER = msgspec.json.Decoder(_PartDoc)
_LOWER_HEX = re.compile(r"[0-9a-f]*")


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
        """The part in ``data``, checked: each row decoded and bounded in C, then every blob name and
        box checked once per part. A part the fast reader refuses is read again by the precise one,
        which says what is wrong and where (or reads what the fast one is too strict for)."""
        try:
            doc = _PART_DECODER.decode(data)
        except (msgspec.DecodeError, UnicodeDecodeError):
            return cls._read_precisely(data, source)
        shards = doc.shards
        if (doc.format != HOST_FORMAT or not _LOWER_HEX.fullmatch("".join([s.blob for s in shards]))
                or not all(a <= b for box in {s.box for s in shards} for a, b in box)):
            return cls._read_precisely(data, source)
        return cls(doc.step, doc.host, tuple(shards), doc.written_bytes, doc.seconds)

    @classmethod
    def _read_precisely(cls, data: bytes | str, source: str) -> "HostManifest":
        """The part read and checked field by field: one error that names the field and the row."""
        doc = load_json(data, source)
        expect(doc.get("format") == HOST_FORMAT, source, f"format is {doc.get('format')!r}, expected {HOST_FORMAT!r}")
        step, host = doc.get("step"), doc.get("host")
        expect(isinstance(step, int) and step >= 0, source, f"step {step!r} is not a non-negative integer")
        expect(isinstance(host, str), source, "host is not a string")
        shards = []
        boxes: dict[str, Box] = {}  # equal boxes (every array of a layer) are checked once
        for i, row in enumerate(doc.get("shards") or []):
            # Checked without building a message; one is made only for a row that fails.
            ok = type(row) is list and len(row) == 4
            if ok:
                array, box, blob, nbytes = row
                ok = (type(array) is int and array >= 0 and type(nbytes) is int and nbytes >= 0
                      and is_blob_name(blob))
            if not ok:
                _row_error(row, f"{source}: shards[{i}]")
            key = repr(box)
            b = boxes.get(key)
            if b is None:
                b = boxes[key] = box_from_doc(box, f"{source}: shards[{i}]")
            shards.append(HostShard(array, b, blob, nbytes))
        return cls(step, host, tuple(shards), int(doc.get("written_bytes", 0)), float(doc.get("seconds", 0.0)))


def _row_error(row: Any, where: str) -> None:
    expect(isinstance(row, list) and len(row) == 4, where, "expected [array, box, blob, nbytes]")
    array, _, blob, nbytes = row
    expect(isinstance(array, int) and array >= 0, where, "array index is not an integer")
    expect(is_blob_name(blob), where, f"blob name {blob!r} is malformed")
    expect(isinstance(nbytes, int) and nbytes >= 0, where, "nbytes is not a non-negative integer")


@dataclasses.dataclass(frozen=True)
class CommitRecord:
    """How a host that does not keep the whole step manifest commits a step (phase 2).

    Phase 2 sends the whole manifest to a few *keeper* hosts only (on distinct slices) and, to
    every other host, the commit decision: the manifest's ``digest`` and who keeps it. Such a
    host writes this record: the digest, the keepers (host, peer address) and its own ``part``
    (its host manifest, byte for byte as it answered phase 1, so its hash is the one in the
    manifest's header). The host fetches the whole manifest from a keeper when it first needs
    it (to read or to hold copies for others) and then replaces this record with it.
    """

    step: int
    digest: str
    keepers: tuple[tuple[str, str], ...]
    part: bytes

    def to_json(self) -> bytes:
        doc = {"format": COMMIT_FORMAT, "step": self.step, "digest": self.digest,
               "keepers": [list(k) for k in self.keepers], "part": self.part.decode()}
        # A checksum of the rest: a damaged record is reported damaged (and given the manifest
        # back by the head), never read as a part that holds other blobs.
        doc["check"] = blob_name(canonical_json(doc))
        return canonical_json(doc)

    def host_manifest(self, source: str = "commit record") -> "HostManifest":
        return HostManifest.from_json(self.part, source=f"{source}: its part")

    @classmethod
    def parse(cls, data: bytes, *, source: str = "commit record") -> "CommitRecord | None":
        """The record in ``data``; None when ``data`` is a step manifest (ManifestError if malformed)."""
        data = bytes(data)
        if b"\n" in data or not data.startswith(b'{"check"'):
            return None  # a commit record is one canonical line, and "check" sorts first
        doc = load_json(data, source)
        if doc.get("format") != COMMIT_FORMAT:
            return None
        check = doc.pop("check", None)
        expect(check == blob_name(canonical_json(doc)), source,
                "it does not match its checksum (changed after it was written); not using it")
        step, digest, keepers, part = doc.get("step"), doc.get("digest"), doc.get("keepers"), doc.get("part")
        expect(isinstance(step, int) and not isinstance(step, bool) and step >= 0, source, f"step {step!r}")
        expect(isinstance(digest, str) and len(digest) == 64, source, "'digest' is not a SHA-256 hex digest")
        expect(isinstance(keepers, list) and all(isinstance(k, list) and len(k) == 2 and all(isinstance(x, str) for x in k)
                                                  for k in keepers), source, "'keepers' is not a list of [host, address]")
        expect(isinstance(part, str) and "\n" not in part, source, "'part' is not a host manifest")
        return cls(step, digest, tuple((h, a) for h, a in keepers), part.encode())
