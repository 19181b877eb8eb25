"""The peer tier's wire service: a sidecar serves its ramdisk's blobs to the other sidecars.

Every sidecar runs a ``PeerServer`` on its peer port; other sidecars reach it with a
``PeerClient``. The frames are those of ``mtc.shared.protocol`` (JSON header, raw payloads,
nothing unpickled). Requests (``args`` -> ``result``; payloads in brackets):

- ``have {blobs}`` -> ``{"have": [names held]}`` (at most ``HAVE_BATCH`` names per request)
- ``get {blob}`` -> ``{"blob", "size"}`` [the blob's bytes, sent from a read-only map of the
  ramdisk file (``send_blob_file``): no copy through Python]
- ``put {blob}`` [the blob's bytes] -> ``{"blob", "added"}``: received into a temp blob and
  kept only when its bytes hash to its name
- ``verify {blob}`` -> ``{"blob", "state": "ok" | "removed" | "missing"}``: the server hashes
  its copy and removes it when it is corrupt (asked by a client whose ``get`` of it failed
  its hash; the server judges by the bytes alone, so no request removes a good blob)

Every request carries ``args["token"]``, the shared secret of the job (``peer_token`` or
``MTC_PEER_TOKEN``; a Kubernetes Secret in production). The server checks it with
``hmac.compare_digest`` before it looks at anything else; a request without it, with a wrong
one, with a malformed blob name, an unknown op, an oversized or garbage frame is refused with an
error reply, logged, and its connection closed. Other connections are served on.

Receiving (``get`` on the client, ``put`` on the server) streams the payload into a temp blob
(``BlobFiles.open_temp``), hashing it as it arrives, and publishes it
(``BlobFiles.finalize_temp``) only when it hashes to its name: a bad copy is discarded and
never counted. A transfer cut short leaves only a temp file, which never looks
like a blob and is removed when the store next opens.
"""

from mtc.shared.config import ENV_TOKEN, MIN_TOKEN_CHARS
from mtc.sidecar.peer.client import PeerClient
from mtc.sidecar.peer.server import PeerServer
from mtc.shared.auth import resolve_token
from mtc.sidecar.peer.wire import HAVE_BATCH, MAX_BLOB_BYTES, MAX_PEER_HEADER, BadCopyError, receive_blob, send_blob_file

__all__ = ["ENV_TOKEN", "HAVE_BATCH", "MAX_BLOB_BYTES", "MAX_PEER_HEADER", "MIN_TOKEN_CHARS", "BadCopyError",
           "PeerClient", "PeerServer", "receive_blob", "resolve_token", "send_blob_file"]
