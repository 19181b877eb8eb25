"""The wire format between the head and the sidecar daemons, and the cluster spec file.

A **frame** is::

    b"MTCF" | header length (u32, big endian) | header (UTF-8 JSON object) | payload bytes

The header carries the protocol version (``"v"``), the kind (``"request"`` or ``"reply"``),
a request id, the op or the result, and ``"payloads"``: the byte length of each binary
payload that follows, back to back. Everything else about a message is JSON; bulk data
(shards, assembled boxes, manifests) travels as payloads, which are sent straight from the
caller's buffers (``sendmsg`` on memoryviews, no copy) and received straight into buffers the
receiver allocates (``recv_into``; 64-byte aligned by default, so the head can hand them to
JAX without a copy). A receive buffer can be ``Digesting``: its bytes are hashed as they
arrive, while they are still in the cache. Nothing is ever unpickled.

Limits: a header is at most ``MAX_HEADER_BYTES``; the payloads of one frame at most the
receiver's ``max_payload``. A frame that breaks a limit, is not JSON, has the wrong magic or
another protocol version raises ``ProtocolError`` before anything is allocated for it.

The cluster spec (``ClusterSpec``) is the contract between the launcher that starts the
daemons (``mtc.sidecar.local_cluster``) and the head that reads it (``mtc.head.dispatch.topology``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import socket
import struct
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from mtc.shared.buffers import aligned_empty, byte_view
from mtc.shared.errors import ConfigError, ProtocolError
from mtc.shared.hashing import blob_name
from mtc.shared.version import PROTOCOL_VERSION

__all__ = [
    "MAGIC", "MAX_HEADER_BYTES", "MAX_PAYLOAD_BYTES", "MAX_PAYLOADS", "Request", "Reply", "RemoteError",
    "HostSpec", "ClusterSpec", "Digesting", "Gathered", "aligned_buffer", "byte_view", "payload_nbytes",
    "payload_views", "send_frame", "recv_frame",
    "frame_head", "recv_header",
    "encode_bitmap", "decode_bitmap", "blob_list_digest",
    "send_request", "recv_request", "send_reply", "recv_reply", "parse_address", "loads_message",
]

MAGIC = b"MTCF"
_PREFIX = struct.Struct("!4sI")
MAX_HEADER_BYTES = 16 << 20
# Default ceiling for the payloads of one frame. A write frame carries a host's whole share of
# a step, so this is large; it exists to refuse absurd declared sizes, not to bound memory.
MAX_PAYLOAD_BYTES = 1 << 40
# Payloads per frame: each costs a buffer object, so a header of zeros must not cost gigabytes.
MAX_PAYLOADS = 1 << 20
# A header is received this much at a time (and its buffer grown only as bytes arrive).
_HEADER_CHUNK = 64 << 10
# Buffers per sendmsg call (Linux IOV_MAX is 1024).
_MAX_IOV = 512
# A Digesting payload is received this much at a time, so that its hash reads bytes still in the cache.
_DIGEST_CHUNK = 1 << 20

# The ops a sidecar daemon answers are those of the sidecar's table of operations (mtc.sidecar.ops).
# Before them, on each connection, the handshake (mtc.shared.auth): "hello", then "auth".

Buffer = Any  # bytes-like or C-contiguous numpy array
Alloc = Callable[[dict, list[int]], Sequence[Buffer]]


# --- buffers ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Digesting:
    """A receive buffer whose bytes go to ``hasher.update`` as they arrive (an allocator may
    return one in place of a buffer): hashing them then reads the cache, not memory."""

    buffer: Buffer
    hasher: Any


class Sink:
    """A payload its receiver streams somewhere itself (an allocator may return one in place of a
    buffer): ``receive(read, n)`` takes the ``n`` bytes through ``read(view) -> bytes read``
    (0 at end of stream) and returns how many it got; the frame then carries ``buffer``."""

    buffer: Buffer

    def receive(self, read: Callable[[memoryview], int], n: int) -> int:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Gathered:
    """One payload made of several buffers, sent back to back (``sendmsg`` on each, no copy): a step's
    manifest as its header and host parts, never joined into one buffer on the head (hundreds of MiB at
    thousands of hosts). The receiver gets one payload of ``nbytes``."""

    buffers: tuple[Buffer, ...]

    @property
    def nbytes(self) -> int:
        return sum(byte_view(b).nbytes for b in self.buffers)

    def views(self) -> list[memoryview]:
        return [byte_view(b) for b in self.buffers]

    def join(self) -> bytes:
        """The payload's bytes in one buffer (a copy), for a reader that needs them whole."""
        return b"".join(self.views())


