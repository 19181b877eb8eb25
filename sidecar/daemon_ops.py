"""``ControlOps``: the sidecar daemon's request handlers, one per op (``_HANDLERS``), and which
``SidecarService`` method each op calls (``SERVICE_METHODS``).

A mixin of ``SidecarDaemon`` (``mtc.sidecar.daemon``), apart from the socket serving: a handler
only checks a request's arguments and calls one service method (``tests/unit/test_transports.py``
pins that against the colocated transport). It uses the daemon's ``service`` and ``_fingerprint``.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from mtc.shared import format as fmt
from mtc.shared.errors import ProtocolError
from mtc.sidecar.jobs import MAX_WAIT_S
from mtc.sidecar.reads import BlobStream
from mtc.sidecar.replication import parse_peers, parse_pulls, parse_shares
from mtc.sidecar.service import SidecarService


class ControlOps:
    """The ``_op_*`` handlers of ``SidecarDaemon`` (a mixin): (args, payloads) -> (result, payloads)."""

    def _op_ping(self, args: dict, payloads: Sequence) -> tuple[Any, list]:
        return {"host": self.service.host_id, "pid": os.getpid()}, []

    def _op_fingerprint(self, args: dict, payloads: Sequence) -> tuple[Any, list]:
        if self._fingerprint is None:  # versions do not change while the process runs
            self._fingerprint = self.service.fingerprint()
        return self._fingerprint, []

    def _op_inventory(self, args: dict, payloads: Sequence) -> tuple[Any, list]:
        devices = args.get("devices")
        if devices is not None and (not isinstance(devices, list) or not all(type(d) is int for d in devices)):
            raise ProtocolError("inventory: 'devices' must be a list of device ids")
        return self.service.inventory(devices), []

    def _op_verify(self, args: dict, payloads: Sequence) -> tuple[Any, list]:
        return self.service.verify(_step(args)), []

    def _op_lease(self, args: dict, payloads: Sequence) -> tuple[Any, list]:
        return {"lease": self.service.current_lease()}, []

    def _op_claim(self, args: dict, payloads: Sequence) -> tuple[Any, list]:
        head = args.get("head")
        if not isinstance(head, dict):
            raise ProtocolError("claim needs 'head' (an object naming the head)")
        return self.service.claim(args.get("generation"), head), []

    def _op_manifest(self, args: dict, payloads: Sequence) -> tuple[Any, list]:
        step = _step(args)
        return {"step": step}, [self.service.manifest_bytes(step, here_only=args.get("here_only") is True)]

    def _op_write(self, args: dict, payloads: Sequence) -> tuple[Any, list]:
        step = _step(args)
        part = args.get("part", 0)
        if type(part) is not int or part < 0:
            raise ProtocolError(f"write: 'part' must be an integer >= 0, got {part!r:.50}")
        rows = args.get("shards")
        if not isinstance(rows, list) or len(rows) != len(payloads):
            raise ProtocolError(f"write: 'shards' must list one [array, box] per payload "
                                f"({len(payloads)} payloads)")
        shards = []
        for i, (row, data) in enumerate(zip(rows, payloads)):
            if not (isinstance(row, list) and len(row) == 2 and type(row[0]) is int and row[0] >= 0):
                raise ProtocolError(f"write: shards[{i}] is not [array index, box]")
            shards.append((row[0], _box(row[1], f"write: shards[{i}]"), np.asarray(data).reshape(-1)))
        manifest = self.service.write_shards(step, shards, part=part)
        summary = {"step": step, "host": manifest.host, "shards": len(manifest.shards),
                   "blobs": len(manifest.blob_names()), "written_bytes": manifest.written_bytes,
                   "seconds": manifest.seconds}
        return summary, [manifest.to_json()]

    def _op_part(self, args: dict, payloads: Sequence) -> tuple[Any, list]:
        step = _step(args)
        return {"step": step}, [self.service.part_bytes(step)]

    def _op_commit(self, args: dict, payloads: Sequence) -> tuple[Any, list]:
        step = _step(args)
        if len(payloads) > 1:
            raise ProtocolError("commit: expected at most one payload (the step manifest, for a keeper)")
        keep = args.get("max_to_keep")
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ProtocolError(f"commit: max_to_keep {keep!r} is not an integer >= 1")
        digest, keepers = args.get("digest"), args.get("keepers")
        if digest is not None and not isinstance(digest, str):
            raise ProtocolError("commit: 'digest' is not a string")
        if keepers is not None and not (isinstance(keepers, list) and all(
                isinstance(k, list) and len(k) == 2 and all(isinstance(x, str) for x in k) for k in keepers)):
            raise ProtocolError("commit: 'keepers' is not a list of [host, peer address]")
        manifest = bytes(payloads[0]) if payloads else None
        return self.service.commit(step, manifest, max_to_keep=keep, digest=digest,
                                   keepers=[tuple(k) for k in keepers] if keepers else None), []

    def _op_abort(self, args: dict, payloads: Sequence) -> tuple[Any, list]:
        return {"removed": self.service.abort(_step(args))}, []

    def _op_read(self, args: dict, payloads: Sequence) -> tuple[Any, list]:
        step = _step(args)
        reads = args.get("reads")
        if not isinstance(reads, list):
            raise ProtocolError("read: 'reads' must be a list of [key, box or null]")
        boxes = []
        for i, row in enumerate(reads):
            if not (isinstance(row, list) and len(row) == 2 and isinstance(row[0], str)):
                raise ProtocolError(f"read: reads[{i}] is not [key, box or null]")
            boxes.append((row[0], None if row[1] is None else _box(row[1], f"read: reads[{i}]")))
        manifest = args.get("manifest")
        if manifest is not None and not isinstance(manifest, str):
            raise ProtocolError("read: 'manifest' must be the step manifest's digest (a string) or null")
        stream = args.get("stream", [])
        if not isinstance(stream, list) or not all(type(i) is int and 0 <= i < len(boxes) for i in stream):
            raise ProtocolError("read: 'stream' must list indices into 'reads' (the boxes the head hashes itself)")
        out, errors = self.service.read_boxes_each(step, boxes, manifest=manifest, stream=stream)
        streamed = [i for i, p in enumerate(out) if isinstance(p, BlobStream)]
        return {"step": step, "errors": [list(e) for e in errors], "streamed": streamed}, out

    def _op_peer_pull(self, args: dict, payloads: Sequence) -> tuple[Any, list]:
        step = _step(args)
        pulls = parse_pulls(args.get("pulls"))
        peers = parse_peers(args.get("peers"))
        if len(payloads) > 1:
            raise ProtocolError("peer_pull: at most one payload (the step manifest, to adopt the step)")
        manifest = bytes(payloads[0]) if payloads else None
        shares = parse_shares(args.get("shares"))
        return {"job": self.service.start_job(self.service.peer_pull, step, pulls, peers, manifest, shares)}, []

    def _op_job(self, args: dict, payloads: Sequence) -> tuple[Any, list]:
        job_id, wait_s = args.get("job"), args.get("wait_s", 0.0)
        if not isinstance(job_id, str) or not job_id.isalnum() or len(job_id) > 64:
            raise ProtocolError("job needs 'job': the id a long operation answered with")
        if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or not 0 <= wait_s <= MAX_WAIT_S:
            raise ProtocolError(f"'wait_s' must be a number in [0, {MAX_WAIT_S:g}]")
        return self.service.job(job_id, float(wait_s)), []

    # --- backup tier -----------------------------------------------------------------------

    def _backup_service(self, args: dict) -> SidecarService:
        url = args.get("backup_url")
        if url is not None and not isinstance(url, str):
            raise ProtocolError("'backup_url' must be a string or null")
        self.service.use_backup_root(url)
        return self.service

    def _op_backup_upload(self, args: dict, payloads: Sequence) -> tuple[Any, list]:
        svc = self._backup_service(args)
        blobs = _names(args.get("blobs"), "backup_upload")
        return {"job": svc.start_job(svc.backup_upload, {svc.host_id: blobs})}, []

    def _op_backup_finalize(self, args: dict, payloads: Sequence) -> tuple[Any, list]:
        svc = self._backup_service(args)
        name, keep = args.get("name"), args.get("max_to_keep")
        if not isinstance(name, str) or type(keep) is not int or keep < 1 or len(payloads) != 1:
            raise ProtocolError("backup_finalize needs 'name', 'max_to_keep' >= 1 and the manifest payload")
        return svc.backup_finalize(name, bytes(payloads[0]), keep, args.get("gen")), []

    def _op_backup_listing(self, args: dict, payloads: Sequence) -> tuple[Any, list]:
        deadline = args.get("deadline_s")
        if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, (int, float))
                                     or deadline < 0):
            raise ProtocolError("'deadline_s' must be a number >= 0 or null")
        return self._backup_service(args).backup_listing(deadline), []

    def _op_backup_manifest(self, args: dict, payloads: Sequence) -> tuple[Any, list]:
        name = args.get("name")
        if not isinstance(name, str):
            raise ProtocolError("backup_manifest needs 'name'")
        return {"name": name}, [self._backup_service(args).backup_manifest(name)]

    def _op_backup_fetch(self, args: dict, payloads: Sequence) -> tuple[Any, list]:
        svc = self._backup_service(args)
        name = args.get("name")
        if not isinstance(name, str):
            raise ProtocolError("backup_fetch needs 'name'")
        blobs = _names(args.get("blobs"), "backup_fetch")
        return {"job": svc.start_job(svc.backup_fetch, name, {svc.host_id: blobs})}, []


# Which service method each operation calls (a test pins it against the colocated transport's).
SERVICE_METHODS = {
    "ping": None,  # the transport's own liveness answer
    "fingerprint": "fingerprint", "inventory": "inventory", "manifest": "manifest_bytes", "write": "write_shards", "part": "part_bytes",
    "commit": "commit", "abort": "abort", "read": "read_boxes_each", "lease": "current_lease", "claim": "claim",
    "verify": "verify", "job": "job",
    "backup_upload": "backup_upload", "backup_finalize": "backup_finalize", "backup_listing": "backup_listing",
    "backup_manifest": "backup_manifest", "backup_fetch": "backup_fetch", "peer_pull": "peer_pull",
}

_HANDLERS = {
    "ping": ControlOps._op_ping,
    "fingerprint": ControlOps._op_fingerprint,
    "inventory": ControlOps._op_inventory,
    "manifest": ControlOps._op_manifest,
    "write": ControlOps._op_write,
    "part": ControlOps._op_part,
    "commit": ControlOps._op_commit,
    "abort": ControlOps._op_abort,
    "lease": ControlOps._op_lease,
    "verify": ControlOps._op_verify,
    "claim": ControlOps._op_claim,
    "read": ControlOps._op_read,
    "backup_upload": ControlOps._op_backup_upload,
    "backup_finalize": ControlOps._op_backup_finalize,
    "backup_listing": ControlOps._op_backup_listing,
    "backup_manifest": ControlOps._op_backup_manifest,
    "backup_fetch": ControlOps._op_backup_fetch,
    "peer_pull": ControlOps._op_peer_pull,
    "job": ControlOps._op_job,
}


def _names(value: Any, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ProtocolError(f"{where}: 'blobs' must be a list of blob names")
    return value


def _step(args: dict) -> int:
    step = args.get("step")
    if type(step) is not int or step < 0:
        raise ProtocolError(f"'step' must be an integer >= 0, got {step!r:.50}")
    return step


def _box(value: Any, where: str) -> fmt.Box:
    if not isinstance(value, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(type(v) is int for v in p) and 0 <= p[0] <= p[1]
            for p in value):
        raise ProtocolError(f"{where}: box {value!r:.100} is not a list of [start, stop] pairs")
    return tuple((p[0], p[1]) for p in value)
