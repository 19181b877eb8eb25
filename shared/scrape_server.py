"""A bounded HTTP server for Prometheus scrapes: the head's and every sidecar daemon's ``/metrics``.

Slow or idle clients can neither exhaust the process it runs in nor lock real scrapes out for long:

- at most ``max_scrapes`` connections (``MAX_SCRAPES``) are served at once, each on a thread of its own;
  the accept loop closes any connection past them at once (a best-effort ``503``, counted in
  ``refused``) without starting a thread, so the server holds at most ``max_scrapes + 1`` threads
  whatever the number of connections;
- a connection has ``REQUEST_DEADLINE_S`` from its accept to the end of its request headers, one
  deadline for the whole request (each read waits only what is left of it, not a fresh timeout), so
  a client that trickles a byte at a time holds its slot no longer than one that sends nothing; then
  ``RESPONSE_DEADLINE_S`` to take the answer;
- the request line and headers may take ``MAX_REQUEST_BYTES``; ``GET`` (and ``HEAD``) of ``/metrics``
  or ``/`` are answered, in the format and encoding the scraper asks for (prometheus_client's
  ``choose_encoder``: OpenMetrics or the text format; gzip), ``name[]`` filters as prometheus_client's
  own server does; one request per connection.

Used by ``mtc.head.metrics`` and ``mtc.sidecar.metrics``; it imports prometheus_client when it starts.
"""

from __future__ import annotations

import gzip
import logging
import re
import socket
import threading
import time
from typing import Any
from urllib.parse import parse_qs, urlsplit

MAX_SCRAPES = 8  # connections served at once; one more is closed at once (a scraper asks again)
REQUEST_DEADLINE_S = 5.0  # from a connection's accept to the end of its request headers
RESPONSE_DEADLINE_S = 10.0  # to take the answer (a few kB to a few hundred kB)
MAX_REQUEST_BYTES = 16 * 1024  # request line and headers
LISTEN_BACKLOG = 128
_PATHS = ("/metrics", "/")
_END_OF_HEADERS = re.compile(rb"\r?\n\r?\n")
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large", 500: "Internal Server Error", 503: "Service Unavailable"}

_log = logging.getLogger(__name__)


class _TooLarge(Exception):
    pass


