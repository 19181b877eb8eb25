"""Colocated-Python dispatch (docs/architecture.md, "The seam": colocated mode).

The head wraps the sidecar class with ``colocated_python_class`` and calls it with
``jax.Array`` arguments on the colocated CPU devices. The class is named by import path, not
imported: it lives in the sidecar image (the same wheel), and ``mtc.head`` never imports
``mtc.sidecar`` (the colocated runtime loads it where the call runs).
"""

from __future__ import annotations

import importlib
import json
import logging
import time
import uuid
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from mtc.head.commit import commit_messages
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
from mtc.shared import format as fmt
from mtc.shared import landing_zones
from mtc.shared.colocated_codec import decode_reply, encode_request
from mtc.shared import protocol, requests, shardings, wire_errors
from mtc.shared.config import MTCConfig
from mtc.shared.host_settings import HostSettings
from mtc.shared.objstore.retry import Backoff
from mtc.shared.errors import ConfigError, HostUnreachableError, ManifestError, MTCError

log = logging.getLogger(__name__)
_JOB_POLL = Backoff(0.005, 0.5)  # how often a long sidecar job is polled: doubling, at most every 0.5 s

SIDECAR_CLASS = "mtc.sidecar.colocated:ColocatedSidecar"


def _load_sidecar_class() -> type:
    module, _, name = SIDECAR_CLASS.partition(":")
    return getattr(importlib.import_module(module), name)


def _row_sharding(devices: list) -> jax.sharding.NamedSharding:
    mesh = jax.sharding.Mesh(np.array(devices, dtype=object), ("d",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))


def _cpu_sharding(sharding: Any, cpu_of: dict) -> Any:
    """The same sharding, with each device replaced by its colocated CPU device."""
    if all(cpu_of[d] is d for d in sharding.device_set):
        return sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        mesh = sharding.mesh
        devs = np.vectorize(lambda d: cpu_of[d], otypes=[object])(mesh.devices)
        return jax.sharding.NamedSharding(jax.sharding.Mesh(devs, mesh.axis_names), sharding.spec)
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        (d,) = sharding.device_set
        return jax.sharding.SingleDeviceSharding(cpu_of[d])
    raise ManifestError(f"cannot map sharding {sharding!r} to colocated CPU devices; use a NamedSharding")


class _Group:
    """Leaves that live on one device list: one colocated call each."""

    def __init__(self, devices: tuple):
        self.devices = list(devices)
        self.leaves: list[Leaf] = []
        self.arrays: list[jax.Array] = []


