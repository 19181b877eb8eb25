"""The sidecar daemon: one host's ``SidecarService`` served over a TCP control socket.

This is the cluster mode (docs/architecture.md, "The seam"): each worker host is a process
(``python -m mtc.sidecar serve ...``) with its own ramdisk, and the head talks to it with the
frames of ``mtc.shared.protocol``. One thread per connection (``mtc.sidecar.tcpserver``); requests
on one connection are answered in order.

The operations, their arguments and their checks are the table in ``mtc.sidecar.ops`` (and
docs/architecture.md, "The seam", one row each). Long ones (``LONG_OPS``) answer ``{"job": id}`` at
once; ``job`` reports their end (``mtc.sidecar.jobs``, as in colocated mode).

Errors come back as ``{"type": class name, "message"}``; the head re-raises them typed.

A ``write``'s payloads are received straight into mapped temp blob files (``Landings.land`` of the store)
and published where they lie: one copy on this host (``_receive_buffers``).

Every control op is served from the table of operations (``mtc.sidecar.ops``), as in colocated
mode; the two data ops (``write``, ``read``) are this transport's own (``_answer``): their shards
travel as payloads, one per shard each way, some of a read's sent straight from a blob's map.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from mtc.shared import auth, protocol, requests, tls, wire_errors
from mtc.shared.auth import resolve_token
from mtc.shared.config import ENV_TOKEN
from mtc.shared.errors import AuthenticationError, ConfigError, MTCError, ProtocolError
from mtc.shared.lifeline import die_with_parent
from mtc.shared.protocol import RemoteError, Reply, Request
from mtc.sidecar import ops
from mtc.sidecar.metrics import serve_metrics
from mtc.sidecar.reads import BlobStream
from mtc.sidecar.service import SidecarService
from mtc.sidecar.tcpserver import ServerStopping, ThreadedTCPServer

log = logging.getLogger(__name__)

_SHUTDOWN_GRACE_S = 30.0


class SidecarDaemon(ThreadedTCPServer):
    """Serve ``service`` on a TCP socket. ``start()`` binds and listens; ``close()`` stops.

    Usable as a context manager. ``close()`` lets requests in flight finish (up to 30 s),
    then closes the connections and the service. With ``tls_files`` (``mtc.shared.tls``) the
    control port serves over mutual TLS only.
    """

    def __init__(self, service: SidecarService, token: str, *, listen: tuple[str, int] = ("127.0.0.1", 0),
                 max_payload: int = protocol.MAX_PAYLOAD_BYTES, max_connections: int = 64,
                 tls_files: tls.TLSFiles | None = None):
        if not token:
            raise ConfigError(f"the control port of host {service.host_id} needs the job token: set {ENV_TOKEN} "
                              "(the same secret the head and every sidecar of the job have)")
        super().__init__(listen, host_id=service.host_id, kind="control", max_connections=max_connections,
                         tls=None if tls_files is None else tls.server_context(tls_files))
        self.service = service
        self._key = auth.control_key(token)
        self._max_payload = max_payload
        self.auth_failures = 0

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> str:
        """Bind, listen and start accepting; returns the bound address ``host:port``."""
        self._start_accepting()
        log.info("host %s: listening on %s", self.service.host_id, self.address)
        return self.address

    @property
    def address(self) -> str:
        host, port = self.bound_address
        return f"{host}:{port}"

    def close(self) -> None:
        """Refuse new requests, let those in flight finish, close the connections and the service."""
        if self._stop(drain_s=_SHUTDOWN_GRACE_S):
            self.service.close()
            log.info("host %s: daemon stopped", self.service.host_id)

    def __enter__(self) -> "SidecarDaemon":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- connections -----------------------------------------------------------------------

    def _handshake(self, conn: socket.socket, peer: Any) -> bool:
        """The control plane's challenge-response (``mtc.shared.auth``); False: close the connection."""
        server_nonce = auth.new_nonce()
        try:
            for step in ("hello", "auth"):
                req = protocol.recv_request(conn, max_payload=0, max_header=auth.PRE_AUTH_HEADER_BYTES)
                if req is None:
                    return False
                if req.op == "ping" and step == "hello":  # liveness needs no token and changes nothing
                    self._try_send(conn, Reply(req.id, self.service.ping()))
                    return False
                if req.op != step:
                    raise ProtocolError(f"expected {step!r} before anything else on a control connection, got "
                                        f"{req.op!r}: the head must authenticate with the job token")
                if step == "hello":
                    client_nonce = req.args.get("nonce")
                    if not auth.valid_nonce(client_nonce):
                        raise ProtocolError("hello needs 'nonce': 32 hex digits")
                    reply = {"nonce": server_nonce, "host": self.service.host_id}
                else:
                    if not auth.check(auth.proof(self._key, "client", server_nonce, client_nonce),
                                      req.args.get("proof")):
                        raise AuthenticationError(f"host {self.service.host_id}: the control request is not from this "
                                          f"job's head (wrong or missing job token {ENV_TOKEN}); refused")
                    reply = {"proof": auth.proof(self._key, "server", server_nonce, client_nonce)}
                if not self._try_send(conn, Reply(req.id, reply)):
                    return False
        except (ProtocolError, AuthenticationError) as e:
            self.auth_failures += 1
            log.warning("host %s: refused a control connection from %s: %s", self.service.host_id, peer, e)
            kind = type(e).__name__
            self._try_send(conn, Reply(None, error=RemoteError(kind, str(e))))
            return False
        except TimeoutError:
            return False
        if not self._authenticated(conn):
            self._try_send(conn, Reply(None, error=RemoteError(
                "HostUnreachableError", f"host {self.service.host_id} is busy: too many control connections")))
            return False
        return True

    def _serve_conn(self, conn: socket.socket, peer: Any) -> None:
        if not self._handshake(conn, peer):
            return
        while True:
            batches: list = []
            try:
                frame = protocol.recv_frame(conn, max_payload=self._max_payload,
                                            alloc=lambda h, sizes: self._receive_buffers(h, sizes, batches))
                req = None if frame is None else Request.from_frame(*frame)
            except ProtocolError as e:
                log.warning("host %s: bad frame from %s, closing the connection: %s", self.service.host_id, peer, e)
                self._close_batches(batches)
                self._try_send(conn, Reply(None, error=RemoteError("ProtocolError", str(e))))
                return
            except BaseException:
                self._close_batches(batches)
                raise
            if req is None:
                return
            try:
                with self.admit():  # counted until its reply is sent: close() waits for the reply too
                    try:
                        reply = self._handle(req)
                    finally:
                        self._close_batches(batches)
                    if not self._send(conn, reply):
                        return
            except ServerStopping as e:
                self._close_batches(batches)
                if not self._try_send(conn, Reply(req.id, error=RemoteError("HostUnreachableError", str(e)))):
                    return

    @staticmethod
    def _close_batches(batches: list) -> None:
        """Drop the landings a write did not publish (it failed, or was refused)."""
        for batch in batches:
            batch.close()
        batches.clear()

    def _send(self, conn: socket.socket, reply: Reply) -> bool:
        """Send ``reply``; a read's streamed blobs go from maps of their files, kept (and pinned) until
        then. False: the connection is gone."""
        streams = [p for p in reply.payloads if isinstance(p, BlobStream)]
        if streams:
            reply = dataclasses.replace(reply, payloads=tuple(
                p.payload if isinstance(p, BlobStream) else p for p in reply.payloads))
        try:
            return self._try_send(conn, reply)
        finally:
            for st in streams:
                st.close()

    def _receive_buffers(self, header: dict, sizes: list[int], batches: list) -> list:
        """Where a request's payloads are received: a write's shards straight into mapped temp blob
        files (the store's ``Landings.land``), which ``write_shards`` hashes and publishes in place, so a
        shard is copied once on this host; anything else into fresh buffers."""
        if header.get("op") != "write" or not sizes:
            return [protocol.aligned_buffer(n) for n in sizes]
        # A new file on 4 KiB pages is received with pwrite (a cold landing's sink), not through its map.
        batch = self.service.store.landings.land(sizes, cold_ok=not self.service.store.huge_pages)
        batches.append(batch)
        return [protocol.aligned_buffer(n) if r is None else r for r, n in zip(batch.receivers(), sizes)]

    def _try_send(self, conn: socket.socket, reply: Reply) -> bool:
        try:
            try:
                protocol.send_reply(conn, reply)
            except ProtocolError as e:  # a result that is not plain JSON: say so instead
                log.error("host %s: cannot send a reply: %s", self.service.host_id, e)
                protocol.send_reply(conn, Reply(reply.id, error=RemoteError("ProtocolError", str(e))))
            return True
        except OSError:
            return False

    # --- requests --------------------------------------------------------------------------

    def _handle(self, req: Request) -> Reply:
        t0 = time.perf_counter()
        try:
            result, payloads = _answer(self.service, req.op, req.args, req.payloads)
            log.debug("op %s done in %.3fs", req.op, time.perf_counter() - t0)
            return Reply(req.id, result, None, tuple(payloads))
        except Exception as e:  # reported to the head, which raises it typed (``wire_errors``)
            if isinstance(e, MTCError):
                log.warning("host %s: %s failed: %s: %s", self.service.host_id, req.op, type(e).__name__, e)
            else:
                log.exception("host %s: %s failed", self.service.host_id, req.op)
            return Reply(req.id, error=RemoteError(*wire_errors.encode(e, self.service.host_id)))