class ScrapeServer:
    """Serves ``registry`` at ``http://addr:port/metrics`` (port 0: a free one, see ``port``) from a thread
    of this process until ``close()``. ``name`` and ``logger`` say whose metrics a collection error is of.
    Raises OSError (or OverflowError for a port out of range) when it cannot listen there."""

    def __init__(self, addr: str, port: int, registry: Any, *, name: str = "metrics",
                 logger: logging.Logger | None = None, max_scrapes: int = MAX_SCRAPES,
                 request_deadline_s: float = REQUEST_DEADLINE_S, response_deadline_s: float = RESPONSE_DEADLINE_S,
                 thread_name: str = "mtc-metrics"):
        from prometheus_client.exposition import choose_encoder  # noqa: F401 (fail here, not at a scrape)

        if max_scrapes < 1 or request_deadline_s <= 0 or response_deadline_s <= 0:
            raise ValueError("max_scrapes must be >= 1 and the deadlines > 0")
        self.registry, self.name, self.refused = registry, name, 0
        self._log = logger or _log
        self._request_s, self._response_s = request_deadline_s, response_deadline_s
        self._slots = threading.BoundedSemaphore(max_scrapes)
        self._closed = threading.Event()
        self._sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((addr, port))
            self._sock.listen(LISTEN_BACKLOG)
            self._sock.settimeout(0.5)  # the accept loop looks at close() this often
        except BaseException:
            self._sock.close()
            raise
        self.address, self.port = self._sock.getsockname()[:2]
        self._thread = threading.Thread(target=self._accept_loop, daemon=True, name=thread_name)
        self._thread_name = thread_name
        self._thread.start()

    def close(self) -> None:
        """Stop accepting (the port is free once this returns); scrapes under way end by their deadlines.
        Safe to call twice."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._thread.join(timeout=10)
        self._sock.close()

    # --- the accept loop (one thread) --------------------------------------------------------------

    def _accept_loop(self) -> None:
        failing = False
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError as e:  # out of file descriptors, a connection aborted before its accept...
                if self._closed.is_set():
                    return
                if not failing:
                    self._log.warning("%s: cannot accept a scrape: %s", self.name, e)
                failing = True
                self._closed.wait(0.1)
                continue
            failing = False
            accepted = time.monotonic()
            if not self._slots.acquire(blocking=False):
                self.refused += 1  # only this thread writes it
                _refuse(conn)
                continue
            try:
                threading.Thread(target=self._serve, args=(conn, accepted), daemon=True,
                                 name=f"{self._thread_name}-scrape").start()
            except RuntimeError:  # no thread to be had: refuse this one as if busy
                self._slots.release()
                self.refused += 1
                _refuse(conn)

    # --- one connection (its own thread, holding a slot) --------------------------------------------

    def _serve(self, conn: socket.socket, accepted: float) -> None:
        try:
            try:
                head = _read_head(conn, accepted + self._request_s)
            except _TooLarge:
                status, headers, body = _plain(431, "the request's headers are too large")
            else:
                if head is None:  # closed, or the deadline passed first: nothing to answer
                    return
                status, headers, body = self._answer(head)
            data = _response(status, headers, body)
            _send_all(conn, data, time.monotonic() + self._response_s)
            conn.shutdown(socket.SHUT_WR)
        except OSError:  # the scraper went away or ran past a deadline: nothing to report
            pass
        except Exception:
            self._log.exception("%s: a scrape failed", self.name)
        finally:
            conn.close()
            self._slots.release()

    def _answer(self, head: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        lines = head.decode("latin-1").splitlines()
        parts = lines[0].split() if lines else []
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            return _plain(400, "not an HTTP/1.x request line")
        method, target, _ = parts
        fields: dict[str, str] = {}
        for line in lines[1:]:
            key, sep, value = line.partition(":")
            if sep:
                fields[key.strip().lower()] = value.strip()
        if method not in ("GET", "HEAD"):
            status, headers, body = _plain(405, "only GET /metrics is served here")
            return status, headers + [("Allow", "GET, HEAD")], body
        url = urlsplit(target)
        if url.path not in _PATHS:
            return _plain(404, "only /metrics is served here")
        from prometheus_client.exposition import choose_encoder

        try:
            encoder, content_type = choose_encoder(fields.get("accept", ""))
            registry = self.registry
            names = parse_qs(url.query).get("name[]")
            if names:
                registry = registry.restricted_registry(names)
            body = encoder(registry)
        except Exception:
            self._log.exception("%s: cannot collect the metrics", self.name)
            return _plain(500, "the metrics could not be collected; see the log")
        headers = [("Content-Type", content_type)]
        if "gzip" in (t.split(";")[0].strip() for t in fields.get("accept-encoding", "").split(",")):
            body = gzip.compress(body)
            headers.append(("Content-Encoding", "gzip"))
        if method == "HEAD":
            return 200, headers + [("Content-Length", str(len(body)))], b""
        return 200, headers, body


def _read_head(conn: socket.socket, deadline: float) -> bytes | None:
    """The request line and headers, read by ``deadline`` (monotonic); None when the client closed or the
    deadline passed first; _TooLarge past ``MAX_REQUEST_BYTES``."""
    buf = bytearray()
    while True:
        end = _END_OF_HEADERS.search(buf, max(0, len(buf) - 4096 - 3))
        if end:
            return bytes(buf[:end.start()])
        if len(buf) >= MAX_REQUEST_BYTES:
            raise _TooLarge
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        conn.settimeout(left)  # what is left of the one deadline, not a fresh per-read timeout
        try:
            chunk = conn.recv(4096)
        except socket.timeout:
            return None
        if not chunk:
            return None
        buf += chunk


def _send_all(conn: socket.socket, data: bytes, deadline: float) -> None:
    view, sent = memoryview(data), 0
    while sent < len(data):
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("the scraper did not take the answer in time")
        conn.settimeout(left)
        sent += conn.send(view[sent:])


def _plain(status: int, text: str) -> tuple[int, list[tuple[str, str]], bytes]:
    return status, [("Content-Type", "text/plain; charset=utf-8")], text.encode() + b"\n"


def _response(status: int, headers: list[tuple[str, str]], body: bytes) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS[status]}", *(f"{k}: {v}" for k, v in headers)]
    if not any(k == "Content-Length" for k, _ in headers):
        lines.append(f"Content-Length: {len(body)}")
    lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


_BUSY = _response(503, [("Content-Type", "text/plain; charset=utf-8"), ("Retry-After", "1")],
                  b"busy: too many scrapes at once; ask again\n")


def _refuse(conn: socket.socket) -> None:
    """Past the limit: a 503 if the socket takes it at once (it never blocks), then closed."""
    try:
        conn.setblocking(False)
        conn.send(_BUSY)
    except OSError:
        pass
    finally:
        conn.close()
