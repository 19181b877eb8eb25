"""The threaded TCP server under the sidecar's two servers: accept loop and connection bookkeeping.

The daemon's control server (``mtc.sidecar.daemon``) and the peer service (``mtc.sidecar.peer``)
both serve each connection on its own thread, and both must, on ``close()``, stop accepting and
shut every open connection down so that no thread stays blocked in ``recv``. That part lives
here, once, with the admission of requests (``admit``: refused once the server stops, counted
while they run, so that stopping can wait for them); what a connection carries (frames,
requests, replies, and the logging of bad ones) stays with each server.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import socket
import ssl
import threading
import time
from typing import Any, Iterator

log = logging.getLogger(__name__)


class ServerStopping(Exception):
    """``admit`` refused a request: the server is stopping."""


class ThreadedTCPServer:
    """Accept on ``listen``; serve each connection on its own thread with ``_serve_conn``.

    ``kind`` names the threads (``mtc-{kind}-accept``, ``mtc-{kind}-{port}``) and the log lines.

    Connections start unauthenticated; the subclass calls ``_authenticated(conn)`` once one has
    proven it holds the job token. At most ``max_unauthenticated`` wait for that at once: a new
    one evicts the oldest, so a flood of idle or slow connections can delay the head's next
    connection by one handshake at most, never lock it out; each waits ``handshake_timeout_s``
    per read at most. ``max_connections`` (None: no limit) bounds the authenticated ones.
    ``idle_timeout_s`` (None: none) is the timeout of an authenticated connection's reads.
    The accept loop outlives running out of descriptors (EMFILE, ENFILE): it waits and serves
    on once some are free.

    With ``tls`` (a server context of ``mtc.shared.tls``), every connection first completes a TLS
    handshake in which the client proves a certificate of the job's CA, on its own thread, under
    the handshake timeout; one that does not is closed before anything it sent is read.

    A request a subclass runs inside ``admit()`` is refused (``ServerStopping``) once the server
    stops, and counted while it runs: ``_stop(drain_s=...)`` waits for the counted ones.

    A subclass implements ``_serve_conn``, calls ``_start_accepting`` from its ``start()`` and
    ``_stop`` from its ``close()``.
    """

    def __init__(self, listen: tuple[str, int], *, host_id: str, kind: str,
                 max_connections: int | None = None, idle_timeout_s: float | None = None,
                 max_unauthenticated: int = 16, handshake_timeout_s: float = 10.0,
                 tls: ssl.SSLContext | None = None):
        self.host_id = host_id
        self._tls = tls
        self._listen = listen
        self._kind = kind
        self._max_connections = max_connections
        self._max_unauth = max(1, int(max_unauthenticated))
        self._handshake_timeout = handshake_timeout_s
        self._unauth: collections.OrderedDict[socket.socket, None] = collections.OrderedDict()
        self._authed: set[socket.socket] = set()
        self._idle_timeout = idle_timeout_s
        self.refused_connections = 0  # evicted or refused (for tests and status)
        self._sock: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._active = 0  # requests inside admit(); _stop waits for them when it drains
        # Guards _conns, _threads, _active and _stopping; _stop waits on it for _active to fall.
        self._cond = threading.Condition()
        self._stopping = False

    @property
    def bound_address(self) -> tuple[str, int]:
        """The (host, port) the server listens on, once started."""
        host, port = self._sock.getsockname()[:2]
        return host, port

    @property
    def idle_timeout_s(self) -> float | None:
        """The read timeout of an authenticated connection (None: none)."""
        return self._idle_timeout

    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        """Run one request: ServerStopping once the server stops; counted while the block runs."""
        with self._cond:
            if self._stopping:
                raise ServerStopping(f"host {self.host_id} is shutting down")
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify_all()

    def _serve_conn(self, conn: socket.socket, peer: Any) -> None:
        """Serve ``conn`` until it is to be closed; an OSError means the peer went away."""
        raise NotImplementedError

    def _start_accepting(self) -> None:
        """Bind, listen and start the accept thread."""
        self._sock = socket.create_server(self._listen, backlog=128)
        t = threading.Thread(target=self._accept_loop, name=f"mtc-{self._kind}-accept", daemon=True)
        t.start()
        self._threads.append(t)

    def _stop(self, drain_s: float | None = None) -> bool:
        """Stop accepting, shut every open connection down and join the threads.

        First ``admit`` refuses every new request; with ``drain_s``, the requests already admitted
        then get up to that many seconds to finish before their connections are shut down.
        Returns False when the server was already stopped, so that a second ``close()`` does nothing.
        """
        with self._cond:
            if self._stopping:
                return False
            self._stopping = True
            if drain_s is not None:
                self._drain(drain_s)
            conns = list(self._conns)
        if self._sock is not None:
            with contextlib.suppress(OSError):  # wakes accept() (close alone does not, on Linux)
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        for t in self._threads:
            t.join(timeout=5)
        return True

    def _drain(self, seconds: float) -> None:
        # Runs holding _cond with _stopping set: no request is admitted any more, so _active only falls.
        deadline = time.monotonic() + seconds
        while self._active and time.monotonic() < deadline:
            self._cond.wait(deadline - time.monotonic())
        if self._active:
            log.warning("host %s: %d requests still running after %.0f s; closing anyway",
                        self.host_id, self._active, seconds)

    def _authenticated(self, conn: socket.socket) -> bool:
        """Move ``conn`` out of the waiting pool; False (close it) when the authenticated limit is hit."""
        with self._cond:
            self._unauth.pop(conn, None)
            if conn in self._authed:
                return True
            if self._max_connections is not None and len(self._authed) >= self._max_connections:
                self.refused_connections += 1
                log.warning("host %s: refusing an authenticated %s connection: %d already open",
                            self.host_id, self._kind, len(self._authed))
                return False
            self._authed.add(conn)
        conn.settimeout(self._idle_timeout)
        return True

    def _accept_loop(self) -> None:
        short_of_fds = False
        while True:
            try:
                conn, peer = self._sock.accept()
            except OSError as e:
                if self._stopping or e.errno in (errno.EBADF, errno.EINVAL, errno.ENOTSOCK):
                    return  # listening socket closed
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    if not short_of_fds:
                        log.warning("host %s: cannot accept %s connections (%s); waiting for descriptors",
                                    self.host_id, self._kind, e.strerror)
                    short_of_fds = True
                    time.sleep(0.05)
                    continue
                continue  # ECONNABORTED and the like: that one connection is gone
            if short_of_fds:
                log.info("host %s: accepting %s connections again", self.host_id, self._kind)
                short_of_fds = False
            with self._cond:
                if self._stopping:
                    conn.close()
                    return
                if len(self._unauth) >= self._max_unauth:
                    oldest, _ = self._unauth.popitem(last=False)
                    self.refused_connections += 1
                    log.warning("host %s: %d %s connections have not authenticated; closing the oldest",
                                self.host_id, self._max_unauth, self._kind)
                    with contextlib.suppress(OSError):
                        oldest.shutdown(socket.SHUT_RDWR)
                if self._tls is not None:  # no I/O here: the handshake runs on the connection's thread
                    try:
                        conn = self._tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
                    except OSError:
                        conn.close()
                        continue
                self._unauth[conn] = None
                self._conns.add(conn)
                self._threads = [t for t in self._threads if t.is_alive()]
                t = threading.Thread(target=self._run_conn, args=(conn, peer), name=f"mtc-{self._kind}-{peer[1]}",
                                     daemon=True)
                self._threads.append(t)
            t.start()

    def _run_conn(self, conn: socket.socket, peer: Any) -> None:
        try:
            conn.settimeout(self._handshake_timeout)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small replies go out at once
            if isinstance(conn, ssl.SSLSocket) and not self._tls_handshake(conn, peer):
                return
            self._serve_conn(conn, peer)
        except OSError:
            pass  # the peer went away (or close() shut the socket down, or it was evicted)
        finally:
            with self._cond:
                self._conns.discard(conn)
                self._unauth.pop(conn, None)
                self._authed.discard(conn)
            conn.close()

    def _tls_handshake(self, conn: ssl.SSLSocket, peer: Any) -> bool:
        """Complete the TLS handshake; False (close) when the client has no certificate of the job's CA."""
        try:
            conn.do_handshake()
        except ssl.SSLError as e:
            with self._cond:
                self.refused_connections += 1
            log.warning("host %s: refused a %s connection from %s: TLS handshake failed (%s); it has no "
                        "certificate of this job's CA, or speaks clear text", self.host_id, self._kind, peer,
                        e.reason or e)
            return False
        return True

