"""The colocated seam's encoding, used by both sides (docs/architecture.md, "The seam").

Colocated Python calls take and return only ``jax.Array``s, so control messages travel as
JSON bytes in uint8 rows (one row per CPU device, each host reading its own), replies as a
JSON object ``{"ok": result, "payloads": [text, ...]}`` or ``{"error": type name, "message": text}``
(``mtc.shared.wire_errors``: every exception, typed) padded to a width the head asks for, and phase-1 answers as the 16-byte xxh3-128 digest of each shard's blob.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from mtc.shared import wire_errors
from mtc.shared.errors import ProtocolError
from mtc.shared.protocol import loads_message



def encode_request(payload: dict) -> np.ndarray:
    """A request as uint8 bytes (the head broadcasts them to one row per device)."""
    return np.frombuffer(json.dumps(payload).encode(), np.uint8)


def decode_request(row: np.ndarray) -> dict:
    """A request from one device's row (zero padding stripped), bounded as a daemon's requests are
    (``protocol.loads_message``)."""
    doc = loads_message(np.asarray(row, np.uint8).tobytes().rstrip(b"\0"), "colocated request")
    if not isinstance(doc, dict):
        raise ProtocolError("colocated request is not a JSON object")
    return doc


def encode_reply(fn: Any, host: str | None = None) -> bytes:
    """Run ``fn()`` (-> (result, payloads: bytes of text)) and encode what it returns, or the
    error it raised (``wire_errors.encode``: any exception, by type name)."""
    try:
        result, payloads = fn()
        return json.dumps({"ok": result, "payloads": [bytes(p).decode() for p in payloads]}).encode()
    except Exception as e:  # reported to the head, which raises it typed
        name, message = wire_errors.encode(e, host)
        return json.dumps({"error": name, "message": message}).encode()


def decode_reply(data: bytes) -> tuple[Any, list[bytes], tuple[str, str] | None]:
    """(result, payloads, None) or (None, [], (error type name, message)) of an encoded reply."""
    doc = loads_message(bytes(data), "colocated reply", request=False)
    if not isinstance(doc, dict) or not ("ok" in doc or "error" in doc):
        raise ProtocolError("colocated reply is neither {'ok': ...} nor {'error': ...}")
    if "error" in doc:
        return None, [], (str(doc["error"]), str(doc.get("message", "")))
    return doc["ok"], [p.encode() for p in doc.get("payloads") or []], None
