"""``HostLanes``: the head's connections to its hosts, and the calls over them.

Each host has three connections (``client.HostConnection``), one per lane: ``control``
(saves, inventories, restores), ``backup`` and ``peer``, so that an upload stuck on a dead
bucket or a slow peer pull never holds up the next save; each lane fans out on a thread pool of
its own for the same reason. ``HostLanes`` makes the connections and the state they share and
that it owns (the aborts store, the peer tier's address book), and runs the calls on them: one
host, a polled sidecar job, or every host at once. ``ClusterDispatcher``
(``mtc.head.dispatch.cluster.dispatcher``) builds it and hands it its hosts, their addresses,
the timeouts, the credentials and the head's stamp.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from mtc.head.dispatch.cluster.client import (
    AddressBook,
    Credentials,
    HeadStamp,
    HostConnection,
    PendingAborts,
    Timeouts,
    call_each,
)
from mtc.shared import op_table, protocol, wire_errors
from mtc.shared.errors import HostUnreachableError, ProtocolError

LANES = op_table.LANES
# How long one ``job`` request waits on the daemon for a long operation to end (a long poll).
_JOB_WAIT_S = 5.0
# Requests that carry at most this much to each host are sent from one thread (``call_each``).
_INLINE_BYTES = 1 << 20


def lane_of(op: str) -> str:
    """The lane an op goes on unless told otherwise: its row's in ``mtc.shared.op_table``."""
    return op_table.spec(op).lane


class HostLanes:
    """Connections to every host, one per lane, with a thread pool per lane; closed by ``close``.

    Attributes:
        hosts: the host ids, in the topology's order (the default of every fan-out).
        stamp: what every connection carries of the head (versions, generation, settings).
        timeouts: the waits of every connection, and each job's deadline.
        aborts: steps queued for hosts that could not be asked; sent first when they reconnect.
        peer_addresses: host -> its peer service's address, as its daemon's fingerprint gave it.
    """

    def __init__(self, hosts: Sequence[str], addresses: AddressBook, timeouts: Timeouts, credentials: Credentials,
                 stamp: HeadStamp):
        self.hosts = list(hosts)
        self.stamp = stamp
        self.timeouts = timeouts
        self.aborts = PendingAborts()
        self.peer_addresses: dict[str, str] = {}
        self._lanes = {lane: {h: HostConnection(h, lane, addresses=addresses, timeouts=timeouts,
                                                credentials=credentials, stamp=stamp, aborts=self.aborts,
                                                peer_addresses=self.peer_addresses)
                              for h in self.hosts}
                       for lane in LANES}
        workers = max(1, min(64, len(self.hosts)))
        self._pools = {lane: ThreadPoolExecutor(max_workers=workers, thread_name_prefix=prefix)
                       for lane, prefix in (("control", "mtc-cluster"), ("backup", "mtc-cluster-backup"),
                                            ("peer", "mtc-cluster-peer"))}

    def call(self, host_id: str, op: str, args: dict | None = None, payloads: Sequence[Any] = (),
             alloc: protocol.Alloc | None = None, *, lane: str | None = None) -> protocol.Reply:
        """``op`` on one host, on ``lane`` (default: the op's own, ``lane_of``)."""
        return self._lanes[lane or lane_of(op)][host_id].call(op, args, payloads, alloc)

    def run_job(self, host_id: str, op: str, args: dict, payloads: Sequence[Any] = ()) -> Any:
        """Start the long operation ``op`` on a host as a job, then ask for its end until it is done
        (``mtc.sidecar.jobs``), on the op's own lane, within the op's deadline."""
        lane = lane_of(op)
        started = self.call(host_id, op, args, payloads, lane=lane).result
        job_id = started.get("job") if isinstance(started, dict) else None
        if not isinstance(job_id, str):
            raise ProtocolError(f"host {host_id}: {op} answered {started!r:.100} instead of a job id")
        deadline_s = self.timeouts.for_op(op)
        deadline = time.monotonic() + deadline_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise HostUnreachableError(f"host {host_id}: {op} did not finish within {deadline_s:.0f} s")
            status = self.call(host_id, "job", {"job": job_id, "wait_s": min(_JOB_WAIT_S, left)}, lane=lane).result
            if not isinstance(status, dict) or not isinstance(status.get("done"), bool):
                raise ProtocolError(f"host {host_id}: malformed job status {status!r:.100}")
            if status["done"]:
                if "error" in status:
                    raise wire_errors.decode(host_id, str(status["error"]), str(status.get("message", "")))
                return status.get("result")

    def call_each(self, op: str, hosts: Sequence[str] | None = None, args: dict | Callable[[str], dict] | None = None,
                  payloads: Callable[[str], Sequence[Any]] | None = None, *,
                  lane: str | None = None) -> tuple[dict[str, protocol.Reply], dict[str, BaseException]]:
        """``call(h, op, args, payloads)`` on every host at once: (replies, failures) by host, as
        ``fan_out`` gives them. ``args`` and ``payloads`` are the same for every host, or
        functions of the host id.

        Small messages go out from this one thread and the replies are read as they come
        (``client.call_each``): one round trip for all hosts, with no thread woken per
        host. Requests that carry more than ``_INLINE_BYTES`` to some host go on the lane's
        pool instead, so that no host waits for another's bytes."""
        hosts = self.hosts if hosts is None else list(hosts)
        args_of = args if callable(args) else (lambda h, a=args or {}: a)
        lane = lane or lane_of(op)
        if payloads is not None and len(hosts) > 1 and max(
                sum(protocol.payload_nbytes(b) for b in payloads(h)) for h in hosts) > _INLINE_BYTES:
            return self.fan_out(lambda h: self.call(h, op, args_of(h), payloads(h) if payloads else (), lane=lane),
                                hosts, lane=lane)
        return call_each([self._lanes[lane][h] for h in hosts], op, args_of, payloads)

    def fan_out(self, fn: Callable[[str], Any], hosts: Sequence[str] | None = None, *, lane: str = "control",
                pool: ThreadPoolExecutor | None = None) -> tuple[dict[str, Any], dict[str, BaseException]]:
        """Run ``fn(host)`` for every host in parallel, on ``pool`` or else the lane's: (results,
        failures) by host."""
        hosts = self.hosts if hosts is None else list(hosts)
        if len(hosts) == 1:
            futures = None
        else:
            futures = {h: (pool or self._pools[lane]).submit(fn, h) for h in hosts}
        results: dict[str, Any] = {}
        failures: dict[str, BaseException] = {}
        for h in hosts:
            try:
                results[h] = fn(h) if futures is None else futures[h].result()
            except Exception as e:  # each host's failure is reported, not the first one only
                failures[h] = e
        return results, failures

    def abort_later(self, host_id: str, steps: Sequence[int]) -> None:
        """Queue ``steps`` for the host and drop its control connection: the next call reconnects
        and aborts them first."""
        self.aborts.add(host_id, steps)
        self._lanes["control"][host_id].close()

    def close(self) -> None:
        for conns in self._lanes.values():
            for c in conns.values():
                c.close()
        for pool in self._pools.values():
            pool.shutdown(wait=True)
