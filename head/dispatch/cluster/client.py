"""The cluster mode's socket client: one connection per (host, lane) to a sidecar daemon, and
what its connections are handed.

A ``HostConnection`` connects lazily, checks on every new connection that the daemon is the
host it should be and runs the same versions as the head, sends the aborts queued for that
host (``PendingAborts``) before anything else, then the head's settings once it claimed its
hosts, stamps every request with the head's generation (fencing; ``HeadStamp``), and turns
transport failures into ``HostUnreachableError`` and a daemon's error answers into the error the
daemon raised, typed (``mtc.shared.wire_errors.decode``: one of mtc's, with the host in its
message, else a ``SidecarError`` that keeps the type's name), as the colocated transport does.
It is given its collaborators: where its host listens (``AddressBook``),
how long to wait (``Timeouts``), how to prove it is the job's head (``Credentials``), what it
stamps (``HeadStamp``), the aborts store and the peer tier's address book it fills in.
``HostLanes`` (``mtc.head.dispatch.cluster.lanes``) makes them and owns them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import selectors
import socket
import ssl
import threading
import time
from typing import Any, Callable, Sequence

from mtc.shared import auth, op_table, protocol, requests, tls, version, wire_errors
from mtc.shared.errors import AuthenticationError, ConfigError, HostUnreachableError, MTCError, ProtocolError

log = logging.getLogger(__name__)



@dataclasses.dataclass(frozen=True)
class Timeouts:
    """How long a connection waits, in seconds, by an operation's timeout class (its row of
    ``mtc.shared.op_table``).

    ``data_s`` bounds each wait for a daemon's bytes (not a whole request) in the ``data`` class
    (write, commit, read), ``control_s`` in the ``control`` class (inventory, manifest, version
    check, abort), so that ``latest_step()`` does not hang on a hung host; ``backup_s`` and
    ``peer_s`` bound one backup or peer job from start to end (``HostLanes.run_job``)."""

    data_s: float
    control_s: float
    connect_s: float
    backup_s: float
    peer_s: float

    def for_op(self, op: str) -> float:
        return getattr(self, f"{op_table.spec(op).timeout}_s")


@dataclasses.dataclass(frozen=True)
class Credentials:
    """How a connection proves it is the job's head (``mtc.shared.auth``) and whether it speaks TLS."""

    control_key: bytes
    tls: ssl.SSLContext | None = None  # a client context of mtc.shared.tls (None: clear text)


@dataclasses.dataclass
class HeadStamp:
    """What every connection carries of its head: the versions checked against each daemon's,
    the generation stamped on every request once the head claimed its hosts (sidecars refuse
    changes from an older head), and the settings a new connection sends first from then on."""

    fingerprint: dict
    generation: int | None = None
    settings: dict | None = None


