"""The sidecar daemon's requests: the control operations of the table (``mtc.sidecar.ops``), and
the two data operations, whose shards travel as payloads (``write``: one per shard, received into
mapped ramdisk files; ``read``: the raw bytes of each box, some sent straight from a blob's map).

A mixin of ``SidecarDaemon`` (``mtc.sidecar.daemon``), apart from the socket serving; it uses the
daemon's ``service``.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from mtc.shared.errors import ProtocolError
from mtc.sidecar import ops
from mtc.sidecar.reads import BlobStream


class ServeOps:
    """``serve_op``: one request -> (result, payloads), for ``SidecarDaemon`` (a mixin)."""

    def serve_op(self, op: str, args: dict, payloads: Sequence) -> tuple[Any, list]:
        data = _DATA.get(op)
        if data is None:
            return ops.serve(self.service, op, args, payloads, "cluster")
        self.service.admit(op, args.get("gen"))
        return data(self, args, payloads)

    def _op_write(self, args: dict, payloads: Sequence) -> tuple[Any, list]:
        step, part, rows = ops.parse_write(args, len(payloads))
        if rows is None:
            raise ProtocolError(f"write: 'shards' must list one [array, box] per payload ({len(payloads)} payloads)")
        shards = [(a, box, np.asarray(data).reshape(-1)) for (a, box), data in zip(rows, payloads)]
        manifest = self.service.write_shards(step, shards, part=part)
        summary = {"step": step, "host": manifest.host, "shards": len(manifest.shards),
                   "blobs": len(manifest.blob_names()), "written_bytes": manifest.written_bytes,
                   "seconds": manifest.seconds}
        return summary, [manifest.to_json()]

    def _op_read(self, args: dict, payloads: Sequence) -> tuple[Any, list]:
        step, boxes, manifest, stream = ops.parse_read(args)
        out, errors = self.service.read_boxes_each(step, boxes, manifest=manifest, stream=stream)
        streamed = [i for i, p in enumerate(out) if isinstance(p, BlobStream)]
        return {"step": step, "errors": [list(e) for e in errors], "streamed": streamed}, out


_DATA = {"write": ServeOps._op_write, "read": ServeOps._op_read}
