"""The peer client: one sidecar asks another for blobs (see ``mtc.sidecar.peer``)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import ssl
import threading
from typing import Any, Iterable

from mtc.shared import format as fmt
from mtc.shared import protocol, version
from mtc.shared.config import ENV_TOKEN
from mtc.shared.errors import (
    ConfigError,
    CorruptBlobError,
    HostUnreachableError,
    InsufficientSpaceError,
    ManifestError,
    ProtocolError,
)
from mtc.shared.hashing import check_blob_name
from mtc.shared.protocol import RemoteError, Reply, Request
from mtc.shared.tls import TLSFiles, client_context, describe
from mtc.sidecar.ram import RamStore
from mtc.sidecar.ram.common import open_blob
from mtc.sidecar.peer.wire import HAVE_BATCH, MAX_BLOB_BYTES, MAX_PEER_HEADER, BadCopyError, peer_failure, receive_blob, send_blob_file

log = logging.getLogger(__name__)

# The TLS client contexts of the jobs whose peer servers in this process serve over TLS, by the
# job's token: the sidecar's pulls and pushes find them without each caller carrying one.
_tls_lock = threading.Lock()
_tls_by_token: dict[str, list[ssl.SSLContext]] = {}


class TLSDialing:
    """The registration ``dial_with_tls`` made; ``close()`` withdraws it."""

    def __init__(self, token: str, context: ssl.SSLContext):
        self._token, self._context = token, context

    def close(self) -> None:
        with _tls_lock:
            contexts = _tls_by_token.get(self._token, [])
            if self._context in contexts:
                contexts.remove(self._context)
            if not contexts:
                _tls_by_token.pop(self._token, None)


def dial_with_tls(token: str, files: TLSFiles) -> TLSDialing:
    """Make this process's peer clients of ``token`` dial over TLS with ``files`` (a TLS peer server does)."""
    context = client_context(files)
    with _tls_lock:
        _tls_by_token.setdefault(token, []).append(context)
    return TLSDialing(token, context)


def _job_tls(token: str) -> ssl.SSLContext | None:
    with _tls_lock:
        contexts = _tls_by_token.get(token)
        return contexts[-1] if contexts else None


