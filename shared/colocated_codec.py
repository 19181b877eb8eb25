"""The colocated seam's encoding, used by both sides (docs/architecture.md, "The seam").

Colocated Python calls take and return only ``jax.Array``s, so control messages travel as
JSON bytes in uint8 rows (one row per CPU device, each host reading its own), replies as a
JSON object ``{"ok": result}`` or ``{"error": type name, "message": text}``
(``mtc.shared.wire_errors``: every exception, typed) padded to a width the head asks for, and phase-1
answers as the 16-byte xxh3-128 digest of each shard's blob.

A message with byte payloads (a step manifest: hundreds of MiB at thousands of hosts) carries their
sizes as ``"payload_bytes"`` and the payloads themselves raw after its JSON and a newline (JSON text
never holds one), copied once into the row: never as JSON strings, which cost an escape scan and a
parse of every byte on both sides.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np

from mtc.shared import wire_errors
from mtc.shared.buffers import byte_view
from mtc.shared.errors import ProtocolError
from mtc.shared.protocol import MAX_HEADER_BYTES, loads_message, payload_views

_PAYLOAD_SIZES = "payload_bytes"
_FIRST_LOOK = 64 << 10  # the first bytes of a row searched for the newline after its JSON


def _encode(doc: dict, payloads: Sequence[Any]) -> np.ndarray:
    """``doc`` as JSON, then (when there are payloads) a newline and each payload's bytes: one uint8 array."""
    if not payloads:
        return np.frombuffer(json.dumps(doc).encode(), np.uint8)
    each = [payload_views(p) for p in payloads]
    sizes = [sum(v.nbytes for v in views) for views in each]
    head = json.dumps({**doc, _PAYLOAD_SIZES: sizes}).encode() + b"\n"
    out = np.empty(len(head) + sum(sizes), np.uint8)
    out[:len(head)] = np.frombuffer(head, np.uint8)
    at = len(head)
    for v in (v for views in each for v in views):
        out[at:at + v.nbytes] = np.frombuffer(v, np.uint8)
        at += v.nbytes
    return out


def _decode(data: Any, what: str, *, request: bool) -> tuple[Any, list[bytes]]:
    """(the JSON document, its payloads) of a message ``_encode`` made, in ``data`` (bytes or a uint8 row,
    zero padded after it), bounded (``protocol.loads_message``); ProtocolError naming ``what`` if not."""
    row = byte_view(np.ascontiguousarray(data, np.uint8) if isinstance(data, np.ndarray) else data)
    cut, look = -1, 0
    while look < min(len(row), MAX_HEADER_BYTES + 1):  # (the JSON of a message with payloads ends in a newline)
        end = min(len(row), MAX_HEADER_BYTES + 1, max(_FIRST_LOOK, 4 * look))
        piece = bytes(row[look:end])
        i = piece.find(b"\n")
        if i >= 0:
            cut = look + i
            break
        if b"\0" in piece:  # the padding after a message without payloads
            break
        look = end
    if cut < 0:
        return loads_message(bytes(row).rstrip(b"\0"), what, request=request), []
    doc = loads_message(bytes(row[:cut]), what, request=request)
    sizes = doc.pop(_PAYLOAD_SIZES, None) if isinstance(doc, dict) else None
    rest = row[cut + 1:]
    if not (isinstance(sizes, list) and all(type(n) is int and n >= 0 for n in sizes) and sum(sizes) <= len(rest)):
        raise ProtocolError(f"{what}: '{_PAYLOAD_SIZES}' must list the sizes of the payloads after it "
                            f"({len(rest)} bytes follow)")
    payloads, at = [], 0
    for n in sizes:
        payloads.append(bytes(rest[at:at + n]))
        at += n
    return doc, payloads


def encode_request(payload: dict, payloads: Sequence[Any] = ()) -> np.ndarray:
    """A request (with ``payloads``: bytes-like, or ``protocol.Gathered``) as uint8 bytes (the head
    puts them in one row per device)."""
    return _encode(payload, payloads)


def decode_request(row: np.ndarray) -> dict:
    """A request from one device's row (zero padding stripped), bounded as a daemon's requests are
    (``protocol.loads_message``); its payloads, if any, under ``"payloads"`` as bytes."""
    doc, payloads = _decode(row, "colocated request", request=True)
    if not isinstance(doc, dict):
        raise ProtocolError("colocated request is not a JSON object")
    if payloads:
        doc["payloads"] = payloads
    return doc


def encode_reply(fn: Any, host: str | None = None) -> bytes:
    """Run ``fn()`` (-> (result, payloads: bytes-like)) and encode what it returns, or the error it
    raised (``wire_errors.encode``: any exception, by type name)."""
    try:
        result, payloads = fn()
        return _encode({"ok": result}, list(payloads)).tobytes()
    except Exception as e:  # reported to the head, which raises it typed
        name, message = wire_errors.encode(e, host)
        return json.dumps({"error": name, "message": message}).encode()


def decode_reply(data: bytes) -> tuple[Any, list[bytes], tuple[str, str] | None]:
    """(result, payloads, None) or (None, [], (error type name, message)) of an encoded reply."""
    doc, payloads = _decode(data, "colocated reply", request=False)
    if not isinstance(doc, dict) or not ("ok" in doc or "error" in doc):
        raise ProtocolError("colocated reply is neither {'ok': ...} nor {'error': ...}")
    if "error" in doc:
        return None, [], (str(doc["error"]), str(doc.get("message", "")))
    return doc["ok"], payloads, None