def _answer(service: SidecarService, op: str, args: dict, payloads: Sequence) -> tuple[Any, list]:
    """Answer one request of the daemon's head on ``service``: (result, payloads). A control
    operation is the table's (``ops.serve``); a data operation's shards are this request's payloads."""
    data = _DATA.get(op)
    if data is None:
        return ops.serve(service, op, args, payloads, "cluster")
    return data(service, ops.data_header(service, op, args, len(payloads), "cluster"), payloads)


def _write(service: SidecarService, header: requests.Write, payloads: Sequence) -> tuple[Any, list]:
    """One payload per shard in; the summary and the host's part manifest out."""
    shards = [(header.arrays[row.array].index, requests.box(row.box), np.asarray(data).reshape(-1))
              for row, data in zip(header.shards, payloads)]
    manifest = ops.method_of(service, "write")(header.step, shards, part=header.part)
    summary = {"step": header.step, "host": manifest.host, "shards": len(manifest.shards),
               "blobs": len(manifest.blob_names()), "written_bytes": manifest.written_bytes,
               "seconds": manifest.seconds}
    return summary, [manifest.to_json()]


def _read(service: SidecarService, header: tuple, payloads: Sequence) -> tuple[Any, list]:
    """The raw bytes of each box out, one payload each; ``streamed``: those sent from a blob's map."""
    step, boxes, manifest, stream, keepers = header
    out, errors = ops.method_of(service, "read")(step, boxes, manifest=manifest, stream=stream, keepers=keepers)
    streamed = [i for i, p in enumerate(out) if isinstance(p, BlobStream)]
    # The blob each stream is (the head hashes the bytes against it: one planned from the header alone
    # knows no blob names; this host's part, checked against the manifest's digest, names them).
    blobs = [out[i].blob for i in streamed]
    return {"step": step, "errors": [list(e) for e in errors], "streamed": streamed, "blobs": blobs}, out


