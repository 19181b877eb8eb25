"""``ClusterLanes``: how ``ClusterDispatcher`` reaches its hosts: one call, a job, a fan-out.

A mixin of ``ClusterDispatcher`` (``mtc.head.dispatch.cluster.dispatcher``), apart from the dispatcher's operations
(save, inventory, restore, backup, peers) because it is their plumbing: the spec's current
addresses, the aborts queued for hosts that were down, each op's timeout (what a
``HostConnection`` asks its owner: ``client.Owner``), and calls on a lane's connections,
one host at a time, as a polled sidecar job, or on every host at once. It uses the dispatcher's
``spec_path``, ``_addresses``, ``_spec_stamp``, ``_spec_lock``, ``_aborts``, ``_aborts_lock``,
its timeouts, its lanes (``_hosts``, ``_backup_lanes``, ``_peer_lanes``) and their pools.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from mtc.head.dispatch.cluster.client import RemoteFailure, call_each
from mtc.shared import protocol
from mtc.shared.errors import ConfigError, HostUnreachableError, ProtocolError

log = logging.getLogger(__name__)

# Ops whose answer may take as long as moving a host's share of a step.
_DATA_OPS = frozenset({"write", "commit", "read"})
# How long one ``job`` request waits on the daemon for a long operation to end (a long poll).
_JOB_WAIT_S = 5.0
# Requests that carry at most this much to each host are sent from one thread (``_call_each``).
_INLINE_BYTES = 1 << 20


class ClusterLanes:
    """Addresses, aborts, timeouts, calls, jobs and fan-outs of ``ClusterDispatcher`` (a mixin)."""

    # False: every fan-out of _call_each runs on the pool, a thread per host (the way before it;
    # bench/bench_cluster.py times both in one run).
    inline_calls = True

    # --- plumbing --------------------------------------------------------------------------

    def _stamp(self) -> tuple | None:
        try:
            st = os.stat(self.spec_path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def address_of(self, host_id: str) -> str:
        """The host's current address; the spec is re-read when it changed on disk."""
        with self._spec_lock:
            stamp = self._stamp()
            if stamp is not None and stamp != self._spec_stamp:
                try:
                    spec = protocol.ClusterSpec.read(self.spec_path)
                except ConfigError as e:
                    log.warning("cluster spec changed but cannot be read (%s); keeping the old addresses", e)
                else:
                    self._spec_stamp = stamp
                    new = {h.id: h.address for h in spec.hosts}
                    if set(new) != set(self._addresses):
                        log.warning("cluster spec %s now lists hosts %s (was %s); the topology of this "
                                    "manager is fixed: create a new CheckpointManager to use them",
                                    self.spec_path, sorted(new), sorted(self._addresses))
                    for h in self._addresses:
                        if h in new:
                            self._addresses[h] = new[h]
            return self._addresses[host_id]

    def take_aborts(self, host_id: str) -> list[int]:
        with self._aborts_lock:
            return sorted(self._aborts.pop(host_id, set()))

    def add_aborts(self, host_id: str, steps: Sequence[int]) -> None:
        with self._aborts_lock:
            self._aborts.setdefault(host_id, set()).update(steps)

    def timeout_for(self, op: str) -> float:
        if op.startswith("backup_"):
            return self.backup_timeout_s
        if op.startswith("peer_"):
            return self.peer_timeout_s
        return self.timeout_s if op in _DATA_OPS else self.control_timeout_s

    def call(self, host_id: str, op: str, args: dict | None = None, payloads: Sequence[Any] = (),
              alloc: protocol.Alloc | None = None, *, lane: str | None = None) -> protocol.Reply:
        lane = lane or ("backup" if op.startswith("backup_") else "peer" if op.startswith("peer_") else "control")
        lanes = {"control": self._hosts, "backup": self._backup_lanes, "peer": self._peer_lanes}[lane]
        return lanes[host_id].call(op, args, payloads, alloc)

    def _run_job(self, host_id: str, op: str, args: dict, payloads: Sequence[Any] = ()) -> Any:
        """Start the long operation ``op`` on a host as a job, then ask for its end until it is done
        (``mtc.sidecar.jobs``), on the op's own lane, within the op's deadline."""
        lane = "backup" if op.startswith("backup_") else "peer"
        started = self.call(host_id, op, args, payloads, lane=lane).result
        job_id = started.get("job") if isinstance(started, dict) else None
        if not isinstance(job_id, str):
            raise ProtocolError(f"host {host_id}: {op} answered {started!r:.100} instead of a job id")
        deadline_s = self.timeout_for(op)
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
                    raise RemoteFailure(host_id, str(status["error"]), str(status.get("message", "")))
                return status.get("result")

    def _call_each(self, op: str, hosts: Sequence[str] | None = None, args: dict | Callable[[str], dict] | None = None,
                   payloads: Callable[[str], Sequence[Any]] | None = None, *,
                   lane: str | None = None) -> tuple[dict[str, protocol.Reply], dict[str, BaseException]]:
        """``call(h, op, args, payloads)`` on every host at once: (replies, failures) by host, as
        ``fan_out`` gives them. ``args`` and ``payloads`` are the same for every host, or
        functions of the host id.

        Small messages go out from this one thread and the replies are read as they come
        (``client.call_each``): one round trip for all hosts, with no thread woken per
        host. Requests that carry more than ``_INLINE_BYTES`` to some host go on the pool's
        threads instead, so that no host waits for another's bytes."""
        hosts = list(self._hosts) if hosts is None else list(hosts)
        args_of = args if callable(args) else (lambda h, a=args or {}: a)
        lane = lane or ("backup" if op.startswith("backup_") else "peer" if op.startswith("peer_") else "control")
        lanes = {"control": self._hosts, "backup": self._backup_lanes, "peer": self._peer_lanes}[lane]
        threads = not self.inline_calls
        if payloads is not None and len(hosts) > 1 and not threads:
            threads = max(sum(protocol.byte_view(b).nbytes for b in payloads(h)) for h in hosts) > _INLINE_BYTES
        if threads:
            pool = {"control": self._pool, "backup": self._backup_pool, "peer": self._peer_pool}[lane]
            return self.fan_out(lambda h: self.call(h, op, args_of(h), payloads(h) if payloads else (), lane=lane),
                                 hosts, pool=pool)
        return call_each([lanes[h] for h in hosts], op, args_of, payloads)

    def fan_out(self, fn: Callable[[str], Any], hosts: Sequence[str] | None = None, *,
                 pool: ThreadPoolExecutor | None = None) -> tuple[dict[str, Any], dict[str, BaseException]]:
        """Run ``fn(host)`` for every host in parallel: (results, failures) by host."""
        hosts = list(self._hosts) if hosts is None else list(hosts)
        if len(hosts) == 1:
            futures = None
        else:
            futures = {h: (pool or self._pool).submit(fn, h) for h in hosts}
        results: dict[str, Any] = {}
        failures: dict[str, BaseException] = {}
        for h in hosts:
            try:
                results[h] = fn(h) if futures is None else futures[h].result()
            except Exception as e:  # each host's failure is reported, not the first one only
                failures[h] = e
        return results, failures
