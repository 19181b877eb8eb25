"""Object storage for the backup tier: one interface, a local-directory backend and a Google
Cloud Storage backend, chosen by URL (`open_store`).

It lives in ``mtc.shared`` because both sides use the bucket: the sidecars write backups,
the head's ``mtc restore-version`` reads and pins them.
"""

from mtc.shared.objstore.store import (
    FatalStoreError,
    InvalidObjectNameError,
    ObjectNotFoundError,
    ObjectStore,
    StoreError,
    TransientStoreError,
    open_store,
)

__all__ = ["ObjectStore", "open_store", "StoreError", "TransientStoreError", "FatalStoreError",
           "ObjectNotFoundError", "InvalidObjectNameError"]
