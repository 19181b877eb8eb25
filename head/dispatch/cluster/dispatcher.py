"""Cluster dispatch (the seam's second transport): sidecar daemons reached over local sockets.

``MTCConfig(cluster_spec=PATH)`` (or ``MTC_CLUSTER_SPEC`` through ``MTCConfig.from_env``)
selects it. The head's devices are mapped to the daemons by ``Topology.from_spec``; each host
gets only the shards of its own devices, and every fan-out (phase 1, phase 2, inventories,
restore reads) runs on all hosts in parallel.

Failures: a save in which any host fails phase 1 or phase 2 raises ``SaveError`` whose
``.hosts`` names each failed host and why. The manager then aborts the step (``abort``, once):
at once on every host the head can reach, and remembered for the others: when the head next
connects to such a host (after its restart), the abort is sent before anything else. So a
failed step is never left committed, where it would count towards ``local_max_to_keep`` and
could push the last good step out. A host that cannot be reached is reported in
``inventories()`` with no steps and an ``"error"``, so ``latest_step()`` confirms nothing while it is down
(it raises ``StepsUnconfirmedError`` rather than answer None when nothing else is confirmed).

Connections are kept open and re-made on failure (re-reading the spec, since a restarted
daemon may listen on a new port). Every new connection checks the host id and the version
fingerprint before it is used. The dispatcher owns the connections through a ``HostLanes``
(``mtc.head.dispatch.cluster.lanes``: the connections per host and lane and the calls over
them) that it builds, and runs the restore reads through a ``ClusterLoader``
(``mtc.head.dispatch.cluster.reads``) handed those lanes and the topology.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from mtc.head.commit import commit_messages
from mtc.head.dispatch.cluster.client import AddressBook, Credentials, HeadStamp, Timeouts
from mtc.head.dispatch.cluster.lanes import HostLanes
from mtc.head.dispatch.cluster.reads import ClusterLoader
from mtc.head.dispatch.interface import (
    Dispatcher,
    Leaf,
    LoadRequest,
    WriteResult,
    host_failure,
    raise_host_failures,
    save_error,
    wire,
)
from mtc.head.dispatch.staging import HostStaging
from mtc.head.dispatch.topology import Topology
from mtc.shared import format as fmt
from mtc.shared import auth, protocol, requests, tls, version
from mtc.shared.config import ENV_TOKEN, MTCConfig
from mtc.shared.host_settings import HostSettings
from mtc.shared.errors import (
    ConfigError,
    HostUnreachableError,
    ManifestError,
    ProtocolError,
    SaveError,
)

log = logging.getLogger(__name__)

__all__ = ["ClusterDispatcher"]

Box = fmt.Box


@dataclasses.dataclass
class _Staged:
    """What ``write`` sends: per host, its unique (leaf index, box, buffer) shards; per leaf index,
    its row of the write's ``arrays`` (its shape, and whether it travels as its bytes)."""

    shards: dict[str, list[tuple[int, Box, np.ndarray]]]
    nbytes: int
    arrays: dict[int, dict] = dataclasses.field(default_factory=dict)


