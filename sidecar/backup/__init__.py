"""The backup tier on a worker host (uploads, finalization, fetches); the storage itself is
``mtc.shared.objstore``."""
