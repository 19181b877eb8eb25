"""Object storage for the backup tier: one interface, a local-directory backend and a Google
Cloud Storage backend, chosen by URL (`open_store`).

It lives in ``mtc.shared`` because both sides use the bucket: the sidecars write backups,
the head's ``mtc restore-version`` reads and pins them.
"""

from __future__ import annotations

import re

from mtc.shared.errors import ConfigError
from mtc.shared.objstore.local import LocalStore
from mtc.shared.objstore.store import (
    DEFAULT_DEADLINE_S,
    FatalStoreError,
    InvalidObjectNameError,
    ObjectNotFoundError,
    ObjectStore,
    StoreError,
    TransientStoreError,
)

__all__ = ["ObjectStore", "open_store", "StoreError", "TransientStoreError", "FatalStoreError",
           "ObjectNotFoundError", "InvalidObjectNameError"]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def open_store(url: str, *, deadline: float = DEFAULT_DEADLINE_S, create: bool = True) -> ObjectStore:
    """Open the store at `url`: `gs://bucket[/prefix]` (Google Cloud Storage, honouring
    STORAGE_EMULATOR_HOST), `file:///path` or a plain path (a local directory, created if
    missing unless `create` is false). `deadline` bounds the retries of one GCS operation (it
    restarts on progress)."""
    if not isinstance(url, str) or not url.strip():
        raise ConfigError(f"backup store URL {url!r} is empty; give gs://bucket/prefix or a local path")
    m = _SCHEME.match(url)
    scheme = m.group(1).lower() if m else ""
    if scheme == "gs":
        # Imported only for a gs:// URL: google-cloud-storage is an optional extra (mtc[gcs]),
        # slow to import, and a local store needs none of it.
        from mtc.shared.objstore.gcs import GCSStore

        bucket, _, prefix = url[len("gs://") :].partition("/")
        if not bucket:
            raise ConfigError(f"backup store URL {url!r} names no bucket; use gs://BUCKET/prefix")
        return GCSStore(bucket, prefix, deadline=deadline)
    if scheme == "file":
        host, slash, path = url[len("file://") :].partition("/")
        if host not in ("", "localhost") or not slash:
            raise ConfigError(
                f"backup store URL {url!r} is not a local file URL; use file:///absolute/path"
            )
        return LocalStore("/" + path, create=create)
    if scheme:
        raise ConfigError(
            f"backup store URL {url!r} has an unsupported scheme {scheme!r}; "
            "use gs://bucket/prefix, file:///path or a plain path"
        )
    return LocalStore(url, create=create)
