"""The peer service: a sidecar serves its ramdisk's blobs to the other sidecars (see ``mtc.sidecar.peer``)."""

from __future__ import annotations

import hmac
import logging
import os
import socket
import threading
from typing import Any

from mtc.shared import format as fmt
from mtc.shared import protocol, version
from mtc.shared.config import ENV_TOKEN
from mtc.shared.errors import (
    ConfigError,
    CorruptBlobError,
    InsufficientSpaceError,
    MTCError,
)
from mtc.shared.hashing import check_blob_name
from mtc.shared.protocol import RemoteError, Reply, Request
from mtc.shared.tls import TLSFiles, server_context
from mtc.sidecar.ram import RamStore
from mtc.sidecar.ram.common import open_blob
from mtc.sidecar.tcpserver import ThreadedTCPServer
from mtc.sidecar.peer.client import TLSDialing, dial_with_tls
from mtc.sidecar.peer.wire import (HAVE_BATCH, MAX_BLOB_BYTES, MAX_PEER_HEADER, StalledTransferError, YieldedCopyError,
                                  receive_blob, send_blob_file)

log = logging.getLogger(__name__)


class _Refused(MTCError):
    """A request the server refuses; the connection is closed after the error reply."""

    def __init__(self, message: str, kind: str = "ProtocolError"):
        super().__init__(message)
        self.kind = kind


# --- server ------------------------------------------------------------------------------------


