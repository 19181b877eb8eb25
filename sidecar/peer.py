"""The peer tier's wire service: a sidecar serves its ramdisk's blobs to the other sidecars.

Every sidecar runs a ``PeerServer`` on its peer port; other sidecars reach it with a
``PeerClient``. The frames are those of ``mtc.shared.protocol`` (JSON header, raw payloads,
nothing unpickled). Requests (``args`` -> ``result``; payloads in brackets):

- ``have {blobs}`` -> ``{"have": [names held]}`` (at most ``HAVE_BATCH`` names per request)
- ``get {blob}`` -> ``{"blob", "size"}`` [the blob's bytes, sent from a read-only map of the
  ramdisk file (``send_blob_file``): no copy through Python]
- ``put {blob}`` [the blob's bytes] -> ``{"blob", "added"}``: received into a temp blob and
  kept only when its bytes hash to its name
- ``verify {blob}`` -> ``{"blob", "state": "ok" | "removed" | "missing"}``: the server hashes
  its copy and removes it when it is corrupt (asked by a client whose ``get`` of it failed
  its hash; the server judges by the bytes alone, so no request removes a good blob)

Every request carries ``args["token"]``, the shared secret of the job (``peer_token`` or
``MTC_PEER_TOKEN``; a Kubernetes Secret in production). The server checks it with
``hmac.compare_digest`` before it looks at anything else; a request without it, with a wrong
one, with a malformed blob name, an unknown op, an oversized or garbage frame is refused with an
error reply, logged, and its connection closed. Other connections are served on.

Receiving (``get`` on the client, ``put`` on the server) streams the payload into a temp blob
(``RamStore.open_temp_blob``), hashing it as it arrives, and publishes it
(``RamStore.finalize_temp_blob``) only when it hashes to its name: a bad copy is discarded and
never counted. A transfer cut short leaves only a temp file, which never looks
like a blob and is removed when the store next opens.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import logging
import mmap
import os
import socket
import threading
from typing import Any, Iterable, Mapping

from mtc.shared import protocol, version
from mtc.shared.config import ENV_TOKEN, MIN_TOKEN_CHARS
from mtc.shared.errors import (
    ConfigError,
    CorruptBlobError,
    HostUnreachableError,
    InsufficientSpaceError,
    MTCError,
    ProtocolError,
)
from mtc.shared.hashing import check_blob_name, new_hasher
from mtc.shared.protocol import RemoteError, Reply, Request
from mtc.sidecar.ram import RamStore
from mtc.sidecar.tcpserver import ThreadedTCPServer

log = logging.getLogger(__name__)

__all__ = ["ENV_TOKEN", "HAVE_BATCH", "BadCopyError", "PeerClient", "PeerServer", "receive_blob", "resolve_token"]

# Names per "have" request; the header limit below leaves room for them.
HAVE_BATCH = 8192
MAX_PEER_HEADER = 1 << 20
# The largest blob a peer accepts or asks for: one shard. Refuses absurd declared sizes.
MAX_BLOB_BYTES = 1 << 40
# Receive buffer: large enough that syscalls are few, small enough to hash while still in cache.
_RECV_CHUNK = 4 << 20
_HASH_CHUNK = 1 << 20  # hashed while in cache, right after it arrives
_MAP_MIN = 2 << 20  # smaller blobs are received into the buffer: a map's set-up would dominate


def resolve_token(token: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The peer token: ``token`` when given (config ``peer_token``), else ``MTC_PEER_TOKEN``.

    Returns "" when neither is set. A token shorter than 16 characters is refused: it would be
    guessable (``secrets.token_hex(32)`` makes a good one).
    """
    env = os.environ if environ is None else environ
    value = token if token else env.get(ENV_TOKEN, "")
    value = value.strip()
    if value and len(value) < MIN_TOKEN_CHARS:
        raise ConfigError(f"the peer token (peer_token or {ENV_TOKEN}) has {len(value)} characters; use at least "
                          f"{MIN_TOKEN_CHARS} random ones, e.g. python -c 'import secrets; print(secrets.token_hex(32))'")
    return value


