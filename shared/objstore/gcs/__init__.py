"""Google Cloud Storage as an object store (`gs://bucket/prefix`).

Every operation runs under `retry_call`: transient failures (connection errors, timeouts,
408/429/5xx) are retried with backoff and full jitter until a deadline that restarts
whenever bytes move; anything else is fatal at once. The client library's own retries are
switched off (retry=None) so that one policy decides.

Small objects go in one multipart request. Files above `resumable_threshold` use a
resumable session driven here, chunk by chunk: after a failure the session is asked how
much it holds and the upload goes on from there. A session that the server finalized early
or with wrong bytes (fake-gcs-server finalizes on a status query) is detected by size and
crc32c, that generation is deleted, and the upload starts again.

The store is in ``store`` (``GCSStore``); clients and the transient/fatal split are in
``client``, the resumable upload in ``upload``. Importing any of them without
google-cloud-storage says what to install.
"""

try:
    import requests  # noqa: F401
    from google.api_core import exceptions as gexc  # noqa: F401
    from google.cloud import storage  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised by a test that hides the package
    raise ImportError(
        f"the gs:// backup store needs google-cloud-storage ({e}); install it with: pip install 'mtc[gcs]'"
    ) from e

from mtc.shared.objstore.gcs.client import EMULATOR_ENV, is_transient, make_client
from mtc.shared.objstore.gcs.store import CHUNK_SIZE, RESUMABLE_THRESHOLD, GCSStore

__all__ = ["CHUNK_SIZE", "EMULATOR_ENV", "RESUMABLE_THRESHOLD", "GCSStore", "is_transient", "make_client"]