def payload_nbytes(payload: Buffer | Gathered) -> int:
    """The bytes one payload sends."""
    return payload.nbytes if isinstance(payload, Gathered) else byte_view(payload).nbytes


def payload_views(payload: Buffer | Gathered) -> list[memoryview]:
    """The buffers one payload sends, back to back, as byte views (one, unless it is ``Gathered``)."""
    return payload.views() if isinstance(payload, Gathered) else [byte_view(payload)]


def aligned_buffer(nbytes: int) -> np.ndarray:
    """An uninitialised uint8 array of ``nbytes`` whose data is 64-byte aligned.

    A 64-byte aligned host buffer becomes a CPU ``jax.Array`` without a copy
    (``jax.device_put(buf.view(dtype), dev, may_alias=True)``).
    """
    return aligned_empty((int(nbytes),), np.uint8)


# --- frames ----------------------------------------------------------------------------------


def _encode_header(header: Mapping) -> bytes:
    try:
        data = json.dumps(header, separators=(",", ":"), sort_keys=True, allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"message header cannot be encoded as JSON: {e}") from None
    if len(data) > MAX_HEADER_BYTES:
        raise ProtocolError(f"message header is {len(data)} bytes, over the limit of {MAX_HEADER_BYTES}; "
                            "send bulk data as payloads")
    return data


def send_frame(sock: socket.socket, header: Mapping, payloads: Sequence[Buffer | Gathered] = ()) -> None:
    """Send one frame; ``header["payloads"]`` is set here from the payload sizes (a ``Gathered``
    payload is one, its buffers sent back to back)."""
    each = [payload_views(p) for p in payloads]
    sizes = [sum(v.nbytes for v in views) for views in each]
    _send_buffers(sock, [frame_head(header, sizes), *(v for views in each for v in views)])


def frame_head(header: Mapping, sizes: Sequence[int]) -> bytes:
    """The bytes of a frame up to its payloads, for payloads of ``sizes`` bytes sent separately.

    For senders that stream a payload from a file (``socket.sendfile``) instead of a buffer:
    send these bytes, then exactly ``sizes[i]`` bytes for each payload, in order.
    """
    header = dict(header)
    header["payloads"] = [int(n) for n in sizes]
    data = _encode_header(header)
    return _PREFIX.pack(MAGIC, len(data)) + data


def _send_buffers(sock: socket.socket, buffers: Sequence[Buffer]) -> None:
    views = [v for v in (byte_view(b) for b in buffers) if v.nbytes]
    i = 0
    while i < len(views):
        sent = sock.sendmsg(views[i : i + _MAX_IOV])
        while sent:
            v = views[i]
            if sent >= v.nbytes:
                sent -= v.nbytes
                i += 1
            else:
                views[i] = v[sent:]
                sent = 0


def _recv_into(sock: socket.socket, view: memoryview, hasher: Any = None) -> int:
    """Fill ``view``; returns the bytes read (less than its size only at end of stream). With
    ``hasher``, each piece is hashed as soon as it is in."""
    got, n = 0, view.nbytes
    while got < n:
        if hasher is None:
            k = sock.recv_into(view[got:], n - got)
        else:
            k = sock.recv_into(view[got:], min(n - got, _DIGEST_CHUNK))
            hasher.update(view[got:got + k])
        if k == 0:
            return got
        got += k
    return got


def _default_alloc(header: dict, sizes: list[int]) -> list[np.ndarray]:
    return [aligned_buffer(n) for n in sizes]


