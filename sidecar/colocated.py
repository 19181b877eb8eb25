"""The sidecar service as a ``colocated_python`` class (docs/architecture.md, "The seam": colocated mode).

The head wraps ``ColocatedSidecar`` with ``jax.experimental.colocated_python.colocated_python_class``.
On Pathways each method runs in the sidecar process of every worker host, with only that
host's shards; on a CPU backend JAX runs it in-process as one host.

Colocated calls take and return only ``jax.Array``s on one device list, so this module is an
array codec around ``SidecarService``:
- control requests travel as uint8 rows of JSON (one row per device of the list); ``call``
  answers the size of each host's reply, ``fetch`` returns the replies padded to one width;
- ``write`` takes the staged state, writes this host's shards and answers one byte per device
  (done: the call's output must be an array); the head then fetches each host's part of the step
  manifest (``part``) and builds the manifest from the parts, unread;
- on a CPU backend (this object in the head's process) the service also registers a landing
  zone (``mtc.shared.landing_zones``): the head's staging copy lands in mapped ramdisk files, and
  ``write`` hashes and publishes them in place (one copy per save). On Pathways the arrays
  arrive in this process's own host memory and ``write_shards`` writes them with one copy;
- ``load`` returns the target arrays, built on the host's devices from verified blobs.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from typing import Any

import numpy as np

from mtc.shared import format as fmt
from mtc.shared import landing_zones, shardings, tls, wire_errors
from mtc.shared.auth import resolve_token
from mtc.shared.buffers import aligned_empty
from mtc.shared.colocated_codec import decode_request, encode_reply
from mtc.shared.errors import ConfigError, ProtocolError
from mtc.shared.ramdisk import is_no_space
from mtc.sidecar import ops
from mtc.sidecar.service import SidecarService

log = logging.getLogger(__name__)



def _device_list(x) -> list:
    """The ordered device list that the head used for a request array."""
    s = x.sharding
    mesh = getattr(s, "mesh", None)
    if mesh is not None:
        return list(mesh.devices.flat)
    return sorted(s.device_set, key=lambda d: d.id)


def _rows(like, rows: dict[Any, np.ndarray], row_shape: tuple[int, ...], dtype) -> Any:
    """An array of shape (len(devices), *row_shape) sharded one row per device."""
    import jax

    devices = _device_list(like)
    mesh = jax.sharding.Mesh(np.array(devices, dtype=object), ("d",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    local = [
        jax.device_put(rows[d].reshape((1,) + row_shape).astype(dtype, copy=False), d)
        for d in devices
        if d in rows
    ]
    return jax.make_array_from_single_device_arrays((len(devices),) + row_shape, sharding, local)


def _request(x) -> dict:
    return decode_request(np.asarray(x.addressable_shards[0].data)[0])


class _Zone:
    """The service's landing zone for a head in this process (``mtc.shared.landing_zones.LandingZone``).

    The head stages one save at a time (the next stage waits for the previous write), so the
    zone holds one batch: reserving again, or closing, removes what the last one left unwritten.
    """

    def __init__(self, service: SidecarService):
        self._service = service
        self._batch = None
        self._cold: dict = {}  # the cold landings of the batch, by buffer address
        self._lock = threading.Lock()

    def reserve(self, sizes):
        with self._lock:
            self._release_locked()
            self._batch = self._service.store.landings.land(sizes, cold_ok=True)
            self._cold = {x.address: x for x in self._batch.landings if x is not None and x.cold}
            return self._batch.buffers

    def filler(self, buffer):
        landing = self._cold.get(buffer.ctypes.data) if buffer.size else None
        if landing is None or landing.size != buffer.nbytes:
            return None

        hashed = not self._service.store.huge_pages  # see Landing.fill

        def fill(src) -> bool:
            try:
                landing.fill(src, hash=hashed)
            except OSError as e:
                if not is_no_space(e):
                    raise
                log.info("ramdisk %s: no room to land a %d-byte shard (%s); staging it in memory",
                         self._service.store.root, landing.size, e)
                return False
            return True

        return fill

    def release(self) -> None:
        with self._lock:
            self._release_locked()

    def _release_locked(self) -> None:
        self._cold = {}
        if self._batch is not None:
            self._batch.close()
            self._batch = None


class ColocatedSidecar:
    """The sidecar service of one host, reached through colocated Python."""

    def __init__(self, config: str):
        # Only plain values cross to the backend: the config travels as JSON.
        self._config = json.loads(config)
        self._service: SidecarService | None = None
        self._replies: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._zone: _Zone | None = None

    def _svc(self) -> SidecarService:
        with self._lock:
            if self._service is None:
                c = self._config
                # Settings (retention, backup root) come from the head's ``configure``, as in cluster mode.
                service = SidecarService(c["ramdisk_root"], host_id=c.get("host_id") or socket.gethostname(),
                                         awaits_head=True)
                port = int(c.get("peer_port") or 0)
                if port:  # the peer tier: other hosts' sidecars pull from this one
                    try:
                        service.start_peer_service(("0.0.0.0", port), resolve_token(c.get("peer_token")),
                                                   tls=tls.resolve(c.get("tls_dir")))  # else MTC_TLS_DIR
                    except (OSError, ConfigError) as e:
                        service.close()
                        raise ConfigError(f"peer_port={port}: the peer service cannot start: {e}") from e
                self._service = service
                self._zone = _Zone(service)
                landing_zones.register(c["ramdisk_root"], self._zone)
            return self._service

    # --- control -----------------------------------------------------------------------

    def call(self, request):
        """Run one control request; answer the byte size of this host's reply per device."""
        req = _request(request)
        payload = encode_reply(lambda: self._dispatch(req), host=self._config.get("host_id") or socket.gethostname())
        with self._lock:
            self._replies[req["id"]] = payload
        n = np.array([len(payload)], np.int64)
        return _rows(request, {d: n for d in request.sharding.addressable_devices}, (), np.int64)

    def fetch(self, request):
        """Return the reply of an earlier ``call``, padded to the width the head asks for."""
        req = _request(request)
        with self._lock:
            payload = self._replies.pop(req["id"])
        width = int(req["width"])
        row = np.zeros(width, np.uint8)
        row[: len(payload)] = np.frombuffer(payload, np.uint8)
        return _rows(request, {d: row for d in request.sharding.addressable_devices}, (width,), np.uint8)

    def _dispatch(self, req: dict) -> tuple[Any, list]:
        """Serve one control request (``mtc.sidecar.ops``): every host gets the same request; one
        with ``per_host`` arguments is this host's only when it names this host (else None)."""
        svc = self._svc()
        name = req.get("op")
        args = dict(req)
        per_host = req.get("per_host")
        if per_host is not None:
            if not isinstance(per_host, dict) or not all(isinstance(a, dict) for a in per_host.values()):
                raise ProtocolError("'per_host' must map host ids to objects of arguments")
            if svc.host_id not in per_host:
                ops.check(name, "colocated")
                return None, []
            args.update(per_host[svc.host_id])
        payloads = args.pop("payloads", None) or []  # (bytes: colocated_codec.decode_request put them there)
        if not (isinstance(payloads, list) and all(isinstance(p, bytes) for p in payloads)):
            raise ProtocolError("'payloads' must travel as the request's payload bytes")
        if name == "close":  # the transport drops the service too
            ops.check(name, "colocated")
            ops.admit(svc, name, args)  # fencing: the generation decoded as every request's is
            with self._lock:
                zone, self._zone, self._service = self._zone, None, None
            if zone is not None:
                landing_zones.unregister(self._config["ramdisk_root"], zone)
                zone.release()
        return ops.serve(svc, name, args, payloads, "colocated")

    # --- data --------------------------------------------------------------------------

    def write(self, request, *arrays):
        """Phase 1: write this host's shards of the staged state; answer one byte per device (done).

        The header (``ops.parse_write``) names each array's leaf and shape; the arrays are
        checked against it before anything is written."""
        req = _request(request)
        svc = self._svc()
        header = ops.data_header(svc, "write", req, len(arrays), "colocated")
        header.check_arrays([(arr.shape, arr.dtype) for arr in arrays])
        shards = []
        for arr, spec in zip(arrays, header.arrays):
            whole = tuple((0, n) for n in spec.shape)
            for sh in arr.addressable_shards:
                box = whole if spec.as_bytes else fmt.box_from_index(sh.index, arr.shape)
                shards.append((spec.index, box, np.asarray(sh.data)))
        ops.method_of(svc, "write")(header.step, shards, part=header.part)
        return _rows(request, {dev: np.ones(1, np.uint8) for dev in request.sharding.addressable_devices}, (1,),
                     np.uint8)

    def load(self, request):
        """Restore: build each requested array on this host's devices from verified blobs."""
        import jax

        req = _request(request)
        svc = self._svc()
        step, arrays, manifest, keepers = ops.data_header(svc, "read", req, 0, "colocated")
        devices_by_id = {d.id: d for d in _device_list(request)}
        # Every distinct box is read once, all of them on the sidecar's I/O threads.
        plans = []
        reads: dict[tuple[int, fmt.Box], int] = {}
        jobs = []
        rebuilt: dict[int, Any] = {}  # arrays of one sharding share its description (parse_load): rebuilt once
        for i, spec in enumerate(arrays):
            shape, dtype = spec["shape"], spec["dtype"]
            sharding = rebuilt.get(id(spec["sharding"]))
            if sharding is None:
                sharding = rebuilt[id(spec["sharding"])] = shardings.rebuild(spec["sharding"], devices_by_id)
            placed = []
            for dev, idx in sharding.addressable_devices_indices_map(shape).items():
                box = fmt.box_from_index(idx, shape)
                if (i, box) not in reads:
                    reads[(i, box)] = len(jobs)
                    if spec.get("as_bytes"):
                        jobs.append((spec["key"], None, True, aligned_empty(shape, dtype)))
                    else:
                        jobs.append((spec["key"], box, False, None))
                placed.append((dev, reads[(i, box)]))
            plans.append((shape, sharding, placed))
        bufs, errors = ops.method_of(svc, "read")(step, jobs, manifest=manifest, keepers=keepers)
        if errors:  # on this host no other holder can stand in: the first failure, typed
            _, name, message = errors[0]
            raise wire_errors.decode(svc.host_id, name, message)
        out = []
        for shape, sharding, placed in plans:
            local = [jax.device_put(bufs[j], dev, may_alias=True) for dev, j in placed]
            out.append(jax.make_array_from_single_device_arrays(shape, sharding, local))
        return tuple(out)