class BadCopyError(CorruptBlobError):
    """A peer's copy of a blob arrived whole but does not hash to its name (or has the wrong size)."""


class _Refused(MTCError):
    """A request the server refuses; the connection is closed after the error reply."""

    def __init__(self, message: str, kind: str = "ProtocolError"):
        super().__init__(message)
        self.kind = kind


# --- receiving a payload into the ramdisk ------------------------------------------------------

_local = threading.local()


def _recv_buffer() -> memoryview:
    """This thread's receive buffer, reused: a fresh one per blob would cost its page faults."""
    buf = getattr(_local, "buf", None)
    if buf is None:
        buf = _local.buf = memoryview(bytearray(_RECV_CHUNK))
    return buf


def receive_blob(sock: socket.socket, store: RamStore, name: str, nbytes: int) -> bool:
    """Receive the next ``nbytes`` of ``sock`` as blob ``name`` into ``store``, verified.

    The bytes are hashed as they arrive (one pass over them, not a second one reading the file
    back), and the temp file is published under ``name`` only when the hash matches. On a
    huge-page ramdisk they are received straight into a map of the temp file; otherwise into a
    reused buffer that is then written (see ``_receive_mapped``). Returns whether the blob was
    added (False: it was there already). CorruptBlobError (temp file removed) when the bytes do
    not hash to ``name``: every byte was read, so the connection stays usable. A transport error
    leaves the connection unusable; the temp file is removed either way.
    """
    fd, tmp = store.open_temp_blob(nbytes)  # reuses a recycled file of that size if there is one
    hasher = new_hasher()
    try:
        try:
            if store.huge_pages and nbytes >= _MAP_MIN:
                _receive_mapped(sock, fd, nbytes, hasher, name)
            else:
                _receive_written(sock, fd, nbytes, hasher, name)
        finally:
            os.close(fd)
    except BaseException as e:
        store.discard_temp_blob(tmp)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise InsufficientSpaceError(
                f"ramdisk {store.root} is full while receiving blob {name} ({nbytes} bytes) from a peer; the "
                "partial copy was removed. Size the ramdisk for the peer copies too: see `mtc size`") from e
        raise
    actual = hasher.hexdigest()
    if actual != name:
        store.discard_temp_blob(tmp)
        raise CorruptBlobError(f"received copy of blob {name} is corrupt: its bytes hash to {actual}; discarded")
    return store.finalize_temp_blob(tmp, name, verify=False)  # verified above, as the bytes arrived


def _cut_short(got: int, nbytes: int, name: str) -> ProtocolError:
    return ProtocolError(f"connection closed after {got} of {nbytes} bytes of blob {name} (peer killed or restarted?)")


def _receive_written(sock: socket.socket, fd: int, nbytes: int, hasher: Any, name: str) -> None:
    """recv into this thread's buffer, hash it, write it: for ramdisks with 4 KiB pages."""
    buf = _recv_buffer()
    got = 0
    while got < nbytes:
        k = sock.recv_into(buf, min(len(buf), nbytes - got))
        if k == 0:
            raise _cut_short(got, nbytes, name)
        chunk = buf[:k]
        hasher.update(chunk)
        out = 0
        while out < k:
            out += os.write(fd, chunk[out:])
        got += k


def _receive_mapped(sock: socket.socket, fd: int, nbytes: int, hasher: Any, name: str) -> None:
    """recv straight into a map of the temp file, hashing each MiB as it lands: one copy, not two.

    With 2 MiB pages a map costs a fault per 2 MiB, and it saves the copy out of a user buffer
    (1 GiB, 2 streams, mapped sender: 0.84-0.89x of a memory-to-memory socket copy against
    0.68-0.80x with recv + write). With 4 KiB pages the faults make it ~4x slower than write(),
    so that path stays. The pages are allocated first: a full ramdisk then fails here with
    ENOSPC, where writing a sparse map would kill the process with SIGBUS.
    """
    os.posix_fallocate(fd, 0, nbytes)
    with mmap.mmap(fd, nbytes) as m, memoryview(m) as view:
        got = hashed = 0
        while got < nbytes:
            with view[got:min(got + _RECV_CHUNK, nbytes)] as part:
                k = sock.recv_into(part)
            if k == 0:
                raise _cut_short(got, nbytes, name)
            got += k
            while got - hashed >= _HASH_CHUNK or (got == nbytes and hashed < got):
                end = min(hashed + _HASH_CHUNK, got)
                with view[hashed:end] as part:
                    hasher.update(part)  # still in cache: it just arrived
                hashed = end