class PeerServer(ThreadedTCPServer):
    """Serve ``store``'s blobs to peers that present ``token``. ``start()``, then ``close()``.

    ``listen`` is the address to bind (port 0: any free port); ``advertise`` the host part other
    sidecars use to reach it (default: the bound host, or this machine's address when bound to
    all interfaces). Each connection has its own thread (``mtc.sidecar.tcpserver``); at most
    ``max_connections`` are open at once, and one whose peer sends nothing for ``idle_timeout_s``
    is closed. A ``put`` whose bytes stop arriving for ``receive_timeout_s`` is dropped: its
    partial copy is removed (its room is free again), one line is logged with the peer and the
    blob, and the connection is closed; the sender retries later. Usable as a context manager.

    With ``tls`` (``TLSFiles`` of ``mtc.shared.tls``) it serves over mutual TLS only, and the peer
    clients of this process that present the same token dial over TLS with the same files.
    """

    def __init__(self, store: RamStore, token: str, *, host_id: str = "host",
                 listen: tuple[str, int] = ("127.0.0.1", 0), advertise: str | None = None,
                 max_blob_bytes: int = MAX_BLOB_BYTES, max_connections: int = 64,
                 idle_timeout_s: float = 120.0, receive_timeout_s: float = 30.0,
                 tls: TLSFiles | None = None):
        if not token:
            raise ConfigError(f"the peer service of host {host_id} needs a token: set peer_token or {ENV_TOKEN} "
                              "(the same secret on every sidecar of the job)")
        super().__init__(listen, host_id=host_id, kind="peer", max_connections=max_connections,
                         idle_timeout_s=idle_timeout_s, handshake_timeout_s=min(10.0, idle_timeout_s),
                         tls=None if tls is None else server_context(tls))
        self._tls_files = tls
        self._dialing: TLSDialing | None = None
        self.store = store
        self._token = token.encode()
        self._advertise = advertise
        self._max_blob = int(max_blob_bytes)
        if not receive_timeout_s > 0:
            raise ConfigError(f"receive_timeout_s of the peer service of host {host_id} must be > 0 seconds, "
                              f"got {receive_timeout_s!r}")
        self._receive_timeout = float(receive_timeout_s)
        self._stats_lock = threading.Lock()
        # Counters, for tests and benchmarks: what this server sent, received and refused.
        self.stats = {"sent_blobs": 0, "sent_bytes": 0, "received_blobs": 0, "received_bytes": 0,
                      "have_requests": 0, "verify_requests": 0, "removed_corrupt": 0, "refused": 0,
                      "sent_manifests": 0, "stalled_puts": 0, "yielded_puts": 0}

    def start(self) -> str:
        """Bind, listen and start accepting; returns the advertised address ``host:port``."""
        self._start_accepting()
        if self._tls_files is not None:
            self._dialing = dial_with_tls(self._token.decode(), self._tls_files)
        log.info("host %s: peer service on %s%s", self.host_id, self.address,
                 " (TLS)" if self._tls_files is not None else "")
        return self.address

    @property
    def address(self) -> str:
        host, port = self.bound_address
        if self._advertise:
            host = self._advertise
        elif host in ("0.0.0.0", "::"):
            try:  # bound to every interface: advertise this machine's own address
                host = socket.gethostbyname(socket.gethostname())
            except OSError:
                host = "127.0.0.1"
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def close(self) -> None:
        """Stop accepting, close every connection, join the threads. Safe to call twice."""
        if self._stop():
            if self._dialing is not None:
                self._dialing.close()
            log.info("host %s: peer service stopped", self.host_id)

    def __enter__(self) -> "PeerServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _count(self, **delta: int) -> None:
        with self._stats_lock:
            for k, v in delta.items():
                self.stats[k] += v

    # --- connections -------------------------------------------------------------------------

    def _serve_conn(self, conn: socket.socket, peer: Any) -> None:
        while self._serve_one(conn, peer):
            pass

    def _serve_one(self, conn: socket.socket, peer: Any) -> bool:
        """Answer one request; False when the connection is to be closed."""
        rid = None
        try:
            header = protocol.recv_header(conn, max_header=MAX_PEER_HEADER, max_payload=self._max_blob)
            if header is None:
                return False
            req = Request.from_frame(header, ())
            rid = req.id
            self._authenticate(req)
            if not self._authenticated(conn):
                raise _Refused(f"host {self.host_id}: peer service busy (too many connections); retry later",
                               "HostUnreachableError")
            handler = _HANDLERS.get(req.op)
            if handler is None:
                raise _Refused(f"unknown peer op {req.op!r}; peer ops: {', '.join(sorted(_HANDLERS))}")
            if req.op != "put" and header["payloads"]:
                raise _Refused(f"peer op {req.op!r} takes no payload")
            return handler(self, conn, req, header["payloads"])
        except StalledTransferError as e:  # its bytes stopped coming: dropped, logged once, closed
            self._count(stalled_puts=1)
            log.warning("host %s: dropped a put from %s: %s", self.host_id, peer, e)
            self._reply(conn, Reply(rid, error=RemoteError("HostUnreachableError", f"host {self.host_id}: {e}")))
            return False
        except MTCError as e:  # refused (a bad token, name or frame), or failed: either way, close
            self._count(refused=1)
            log.warning("host %s: refused a peer request from %s and closed the connection: %s",
                        self.host_id, peer, e)
            kind = e.kind if isinstance(e, _Refused) else type(e).__name__
            self._reply(conn, Reply(rid, error=RemoteError(kind, f"host {self.host_id}: {e}")))
            return False
        except TimeoutError:
            return False  # idle (or stalled) peer

    def _authenticate(self, req: Request) -> None:
        token = req.args.get("token")
        if not isinstance(token, str) or not token:
            raise _Refused("request without a peer token", "PermissionError")
        if not hmac.compare_digest(token.encode("utf-8", "surrogatepass"), self._token):
            raise _Refused("wrong peer token (every sidecar of a job must share MTC_PEER_TOKEN)", "PermissionError")
        # Peers of one job run one image: another mtc or protocol version is refused, not half understood.
        theirs = (req.args.get("mtc"), req.args.get("protocol"))
        if theirs != (version.MTC_VERSION, version.PROTOCOL_VERSION):
            raise _Refused(f"peer runs mtc {theirs[0]} protocol {theirs[1]}, this sidecar mtc {version.MTC_VERSION} "
                           f"protocol {version.PROTOCOL_VERSION}; run every sidecar of a job from the same image",
                           "VersionMismatchError")

    def _reply(self, conn: socket.socket, reply: Reply) -> bool:
        try:
            protocol.send_reply(conn, reply)
            return True
        except OSError:
            return False

    def _blob_arg(self, req: Request) -> str:
        name = req.args.get("blob")
        try:
            return check_blob_name(name)
        except ValueError as e:
            raise _Refused(str(e)) from None

    # --- ops ---------------------------------------------------------------------------------

    def _op_have(self, conn: socket.socket, req: Request, sizes: list[int]) -> bool:
        names = req.args.get("blobs")
        if not isinstance(names, list) or len(names) > HAVE_BATCH:
            raise _Refused(f"'have' needs a list of at most {HAVE_BATCH} blob names")
        for n in names:
            try:
                check_blob_name(n)
            except ValueError as e:
                raise _Refused(str(e)) from None
        self._count(have_requests=1)
        have = [n for n in names if self.store.blobs.has(n)]
        return self._reply(conn, Reply(req.id, {"have": have}))

    def _op_get(self, conn: socket.socket, req: Request, sizes: list[int]) -> bool:
        name = self._blob_arg(req)
        # Pinned while the file is open and mapped: collection must not recycle it under the send.
        with self.store.pins.hold([name]):
            try:
                f = os.fdopen(open_blob(self.store.blobs.path(name)), "rb")
            except FileNotFoundError:
                return self._reply(conn, Reply(req.id, error=RemoteError(
                    "FileNotFoundError", f"host {self.host_id} does not hold blob {name}")))
            with f:
                size = os.fstat(f.fileno()).st_size
                head = protocol.frame_head(Reply(req.id, {"blob": name, "size": size}).header(), [size])
                conn.sendall(head)
                send_blob_file(conn, f.fileno(), size)
        self._count(sent_blobs=1, sent_bytes=size)
        return True

    def _op_put(self, conn: socket.socket, req: Request, sizes: list[int]) -> bool:
        name = self._blob_arg(req)
        if len(sizes) != 1:
            raise _Refused(f"'put' of blob {name} needs exactly one payload, got {len(sizes)}")
        conn.settimeout(self._receive_timeout)  # no byte for this long: the transfer is dropped
        try:
            added = receive_blob(conn, self.store, name, sizes[0])
        except CorruptBlobError as e:  # every byte was read: the connection is still good
            log.warning("host %s: %s", self.host_id, e)
            return self._reply(conn, Reply(req.id, error=RemoteError("CorruptBlobError", f"host {self.host_id}: {e}")))
        except InsufficientSpaceError as e:
            yielded = isinstance(e, YieldedCopyError)
            self._count(**({"yielded_puts": 1} if yielded else {}))
            (log.warning if yielded else log.error)("host %s: %s", self.host_id, e)
            self._reply(conn, Reply(req.id, error=RemoteError("InsufficientSpaceError", str(e))))
            return False  # the rest of the payload is unread
        finally:
            conn.settimeout(self.idle_timeout_s)
        self._count(received_blobs=1, received_bytes=sizes[0])
        return self._reply(conn, Reply(req.id, {"blob": name, "added": added}))


    def _op_verify(self, conn: socket.socket, req: Request, sizes: list[int]) -> bool:
        # A peer got a copy of this blob that failed its hash: check ours, drop it if it is bad.
        # The store decides from the bytes alone, so a request can never remove a good blob.
        name = self._blob_arg(req)
        with self.store.pins.hold([name]):
            state = self.store.scrub_blob(name)
        self._count(verify_requests=1, **({"removed_corrupt": 1} if state == "removed" else {}))
        return self._reply(conn, Reply(req.id, {"blob": name, "state": state}))


    def _op_manifest(self, conn: socket.socket, req: Request, sizes: list[int]) -> bool:
        # The whole step manifest (or, with header_only, its first line), from a host that keeps it
        # (see fmt.CommitRecord). The reader
        # checks it against the digest every host committed; this side only matches the claim.
        step, digest = req.args.get("step"), req.args.get("digest")
        if type(step) is not int or step < 0 or not isinstance(digest, str):
            raise _Refused("'manifest' needs a step (integer >= 0) and the digest of its manifest")
        try:
            data = self.store.catalog.read(step)
        except (MTCError, OSError):
            data = None
        if data is None or fmt.CommitRecord.parse(data) is not None or fmt.step_digest(data) != digest:
            return self._reply(conn, Reply(req.id, error=RemoteError(
                "FileNotFoundError", f"host {self.host_id} does not keep the manifest {digest[:12]} of step {step}")))
        if req.args.get("header_only") is True:  # what a host needs to read its own shards (mtc/3)
            data = data.partition(b"\n")[0]
        conn.sendall(protocol.frame_head(Reply(req.id, {"step": step, "size": len(data)}).header(), [len(data)]))
        conn.sendall(data)
        self._count(sent_manifests=1)
        return True


_HANDLERS = {"have": PeerServer._op_have, "get": PeerServer._op_get, "put": PeerServer._op_put,
             "verify": PeerServer._op_verify, "manifest": PeerServer._op_manifest}


# --- client ------------------------------------------------------------------------------------