def recv_header(sock: socket.socket, *, max_header: int = MAX_HEADER_BYTES,
                max_payload: int = MAX_PAYLOAD_BYTES) -> dict | None:
    """Receive the prefix and header of one frame and leave its payloads on the socket.

    Returns the validated header (``header["payloads"]`` lists the payload sizes, which
    together are at most ``max_payload``), or None when the peer closed cleanly. For receivers
    that stream a payload somewhere other than a buffer (a file); they must then read exactly
    those bytes. Raises ``ProtocolError`` like :func:`recv_frame`.
    """
    prefix = bytearray(_PREFIX.size)
    got = _recv_into(sock, memoryview(prefix))
    if got == 0:
        return None
    if got < len(prefix):
        raise ProtocolError(f"connection closed after {got} of {len(prefix)} bytes of a frame prefix "
                            "(peer killed or restarted?)")
    magic, hlen = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise ProtocolError(f"not an mtc frame (magic {bytes(magic)!r}, expected {MAGIC!r}): "
                            "is something else listening on this port?")
    if hlen > min(max_header, MAX_HEADER_BYTES):
        raise ProtocolError(f"frame header of {hlen} bytes is over the limit of "
                            f"{min(max_header, MAX_HEADER_BYTES)} bytes; refusing it")
    # Grown as the bytes arrive: a prefix that declares a large header pins no memory by itself.
    raw = bytearray()
    while len(raw) < hlen:
        chunk = sock.recv(min(_HEADER_CHUNK, hlen - len(raw)))
        if not chunk:
            raise ProtocolError(f"connection closed after {len(raw)} of {hlen} bytes of a frame header "
                                "(peer killed or restarted?)")
        raw += chunk
    header = _decode_header(raw)
    total = sum(header["payloads"])
    if total > max_payload:
        raise ProtocolError(f"frame declares {total} bytes of payload, over the limit of {max_payload} "
                            "bytes; refusing it")
    return header


def recv_frame(sock: socket.socket, *, max_header: int = MAX_HEADER_BYTES,
               max_payload: int = MAX_PAYLOAD_BYTES,
               alloc: Alloc | None = None) -> tuple[dict, list[Buffer]] | None:
    """Receive one frame: (header, payload buffers), or None when the peer closed cleanly.

    ``alloc(header, sizes)`` returns one writable buffer of exactly each size to receive the
    payloads into (default: fresh 64-byte aligned uint8 arrays), or a ``Digesting`` around one
    (it comes back as given, its hasher fed), or a ``Sink`` (its ``buffer`` comes back); it may raise ``ProtocolError`` to refuse sizes
    it does not expect. Raises ``ProtocolError`` for a malformed, oversized or truncated frame
    (the connection is unusable afterwards).
    """
    header = recv_header(sock, max_header=max_header, max_payload=max_payload)
    if header is None:
        return None
    sizes = header["payloads"]
    buffers = list((alloc or _default_alloc)(header, sizes))
    if len(buffers) != len(sizes):
        raise ProtocolError(f"allocator gave {len(buffers)} buffers for {len(sizes)} payloads")
    for i, (buf, n) in enumerate(zip(buffers, sizes)):
        if isinstance(buf, Sink):
            got = buf.receive(sock.recv_into, n)
            if got < n:
                raise ProtocolError(f"connection closed after {got} of {n} bytes of payload {i} "
                                    "(peer killed or restarted?)")
            buffers[i] = buf.buffer
            continue
        hasher = buf.hasher if isinstance(buf, Digesting) else None
        view = byte_view(buf.buffer if hasher is not None else buf)
        if view.nbytes != n or view.readonly:
            raise ProtocolError(f"buffer for payload {i} is {view.nbytes} bytes"
                                f"{' and read-only' if view.readonly else ''}, the frame declares {n}")
        got = _recv_into(sock, view, hasher)
        if got < n:
            raise ProtocolError(f"connection closed after {got} of {n} bytes of payload {i} "
                                "(peer killed or restarted?)")
    return header, buffers


# --- JSON of messages -------------------------------------------------------------------------
#
# Every message's JSON is read by ``loads_message`` (frame headers here, colocated requests in
# ``mtc.shared.colocated_codec``): integers fit in 64 bits, numbers are finite, nesting is bounded
# by the interpreter's recursion limit, and a request's strings are text (no lone UTF-16
# surrogate, which no file name, log line or reply could encode). Anything else is a
# ProtocolError, so no parser behind it meets a value it cannot hold.

