"""The on-disk and on-the-wire formats: step manifests, host manifests, dtypes, index boxes.

A **step manifest** says which blobs make up a step and how they assemble into arrays; it is
the commit of a step: written last, atomically. Format ``mtc/3`` (docs/architecture.md, Formats) is JSON Lines:
line 1 is the *header* (the arrays, each named sharding once, the tree, and one
``{"host", "digest", "bytes"}`` entry per host part, with a ``"digest"`` of the header itself);
each following line is one **host manifest** (a *part*): the shards one sidecar wrote in phase
1, exactly as it wrote them, as columns (``mtc-host/2``, ``PartColumns``; ``mtc-host/1`` rows still read). The head builds a step manifest without reading the parts (it
hashes and concatenates them), so its work per save grows with arrays and hosts, not shards.
Which devices held a shard is derived from the named sharding, not listed per shard.
``mtc/2`` and ``mtc/1`` (one JSON document with every shard inline) are still read.

Everything read from disk or the network goes through ``from_json``, which validates the
document and says what is wrong.

The documents live in modules of their own, and every public name is importable from here:
``step`` (step manifests), ``host`` (host manifests, commit records), ``base`` (boxes, dtype
names, the JSON helpers the readers share), ``writers`` (which host's part holds which saved box,
from a step's header alone) and ``files`` (what a step file says whatever its
format: ``step_format``, ``step_digest``, ``collect_blob_names``).
"""

from mtc.shared.format.base import (Box, box_from_index, box_intersect, box_shape, box_slices, box_str,
                                    dtype_from_name, dtype_name)
from mtc.shared.format.files import collect_blob_names, step_digest, step_format
from mtc.shared.format.host import (COMMIT_FORMAT, HOST_FORMAT, HOST_FORMAT_V1, CommitRecord, HostManifest, HostShard,
                                    PartColumns)
from mtc.shared.format.step import (FORMAT, ArrayRecord, ShardRecord, StepBlobNames, StepHeader, StepManifest,
                                    check_step_bytes, encode_step, encode_step_segments,
                                    step_blob_names, step_blobs_among)

__all__ = [
    "COMMIT_FORMAT", "FORMAT", "HOST_FORMAT", "HOST_FORMAT_V1", "ArrayRecord", "Box", "CommitRecord", "HostManifest",
    "HostShard", "PartColumns",
    "ShardRecord", "StepBlobNames", "StepHeader", "StepManifest", "box_from_index", "box_intersect", "box_shape", "box_slices", "box_str",
    "check_step_bytes", "collect_blob_names", "dtype_from_name", "dtype_name", "encode_step", "encode_step_segments",
    "step_blob_names",
    "step_blobs_among", "step_digest",
    "step_format",
]
