"""Host manifests (the shards one sidecar wrote in phase 1 of a save) and commit records
(``mtc-commit/1``: how a host that does not keep the whole step manifest commits a step).

A host manifest (a *part*) is written as ``mtc-host/2``: one JSON line whose rows are columns,
``PartColumns``: the part's distinct boxes listed once, and every row's array index, box index,
size and blob name packed little-endian in one base64 string. A reader makes no Python object per
row (a whole step's manifest has millions) until it asks for them. ``mtc-host/1`` (a JSON list
``[array, box, blob, nbytes]`` per row) is still read."""

from __future__ import annotations

import base64
import dataclasses
import json
import re
from typing import Annotated, Any, Iterable, Literal

import msgspec
import numpy as np
import pybase64

from mtc.shared.errors import ManifestError
from mtc.shared.format.base import Box, box_from_doc, box_str, canonical_json, expect, load_json
from mtc.shared.hashing import blob_name, is_blob_name

HOST_FORMAT = "mtc-host/2"
HOST_FORMAT_V1 = "mtc-host/1"
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


class _ColumnsDoc(msgspec.Struct, gc=False):
    """An ``mtc-host/2`` document: the rows are in ``boxes`` and ``columns`` (see ``PartColumns``)."""

    format: Literal["mtc-host/2"]
    step: _Count
    host: str
    rows: _Count
    boxes: list[tuple[tuple[_Count, _Count], ...]]
    columns: msgspec.Raw  # a base64 string, decoded by ``_columns`` (not by msgspec: about 6x faster)
    written_bytes: _Count = 0
    seconds: float = 0.0


class _Named(msgspec.Struct):
    format: str


_COLUMNS_DECODER = msgspec.json.Decoder(_ColumnsDoc)
# The same document for the message when it is wrong: msgspec says where ("columns" a base64 string).
_ColumnsCheck = msgspec.defstruct("_ColumnsCheck", [
    (f.name, bytes if f.name == "columns" else f.type) if f.required else
    (f.name, f.type, f.default) for f in msgspec.structs.fields(_ColumnsDoc)])
_BYTES_DECODER = msgspec.json.Decoder(bytes)
_FORMAT_DECODER = msgspec.json.Decoder(_Named)
_ROW_BYTES = 4 + 4 + 8 + 16  # array index (u32), box index (u32), nbytes (i64), blob name (16 bytes)


def _columns(raw: msgspec.Raw, source: str) -> bytes:
    """The bytes of a part's ``columns`` (a JSON string of base64, as ``raw`` holds it, quotes and all):
    decoded by SIMD base64 from the document's own buffer, at about memory speed; a string written with
    JSON escapes (valid, but never written by mtc) is decoded by msgspec."""
    view = memoryview(raw)
    if view.nbytes >= 2 and view[0] == view[-1] == 0x22:  # '"'
        try:
            return pybase64.b64decode(view[1:-1], validate=True)
        except ValueError:  # (binascii.Error: a character outside the alphabet, or a wrong length)
            pass
    try:
        return _BYTES_DECODER.decode(view)
    except (msgspec.DecodeError, UnicodeDecodeError):
        raise ManifestError(f"{source} is invalid: 'columns' is not base64") from None