MAX_JSON_INT = 2**63 - 1
_LONG_DIGITS = re.compile(rb"\d{19}")  # a run of 19 digits: a number that may not fit in 64 bits
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # only an escape can make a surrogate in JSON
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > 19 or not -MAX_JSON_INT - 1 <= (n := int(text)) <= MAX_JSON_INT:
        raise ProtocolError(f"the number {text:.24}{'...' if len(text) > 24 else ''} ({len(text)} digits) does not "
                            "fit in 64 bits; every integer of the protocol does")
    return n


def _finite_float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise ProtocolError(f"the number {text:.40} is not finite; every number of the protocol is")
    return x


def _no_constant(name: str) -> Any:
    raise ProtocolError(f"{name} is not a number of the protocol")


def _strings(doc: Any) -> Any:
    """Every string of ``doc`` (keys and values), without recursion."""
    todo = [doc]
    while todo:
        x = todo.pop()
        if isinstance(x, str):
            yield x
        elif isinstance(x, dict):
            todo.extend(x.keys())
            todo.extend(x.values())
        elif isinstance(x, list):
            todo.extend(x)


def _mend(doc: Any) -> Any:
    """``doc`` with each lone surrogate replaced by U+FFFD (an answer stays printable): ``doc``
    itself for a list or an object, changed in place, without recursion."""
    if isinstance(doc, str):
        return _LONE_SURROGATE.sub("\ufffd", doc)
    todo = [doc]
    while todo:
        x = todo.pop()
        if isinstance(x, dict):
            for k in list(x):
                v = x.pop(k) if isinstance(k, str) and _LONE_SURROGATE.search(k) else x[k]
                x[_mend(k)] = _mend(v) if isinstance(v, str) else v
                todo.append(v)
        elif isinstance(x, list):
            for i, v in enumerate(x):
                if isinstance(v, str):
                    x[i] = _mend(v)
                else:
                    todo.append(v)
    return doc


def loads_message(raw: bytes | bytearray, what: str = "frame header", *, request: bool | None = True) -> Any:
    """The JSON document of a message, bounded (see above); ProtocolError naming ``what`` if not.

    A ``request`` (None: a frame whose ``kind`` is "request") with a lone surrogate in a string is
    refused; another message gets U+FFFD in its place."""
    try:
        doc = json.loads(raw, parse_int=_bounded_int if _LONG_DIGITS.search(raw) else None,
                         parse_float=_finite_float, parse_constant=_no_constant)
    except ProtocolError as e:
        raise ProtocolError(f"{what}: {e}") from None
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        reason = "nested too deeply" if isinstance(e, RecursionError) else str(e)[:100]
        raise ProtocolError(f"{what} is not valid JSON ({reason})") from None
    if _SURROGATE_ESCAPE.search(raw):
        bad = next((t for t in _strings(doc) if _LONE_SURROGATE.search(t)), None)
        if bad is not None:
            if request is None:
                request = isinstance(doc, dict) and doc.get("kind") == "request"
            if request:
                raise ProtocolError(f"{what}: the string {bad!r:.80} holds a lone UTF-16 surrogate, which is not "
                                    "text; send UTF-8 text")
            doc = _mend(doc)
    return doc


def _decode_header(raw: bytes | bytearray) -> dict:
    header = loads_message(raw, request=None)
    if not isinstance(header, dict):
        raise ProtocolError(f"frame header is a JSON {type(header).__name__}, expected an object")
    v = header.get("v")
    if v != PROTOCOL_VERSION:
        raise ProtocolError(f"peer speaks mtc protocol version {v!r}, this side {PROTOCOL_VERSION}: "
                            "run the same mtc version on the head and every sidecar")
    sizes = header.get("payloads", [])
    if not isinstance(sizes, list) or not all(type(n) is int and n >= 0 for n in sizes):
        raise ProtocolError(f"frame header 'payloads' must be a list of byte counts, got {sizes!r:.100}")
    if len(sizes) > MAX_PAYLOADS:
        raise ProtocolError(f"frame declares {len(sizes)} payloads, over the limit of {MAX_PAYLOADS}")
    header["payloads"] = sizes
    return header