# --- sending a blob from the ramdisk -----------------------------------------------------------------

_SEND_CHUNK = 4 << 20


def send_blob_file(sock: socket.socket, fd: int, size: int) -> None:
    """Send the ``size`` bytes of open blob file ``fd``: ``sendall`` from a read-only map of it.

    Not ``sendfile``: on loopback and veth (sidecars of one machine, the tests, the benchmark)
    the receiver then copies out of the sender's 4 KiB page-cache fragments, and two streams
    moved 0.55-0.60x of a memory-to-memory copy; from a map the kernel copies once into its own
    large socket buffers, 0.87-0.88x (FACTS-style measurement, 1 GiB, 2 streams, both page
    sizes). Between hosts that costs the sender one memory copy (~0.1 core-second per GiB).
    The caller pins the blob, so nothing truncates or recycles the file under the map.
    """
    if size == 0:
        return
    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as m, memoryview(m) as whole:
        for off in range(0, size, _SEND_CHUNK):
            with whole[off:off + _SEND_CHUNK] as part:
                sock.sendall(part)


# --- server ------------------------------------------------------------------------------------


class PeerServer(ThreadedTCPServer):
    """Serve ``store``'s blobs to peers that present ``token``. ``start()``, then ``close()``.

    ``listen`` is the address to bind (port 0: any free port); ``advertise`` the host part other
    sidecars use to reach it (default: the bound host, or this machine's address when bound to
    all interfaces). Each connection has its own thread (``mtc.sidecar.tcpserver``); at most
    ``max_connections`` are open at once, and one whose peer sends nothing for ``idle_timeout_s``
    is closed. Usable as a context manager.
    """

    def __init__(self, store: RamStore, token: str, *, host_id: str = "host",
                 listen: tuple[str, int] = ("127.0.0.1", 0), advertise: str | None = None,
                 max_blob_bytes: int = MAX_BLOB_BYTES, max_connections: int = 64,
                 idle_timeout_s: float = 120.0):
        if not token:
            raise ConfigError(f"the peer service of host {host_id} needs a token: set peer_token or {ENV_TOKEN} "
                              "(the same secret on every sidecar of the job)")
        super().__init__(listen, host_id=host_id, kind="peer", max_connections=max_connections,
                         idle_timeout_s=idle_timeout_s)
        self.store = store
        self._token = token.encode()
        self._advertise = advertise
        self._max_blob = int(max_blob_bytes)
        self._stats_lock = threading.Lock()
        # Counters, for tests and benchmarks: what this server sent, received and refused.
        self.stats = {"sent_blobs": 0, "sent_bytes": 0, "received_blobs": 0, "received_bytes": 0,
                      "have_requests": 0, "verify_requests": 0, "removed_corrupt": 0, "refused": 0}

    def start(self) -> str:
        """Bind, listen and start accepting; returns the advertised address ``host:port``."""
        self._start_accepting()
        log.info("host %s: peer service on %s", self.host_id, self.address)
        return self.address

    @property
    def address(self) -> str:
        host, port = self._sock.getsockname()[:2]
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
            handler = _HANDLERS.get(req.op)
            if handler is None:
                raise _Refused(f"unknown peer op {req.op!r}; peer ops: {', '.join(sorted(_HANDLERS))}")
            if req.op != "put" and header["payloads"]:
                raise _Refused(f"peer op {req.op!r} takes no payload")
            return handler(self, conn, req, header["payloads"])
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
        have = [n for n in names if self.store.has_blob(n)]
        return self._reply(conn, Reply(req.id, {"have": have}))

    def _op_get(self, conn: socket.socket, req: Request, sizes: list[int]) -> bool:
        name = self._blob_arg(req)
        # Pinned while the file is open and mapped: collection must not recycle it under the send.
        with self.store.pin([name]):
            try:
                f = open(self.store.blob_path(name), "rb")
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
        try:
            added = receive_blob(conn, self.store, name, sizes[0])
        except CorruptBlobError as e:  # every byte was read: the connection is still good
            log.warning("host %s: %s", self.host_id, e)
            return self._reply(conn, Reply(req.id, error=RemoteError("CorruptBlobError", f"host {self.host_id}: {e}")))
        except InsufficientSpaceError as e:
            log.error("host %s: %s", self.host_id, e)
            self._reply(conn, Reply(req.id, error=RemoteError("InsufficientSpaceError", str(e))))
            return False  # the rest of the payload is unread
        self._count(received_blobs=1, received_bytes=sizes[0])
        return self._reply(conn, Reply(req.id, {"blob": name, "added": added}))


    def _op_verify(self, conn: socket.socket, req: Request, sizes: list[int]) -> bool:
        # A peer got a copy of this blob that failed its hash: check ours, drop it if it is bad.
        # The store decides from the bytes alone, so a request can never remove a good blob.
        name = self._blob_arg(req)
        with self.store.pin([name]):
            state = self.store.scrub_blob(name)
        self._count(verify_requests=1, **({"removed_corrupt": 1} if state == "removed" else {}))
        return self._reply(conn, Reply(req.id, {"blob": name, "state": state}))


