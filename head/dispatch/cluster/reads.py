"""The cluster mode's restore reads: every target box planned (``dispatch.box_reads``),
then read from the daemons in per-host batches, in parallel, straight into the target buffers;
a read that fails moves on to its next candidate host.

A read that is exactly one saved shard is asked for as a stream: the daemon sends its blob's
file as it is (from a map of it, no hash there) and the head hashes the bytes as they arrive
(``protocol.Digesting``, while they are in the cache), against the blob name the manifest
gives. So the bytes are verified end to end, the socket included, and the daemon reads them
once. A stream that does not hash to its name is read again from the same host without
streaming: that host then hashes its copy itself, removes it if it is the copy that is bad, and
answers with the error, after which the read moves on as for any other failure.

``ClusterLoader`` is handed the connections it reads over (``lanes.HostLanes``) and the
topology that maps devices to hosts."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from mtc.head.dispatch.cluster.client import read_errors
from mtc.head.dispatch.cluster.lanes import HostLanes
from mtc.head.dispatch.interface import LoadRequest, host_failure, raise_remote
from mtc.head.dispatch.box_reads import BoxRead, box_reads
from mtc.head.dispatch.topology import Topology
from mtc.shared import format as fmt
from mtc.shared import protocol, wire_errors
from mtc.shared.errors import ConfigError, HostUnreachableError, ProtocolError
from mtc.shared.hashing import is_blob_name, new_hasher

log = logging.getLogger(__name__)

Box = fmt.Box


@dataclasses.dataclass
class _Read:
    """A planned read (``box_reads.BoxRead``) being run: its destination and the hosts tried."""

    plan: BoxRead
    dest: np.ndarray  # a view into the target box buffer (may be strided for a piece)
    blob: str | None = None  # the saved shard that is exactly what is read: streamed, hashed here ("": the host names it)
    tried: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)  # (host, error type, cause)
    host_verifies: bool = False  # its stream failed its hash here: the host hashes it next time

    @property
    def nbytes(self) -> int:
        return int(self.dest.nbytes)


class ClusterLoader:
    """Runs the restore reads over the hosts' control connections and their lane's thread pool."""

    def __init__(self, lanes: HostLanes, topology: Topology):
        self._lanes = lanes
        self._topology = topology

    def load(self, step: int, requests: list[LoadRequest], holders: Mapping[str, set[str]] | None = None,
             manifest: str | None = None, keepers: Sequence[str] = ()) -> list[Any]:
        book = self._lanes.peer_addresses
        where = {h: book[h] for h in keepers if h in book}  # where they serve now: see Dispatcher.load
        reads: list[_Read] = []
        layouts: list[tuple[dict, dict] | np.ndarray] = []
        for r in requests:
            rec = r.record
            dtype = rec.np_dtype
            full = tuple((0, n) for n in rec.shape)
            if r.sharding is None:
                dev_box: dict[Any, Box] = {}
                boxes = [full]
            else:
                idx = r.sharding.addressable_devices_indices_map(tuple(rec.shape))
                dev_box = {d: fmt.box_from_index(i, rec.shape) for d, i in idx.items()}
                boxes = list(dict.fromkeys(dev_box.values()))
            bufs: dict[Box, np.ndarray] = {}
            exact = {s.box: s.blob for s in rec.shards}  # a read of exactly a saved shard is streamed
            # Planned from the manifest's header (no shard rows): every whole box is asked for as a stream,
            # and the host names the blob it sends (``_Read.blob`` "").
            unnamed = rec.kind == "jax" and not rec.shards
            for box in boxes:
                shape = fmt.box_shape(box)
                nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                buf = bufs[box] = protocol.aligned_buffer(nbytes).view(dtype).reshape(shape)
                if nbytes:
                    owners = [self._owner(d) for d, b in dev_box.items() if b == box]
                    for plan in box_reads(rec, box, owners, self._topology.host_ids, holders, self._host_or_none):
                        blob = exact.get(plan.region, "" if unnamed and plan.whole else None)
                        reads.append(_Read(plan, buf if plan.whole else buf[plan.offsets()], blob))
            layouts.append((dev_box, bufs) if r.sharding is not None else bufs[full])
        self._run_reads(step, reads, manifest, where)
        out: list[Any] = []
        for r, lay in zip(requests, layouts):
            if r.sharding is None:
                out.append(lay)
                continue
            dev_box, bufs = lay
            # 64-byte aligned host buffers: device_put is zero-copy on a CPU backend. The arrays
            # then hold the buffers (JAX keeps a reference), which are fresh for every restore
            # and never written once the reads are done: nothing reuses or frees them under an array.
            arrays = [jax.device_put(bufs[b], d, may_alias=True) for d, b in dev_box.items()]
            out.append(jax.make_array_from_single_device_arrays(tuple(r.record.shape), r.sharding, arrays))
        return out

    def _owner(self, device: Any) -> str:
        return self._topology.host_of(int(device.id))

    def _host_or_none(self, device_id: int) -> str | None:
        try:
            return self._topology.host_of(device_id)
        except ConfigError:  # a device of the saving mesh that this one does not have
            return None

    def _run_reads(self, step: int, reads: list[_Read], manifest: str | None, keepers: dict[str, str]) -> None:
        """Run every read, batched per host and in parallel; a failed read moves on to its next
        candidate host. Raises when a read has no candidate left."""
        pending = list(reads)
        while pending:
            by_host: dict[str, list[_Read]] = {}
            for r in pending:
                by_host.setdefault(r.plan.candidates[len(r.tried)], []).append(r)
            results, failures = self._lanes.fan_out(lambda h: self._read_batch(h, step, by_host[h], manifest, keepers),
                                                    list(by_host))
            pending = []
            for h, batch in by_host.items():
                if h in failures:
                    e = failures[h]
                    bad = [(r, wire_errors.name_of(e), host_failure(e)) for r in batch]
                else:
                    bad = results[h]
                for r, kind, why in bad:
                    if kind is None:  # a stream that failed its hash: ask the same host to check its copy
                        pending.append(r)
                        continue
                    r.tried.append((h, kind, why))
                    if len(r.tried) >= len(r.plan.candidates):
                        self._raise_read_error(step, r)
                    pending.append(r)

    def _read_batch(self, h: str, step: int, batch: list[_Read], manifest: str | None,
                    keepers: dict[str, str]) -> list[tuple[_Read, str | None, str]]:
        """Read every box of ``batch`` from host ``h`` in one request; returns the failed ones
        as (read, error type, cause); error type None: a stream that failed its hash here (the
        read is marked for the host to verify)."""
        tmp: dict[int, np.ndarray] = {}
        stream = [i for i, r in enumerate(batch) if r.blob is not None and not r.host_verifies]
        hashers: dict[int, Any] = {}
        named: dict[int, str] = {}  # index -> the blob the host says it streamed

        def alloc(header: dict, sizes: list[int]) -> list[Any]:
            if "error" in header:
                return [protocol.aligned_buffer(n) for n in sizes]
            errors = {e[0] for e in read_errors(header.get("result"))}
            streamed = _streamed(h, header.get("result"), stream, errors)
            named.update(_stream_blobs(h, header.get("result"), streamed))
            if len(sizes) != len(batch):
                raise ProtocolError(f"host {h}: read answered {len(sizes)} payloads for {len(batch)} boxes")
            out = []
            for i, (r, n) in enumerate(zip(batch, sizes)):
                want = 0 if i in errors else r.nbytes
                if n != want:
                    raise ProtocolError(f"host {h}: read of {r.plan.key!r} {fmt.box_str(r.plan.region)} answered "
                                        f"{n} bytes, expected {want}")
                if n and r.dest.flags.c_contiguous:
                    buf = r.dest  # straight into the target buffer
                else:
                    buf = tmp.setdefault(i, protocol.aligned_buffer(n))
                if i in streamed:
                    buf = protocol.Digesting(buf, hashers.setdefault(i, new_hasher()))
                out.append(buf)
            return out

        reads = [[r.plan.key, [list(p) for p in r.plan.region]] for r in batch]
        args = {"step": step, "reads": reads}
        if manifest is not None:  # the digest every read is checked against on the host
            args["manifest"] = manifest
        if stream:
            args["stream"] = stream
        if keepers:
            args["keepers"] = keepers
        reply = self._lanes.call(h, "read", args, alloc=alloc)
        failed: dict[int, tuple[str | None, str]] = {
            i: (kind, f"{kind}: {msg}") for i, kind, msg in read_errors(reply.result)}
        for i, hasher in hashers.items():
            got = hasher.hexdigest()
            want = batch[i].blob or named.get(i)
            if got != want:
                r = batch[i]
                log.warning("host %s: the bytes of blob %s (%r %s) it sent hash to %s; asking it to check its copy",
                            h, want, r.plan.key, fmt.box_str(r.plan.region), got)
                r.host_verifies = True
                failed[i] = (None, f"blob {want} arrived corrupt (hashes to {got})")
        for i, buf in tmp.items():
            if i not in failed and buf.nbytes:
                batch[i].dest[...] = buf.view(batch[i].dest.dtype).reshape(batch[i].dest.shape)
        return [(batch[i], kind, cause) for i, (kind, cause) in failed.items()]

    def _raise_read_error(self, step: int, r: _Read) -> None:
        tried = "; ".join(f"{h}: {c}" for h, _, c in r.tried)
        msg = (f"step {step}: array {r.plan.key!r} box {fmt.box_str(r.plan.region)} could not be read from any host "
               f"that holds it (tiers tried: ram; hosts tried: {tried})")
        if any(kind == "HostUnreachableError" for _, kind, _ in r.tried):
            raise HostUnreachableError(msg + "; restart the host's daemon and retry the restore")
        host, kind, _ = r.tried[-1]
        raise_remote(host, kind, msg)


def _stream_blobs(h: str, result: Any, streamed: set[int]) -> dict[int, str]:
    """index -> the blob name a read answer gives for each box it streamed, in the order of ``streamed``."""
    names = result.get("blobs", []) if isinstance(result, dict) else []
    order = result.get("streamed", []) if isinstance(result, dict) else []
    if not isinstance(names, list) or len(names) != len(order) or not all(is_blob_name(n) for n in names):
        raise ProtocolError(f"host {h}: read answer 'blobs' {names!r:.100} does not name a blob per box streamed")
    return {i: n for i, n in zip(order, names) if i in streamed}


def _streamed(h: str, result: Any, asked: list[int], errors: set[int]) -> set[int]:
    """The boxes a read answer says it sent unverified: only ones the head asked to stream."""
    rows = result.get("streamed", []) if isinstance(result, dict) else []
    if not isinstance(rows, list) or not all(type(i) is int for i in rows) or not set(rows) <= set(asked) - errors:
        raise ProtocolError(f"host {h}: read answer 'streamed' {rows!r:.100} is not a list of the boxes asked to "
                            "be streamed")
    return set(rows)
