"""Errors across the seam: one table of the types a sidecar can report, one codec for both transports.

A sidecar reports every exception it raises while serving a request as (type name, message);
the head turns it back into an exception: one of mtc's own types (``TYPES``) when the name is
one, else a ``SidecarError`` that keeps the name. The colocated transport (JSON replies), the
daemon (``RemoteError`` frames), the sidecar's jobs and the per-box read errors all go through
``encode`` and ``decode``, so an error has the same type whichever way the head reached the host.
"""

from __future__ import annotations

from mtc.shared import errors
from mtc.shared.objstore import store as objstore


class SidecarError(errors.MTCError):
    """An exception raised on a sidecar that is not one of mtc's (a bug, or a library's error):
    ``type_name`` is the name of its type there; the message names the host."""

    def __init__(self, message: str, *, type_name: str = "Exception"):
        super().__init__(message)
        self.type_name = type_name


# Every error type a sidecar may report, by name. A new one that can cross the seam goes here.
TYPES: dict[str, type[errors.MTCError]] = {cls.__name__: cls for cls in (
    errors.MTCError, errors.ConfigError, errors.ManifestError, errors.StepNotFoundError, errors.RecordOnlyError,
    errors.TargetMismatchError, errors.CorruptBlobError, errors.InsufficientSpaceError, errors.BackupListingError,
    errors.VersionMismatchError, errors.SaveError, errors.ProtocolError, errors.HostUnreachableError,
    errors.AuthenticationError, errors.FencedError, errors.BackupSupersededError, errors.InjectedFaultError,
    errors.NotConfiguredError,
    objstore.StoreError, objstore.TransientStoreError, objstore.FatalStoreError, objstore.ObjectNotFoundError,
    objstore.InvalidObjectNameError,
)}


def encode(e: BaseException, host: str | None = None) -> tuple[str, str]:
    """(type name, message) of ``e`` as a sidecar reports it. An exception that is not one of
    mtc's gets the host named in its message (mtc's messages name what they are about)."""
    name, message = type(e).__name__, str(e)
    if name not in TYPES:
        # A subclass of one of ours (the peer wire's BadCopyError, ...) travels as its nearest listed base.
        base = next((c for c in type(e).__mro__ if c.__name__ in TYPES and TYPES[c.__name__] is c), None)
        if base is not None:
            name = base.__name__
        elif host and not names_host(message, host):
            message = f"host {host}: {message}"
    return name, message


def names_host(message: str, host: str) -> bool:
    """Whether ``message`` already says which host it is from ("host <id>"). Not the bare id: a
    short one ("vm") also turns up inside a path the message quotes."""
    return f"host {host}" in message


def name_of(e: BaseException) -> str:
    """The name of the type ``e`` was raised as: a ``SidecarError``'s type on its sidecar, else its own."""
    return e.type_name if isinstance(e, SidecarError) else type(e).__name__


def decode(host: str, name: str, message: str) -> errors.MTCError:
    """The exception a sidecar of ``host`` reported as (``name``, ``message``), typed."""
    text = message if names_host(message, host) else f"host {host}: {message}"
    cls = TYPES.get(name)
    if cls is None:
        return SidecarError(f"{name}: {text}", type_name=name)
    if cls is errors.SaveError:
        return errors.SaveError(message, hosts={host: message})
    return cls(text)
