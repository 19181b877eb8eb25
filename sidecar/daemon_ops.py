"""The sidecar daemon's requests: the control operations of the table (``mtc.sidecar.ops``), and
the two data operations, whose shards travel as payloads (``write``: one per shard, received into
mapped ramdisk files; ``read``: the raw bytes of each box, some sent straight from a blob's map).

Functions of the service a ``SidecarDaemon`` (``mtc.sidecar.daemon``) serves, apart from the socket
serving: ``serve`` is one request -> (result, payloads).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from mtc.sidecar import ops
from mtc.sidecar.reads import BlobStream
from mtc.sidecar.service import SidecarService


def serve(service: SidecarService, op: str, args: dict, payloads: Sequence) -> tuple[Any, list]:
    """Answer one request of the daemon's head on ``service``: (result, payloads)."""
    data = _DATA.get(op)
    if data is None:
        return ops.serve(service, op, args, payloads, "cluster")
    return data(service, ops.data_header(service, op, args, len(payloads), "cluster"), payloads)


def _write(service: SidecarService, header: ops.WriteHeader, payloads: Sequence) -> tuple[Any, list]:
    shards = [(header.arrays[k].index, box, np.asarray(data).reshape(-1))
              for (k, box), data in zip(header.shards, payloads)]
    manifest = ops.method_of(service, "write")(header.step, shards, part=header.part)
    summary = {"step": header.step, "host": manifest.host, "shards": len(manifest.shards),
               "blobs": len(manifest.blob_names()), "written_bytes": manifest.written_bytes,
               "seconds": manifest.seconds}
    return summary, [manifest.to_json()]


def _read(service: SidecarService, header: tuple, payloads: Sequence) -> tuple[Any, list]:
    step, boxes, manifest, stream = header
    out, errors = ops.method_of(service, "read")(step, boxes, manifest=manifest, stream=stream)
    streamed = [i for i, p in enumerate(out) if isinstance(p, BlobStream)]
    return {"step": step, "errors": [list(e) for e in errors], "streamed": streamed}, out


# The table's data operations (``ops.DATA_OPS``), as a daemon serves them.
_DATA = {"write": _write, "read": _read}
if set(_DATA) != ops.DATA_OPS:
    raise ImportError(f"the daemon serves the data operations {sorted(_DATA)}, the table has {sorted(ops.DATA_OPS)}")