# The table's data operations (``ops.DATA_OPS``), as the daemon serves them.
_DATA = {"write": _write, "read": _read}
if set(_DATA) != ops.DATA_OPS:
    raise ImportError(f"the daemon serves the data operations {sorted(_DATA)}, the table has {sorted(ops.DATA_OPS)}")


# --- command line --------------------------------------------------------------------------


def _write_ready(path: Path, doc: dict) -> None:
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def serve(args: argparse.Namespace) -> int:
    """Run the daemon until SIGTERM or SIGINT; returns the exit code."""
    if args.parent_pid:
        die_with_parent(args.parent_pid, "this daemon")
    os.umask(0o077)  # least privilege: what the daemon writes (ramdisk, logs, address files) is its own
    host, port = protocol.parse_address(args.listen)
    handlers: list[logging.Handler] = [logging.FileHandler(args.log_file) if args.log_file
                                       else logging.StreamHandler(sys.stderr)]
    logging.basicConfig(level=logging.INFO, handlers=handlers, force=True,
                        format=f"%(asctime)s %(levelname)s {args.host_id} %(name)s: %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        token = resolve_token(Path(args.peer_token_file).read_text() if args.peer_token_file else None)
        tls_files = tls.resolve(args.tls_dir)
    except (OSError, ConfigError) as e:
        print(f"mtc sidecar: {e}", file=sys.stderr)
        return 2
    if not token:
        print(f"mtc sidecar: no job token: set {ENV_TOKEN} (or --peer-token-file) to the secret the head and every "
              "sidecar of the job share; the daemon serves no request without it", file=sys.stderr)
        return 2
    root = Path(args.root) / "mtc"  # the ramdisk may be shared with other tools
    service = SidecarService(root, host_id=args.host_id, awaits_head=True)  # settings: the head's configure
    daemon = SidecarDaemon(service, token, listen=(host, port), max_payload=args.max_payload, tls_files=tls_files)
    metrics = None
    try:
        service.start_peer_service(protocol.parse_address(args.peer_listen), token, advertise=args.peer_advertise,
                                   tls=tls_files)
        if args.metrics_port:  # where the control port listens unless --metrics-host says otherwise
            metrics = serve_metrics(args.metrics_port, service,
                                    host if args.metrics_host is None else args.metrics_host)
        address = daemon.start()
        steps = service.store.catalog.committed()
        log.info("host %s: serving %s (pid %d); committed steps found: %s", args.host_id, root, os.getpid(), steps)
        if args.ready_file:
            _write_ready(Path(args.ready_file), {"host": args.host_id, "address": address, "pid": os.getpid(),
                                                 "peer": service.peer_address})
        while not stop.wait(1.0):
            pass
        log.info("host %s: signal received, shutting down", args.host_id)
    except ConfigError as e:  # a port taken, an address not of this host: one line, as for the options
        print(f"mtc sidecar: {e}", file=sys.stderr)
        return 2
    finally:
        if metrics is not None:
            metrics.close()
        daemon.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mtc.sidecar", description="mtc sidecar daemon")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve one host's sidecar service on a control socket")
    s.add_argument("--root", required=True, help="the host's ramdisk (local_checkpoint_directory); "
                                                 "mtc keeps its files in ROOT/mtc")
    s.add_argument("--host-id", required=True, type=protocol.check_host_id, help="this host's id, e.g. s0-h1")
    s.add_argument("--listen", default="127.0.0.1:0", help="control address host:port (port 0: any free port)")
    s.add_argument("--ready-file", help="write {host, address, pid} here (atomically) once listening")
    s.add_argument("--log-file", help="log here instead of stderr")
    s.add_argument("--max-payload", type=int, default=protocol.MAX_PAYLOAD_BYTES,
                   help="largest payload of one request, in bytes")
    s.add_argument("--metrics-port", type=int, default=0,
                   help="serve Prometheus metrics (clear text) at http://HOST:PORT/metrics (default 0: off)")
    s.add_argument("--metrics-host", help="the address the metrics bind (default: the --listen host; 0.0.0.0: every "
                                          "interface, for a scraper on another machine)")
    s.add_argument("--parent-pid", type=int, help="exit (SIGKILL) when this process, our parent, dies")
    s.add_argument("--peer-listen", default="127.0.0.1:0",
                   help="peer service address host:port (port 0: any free port); the peer token comes from "
                        f"{ENV_TOKEN} or --peer-token-file, never from the command line")
    s.add_argument("--peer-token-file", help="read the peer token from this file")
    s.add_argument("--peer-advertise", help="host name or IP the other sidecars use to reach the peer service "
                                            "(default: the --peer-listen host)")
    s.add_argument("--tls-dir", help=f"serve the control and peer ports over mutual TLS with this folder's ca.crt, "
                                     f"tls.crt and tls.key (default: {tls.ENV_TLS_DIR}; unset: clear text)")
    s.set_defaults(func=serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