class PeerClient:
    """One connection to one peer's ``PeerServer`` (not thread-safe; one per thread).

    ``peer`` names the peer host in messages. Transport failures raise HostUnreachableError
    (the next call reconnects); a refused token raises ConfigError; a copy that is missing or
    does not hash to its name raises CorruptBlobError.

    ``tls`` (a client context of ``mtc.shared.tls``): dial over TLS with it. By default, the one
    a TLS peer server of this process registered for ``token`` (``dial_with_tls``), else clear text.
    """

    def __init__(self, address: str, token: str, *, peer: str = "peer", timeout_s: float = 60.0,
                 connect_timeout_s: float = 10.0, tls: ssl.SSLContext | None = None):
        self.address = address
        self.peer = peer
        self._addr = protocol.parse_address(address)
        self._token = token
        self._timeout = timeout_s
        self._connect_timeout = connect_timeout_s
        self._tls = tls if tls is not None else _job_tls(token)
        self._sock: socket.socket | None = None
        self._next_id = 0

    def __enter__(self) -> "PeerClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None

    def _where(self) -> str:
        return f"peer {self.peer} at {self.address}"

    def _connect(self) -> socket.socket:
        if self._sock is None:
            try:
                sock = socket.create_connection(self._addr, timeout=self._connect_timeout)
            except OSError as e:
                raise HostUnreachableError(f"{self._where()}: cannot connect ({peer_failure(e)})") from e
            if self._tls is not None:
                try:
                    sock = self._tls.wrap_socket(sock)
                except OSError as e:
                    sock.close()
                    why = describe(e) if isinstance(e, ssl.SSLError) else peer_failure(e)
                    raise HostUnreachableError(f"{self._where()}: {why}") from e
            sock.settimeout(self._timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock
        return self._sock

    def _send(self, op: str, args: dict, payload_sizes: list[int] | None = None) -> int:
        sock = self._connect()
        self._next_id += 1
        req = Request(op, self._next_id, {**args, "token": self._token, "mtc": version.MTC_VERSION,
                                          "protocol": version.PROTOCOL_VERSION})
        try:
            if payload_sizes is None:
                protocol.send_request(sock, req)
            else:
                sock.sendall(protocol.frame_head(req.header(), payload_sizes))
        except OSError as e:
            self.close()
            raise HostUnreachableError(f"{self._where()}: {op} failed ({peer_failure(e)})") from e
        return req.id

    def _reply_header(self, op: str, rid: int, max_payload: int) -> dict:
        try:
            header = protocol.recv_header(self._sock, max_header=MAX_PEER_HEADER, max_payload=max_payload)
        except (OSError, ProtocolError) as e:
            self.close()
            raise HostUnreachableError(f"{self._where()}: {op} failed ({peer_failure(e)})") from e
        if header is None:
            self.close()
            raise HostUnreachableError(f"{self._where()}: connection closed before the {op} reply "
                                       "(peer killed or restarted?)")
        reply = Reply.from_frame(header, ())
        if reply.error is not None:
            self._raise(op, reply.error, bool(header["payloads"]))
        if reply.id != rid:
            self.close()
            raise HostUnreachableError(f"{self._where()}: {op} reply id {reply.id} does not match request id {rid}")
        return header

    def _raise(self, op: str, err: RemoteError, has_payload: bool) -> None:
        if has_payload or err.type in ("PermissionError", "ProtocolError"):
            self.close()  # the server closes the connection after these
        msg = f"{self._where()} refused {op}: {err.message}"
        if err.type == "PermissionError":
            raise ConfigError(msg + f"; give every sidecar of the job the same {ENV_TOKEN}")
        if err.type in ("FileNotFoundError", "CorruptBlobError"):
            raise CorruptBlobError(msg)
        if err.type == "InsufficientSpaceError":
            raise InsufficientSpaceError(msg)
        raise ProtocolError(msg)

    def have(self, names: Iterable[str]) -> set[str]:
        """Which of ``names`` the peer holds."""
        names = [check_blob_name(n) for n in names]
        out: set[str] = set()
        for i in range(0, len(names), HAVE_BATCH):
            batch = names[i:i + HAVE_BATCH]
            rid = self._send("have", {"blobs": batch})
            result = Reply.from_frame(self._reply_header("have", rid, 0), ()).result
            have = result.get("have") if isinstance(result, dict) else None
            if not isinstance(have, list) or not set(have) <= set(batch):
                self.close()
                raise ProtocolError(f"{self._where()}: malformed 'have' answer {result!r:.100}")
            out.update(have)
        return out

    def verify(self, name: str) -> str:
        """Have the peer check its copy of ``name``: ``"ok"``, ``"removed"`` (it was corrupt) or ``"missing"``."""
        check_blob_name(name)
        rid = self._send("verify", {"blob": name})
        result = Reply.from_frame(self._reply_header("verify", rid, 0), ()).result
        state = result.get("state") if isinstance(result, dict) else None
        if state not in ("ok", "removed", "missing"):
            self.close()
            raise ProtocolError(f"{self._where()}: malformed 'verify' answer {result!r:.100}")
        return state

    def get(self, store: RamStore, name: str, *, size: int | None = None) -> int:
        """Fetch blob ``name`` from the peer into ``store``, verified; returns the bytes received.

        ``size`` (when known, from the manifest) bounds what the peer may send. A copy that
        does not hash to ``name`` raises CorruptBlobError and is not kept.
        """
        check_blob_name(name)
        rid = self._send("get", {"blob": name})
        limit = MAX_BLOB_BYTES if size is None else int(size)
        header = self._reply_header("get", rid, limit)
        sizes = header["payloads"]
        result = header.get("result") if isinstance(header.get("result"), dict) else {}
        if len(sizes) != 1 or result.get("size") != sizes[0] or (size is not None and sizes[0] != size):
            self.close()
            raise BadCopyError(f"{self._where()}: blob {name} came with sizes {sizes} "
                                   f"(expected {size if size is not None else result.get('size')}); not using it")
        try:
            receive_blob(self._sock, store, name, sizes[0])
        except CorruptBlobError as e:
            raise BadCopyError(f"copy of blob {name} from {self._where()} is corrupt ({e})") from None
        except (OSError, ProtocolError) as e:
            if isinstance(e, InsufficientSpaceError):
                self.close()
                raise
            self.close()
            raise HostUnreachableError(f"{self._where()}: get of blob {name} failed ({peer_failure(e)})") from e
        return sizes[0]

    def manifest(self, step: int, digest: str, *, header_only: bool = False, max_bytes: int = 1 << 34) -> bytes:
        """The whole manifest of ``step`` from a peer that keeps it, checked against ``digest``;
        with ``header_only`` its header line (the reader checks it: ``StepManifest.local_view``)."""
        rid = self._send("manifest", {"step": int(step), "digest": digest, **({"header_only": True} if header_only else {})})
        header = self._reply_header("manifest", rid, max_bytes)
        sizes = header["payloads"]
        if len(sizes) != 1:
            self.close()
            raise ProtocolError(f"{self._where()}: the manifest of step {step} came with {len(sizes)} payloads")
        buf = bytearray(sizes[0])
        view = memoryview(buf)
        got = 0
        try:
            while got < len(buf):
                n = self._sock.recv_into(view[got:])
                if not n:
                    raise ConnectionError("connection closed in the middle of the manifest")
                got += n
        except OSError as e:
            self.close()
            raise HostUnreachableError(f"{self._where()}: manifest of step {step} failed ({peer_failure(e)})") from e
        data = bytes(buf)
        if header_only:
            return data
        try:
            m = fmt.StepManifest.from_json(data, source=f"step {step} manifest from {self._where()}")
        except ManifestError as e:
            raise CorruptBlobError(f"{e}; not using it") from None
        if m.step != step or m.digest != digest:
            raise CorruptBlobError(f"{self._where()} sent a manifest of step {m.step} with digest {m.digest[:12]}, "
                                   f"not the one of step {step} every host committed ({digest[:12]}); not using it")
        return data

    def put(self, store: RamStore, name: str) -> bool:
        """Send blob ``name`` from ``store`` to the peer (``send_blob_file``); whether the peer added it."""
        check_blob_name(name)
        with store.pins.hold([name]):
            with os.fdopen(open_blob(store.blobs.path(name)), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                rid = self._send("put", {"blob": name}, [size])
                try:
                    send_blob_file(self._sock, f.fileno(), size)
                except OSError as e:
                    self.close()
                    raise HostUnreachableError(f"{self._where()}: put of blob {name} failed ({peer_failure(e)})") from e
        result = Reply.from_frame(self._reply_header("put", rid, 0), ()).result
        return bool(isinstance(result, dict) and result.get("added"))