class ClusterDispatcher(Dispatcher):
    """Reach sidecar daemons over TCP, as described by the cluster spec of ``config``.

    ``devices`` are the head devices mapped onto the hosts (default ``jax.devices()``).
    ``timeout_s`` bounds each wait for a daemon's bytes (not a whole request) in the data ops
    (write, commit, read); ``control_timeout_s`` in the others (inventory, manifest, version
    check, abort), so that ``latest_step()`` does not hang on a hung host. The long operations
    (uploads, downloads, peer pulls) run as sidecar jobs on their own connections
    (``HostLanes.run_job``); ``backup_timeout_s`` and ``peer_timeout_s`` bound one such job from
    start to end: a backup may wait out a bucket outage (the sidecar retries with backoff).

    Attributes:
        topology: the hosts, their slices and devices (``Topology.from_spec``).
        lanes: the connections to the hosts and the calls over them (``HostLanes``).
    """

    def __init__(self, config: MTCConfig, devices: Sequence[Any] | None = None, *,
                 timeout_s: float = 300.0, control_timeout_s: float = 20.0, connect_timeout_s: float = 10.0,
                 backup_timeout_s: float = 3600.0, peer_timeout_s: float = 3600.0):
        spec = config.cluster_spec
        if not spec:
            raise ConfigError("ClusterDispatcher needs cluster_spec (or MTC_CLUSTER_SPEC with "
                              "MTCConfig.from_env): the path of the spec LocalCluster wrote")
        spec_path = os.fspath(spec)
        # Hosts that keep each step's whole manifest (on distinct slices; the others commit its digest), and
        # the settings every sidecar follows: sent with the claim, and first on each new connection.
        super().__init__(keepers=max(2, int(config.replication_factor)),
                         host_settings=HostSettings.from_config(config).to_wire())
        self.topology = Topology.from_spec(spec_path, list(devices if devices is not None else jax.devices()))
        token = auth.resolve_token(config.peer_token)
        if not token:
            raise ConfigError(f"cluster mode needs the job token: set {ENV_TOKEN} (or peer_token) in the head's "
                              "environment to the secret the sidecars were started with; the sidecars refuse "
                              "every control request without it")
        self.lanes = HostLanes(
            self.topology.host_ids,
            AddressBook(spec_path, {h.id: h.address for h in self.topology.hosts}),
            Timeouts(data_s=float(timeout_s), control_s=float(control_timeout_s), connect_s=float(connect_timeout_s),
                     backup_s=float(backup_timeout_s), peer_s=float(peer_timeout_s)),
            Credentials(auth.control_key(token), tls.client_context_for(config.tls_dir)),
            HeadStamp(version.fingerprint()))
        self._unreached: dict[int, set[str]] = {}  # step -> hosts its failed save could not reach
        self._unreached_lock = threading.Lock()  # _save_error writes it, abort() (the manager's next call) reads it
        self._staging = HostStaging()
        self._loader = ClusterLoader(self.lanes, self.topology)
        self._closed = False

    @property
    def generation(self) -> int | None:
        """The head's generation once it claimed its hosts: every request carries it (fencing)."""
        return self.lanes.stamp.generation

    @generation.setter
    def generation(self, value: int | None) -> None:
        self.lanes.stamp.generation = value

    # --- Dispatcher: identity --------------------------------------------------------------

    def hosts(self) -> list[str]:
        return self.topology.host_ids

    # --- save ------------------------------------------------------------------------------

    def stage(self, leaves: list[Leaf]) -> _Staged:
        hosts = self.topology.host_ids
        shards: dict[str, list[tuple[int, Box, np.ndarray]]] = {h: [] for h in hosts}
        seen: dict[str, set[tuple[int, Box]]] = {h: set() for h in hosts}
        to_copy: list[tuple[np.ndarray, np.ndarray]] = []
        arrays: dict[int, dict] = {}
        nbytes = 0
        for leaf in leaves:
            if leaf.kind == "scalar":
                continue
            arrays[leaf.index] = ({"index": leaf.index, "shape": list(leaf.shape), "as_bytes": True}
                                  if leaf.kind == "numpy" else {"index": leaf.index, "shape": list(leaf.value.shape)})
            if leaf.kind == "numpy":
                # Host data: every host keeps a copy (it is small, and then any host can restore it).
                src = np.asarray(leaf.value)
                buf = self._staging.buffer((leaf.key, "numpy"), src.shape, src.dtype)
                to_copy.append((buf, src))
                box = tuple((0, n) for n in leaf.shape)
                for h in hosts:
                    shards[h].append((leaf.index, box, buf))
                nbytes += buf.nbytes
                continue
            copies: dict[Box, np.ndarray] = {}
            for shard in leaf.value.addressable_shards:
                dev_id = int(shard.device.id)
                host = self.topology.host_of(dev_id)
                box = leaf.device_boxes[dev_id]
                buf = copies.get(box)
                if buf is None:
                    # Copy each unique shard once into a reused, aligned host buffer, so a train
                    # step that donates its inputs cannot touch what is being written.
                    src = np.asarray(shard.data)
                    buf = self._staging.buffer((leaf.key, box), src.shape, src.dtype)
                    to_copy.append((buf, src))
                    copies[box] = buf
                    nbytes += buf.nbytes
                if (leaf.index, box) not in seen[host]:
                    seen[host].add((leaf.index, box))
                    shards[host].append((leaf.index, box, buf))
        self._staging.copy_all(to_copy)  # on several threads
        self._staging.end()
        return _Staged(shards, nbytes, arrays)

    def write(self, step: int, staged: _Staged) -> WriteResult:
        def args(h: str) -> dict:
            # The header of a write in both modes (docs/architecture.md, "The seam"), with one
            # [position in "arrays", box] per payload.
            at: dict[int, int] = {}
            for a, _, _ in staged.shards[h]:
                at.setdefault(a, len(at))
            return {"step": step, "part": 0, "arrays": [staged.arrays[a] for a in at],
                    "shards": [[at[a], [list(p) for p in box]] for a, box, _ in staged.shards[h]]}

        def one(h: str, reply: protocol.Reply) -> tuple[dict, bytes]:
            items = staged.shards[h]
            if len(reply.payloads) != 1:
                raise ProtocolError(f"host {h}: write answered {len(reply.payloads)} payloads, expected 1")
            # The host's part of the manifest is forwarded, not parsed (that would cost the head
            # O(shards) per save); its summary must match what was sent.
            info = reply.result if isinstance(reply.result, dict) else {}
            if info.get("step") != step or info.get("host") != h or info.get("shards") != len(items):
                raise ManifestError(f"host {h}: phase 1 answer for step {step} does not match what was sent "
                                    f"(step {info.get('step')}, host {info.get('host')}, {info.get('shards')} "
                                    f"shards for {len(items)} sent)")
            return info, bytes(reply.payloads[0])

        replies, failures = self.lanes.call_each("write", None, args, lambda h: [buf for _, _, buf in staged.shards[h]])
        results: dict[str, tuple[dict, bytes]] = {}
        for h, reply in replies.items():
            try:
                results[h] = one(h, reply)
            except Exception as e:  # a bad answer fails this host, like any other failure
                failures[h] = e
        if failures:
            raise self._save_error(step, "phase 1 (writing shards)", failures)
        info = {h: {"written_bytes": r.get("written_bytes", 0), "blobs": r.get("blobs", 0),
                    "write_s": r.get("seconds", 0.0), "devices": list(self.topology.host(h).devices)}
                for h, (r, _) in results.items()}
        return WriteResult([(h, results[h][1]) for h in self.topology.host_ids], info)

    def commit(self, step: int, manifest: bytes | protocol.Gathered, digest: str, keepers: list[str]
               ) -> dict[str, dict]:
        """Phase 2: the whole manifest to the keepers only; the decision (digest, keepers) to the others."""
        keep, where = commit_messages(self.topology.host_ids, keepers, dict(self.lanes.peer_addresses))
        args = wire("commit", requests.Commit(step=step, digest=digest))
        decision = wire("commit", requests.Commit(step=step, digest=digest, keepers=where))
        replies, failures = self.lanes.call_each("commit", None, lambda h: args if h in keep else decision,
                                                 lambda h: [manifest] if h in keep else [])
        results = {h: r.result for h, r in replies.items()}
        if failures:
            raise self._save_error(step, "phase 2 (commit)", failures)
        return results

    def abort(self, step: int) -> None:
        """Forget ``step`` everywhere: now on the hosts that answer, on reconnect on the others
        (those the failed save could not reach are not asked now: their abort waits for them)."""
        with self._unreached_lock:
            away = self._unreached.pop(step, set())
        for h in away:
            self.lanes.abort_later(h, [step])
        _, failures = self.lanes.call_each("abort", [h for h in self.topology.host_ids if h not in away],
                                           wire("abort", requests.StepRequest(step=step)))
        for h, e in failures.items():
            log.warning("could not abort step %d on host %s now (%s); will on reconnect", step, h, host_failure(e))
            self.lanes.abort_later(h, [step])

    def _each(self, op: str, args: dict | None = None, *, hosts: Sequence[str] | None = None,
              per_host: dict[str, dict] | None = None, lane: str | None = None
              ) -> tuple[dict[str, Any], dict[str, BaseException]]:
        """``HostLanes.call_each`` on ``lane`` (None: the op's row's): every host (or ``hosts``, or those
        of ``per_host``)."""
        if per_host is not None:
            hosts, args = list(per_host), (lambda h: per_host[h])
        replies, failures = self.lanes.call_each(op, hosts, args, lane=lane)
        return {h: r.result for h, r in replies.items()}, failures

    def _devices_by_host(self) -> dict[str, list[int]]:
        return {h: list(self.topology.host(h).devices) for h in self.topology.host_ids}

    def _take_settings(self) -> dict:
        self.lanes.stamp.settings = self._host_settings
        return self._host_settings

    def _save_error(self, step: int, phase: str, failures: dict[str, BaseException]) -> SaveError:
        """``save_error``, remembering the hosts it could not reach: ``abort`` queues theirs."""
        with self._unreached_lock:
            self._unreached[step] = {h for h, e in failures.items() if isinstance(e, HostUnreachableError)}
        return save_error(step, phase, failures, len(self.topology.host_ids))

    # --- restore ---------------------------------------------------------------------------

    def load(self, step: int, requests: list[LoadRequest], holders: Mapping[str, set[str]] | None = None,
             manifest: str | None = None, keepers: Sequence[str] = ()) -> list[Any]:
        return self._loader.load(step, requests, holders, manifest, keepers)

    def host_of_device(self, device_id: int) -> str:
        return self.topology.host_of(device_id)

    # --- backup tier (the sidecars do the work; the head coordinates) ----------------------

    def _jobs(self, op: str, per_host: dict[str, dict], args: dict | None = None, *, lane: str | None = None,
              own_threads: bool = False, payloads: Sequence[bytes] = ()) -> tuple[dict[str, Any], dict[str, BaseException]]:
        """``HostLanes.run_job`` on each host, in parallel on the lane's pool (or threads of their own)."""
        def one(h: str) -> Any:
            return self.lanes.run_job(h, op, {**(args or {}), **per_host[h]}, list(payloads))

        if own_threads:
            with ThreadPoolExecutor(max_workers=max(1, len(per_host)), thread_name_prefix=f"mtc-cluster-{op}") as pool:
                return self.lanes.fan_out(one, list(per_host), pool=pool)
        return self.lanes.fan_out(one, list(per_host), lane=lane or "control")

    def _peer_book(self) -> dict[str, str]:
        return dict(self.lanes.peer_addresses)

    def _call(self, host: str, op: str, args: dict, payloads: Sequence[bytes] = ()) -> tuple[Any, list]:
        reply = self.lanes.call(host, op, args, list(payloads))
        return reply.result, list(reply.payloads)

    def _any_host(self, op: str, args: dict) -> tuple[str, Any, list]:
        """Ask the hosts in turn until one answers (for questions any host can answer)."""
        failures: dict[str, BaseException] = {}
        for h in self.topology.host_ids:
            try:
                reply = self.lanes.call(h, op, args)
                return h, reply.result, list(reply.payloads)
            except HostUnreachableError as e:
                failures[h] = e
        if len(failures) > 1:  # no host could be asked: that type, so that a listing reads as "not known"
            raise HostUnreachableError(f"{op}: no host could be asked: "
                                       + "; ".join(f"{h}: {host_failure(e)}" for h, e in sorted(failures.items())))
        raise_host_failures(op, failures)
        raise AssertionError("unreachable")  # pragma: no cover

    # --- peer tier (the sidecars move the bytes; the head plans and hands out addresses) ----

    def slice_of(self, host_id: str) -> int:
        return self.topology.slice_of(host_id)

    # --- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.lanes.close()
        self._staging.close()
