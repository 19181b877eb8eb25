"""The sidecar daemon's requests: the control operations of the table (``mtc.sidecar.ops``), and
the two data operations, whose shards travel as payloads (``write``: one per shard, received into
mapped ramdisk files; ``read``: the raw bytes of each box, some sent straight from a blob's map).

Functions of the service a ``SidecarDaemon`` (``mtc.sidecar.daemon``) serves, apart from the socket
serving: ``serve`` is one request -> (result, payloads).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from mtc.shared.errors import ProtocolError
from mtc.sidecar import ops
from mtc.sidecar.reads import BlobStream
from mtc.sidecar.service import SidecarService


def serve(service: SidecarService, op: str, args: dict, payloads: Sequence) -> tuple[Any, list]:
    """Answer one request of the daemon's head on ``service``: (result, payloads)."""
    data = _DATA.get(op)
    if data is None:
        return ops.serve(service, op, args, payloads, "cluster")
    service.admit(op, args.get("gen"))
    return data(service, args, payloads)


def _write(service: SidecarService, args: dict, payloads: Sequence) -> tuple[Any, list]:
    step, part, rows = ops.parse_write(args, len(payloads))
    if rows is None:
        raise ProtocolError(f"write: 'shards' must list one [array, box] per payload ({len(payloads)} payloads)")
    shards = [(a, box, np.asarray(data).reshape(-1)) for (a, box), data in zip(rows, payloads)]
    manifest = service.write_shards(step, shards, part=part)
    summary = {"step": step, "host": manifest.host, "shards": len(manifest.shards),
               "blobs": len(manifest.blob_names()), "written_bytes": manifest.written_bytes,
               "seconds": manifest.seconds}
    return summary, [manifest.to_json()]


def _read(service: SidecarService, args: dict, payloads: Sequence) -> tuple[Any, list]:
    step, boxes, manifest, stream = ops.parse_read(args)
    out, errors = service.read_boxes_each(step, boxes, manifest=manifest, stream=stream)
    streamed = [i for i, p in enumerate(out) if isinstance(p, BlobStream)]
    return {"step": step, "errors": [list(e) for e in errors], "streamed": streamed}, out


_DATA = {"write": _write, "read": _read}