@dataclasses.dataclass(frozen=True, eq=False)
class PartColumns:
    """One host's part as columns: ``boxes`` (its distinct boxes) and, per row, ``array`` (uint32),
    ``box`` (uint32, an index of ``boxes``), ``nbytes`` (int64) and ``blob`` (the blob name's 16
    bytes, as an (n, 2) uint64 array). Every part is read through ``PartColumns.from_json`` (the
    rows of ``mtc-host/1`` parts are turned into columns); ``rows`` makes a ``HostShard`` per row
    for the readers that want them (a host reading its own part)."""

    step: int
    host: str
    boxes: tuple[Box, ...]
    array: np.ndarray
    box: np.ndarray
    nbytes: np.ndarray
    blob: np.ndarray
    written_bytes: int = 0
    seconds: float = 0.0

    def __len__(self) -> int:
        return len(self.array)

    def blob_names(self) -> list[str]:
        """Every row's blob name (hex), in row order."""
        return split_names(self.blob)

    def rows(self) -> tuple[HostShard, ...]:
        boxes = self.boxes
        return tuple(HostShard(a, boxes[b], name, n) for a, b, name, n in
                     zip(self.array.tolist(), self.box.tolist(), self.blob_names(), self.nbytes.tolist()))

    @classmethod
    def from_rows(cls, step: int, host: str, shards: Iterable[HostShard], written_bytes: int = 0,
                  seconds: float = 0.0) -> "PartColumns":
        shards = list(shards)
        index: dict[Box, int] = {}
        box = [index.setdefault(s.box, len(index)) for s in shards]
        names = "".join([s.blob for s in shards])
        if len(names) != 32 * len(shards) or not _LOWER_HEX.fullmatch(names):
            bad = next(s.blob for s in shards if not is_blob_name(s.blob))
            raise ManifestError(f"host {host} step {step}: blob name {bad!r} is malformed")
        n = len(shards)
        return cls(step, host, tuple(index), np.fromiter((s.array for s in shards), np.uint32, n),
                   np.array(box, np.uint32), np.fromiter((s.nbytes for s in shards), np.int64, n),
                   np.frombuffer(bytes.fromhex(names), np.uint64).reshape(n, 2), written_bytes, seconds)

    def to_json(self) -> bytes:
        """The ``mtc-host/2`` line. Its fields come in this order, ``rows`` first of the rows' fields
        (so parts with the same rows, data-parallel twins', end in the same bytes)."""
        packed = b"".join([self.array.astype("<u4").tobytes(), self.box.astype("<u4").tobytes(),
                           self.nbytes.astype("<i8").tobytes(), np.ascontiguousarray(self.blob).tobytes()])
        head = json.dumps({"format": HOST_FORMAT, "step": self.step, "host": self.host,
                           "written_bytes": self.written_bytes, "seconds": self.seconds}, separators=(",", ":"))
        boxes = json.dumps([[list(d) for d in b] for b in self.boxes], separators=(",", ":"))
        return (f'{head[:-1]},"rows":{len(self)},"boxes":{boxes},"columns":"'.encode()
                + base64.b64encode(packed) + b'"}')

    @classmethod
    def from_json(cls, data: bytes | memoryview | str, *, source: str = "host manifest",
                  check_boxes: bool = True) -> "PartColumns":
        """The part in ``data`` (``mtc-host/2``, or ``mtc-host/1`` turned into columns), checked:
        every box index in range, sizes non-negative, and (``check_boxes``) no box's start past its
        stop; ManifestError naming what is wrong. A reader of a whole step's parts checks their
        distinct boxes once instead (most parts list boxes that others list too)."""
        try:
            doc = _COLUMNS_DECODER.decode(data)
        except (msgspec.DecodeError, UnicodeDecodeError):
            if isinstance(data, memoryview):  # (a part cut from a whole manifest without a copy)
                data = bytes(data)
            try:
                named = _FORMAT_DECODER.decode(data).format
            except (msgspec.DecodeError, UnicodeDecodeError):
                named = None  # not JSON, or no format: the mtc-host/1 reader says what is wrong
            if named != HOST_FORMAT:
                m = HostManifest._read_v1(data, source)
                return cls.from_rows(m.step, m.host, m.shards, m.written_bytes, m.seconds)
            try:  # an mtc-host/2 document that is wrong somewhere: msgspec says where
                msgspec.convert(load_json(data, source), _ColumnsCheck, strict=True)
            except msgspec.ValidationError as e:
                if "base64" in str(e) and "$.columns" in str(e):
                    raise ManifestError(f"{source} is invalid: 'columns' is not base64") from None
                raise ManifestError(f"{source} is invalid: {e}") from None
            raise ManifestError(f"{source} is invalid: not an {HOST_FORMAT} document") from None
        n = doc.rows
        packed = _columns(doc.columns, source)
        expect(len(packed) == n * _ROW_BYTES, source,
               f"'columns' holds {len(packed)} bytes, {n} rows take {n * _ROW_BYTES}")
        if check_boxes:
            check_box_order(doc.boxes, source)
        array = np.frombuffer(packed, "<u4", n, 0)
        box = np.frombuffer(packed, "<u4", n, 4 * n)
        nbytes = np.frombuffer(packed, "<i8", n, 8 * n)
        blob = np.frombuffer(packed, np.uint64, 2 * n, 16 * n).reshape(n, 2)
        if n and int(box.max()) >= len(doc.boxes):
            i = int(np.argmax(box >= len(doc.boxes)))
            expect(False, f"{source}: row {i}", f"box index {int(box[i])} is not an index of its {len(doc.boxes)} boxes")
        if n and int(nbytes.min()) < 0:
            i = int(np.argmax(nbytes < 0))
            expect(False, f"{source}: row {i}", f"nbytes {int(nbytes[i])} is negative")
        return cls(doc.step, doc.host, tuple(doc.boxes), array, box, nbytes, blob, doc.written_bytes, doc.seconds)


