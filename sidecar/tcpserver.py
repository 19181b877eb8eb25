"""The threaded TCP server under the sidecar's two servers: accept loop and connection bookkeeping.

The daemon's control server (``mtc.sidecar.daemon``) and the peer service (``mtc.sidecar.peer``)
both serve each connection on its own thread, and both must, on ``close()``, stop accepting and
shut every open connection down so that no thread stays blocked in ``recv``. That part lives
here, once; what a connection carries (frames, requests, replies, and the logging of bad ones)
stays with each server.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from typing import Any, Callable

log = logging.getLogger(__name__)


class ThreadedTCPServer:
    """Accept on ``listen``; serve each connection on its own thread with ``_serve_conn``.

    ``kind`` names the threads (``mtc-{kind}-accept``, ``mtc-{kind}-{port}``) and the log lines.
    ``max_connections`` (None: no limit) bounds the connections open at once: one more is closed
    as soon as it is accepted, so a flood of connections cannot exhaust threads or descriptors.
    ``idle_timeout_s`` (None: none) is the timeout of each connection's socket operations.

    A subclass implements ``_serve_conn``, calls ``_start_accepting`` from its ``start()`` and
    ``_stop`` from its ``close()``.
    """

    def __init__(self, listen: tuple[str, int], *, host_id: str, kind: str,
                 max_connections: int | None = None, idle_timeout_s: float | None = None):
        self.host_id = host_id
        self._listen = listen
        self._kind = kind
        self._slots = None if max_connections is None else threading.BoundedSemaphore(max_connections)
        self._idle_timeout = idle_timeout_s
        self._sock: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        # Guards _conns, _threads and _stopping. A Condition, so that a subclass can wait on it.
        self._cond = threading.Condition()
        self._stopping = False

    def _serve_conn(self, conn: socket.socket, peer: Any) -> None:
        """Serve ``conn`` until it is to be closed; an OSError means the peer went away."""
        raise NotImplementedError

    def _start_accepting(self) -> None:
        """Bind, listen and start the accept thread."""
        self._sock = socket.create_server(self._listen, backlog=128)
        t = threading.Thread(target=self._accept_loop, name=f"mtc-{self._kind}-accept", daemon=True)
        t.start()
        self._threads.append(t)

    def _stop(self, drain: Callable[[], None] | None = None) -> bool:
        """Stop accepting, shut every open connection down and join the threads.

        ``_stopping`` is set first, under ``_cond``; ``drain`` then runs still holding it (the
        daemon waits there for the requests in flight). Returns False when the server was
        already stopped, so that a second ``close()`` does nothing.
        """
        with self._cond:
            if self._stopping:
                return False
            self._stopping = True
            if drain is not None:
                drain()
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

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return  # listening socket closed
            with self._cond:
                if self._stopping:
                    conn.close()
                    return
                if self._slots is not None and not self._slots.acquire(blocking=False):
                    log.warning("host %s: refusing a %s connection from %s: %s connections already open",
                                self.host_id, self._kind, peer, len(self._conns))
                    conn.close()
                    continue
                self._conns.add(conn)
                self._threads = [t for t in self._threads if t.is_alive()]
                t = threading.Thread(target=self._run_conn, args=(conn, peer), name=f"mtc-{self._kind}-{peer[1]}",
                                     daemon=True)
                self._threads.append(t)
            t.start()

    def _run_conn(self, conn: socket.socket, peer: Any) -> None:
        try:
            conn.settimeout(self._idle_timeout)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small replies go out at once
            self._serve_conn(conn, peer)
        except OSError:
            pass  # the peer went away (or close() shut the socket down)
        finally:
            with self._cond:
                self._conns.discard(conn)
            conn.close()
            if self._slots is not None:
                self._slots.release()