# --- messages --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Request:
    """A call from the head to a sidecar: ``op`` with JSON ``args`` and binary ``payloads``."""

    op: str
    id: int
    args: Mapping = dataclasses.field(default_factory=dict)
    payloads: tuple = ()

    def header(self) -> dict:
        return {"v": PROTOCOL_VERSION, "kind": "request", "op": self.op, "id": self.id, "args": dict(self.args)}

    @classmethod
    def from_frame(cls, header: dict, payloads: Sequence[Buffer]) -> "Request":
        op, rid, args = header.get("op"), header.get("id"), header.get("args", {})
        if header.get("kind") != "request":
            raise ProtocolError(f"expected a request, got a frame of kind {header.get('kind')!r}")
        if not isinstance(op, str) or not isinstance(rid, int) or isinstance(rid, bool):
            raise ProtocolError(f"request needs a string 'op' and an integer 'id', got {op!r:.50} and {rid!r:.50}")
        if not isinstance(args, dict):
            raise ProtocolError(f"request {op!r}: 'args' must be a JSON object")
        return cls(op, rid, args, tuple(payloads))


@dataclasses.dataclass(frozen=True)
class RemoteError:
    """An error a sidecar reports: the exception class name and its message."""

    type: str
    message: str


@dataclasses.dataclass(frozen=True)
class Reply:
    """A sidecar's answer to one request: a JSON ``result`` or an ``error``, plus payloads."""

    id: int | None
    result: Any = None
    error: RemoteError | None = None
    payloads: tuple = ()

    def header(self) -> dict:
        h: dict[str, Any] = {"v": PROTOCOL_VERSION, "kind": "reply", "id": self.id}
        if self.error is not None:
            h["error"] = {"type": self.error.type, "message": self.error.message}
        else:
            h["result"] = self.result
        return h

    @classmethod
    def from_frame(cls, header: dict, payloads: Sequence[Buffer]) -> "Reply":
        if header.get("kind") != "reply":
            raise ProtocolError(f"expected a reply, got a frame of kind {header.get('kind')!r}")
        rid = header.get("id")
        if rid is not None and (not isinstance(rid, int) or isinstance(rid, bool)):
            raise ProtocolError(f"reply 'id' must be an integer, got {rid!r:.50}")
        err = header.get("error")
        if err is not None:
            if not (isinstance(err, dict) and isinstance(err.get("type"), str)
                    and isinstance(err.get("message"), str)):
                raise ProtocolError(f"reply 'error' must be {{type, message}}, got {err!r:.100}")
            return cls(rid, None, RemoteError(err["type"], err["message"]), tuple(payloads))
        return cls(rid, header.get("result"), None, tuple(payloads))


def send_request(sock: socket.socket, req: Request) -> None:
    send_frame(sock, req.header(), req.payloads)


def recv_request(sock: socket.socket, *, max_payload: int = MAX_PAYLOAD_BYTES,
                 max_header: int = MAX_HEADER_BYTES) -> Request | None:
    """The next request on ``sock``, or None when the head closed the connection."""
    frame = recv_frame(sock, max_payload=max_payload, max_header=max_header)
    return None if frame is None else Request.from_frame(*frame)


def send_reply(sock: socket.socket, reply: Reply) -> None:
    send_frame(sock, reply.header(), reply.payloads)


def recv_reply(sock: socket.socket, *, max_payload: int = MAX_PAYLOAD_BYTES,
               alloc: Alloc | None = None) -> Reply:
    """The reply on ``sock``; ``ProtocolError`` if the peer closed instead of answering."""
    frame = recv_frame(sock, max_payload=max_payload, alloc=alloc)
    if frame is None:
        raise ProtocolError("connection closed before the reply (peer killed or restarted?)")
    return Reply.from_frame(*frame)


# --- inventories -----------------------------------------------------------------------------


