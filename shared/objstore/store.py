"""The object store interface of the backup tier (`ObjectStore`), its errors and the checks of
object names.

Names are relative to the store root ("blobs/<hash>", "backups/<name>.json") and are validated
before they reach a filesystem or a URL. The backends (the gcs/ package, local.py) subclass
`ObjectStore`; the package's `open_store` picks one by URL.
"""

from __future__ import annotations

import abc
import copy
from typing import Any, Callable

from mtc.shared.errors import MTCError

DEFAULT_DEADLINE_S = 300.0
# The most ``get_bytes`` reads unless told otherwise: a small object (a manifest, a marker) never comes near
# it, and a larger one (planted, or a link to /dev/zero in a local root) cannot exhaust the reader's memory.
MAX_SMALL_OBJECT_BYTES = 1 << 30
_MAX_NAME_BYTES = 1024  # GCS's limit on object names (UTF-8)


class StoreError(MTCError):
    """An object store operation failed."""


class TransientStoreError(StoreError):
    """The store kept failing with errors that may go away (network, 429, 5xx, timeouts)
    until the retry deadline passed. Retrying later, from the caller, may succeed."""


class FatalStoreError(StoreError):
    """The store refused the operation (missing bucket, permission, bad request): retrying
    will not help; the configuration or the data must change."""


class ObjectNotFoundError(FatalStoreError, FileNotFoundError):
    """The named object does not exist in the store."""


class UntrustedObjectError(FatalStoreError):
    """An object is not what mtc writes there: larger than its kind may be, or (a local root) not a
    regular file (a link, a FIFO, a device). Nothing of it was used."""


class InvalidObjectNameError(FatalStoreError, ValueError):
    """An object name is not a clean relative path; nothing was read or written."""


def validate_name(name: str) -> str:
    """Return `name` if it is a clean relative object name, else raise InvalidObjectNameError.

    Refused: empty names, a leading "/", empty, "." or ".." parts, parts starting with "."
    (the stores keep their temporary files there), backslashes and control characters.
    """
    why = name_problem(name)
    if why:
        raise InvalidObjectNameError(
            f"object name {name!r} is not valid: {why}; use a relative path such as "
            "'blobs/<hash>' with non-empty parts, no '..' and no leading '/'"
        )
    return name


def validate_prefix(prefix: str) -> str:
    """Return `prefix` if it can start a valid name ("" and a trailing "/" are fine)."""
    if prefix == "":
        return prefix
    validate_name(prefix[:-1] if prefix.endswith("/") else prefix)
    return prefix


def name_problem(name: Any) -> str | None:
    """Why ``name`` is not a valid object name (see ``validate_name``), or None when it is."""
    if not isinstance(name, str):
        return f"names are str, not {type(name).__name__}"
    if not name:
        return "it is empty"
    if name.startswith("/"):
        return "it starts with '/'"
    if "\\" in name:
        return "it contains a backslash"
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "it contains a control character"
    if len(name.encode("utf-8", "surrogatepass")) > _MAX_NAME_BYTES:
        return f"it is longer than {_MAX_NAME_BYTES} bytes"
    for part in name.split("/"):
        if part == "":
            return "it has an empty part ('//' or a trailing '/')"
        if part in (".", ".."):
            return f"it has a {part!r} part"
        if part.startswith("."):
            return f"part {part!r} starts with '.'"
    return None


class ObjectStore(abc.ABC):
    """Durable named objects under one root. Thread-safe; usable as a context manager.

    Every method raises InvalidObjectNameError for a bad name, TransientStoreError when the
    store stayed unreachable until the retry deadline, and FatalStoreError (or its subclass
    ObjectNotFoundError) when retrying cannot help. Errors about the caller's local files
    (a missing source file, a full local disk) are plain OSErrors.

    A backend calls ``_check_guard()`` first in each of the operations below and, if it retries,
    before every try (``with_guard``).
    """

    url: str  # where the store points, for messages ("gs://bucket/prefix/", "file:///...")
    _guard: Callable[[], None] | None = None  # see with_guard

    def with_deadline(self, seconds: float) -> "ObjectStore":
        """This store with another retry deadline (same connection), for calls someone waits on.

        A store that does not retry returns itself.
        """
        return self

    def with_guard(self, guard: Callable[[], None]) -> "ObjectStore":
        """This store with ``guard()`` called before every operation, and before every retry of
        one (a store that retries): ``guard`` raises to stop the caller, e.g. a backup finalize
        whose head was fenced off while the bucket was unreachable (``BackupTier.finalize``)."""
        other = copy.copy(self)  # the same store and settings (a connection too); only the guard differs
        other._guard = guard
        return other

    def _check_guard(self) -> None:
        """Call the guard ``with_guard`` gave, if any (it raises to stop the operation)."""
        if self._guard is not None:
            self._guard()

    @abc.abstractmethod
    def put_file(self, name: str, path: str, *, if_absent: bool = False) -> bool:
        """Upload the local file `path` as `name`, streaming. The object appears whole or
        not at all. With `if_absent`, create only: return False (and write nothing) when
        `name` already exists. Return True when this call wrote the object."""

    @abc.abstractmethod
    def put_bytes(self, name: str, data: bytes, *, if_absent: bool = False) -> bool:
        """Like put_file for a small object held in memory (manifests, markers)."""

    @abc.abstractmethod
    def get_to_file(self, name: str, path: str) -> int:
        """Download `name` into the local file `path` (created or truncated), streaming;
        return the number of bytes. The caller verifies contents against their hash."""

    @abc.abstractmethod
    def get_bytes(self, name: str, *, max_bytes: int = MAX_SMALL_OBJECT_BYTES) -> bytes:
        """The whole content of a small object; UntrustedObjectError (after reading at most
        ``max_bytes + 1`` bytes) when it is larger than ``max_bytes``."""

    @abc.abstractmethod
    def get_range(self, name: str, offset: int, length: int) -> bytes:
        """``length`` bytes of ``name`` from byte ``offset`` (fewer where the object ends sooner: the
        caller checks the count and the content against what it expects)."""

    @abc.abstractmethod
    def exists(self, name: str) -> bool:
        """Whether `name` exists."""

    @abc.abstractmethod
    def size(self, name: str) -> int | None:
        """The size in bytes of `name`, or None when it does not exist."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Sorted names (relative to the store root) that start with `prefix`."""

    @abc.abstractmethod
    def delete(self, name: str) -> None:
        """Delete `name`; a missing object is fine."""

    def close(self) -> None:
        """Release connections. The store must not be used afterwards."""

    def __enter__(self) -> ObjectStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