def check_box_order(boxes: Iterable[Box], source: str) -> None:
    """ManifestError naming the first of ``boxes`` (a part's, by index) whose start is past its stop."""
    for i, b in enumerate(boxes):
        if not all(lo <= hi for lo, hi in b):  # (the message made only when it is said)
            expect(False, source, f"boxes[{i}] {box_str(b)} has a start past its stop")


def split_names(blob: np.ndarray) -> list[str]:
    """Blob names (hex) from their 16 bytes each (rows of an (n, 2) uint64 array), in order."""
    text = np.ascontiguousarray(blob).tobytes().hex()
    return [text[i:i + 32] for i in range(0, len(text), 32)]


@dataclasses.dataclass(frozen=True)
class HostManifest:
    """A sidecar's answer to phase 1 of a save: the shards it wrote, by blob (one ``HostShard`` per
    row; ``PartColumns`` is the same part as columns)."""

    step: int
    host: str
    shards: tuple[HostShard, ...]
    written_bytes: int = 0
    seconds: float = 0.0

    def blob_names(self) -> set[str]:
        return {s.blob for s in self.shards}

    def to_json(self) -> bytes:
        """The part as ``mtc-host/2``."""
        return PartColumns.from_rows(self.step, self.host, self.shards, self.written_bytes, self.seconds).to_json()

    @classmethod
    def from_json(cls, data: bytes | str, *, source: str = "host manifest") -> "HostManifest":
        """The part in ``data`` (either format), checked, one ``HostShard`` per row."""
        cols = PartColumns.from_json(data, source=source)
        return cls(cols.step, cols.host, cols.rows(), cols.written_bytes, cols.seconds)

    @classmethod
    def _read_v1(cls, data: bytes | str, source: str) -> "HostManifest":
        """An ``mtc-host/1`` part, checked: each row decoded and bounded in C, then every blob name and
        box checked once per part. A part the fast reader refuses is read again by the precise one,
        which says what is wrong and where (or reads what the fast one is too strict for)."""
        try:
            doc = _PART_DECODER.decode(data)
        except (msgspec.DecodeError, UnicodeDecodeError):
            return cls._read_precisely(data, source)
        shards = doc.shards
        if (doc.format != HOST_FORMAT_V1 or not _LOWER_HEX.fullmatch("".join([s.blob for s in shards]))
                or not all(a <= b for box in {s.box for s in shards} for a, b in box)):
            return cls._read_precisely(data, source)
        return cls(doc.step, doc.host, tuple(shards), doc.written_bytes, doc.seconds)

    @classmethod
    def _read_precisely(cls, data: bytes | str, source: str) -> "HostManifest":
        """An ``mtc-host/1`` part read and checked field by field: one error that names the field and the row."""
        doc = load_json(data, source)
        expect(doc.get("format") == HOST_FORMAT_V1, source,
               f"format is {doc.get('format')!r}, expected {HOST_FORMAT!r} or {HOST_FORMAT_V1!r}")
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