def encode_bitmap(bits: Sequence[bool]) -> str:
    """``bits`` as hex, 4 per digit, first bit in the high bit of the first digit.

    Inventories say which blobs of a step a host holds this way: one bit per blob of the
    step's sorted blob names, a quarter of a byte each on the wire.
    """
    n = len(bits)
    value = 0
    for b in bits:
        value = (value << 1) | bool(b)
    width = -(-n // 4)
    value <<= width * 4 - n
    return f"{value:0{width}x}" if width else ""


def blob_list_digest(names: Sequence[str]) -> str:
    """A short name for a step's sorted blob list, so that bitmaps over it are read against it."""
    return blob_name("\n".join(names).encode())


def decode_bitmap(text: str, n: int) -> list[bool]:
    """The ``n`` bits of :func:`encode_bitmap`'s ``text``; ProtocolError when malformed."""
    width = -(-n // 4)
    if not isinstance(text, str) or len(text) != width or (width and not re.fullmatch(r"[0-9a-f]+", text)):
        raise ProtocolError(f"bitmap {text!r:.60} is not {width} lowercase hex digits for {n} bits")
    value = int(text, 16) if width else 0
    value >>= width * 4 - n
    return [bool((value >> (n - 1 - i)) & 1) for i in range(n)]


# --- cluster spec ----------------------------------------------------------------------------

SPEC_FORMAT = "mtc-cluster/1"
_HOST_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def parse_address(text: str) -> tuple[str, int]:
    """``"host:port"`` -> (host, port); ConfigError when malformed."""
    host, sep, port = str(text).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"address {text!r} is not host:port (e.g. 127.0.0.1:7000)")
    return host.strip("[]"), int(port)


def check_host_id(host_id: str) -> str:
    """A host id is safe as a file name: letters, digits, '.', '_', '-' (at most 64)."""
    if not isinstance(host_id, str) or not _HOST_ID_RE.match(host_id):
        raise ConfigError(f"host id {host_id!r} is invalid: use letters, digits, '.', '_' and '-' "
                          "(at most 64, not starting with a punctuation mark)")
    return host_id


@dataclasses.dataclass(frozen=True)
class HostSpec:
    """One sidecar daemon: its id, slice, control address and how many head devices it holds."""

    id: str
    slice: int
    address: str
    devices: int


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """The hosts of a cluster, in the order the head assigns its devices to them."""

    hosts: tuple[HostSpec, ...]

    def to_json(self) -> bytes:
        doc = {"format": SPEC_FORMAT,
               "hosts": [{"id": h.id, "slice": h.slice, "address": h.address, "devices": h.devices}
                         for h in self.hosts]}
        return json.dumps(doc, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes | str, *, source: str = "cluster spec") -> "ClusterSpec":
        def bad(what: str) -> ConfigError:
            return ConfigError(f"{source} is invalid: {what}; it is written by "
                               "mtc.sidecar.local_cluster.LocalCluster (or by hand in the same format)")

        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise bad(f"not JSON ({e})") from None
        if not isinstance(doc, dict) or doc.get("format") != SPEC_FORMAT:
            raise bad(f"format is {doc.get('format') if isinstance(doc, dict) else None!r}, expected {SPEC_FORMAT!r}")
        rows = doc.get("hosts")
        if not isinstance(rows, list) or not rows:
            raise bad("'hosts' must be a non-empty list")
        hosts = []
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise bad(f"hosts[{i}] is not an object")
            hid, sl, addr, n = row.get("id"), row.get("slice"), row.get("address"), row.get("devices")
            try:
                check_host_id(hid)
                parse_address(addr)
            except ConfigError as e:
                raise bad(f"hosts[{i}]: {e}") from None
            if type(sl) is not int or sl < 0:
                raise bad(f"hosts[{i}] ({hid}): slice {sl!r} is not an integer >= 0")
            if type(n) is not int or n < 1:
                raise bad(f"hosts[{i}] ({hid}): devices {n!r} is not an integer >= 1")
            hosts.append(HostSpec(hid, sl, addr, n))
        ids = [h.id for h in hosts]
        dup = sorted({h for h in ids if ids.count(h) > 1})
        if dup:
            raise bad(f"host ids {dup} appear more than once")
        return cls(tuple(hosts))

    @classmethod
    def read(cls, path: str | os.PathLike) -> "ClusterSpec":
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            raise ConfigError(f"cannot read the cluster spec {path} ({e.strerror}); set cluster_spec "
                              "(or MTC_CLUSTER_SPEC) to the file LocalCluster wrote (.spec_path)") from None
        return cls.from_json(data, source=f"cluster spec {path}")

    def write(self, path: str | os.PathLike) -> None:
        """Write atomically: a reader sees the old file or the new one, never half of one."""
        path = Path(path)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(self.to_json())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