class ColocatedDispatcher(Dispatcher):
    """Reach the sidecars through ``jax.experimental.colocated_python``."""

    def __init__(self, config: MTCConfig, devices: list | None = None):
        from jax.experimental import colocated_python as cp

        self._cp = cp
        self._devices = list(devices if devices is not None else jax.devices())
        cpu = cp.colocated_cpu_devices(self._devices)
        self._cpu_of = dict(zip(self._devices, cpu))
        # Identity on a CPU backend: then device_put would not copy, so staging copies itself
        # (into the sidecar's mapped ramdisk files where it runs in this process).
        self._same_memory = all(a is b for a, b in self._cpu_of.items())
        self._ctl_devices = sorted(set(cpu), key=lambda d: d.id)
        cls = cp.colocated_python_class(_load_sidecar_class())
        # What a sidecar needs to start; the settings it follows come with ``configure`` (claim).
        host_settings = HostSettings.from_config(config).to_wire()
        self._settings: dict | None = None  # sent once the hosts are claimed
        self._obj = cls(json.dumps({
            "ramdisk_root": str(config.ramdisk_root),
            "peer_port": config.peer_port,
            # Only when set in the config: otherwise each sidecar reads MTC_PEER_TOKEN itself.
            **({"peer_token": config.peer_token} if config.peer_token else {}),
        }))
        self._staging = HostStaging()
        self._ramdisk_root = str(config.ramdisk_root)
        self._zone = None  # the landing zone of the last stage, if the sidecar is in this process
        self._host_of_row: list[str] | None = None
        super().__init__(keepers=max(2, int(config.replication_factor)), host_settings=host_settings)

    # --- control requests ---------------------------------------------------------------

    def _request_array(self, payload: dict, devices: list, payloads: Sequence[Any] = ()) -> jax.Array:
        data = encode_request(payload, payloads)
        if payloads:  # (a manifest: each device gets the one buffer, never a copy of it per row on the head)
            row = data.reshape(1, -1)
            return jax.make_array_from_single_device_arrays(
                (len(devices), len(data)), _row_sharding(devices), [jax.device_put(row, d) for d in devices])
        rows = np.broadcast_to(data, (len(devices), len(data)))
        return jax.device_put(np.ascontiguousarray(rows), _row_sharding(devices))

    def _control(self, op: str, *, rows: list[int] | None = None, payloads: tuple[bytes, ...] = (),
                 per_host: dict[str, dict] | None = None, **args: Any) -> list[tuple[str, Any]]:
        """Run ``op`` on every host (or on the hosts of control device ``rows``); (host, result)
        per device row, errors re-raised typed. ``per_host``: arguments for some hosts only (the
        others answer None); ``payloads``: the request's bytes (bytes-like or ``protocol.Gathered``)."""
        return [(h, r) for h, r, _ in self._exchange(op, rows, payloads, per_host, args)]

    def _control_each(self, op: str, *, rows: list[int] | None = None, payloads: tuple[bytes, ...] = (),
                      per_host: dict[str, dict] | None = None, **args: Any) -> tuple[dict[str, Any], dict[str, MTCError]]:
        """``_control``, one host's error that host's alone: (results, failures) by host, as the
        cluster transport's fan-outs give them (a host with several device rows fails if one does)."""
        results: dict[str, Any] = {}
        failures: dict[str, MTCError] = {}
        for host, result, _, error in self._replies(op, rows, payloads, per_host, args):
            if error is not None:
                failures.setdefault(host, error)
            else:
                results.setdefault(host, result)
        return {h: r for h, r in results.items() if h not in failures}, failures

    def _exchange(self, op: str, rows: list[int] | None, payloads: tuple[bytes, ...],
                  per_host: dict[str, dict] | None, args: dict) -> list[tuple]:
        """(host, result, payloads) per device row; the first host's error raised, typed."""
        out = []
        for host, result, blobs, error in self._replies(op, rows, payloads, per_host, args):
            if error is not None:
                raise error
            out.append((host, result, blobs))
        return out

    def _replies(self, op: str, rows: list[int] | None, payloads: tuple[bytes, ...],
                 per_host: dict[str, dict] | None, args: dict, *, configured: bool = False) -> list[tuple]:
        """Run ``op`` in one colocated call: (host, result, payloads, error typed or None) per row."""
        devices = self._ctl_devices if rows is None else [self._ctl_devices[i] for i in rows]
        rid = uuid.uuid4().hex
        sharding = _row_sharding(devices)
        doc = {"id": rid, "op": op, "gen": self.generation, **args}
        if per_host is not None:
            doc["per_host"] = per_host
        req = self._request_array(doc, devices, payloads)
        call = self._obj.call.specialize(
            out_specs_fn=lambda r: jax.ShapeDtypeStruct((len(devices),), np.int64, sharding=sharding))
        sizes = np.asarray(call(req))
        width = int(sizes.max())
        fetch = self._obj.fetch.specialize(
            out_specs_fn=lambda r: jax.ShapeDtypeStruct((len(devices), width), np.uint8, sharding=sharding))
        data = np.asarray(fetch(self._request_array({"id": rid, "width": width}, devices)))
        replies = [decode_reply(data[i, : sizes[i]].tobytes()) for i in range(len(devices))]
        if op == "fingerprint" and self._host_of_row is None:  # how the rows' hosts are learnt
            hosts = [None] * len(devices)
        else:
            hosts = self._hosts_of_rows() if rows is None else [self._hosts_of_rows()[i] for i in rows]
        if not configured and self._settings is not None and any(
                e is not None and e[0] == "NotConfiguredError" for _, _, e in replies):
            # A sidecar that restarted has no settings: configure the hosts, then ask again (a host
            # that refuses the settings answers the question with its error).
            for h, e in sorted(self._control_each("configure", **wire("configure", requests.Configure(
                    settings=self._settings)))[1].items()):
                log.warning("host %s: re-configuring it failed: %s", h, host_failure(e))
            return self._replies(op, rows, payloads, per_host, args, configured=True)
        out = []
        for i, (result, blobs, error) in enumerate(replies):
            host = hosts[i] or (result if isinstance(result, dict) else {}).get("host", f"row{i}")
            out.append((host, result, blobs, None if error is None else wire_errors.decode(host, *error)))
        return out

    def _hosts_of_rows(self) -> list[str]:
        if self._host_of_row is None:
            self._host_of_row = [fp["host"] for _, fp in self._control("fingerprint")]
        return self._host_of_row

    # --- Dispatcher ---------------------------------------------------------------------

    def hosts(self) -> list[str]:
        return sorted(set(self._hosts_of_rows()))

    def stage(self, leaves: list[Leaf]) -> list[_Group]:
        all_cpu = tuple(self._ctl_devices)
        # First every host copy (on several threads), then the arrays over the copied buffers.
        wants: list[tuple[tuple, tuple, Any, np.ndarray]] = []  # (staging key, shape, dtype, source)
        plans = []
        for leaf in leaves:
            if leaf.kind == "scalar":
                continue
            if leaf.kind == "numpy":
                src = np.ascontiguousarray(leaf.value).reshape(-1).view(np.uint8)
                plans.append((leaf, len(wants)))
                wants.append(((leaf.key, "numpy"), src.shape, np.uint8, src))
            elif not self._same_memory:
                plans.append((leaf, None))  # a real device-to-host transfer (below)
            else:
                plans.append((leaf, self._plan_shards(leaf, wants)))
        bufs = self._host_buffers(wants)
        try:
            fills = [self._zone.filler(buf) for buf in bufs] if self._zone is not None else None
            declined = self._staging.copy_all([(buf, src) for buf, (*_, src) in zip(bufs, wants)], fills)
            for j in declined:  # no room to land it after all: staged here, the sidecar writes it
                key, shape, dtype, src = wants[j]
                bufs[j] = self._staging.buffer(key, shape, dtype)
                np.copyto(bufs[j], src.reshape(shape))
        except BaseException:
            if self._zone is not None:
                self._zone.release()
            raise
        groups: dict[tuple, _Group] = {}
        for leaf, plan in plans:
            if leaf.kind == "numpy":
                buf = bufs[plan]
                sharding = jax.sharding.NamedSharding(
                    jax.sharding.Mesh(np.array(all_cpu, dtype=object), ("d",)), jax.sharding.PartitionSpec())
                arr = jax.make_array_from_single_device_arrays(
                    buf.shape, sharding, [jax.device_put(buf, d, may_alias=True) for d in all_cpu])
            elif plan is None:
                arr = jax.device_put(leaf.value, _cpu_sharding(leaf.value.sharding, self._cpu_of))
            else:
                per_device = [jax.device_put(bufs[j], dev, may_alias=True) for j, dev in plan]
                arr = jax.make_array_from_single_device_arrays(
                    leaf.value.shape, _cpu_sharding(leaf.value.sharding, self._cpu_of), per_device)
            devices = all_cpu if leaf.kind == "numpy" else tuple(sorted(arr.sharding.device_set, key=lambda d: d.id))
            g = groups.setdefault(devices, _Group(devices))
            g.leaves.append(leaf)
            g.arrays.append(arr)
        self._staging.end()
        return list(groups.values())

    def _plan_shards(self, leaf: Leaf, wants: list) -> list[tuple[int, Any]]:
        """CPU backend: one host copy per unique shard of a jax leaf (appended to ``wants``), so
        that a train step that donates its inputs cannot touch what is being written. Returns
        (index into ``wants``, colocated CPU device) per shard."""
        index: dict[fmt.Box, int] = {}
        placed = []
        for shard in leaf.value.addressable_shards:
            box = leaf.device_boxes[shard.device.id]
            j = index.get(box)
            if j is None:
                src = np.asarray(shard.data)
                j = index[box] = len(wants)
                wants.append(((leaf.key, box), src.shape, src.dtype, src))
            placed.append((j, self._cpu_of[shard.device]))
        return placed

    def _host_buffers(self, wants: list) -> list[np.ndarray]:
        """Where each host copy goes: mapped ramdisk files of the sidecar in this process, which
        publishes them as blobs where they lie (``mtc.shared.landing_zones``: one copy per save), or
        reused staging buffers (Pathways, small shards, a ramdisk without room for every shard
        as a new blob: the sidecar then writes them)."""
        self._zone = landing_zones.find(self._ramdisk_root) if self._same_memory and wants else None
        sizes = [int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize for _, shape, dtype, _ in wants]
        landed = self._zone.reserve(sizes) if self._zone is not None else [None] * len(wants)
        out = []
        for (key, shape, dtype, _), buf in zip(wants, landed):
            if buf is None:
                out.append(self._staging.buffer(key, shape, dtype))
            else:
                out.append(buf.view(dtype).reshape(shape))
        return out

    def write(self, step: int, staged: list[_Group]) -> WriteResult:
        for part, g in enumerate(staged):
            sharding = _row_sharding(g.devices)
            # The header of a write in both modes (docs/architecture.md, "The seam"): each array's
            # leaf and shape; a host numpy leaf travels as its flat bytes, its box its own shape.
            arrays = [{"index": leaf.index, "shape": list(leaf.shape), "as_bytes": True} if leaf.kind == "numpy"
                      else {"index": leaf.index, "shape": list(arr.shape)} for leaf, arr in zip(g.leaves, g.arrays)]
            req = self._request_array({"step": step, "part": part, "gen": self.generation, "arrays": arrays},
                                      g.devices)
            fn = self._obj.write.specialize(out_specs_fn=lambda *a: jax.ShapeDtypeStruct(
                (len(g.devices), 1), np.uint8, sharding=sharding))  # one byte a device: done
            jax.block_until_ready(fn(req, *g.arrays))
        # Each host's part of the step manifest, as it wrote it: forwarded, not parsed.
        parts = {host: blobs[0] for host, _, blobs in self._exchange("part", None, (), None,
                                                                     wire("part", requests.StepRequest(step=step)))}
        return WriteResult([(h, parts[h]) for h in self.hosts() if h in parts], {h: {} for h in self.hosts()})

    def commit(self, step: int, manifest: bytes | protocol.Gathered, digest: str, keepers: list[str]
               ) -> dict[str, dict]:
        """Phase 2: the whole manifest to the keepers (one call on their control devices), the
        decision (digest, keepers) to the others (a second call, on theirs): each host receives
        its own rows only, so the others never get the manifest's bytes."""
        row_hosts = self._hosts_of_rows()
        hosts = sorted(set(row_hosts))
        peers = {}
        if len(hosts) > len(keepers):  # several hosts (Pathways): their peer addresses, as they are now
            peers = {fp["host"]: fp["peer"] for fp in self.fingerprints().values() if fp.get("peer")}
        keep, where = commit_messages(hosts, keepers, peers)
        out, failures = self._control_each("commit", rows=[i for i, h in enumerate(row_hosts) if h in keep],
                                           payloads=(manifest,), **wire("commit", requests.Commit(step=step, digest=digest)))
        others = [i for i, h in enumerate(row_hosts) if h not in keep]
        if others:
            more, failed = self._control_each("commit", rows=others, **wire("commit", requests.Commit(
                step=step, digest=digest, keepers=where)))
            out.update(more)
            failures.update(failed)
        if failures:
            raise save_error(step, "phase 2 (commit)", failures, len(hosts))
        return out

    def abort(self, step: int) -> None:
        """Forget ``step`` on every host that answers; one that fails drops it when a later step commits."""
        _, failures = self._control_each("abort", **wire("abort", requests.StepRequest(step=step)))
        for h, e in sorted(failures.items()):
            log.warning("could not abort step %d on host %s (%s)", step, h, host_failure(e))

    def _devices_by_host(self) -> dict[str, list[int]]:
        hosts = self._hosts_of_rows()
        out: dict[str, list[int]] = {}
        for dev, cpu in self._cpu_of.items():
            out.setdefault(hosts[self._ctl_devices.index(cpu)], []).append(dev.id)
        return out

    def _each(self, op: str, args: dict | None = None, *, hosts: Sequence[str] | None = None,
              per_host: dict[str, dict] | None = None, lane: str | None = None
              ) -> tuple[dict[str, Any], dict[str, BaseException]]:
        """One colocated call over the control devices (every host, or the rows of ``hosts``): there
        is one way to each host, whatever the ``lane``."""
        rows = None if hosts is None else [i for i, h in enumerate(self._hosts_of_rows()) if h in set(hosts)]
        return self._control_each(op, rows=rows, per_host=per_host, **(args or {}))

    def _take_settings(self) -> dict:
        self._settings = self._host_settings
        return self._settings

    def load(self, step: int, requests: list[LoadRequest], holders: Mapping[str, set[str]] | None = None,
             manifest: str | None = None, keepers: Sequence[str] = ()) -> list[Any]:
        all_cpu = list(self._ctl_devices)
        where = {}
        if keepers:  # where the keepers serve now (a record host fetches the header from them)
            book = {fp["host"]: fp["peer"] for fp in self.fingerprints().values() if fp.get("peer")}
            where = {h: book[h] for h in keepers if h in book}
        groups: dict[tuple, list[int]] = {}
        specs: list[dict] = []
        cpu_shardings: list[Any] = []
        described: dict[Any, dict] = {}  # one description per sharding: a mesh lists every device
        for i, r in enumerate(requests):
            rec = r.record
            if r.sharding is None:  # host numpy leaf: comes back as raw bytes, replicated
                cpu_s = jax.sharding.NamedSharding(
                    jax.sharding.Mesh(np.array(all_cpu, dtype=object), ("d",)), jax.sharding.PartitionSpec())
                spec = {"key": rec.key, "shape": [rec.nbytes], "dtype": "uint8", "as_bytes": True}
            else:
                cpu_s = _cpu_sharding(r.sharding, self._cpu_of)
                spec = {"key": rec.key, "shape": list(rec.shape), "dtype": rec.dtype}
            desc = described.get(cpu_s)
            if desc is None:
                desc = described[cpu_s] = shardings.describe(cpu_s)
            spec["sharding"] = desc
            specs.append(spec)
            cpu_shardings.append(cpu_s)
            devices = tuple(sorted(cpu_s.device_set, key=lambda d: d.id))
            groups.setdefault(devices, []).append(i)
        out: list[Any] = [None] * len(requests)
        for devices, idxs in groups.items():
            out_specs = tuple(
                jax.ShapeDtypeStruct(tuple(specs[i]["shape"]), fmt.dtype_from_name(specs[i]["dtype"]),
                                     sharding=cpu_shardings[i]) for i in idxs)
            table: dict[int, int] = {}  # id(description) -> its index in this request's "shardings"
            descs: list[dict] = []
            arrays_doc = []
            for i in idxs:
                desc = specs[i]["sharding"]
                if id(desc) not in table:
                    table[id(desc)] = len(descs)
                    descs.append(desc)
                arrays_doc.append({**specs[i], "sharding": table[id(desc)]})
            req = self._request_array({"step": step, "arrays": arrays_doc, "shardings": [shardings.pack(d) for d in descs],
                                       "manifest": manifest, **({"keepers": where} if where else {})},
                                      list(devices))
            fn = self._obj.load.specialize(out_specs_fn=lambda r, _o=out_specs: _o)
            arrays = fn(req)
            for i, arr in zip(idxs, arrays):
                r = requests[i]
                if r.sharding is None:
                    out[i] = np.asarray(arr).view(r.record.np_dtype).reshape(r.record.shape).copy()
                elif arr.sharding == r.sharding:
                    out[i] = arr
                else:
                    out[i] = jax.device_put(arr, r.sharding)
        return out

    def host_of_device(self, device_id: int) -> str:
        cpu = cpu_of_id(device_id, self._cpu_of)
        if cpu is None:
            ids = sorted(d.id for d in self._cpu_of)
            raise ConfigError(f"device {device_id} belongs to no host of this dispatcher (devices "
                              f"{ids[:8]}{'...' if len(ids) > 8 else ''}); put the state on the devices it covers")
        return self._hosts_of_rows()[self._ctl_devices.index(cpu)]

    def _run_jobs(self, op: str, *, per_host: dict[str, dict] | None = None, payloads: tuple[bytes, ...] = (),
                  **args: Any) -> tuple[dict[str, Any], dict[str, MTCError]]:
        """Start a long sidecar job on every host (of ``per_host``), then poll until all are done:
        (results, failures) by host, a host's failure (to start, or its job's) its own."""
        started, failures = self._control_each(op, per_host=per_host, payloads=payloads, **args)
        if per_host is not None:  # a host not asked answers nothing of this operation
            failures = {h: e for h, e in failures.items() if h in per_host}
        jobs = {h: r["job"] for h, r in started.items() if r is not None}
        results: dict[str, Any] = {}
        polls = 0
        while True:
            pending = {h: {"job": j} for h, j in jobs.items() if h not in results and h not in failures}
            if not pending:
                return results, failures
            statuses, failed = self._control_each("job", per_host=pending)
            failures.update({h: e for h, e in failed.items() if h in pending})
            for host, status in statuses.items():
                if host in pending and status is not None and status["done"]:
                    if "error" in status:
                        failures[host] = wire_errors.decode(host, status["error"], status["message"])
                    else:
                        results[host] = status["result"]
            if any(h not in results and h not in failures for h in pending):
                polls += 1
                time.sleep(_JOB_POLL.cap(polls))  # polling a remote job: nothing to wait on locally

    def slice_of(self, host_id: str) -> int:
        """The slice of a host: the ``slice_index`` of its devices (Pathways), else 0."""
        hosts = self._hosts_of_rows()
        for dev, cpu in self._cpu_of.items():
            if hosts[self._ctl_devices.index(cpu)] == host_id:
                return int(getattr(dev, "slice_index", 0) or 0)
        return 0

    def _jobs(self, op: str, per_host: dict[str, dict], args: dict | None = None, *, lane: str | None = None,
              own_threads: bool = False, payloads: Sequence[bytes] = ()) -> tuple[dict[str, Any], dict[str, BaseException]]:
        """Sidecar jobs, started in one call and polled (``_run_jobs``): one way to each host, whatever
        the lane, and no threads of the head's."""
        return self._run_jobs(op, per_host=per_host, payloads=tuple(payloads), **(args or {}))

    def _peer_book(self) -> dict[str, str]:
        # A host whose sidecar fails is left out of the book: its own pulls fail with its error.
        return {fp["host"]: fp["peer"] for fp in self._control_each("fingerprint")[0].values() if fp.get("peer")}

    def _call(self, host: str, op: str, args: dict, payloads: Sequence[bytes] = ()) -> tuple[Any, list]:
        """A colocated call on the host's control device alone."""
        ((_, result, blobs),) = self._exchange(op, [self._hosts_of_rows().index(host)], tuple(payloads), None, args)
        return result, list(blobs)

    def _any_host(self, op: str, args: dict) -> tuple[str, Any, list]:
        """The answer of the first host (in host order) that can answer a question any host can
        (asked of all in one call); one that cannot be reached is passed over, as in cluster mode."""
        answers: dict[str, tuple[Any, list]] = {}
        failures: dict[str, MTCError] = {}
        for host, result, blobs, error in self._replies(op, None, (), None, args):
            if error is not None:
                failures.setdefault(host, error)
            else:
                answers.setdefault(host, (result, blobs))
        unreachable: dict[str, MTCError] = {}
        for h in self.hosts():
            if h in failures:
                if not isinstance(failures[h], HostUnreachableError):
                    raise failures[h]
                unreachable[h] = failures[h]
            elif h in answers:
                return (h, *answers[h])
        if len(unreachable) > 1:  # no host could be asked: that type, so that a listing reads as "not known"
            raise HostUnreachableError(f"{op}: no host could be asked: "
                                       + "; ".join(f"{h}: {host_failure(e)}" for h, e in sorted(unreachable.items())))
        raise_host_failures(op, unreachable)
        raise AssertionError("unreachable")  # pragma: no cover

    def close(self) -> None:
        try:
            self._control("close")
        finally:
            self._staging.close()
            # Drop the colocated object now: its finaliser needs a live interpreter.
            self._obj = None
            import gc

            gc.collect()


def _box_on(leaf: Leaf, cpu_dev: Any, cpu_of: dict) -> fmt.Box | None:
    if leaf.kind == "numpy":
        return tuple((0, n) for n in leaf.shape)
    for dev_id, box in leaf.device_boxes.items():
        if cpu_of_id(dev_id, cpu_of) is cpu_dev:
            return box
    return None


def cpu_of_id(dev_id: int, cpu_of: dict) -> Any:
    for d, c in cpu_of.items():
        if d.id == dev_id:
            return c
    return None
