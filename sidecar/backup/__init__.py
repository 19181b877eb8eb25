"""The backup tier's storage layer: one object store interface, a local-directory backend
and a Google Cloud Storage backend, chosen by URL (`open_store`)."""

from mtc.sidecar.backup.store import FatalStoreError, ObjectStore, TransientStoreError, open_store

__all__ = ["ObjectStore", "open_store", "TransientStoreError", "FatalStoreError"]