class AddressBook:
    """The hosts' current addresses, from the cluster spec: re-read when the file changed on
    disk, since a restarted daemon may listen on a new port. The set of hosts is fixed."""

    def __init__(self, spec_path: str, addresses: dict[str, str]):
        self.spec_path = spec_path
        self._addresses = dict(addresses)
        self._lock = threading.Lock()
        self._stamp = self._file_stamp()

    def _file_stamp(self) -> tuple | None:
        try:
            st = os.stat(self.spec_path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def of(self, host_id: str) -> str:
        """The host's current address."""
        with self._lock:
            stamp = self._file_stamp()
            if stamp is not None and stamp != self._stamp:
                try:
                    spec = protocol.ClusterSpec.read(self.spec_path)
                except ConfigError as e:
                    log.warning("cluster spec changed but cannot be read (%s); keeping the old addresses", e)
                else:
                    self._stamp = stamp
                    new = {h.id: h.address for h in spec.hosts}
                    if set(new) != set(self._addresses):
                        log.warning("cluster spec %s now lists hosts %s (was %s); the topology of this "
                                    "manager is fixed: create a new CheckpointManager to use them",
                                    self.spec_path, sorted(new), sorted(self._addresses))
                    for h in self._addresses:
                        if h in new:
                            self._addresses[h] = new[h]
            return self._addresses[host_id]


class PendingAborts:
    """Steps to abort on hosts that could not be asked: a host's are sent first on its next new
    connection (after its restart), so that a failed step is never left committed there."""

    def __init__(self) -> None:
        self._steps: dict[str, set[int]] = {}
        self._lock = threading.Lock()

    def take(self, host_id: str) -> list[int]:
        with self._lock:
            return sorted(self._steps.pop(host_id, set()))

    def add(self, host_id: str, steps: Sequence[int]) -> None:
        with self._lock:
            self._steps.setdefault(host_id, set()).update(steps)


class _Answered(Exception):
    """A daemon's error answer on its way out of the transport code (whose handlers take an
    ``OSError`` or ``ProtocolError`` for a lost connection, which some of mtc's types are): the
    connection raises ``error``, typed, once it is out of them."""

    def __init__(self, error: MTCError):
        super().__init__(str(error))
        self.error = error


class HostConnection:
    """One connection to one daemon. Requests on it are serialised by a lock.

    Each host has three: the ``control`` lane (saves, inventories, restores), the ``backup``
    lane, so that an upload stuck on a dead bucket never holds up the next save, and the
    ``peer`` lane (replication, restore pulls), for the same reason. The daemon serves each
    connection on its own thread.

    ``call`` is one request, start to end. Its steps are public too (``connect``, ``send``,
    ``receive``, ``drop``, and the errors ``unreachable`` and ``error_of``), so that
    ``call_each`` can send one request on each of many connections before it reads any answer;
    whoever runs the steps holds ``lock``.
    """

    def __init__(self, host_id: str, lane: str = "control", *, addresses: AddressBook, timeouts: Timeouts,
                 credentials: Credentials, stamp: HeadStamp, aborts: PendingAborts, peer_addresses: dict[str, str]):
        self.id = host_id
        self.addresses = addresses
        self.timeouts = timeouts
        self.credentials = credentials
        self.stamp = stamp
        self.aborts = aborts
        self.peer_addresses = peer_addresses  # host -> its peer service's address: filled from fingerprints
        self.lane = lane
        self.lock = threading.Lock()
        self.sock: socket.socket | None = None
        self.address: str | None = None
        self._next_id = 0

    def call(self, op: str, args: dict | None = None, payloads: Sequence[Any] = (),
             alloc: protocol.Alloc | None = None) -> protocol.Reply:
        """Run ``op``; HostUnreachableError if the daemon cannot be reached, the error the daemon
        raised (typed) if it answers with one. A stale connection (daemon restarted since) is
        retried once."""
        with self.lock:
            for attempt in (0, 1):
                fresh = self.sock is None
                if fresh:
                    self.connect()
                timeout = self.timeouts.for_op(op)
                try:
                    self.sock.settimeout(timeout)
                    reply = self.receive(op, self.send(op, args or {}, payloads), alloc)
                except _Answered as a:
                    self.drop()
                    raise a.error from None
                except (OSError, ProtocolError) as e:
                    self.drop()
                    if fresh or attempt or isinstance(e, TimeoutError):
                        raise self.unreachable(e, timeout) from e
                    continue
                return self._answer(reply)
        raise AssertionError("unreachable")  # pragma: no cover

    def _roundtrip(self, op: str, args: dict, payloads: Sequence[Any], alloc, *, stamp: bool = True) -> protocol.Reply:
        return self.receive(op, self.send(op, args, payloads, stamp=stamp), alloc)

    def send(self, op: str, args: dict, payloads: Sequence[Any], *, stamp: bool = True) -> int:
        """Send one request on the open socket; returns its id. Transport errors are raised as they are."""
        self._next_id += 1
        rid = self._next_id
        if stamp and self.stamp.generation is not None:  # fencing: sidecars refuse changes from an older head
            args = {**args, "gen": self.stamp.generation}
        protocol.send_request(self.sock, protocol.Request(op, rid, args, tuple(payloads)))
        return rid

    def receive(self, op: str, rid: int, alloc) -> protocol.Reply:
        """The reply to request ``rid`` (an error answer is returned, not raised: see ``_answer``).

        Raises ``_Answered`` when the daemon refused this head (its ``error``: the refusal,
        typed), ``ProtocolError`` for a request it could not read or a reply to another, and
        transport errors as they are."""
        reply = protocol.recv_reply(self.sock, alloc=alloc)
        if reply.id is None and reply.error is not None:  # the daemon could not read our frame, or refused us
            if reply.error.type in ("AuthenticationError", "HostUnreachableError"):
                raise _Answered(self.error_of(reply.error))
            raise ProtocolError(f"host {self.id} refused a {op} request: {reply.error.message}")
        if reply.id != rid:
            raise ProtocolError(f"reply id {reply.id} does not match request id {rid} ({op})")
        return reply

    def _answer(self, reply: protocol.Reply) -> protocol.Reply:
        if reply.error is not None:
            raise self.error_of(reply.error)
        return reply

    def error_of(self, error: protocol.RemoteError) -> MTCError:
        """The error the daemon answered with, typed, naming this host."""
        return wire_errors.decode(self.id, error.type, error.message)

    def unreachable(self, e: BaseException, timeout: float) -> HostUnreachableError:
        """The error that a transport failure ``e`` (waiting at most ``timeout`` s) is, naming this host."""
        return HostUnreachableError(f"host {self.id} at {self.address}: {transport_cause(e, timeout)}")

    def connect(self) -> None:
        """Open the socket: authenticate, check the daemon's host and versions, send this host's
        queued aborts, then the head's settings. Raises ``HostUnreachableError`` or the error
        the daemon answered, typed; the socket is dropped then."""
        address = self.addresses.of(self.id)
        self.address = address
        try:
            sock = socket.create_connection(protocol.parse_address(address), timeout=self.timeouts.connect_s)
        except OSError as e:
            raise HostUnreachableError(f"host {self.id} at {address}: {transport_cause(e, self.timeouts.connect_s)}"
                                       ) from e
        # Mutual TLS: the daemon must hold a certificate of the job's CA, and so must we.
        if self.credentials.tls is not None:
            try:
                sock = self.credentials.tls.wrap_socket(sock)
            except OSError as e:
                sock.close()
                raise HostUnreachableError(f"host {self.id} at {address}: "
                                           f"{transport_cause(e, self.timeouts.connect_s)}") from e
        sock.settimeout(self.timeouts.control_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        try:
            self._authenticate()
            reply = self._roundtrip("fingerprint", {}, (), None)
            if reply.error is not None:
                raise _Answered(self.error_of(reply.error))
            fp = reply.result if isinstance(reply.result, dict) else {}
            if fp.get("host") != self.id:
                raise HostUnreachableError(
                    f"host {self.id}: the daemon at {address} answers as host {fp.get('host')!r}; the cluster "
                    f"spec {self.addresses.spec_path} is stale or wrong")
            version.check_fingerprints(self.stamp.fingerprint, {self.id: fp})
            if isinstance(fp.get("peer"), str):  # the address book the head hands to the peer tier
                self.peer_addresses[self.id] = fp["peer"]
            # A save that failed while this host was away may have left its step here.
            for step in self.aborts.take(self.id):
                try:
                    r = self._roundtrip("abort", requests.StepRequest(step=step).to_wire(), (), None)
                except BaseException:
                    self.aborts.add(self.id, [step])
                    raise
                if r.error is not None:
                    self.aborts.add(self.id, [step])
                    raise _Answered(self.error_of(r.error))
                log.info("host %s: aborted step %d left by a failed save", self.id, step)
            if self.stamp.settings is not None:  # a restarted sidecar has none: it follows this head's
                r = self._roundtrip("configure", requests.Configure(settings=self.stamp.settings).to_wire(), (), None)
                if r.error is not None:
                    raise _Answered(self.error_of(r.error))
        except _Answered as a:
            self.drop()
            raise a.error from None
        except (OSError, ProtocolError) as e:
            self.drop()
            raise HostUnreachableError(f"host {self.id} at {address}: "
                                       f"{transport_cause(e, self.timeouts.control_s)}") from e
        except BaseException:
            self.drop()
            raise

    def _authenticate(self) -> None:
        """Prove to the daemon that this is the job's head, and check it holds the job token too
        (``mtc.shared.auth``)."""
        client_nonce = auth.new_nonce()
        try:
            hello = self._roundtrip("hello", {"nonce": client_nonce}, (), None, stamp=False)
        except (OSError, ProtocolError) as e:
            if self.credentials.tls is None and not isinstance(e, TimeoutError):  # a TLS daemon closes on clear text
                raise ProtocolError(f"closed before the hello answer ({e}); if the sidecars serve TLS "
                                    f"(--tls-dir), give the head the job's TLS folder too ({tls.ENV_TLS_DIR} "
                                    "or tls_dir)") from e
            raise
        if hello.error is not None:
            raise _Answered(self.error_of(hello.error))
        server_nonce = hello.result.get("nonce") if isinstance(hello.result, dict) else None
        if not auth.valid_nonce(server_nonce):
            raise ProtocolError(f"host {self.id}: malformed hello answer")
        key = self.credentials.control_key
        done = self._roundtrip("auth", {"proof": auth.proof(key, "client", server_nonce, client_nonce)}, (), None,
                               stamp=False)
        if done.error is not None:
            raise _Answered(self.error_of(done.error))
        got = done.result.get("proof") if isinstance(done.result, dict) else None
        if not auth.check(auth.proof(key, "server", server_nonce, client_nonce), got):
            raise AuthenticationError(f"host {self.id} at {self.address} does not hold this job's token: it is not "
                                      "one of the job's sidecars (a stale cluster spec, or something else on the port)")

    def drop(self) -> None:
        """Close the socket (the next request reconnects); the caller holds ``lock``, unlike ``close``."""
        if self.sock is not None:
            try:
                self.sock.close()
            finally:
                self.sock = None

    def close(self) -> None:
        with self.lock:
            self.drop()


def call_each(conns: Sequence[HostConnection], op: str, args: Callable[[str], dict],
              payloads: Callable[[str], Sequence[Any]] | None = None,
              ) -> tuple[dict[str, protocol.Reply], dict[str, BaseException]]:
    """``conn.call(op, args(id), payloads(id))`` on every connection at once, from this thread.

    Every request is sent first, then the replies are read in the order they come (a selector),
    so that N hosts cost one round trip and N encodes and decodes, not N threads woken in turn.
    The guarantees are those of ``call``: each connection's lock is held, a new connection is
    authenticated, checked and sends its queued aborts first (the missing ones are made in
    parallel, on threads of their own), every request carries the generation,
    each wait is bounded by the op's timeout, and a connection found stale (the daemon restarted
    since) is tried once more through ``call``. For small messages: a payload is sent whole
    before the next host's, and replies are read into fresh buffers. Returns (replies, failures)
    by host id; a failure is a ``HostUnreachableError`` or the error the daemon answered, typed.
    """
    order = sorted(conns, key=lambda c: c.id)
    replies: dict[str, protocol.Reply] = {}
    failures: dict[str, BaseException] = {}
    stale: list[HostConnection] = []
    with contextlib.ExitStack() as held, selectors.DefaultSelector() as sel:
        for c in order:  # in one order everywhere: two of these never deadlock
            held.enter_context(c.lock)
        missing = [c for c in order if c.sock is None]
        fresh = {c.id for c in missing}
        if missing:
            failures.update(_connect_each(missing))

        def failed(c: HostConnection, e: BaseException, timeout: float) -> None:
            c.drop()
            if c.id in fresh or isinstance(e, TimeoutError):
                failures[c.id] = c.unreachable(e, timeout)
            else:
                stale.append(c)

        for c in order:
            if c.id in failures:
                continue
            timeout = c.timeouts.for_op(op)
            try:
                c.sock.settimeout(timeout)
                rid = c.send(op, args(c.id), payloads(c.id) if payloads is not None else ())
            except (OSError, ProtocolError) as e:
                failed(c, e, timeout)
                continue
            sel.register(c.sock, selectors.EVENT_READ, (c, rid, timeout, time.monotonic() + timeout))
        while sel.get_map():
            ready = sel.select(max(0.0, min(k.data[3] for k in sel.get_map().values()) - time.monotonic()))
            if not ready:
                now = time.monotonic()
                for key in [k for k in sel.get_map().values() if k.data[3] <= now]:
                    sel.unregister(key.fileobj)
                    c, _, timeout, _ = key.data
                    failed(c, TimeoutError(), timeout)
                continue
            for key, _ in ready:
                sel.unregister(key.fileobj)
                c, rid, timeout, _ = key.data
                try:
                    reply = c.receive(op, rid, None)
                except _Answered as a:
                    c.drop()
                    failures[c.id] = a.error
                    continue
                except (OSError, ProtocolError) as e:
                    failed(c, e, timeout)
                    continue
                if reply.error is not None:
                    failures[c.id] = c.error_of(reply.error)
                else:
                    replies[c.id] = reply
    for c in stale:  # the locks are released: call() takes its own, reconnects and tries once
        try:
            replies[c.id] = c.call(op, args(c.id), payloads(c.id) if payloads is not None else ())
        except Exception as e:  # each host's failure is reported
            failures[c.id] = e
    return replies, failures


def _connect_each(conns: Sequence[HostConnection]) -> dict[str, BaseException]:
    """Connect each of ``conns`` (their locks held by the caller), in parallel; the failures by host.

    On threads of their own, not a shared pool: the pool's threads may all be waiting for the
    locks the caller holds."""
    failures: dict[str, BaseException] = {}

    def one(c: HostConnection) -> None:
        try:
            c.connect()
        except Exception as e:  # reported per host, like any other failure of the call
            failures[c.id] = e

    if len(conns) == 1:
        one(conns[0])
        return failures
    threads = [threading.Thread(target=one, args=(c,), name=f"mtc-connect-{c.id}", daemon=True) for c in conns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return failures


def read_errors(result: Any) -> list[tuple[int, str, str]]:
    """The per-box errors of a read answer: (index, error type, message)."""
    rows = (result or {}).get("errors", []) if isinstance(result, dict) else []
    out = []
    for e in rows:
        if not (isinstance(e, list) and len(e) == 3 and type(e[0]) is int and isinstance(e[1], str)
                and isinstance(e[2], str)):
            raise ProtocolError(f"malformed read error entry {e!r:.100}")
        out.append((e[0], e[1], e[2]))
    return out


def transport_cause(e: BaseException, timeout: float) -> str:
    if isinstance(e, ssl.SSLError):
        return tls.describe(e)
    if isinstance(e, ConnectionRefusedError):
        return "connection refused (daemon not running?)"
    if isinstance(e, TimeoutError):
        return f"no answer within {timeout:.0f}s (daemon hung or overloaded?)"
    if isinstance(e, (ConnectionResetError, BrokenPipeError)):
        return "connection lost (daemon killed or restarted?)"
    if isinstance(e, ProtocolError):
        return f"connection lost or garbled ({e})"
    return f"{type(e).__name__}: {e}"