_HANDLERS = {"have": PeerServer._op_have, "get": PeerServer._op_get, "put": PeerServer._op_put,
             "verify": PeerServer._op_verify}


# --- client ------------------------------------------------------------------------------------


class PeerClient:
    """One connection to one peer's ``PeerServer`` (not thread-safe; one per thread).

    ``peer`` names the peer host in messages. Transport failures raise HostUnreachableError
    (the next call reconnects); a refused token raises ConfigError; a copy that is missing or
    does not hash to its name raises CorruptBlobError.
    """

    def __init__(self, address: str, token: str, *, peer: str = "peer", timeout_s: float = 60.0,
                 connect_timeout_s: float = 10.0):
        self.address = address
        self.peer = peer
        self._addr = protocol.parse_address(address)
        self._token = token
        self._timeout = timeout_s
        self._connect_timeout = connect_timeout_s
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
                raise HostUnreachableError(f"{self._where()}: cannot connect ({_cause(e)})") from e
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
            raise HostUnreachableError(f"{self._where()}: {op} failed ({_cause(e)})") from e
        return req.id

    def _reply_header(self, op: str, rid: int, max_payload: int) -> dict:
        try:
            header = protocol.recv_header(self._sock, max_header=MAX_PEER_HEADER, max_payload=max_payload)
        except (OSError, ProtocolError) as e:
            self.close()
            raise HostUnreachableError(f"{self._where()}: {op} failed ({_cause(e)})") from e
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
            raise HostUnreachableError(f"{self._where()}: get of blob {name} failed ({_cause(e)})") from e
        return sizes[0]

    def put(self, store: RamStore, name: str) -> bool:
        """Send blob ``name`` from ``store`` to the peer (``send_blob_file``); whether the peer added it."""
        check_blob_name(name)
        with store.pin([name]):
            with open(store.blob_path(name), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                rid = self._send("put", {"blob": name}, [size])
                try:
                    send_blob_file(self._sock, f.fileno(), size)
                except OSError as e:
                    self.close()
                    raise HostUnreachableError(f"{self._where()}: put of blob {name} failed ({_cause(e)})") from e
        result = Reply.from_frame(self._reply_header("put", rid, 0), ()).result
        return bool(isinstance(result, dict) and result.get("added"))


def _cause(e: BaseException) -> str:
    if isinstance(e, ConnectionRefusedError):
        return "connection refused: peer service not running?"
    if isinstance(e, TimeoutError):
        return "timed out: peer hung or overloaded?"
    if isinstance(e, (ConnectionResetError, BrokenPipeError)):
        return "connection lost: peer killed or restarted?"
    return f"{type(e).__name__}: {e}"
