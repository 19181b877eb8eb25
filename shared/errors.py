"""Every error mtc raises, in one place.

Each message says what happened, to what, and what to do about it.
"""

from __future__ import annotations


class MTCError(Exception):
    """Base class of every mtc error."""


def cause_in_chain(e: BaseException | None, cls: type) -> BaseException | None:
    """The first exception of type ``cls`` in ``e``'s cause/context chain (``e`` itself first)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, cls):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


class ConfigError(MTCError, ValueError):
    """A configuration flag is missing, malformed or inconsistent with another."""


class ManifestError(MTCError, ValueError):
    """A manifest (JSON) is malformed, of an unknown format, or inconsistent."""


class StepNotFoundError(MTCError, ValueError):
    """The requested step is not committed anywhere mtc can see."""


class RecordOnlyError(StepNotFoundError):
    """This host committed only a record of the step (``fmt.CommitRecord``), not its manifest: the
    manifest is asked of it again, to fetch from a keeper, only after the keepers were asked."""


class NotConfiguredError(ConfigError):
    """A sidecar was asked for something that needs the head's settings (``configure``) before any
    head configured it (a sidecar that restarted): the head configures it and asks again."""


class TargetMismatchError(MTCError, ValueError):
    """A restore target does not match the saved tree (structure, shape or dtype)."""


class CorruptBlobError(MTCError):
    """No copy of a blob that passes its hash check could be found."""


class InsufficientSpaceError(MTCError, OSError):
    """The ramdisk cannot hold the step; nothing was written."""


class BackupListingError(MTCError):
    """The backup root could not be listed (the store failed, or did not answer in time), where the
    answer depended on it: which backups exist is not known, which is not the same as "none"."""

    def __init__(self, message: str, *, root: str | None = None, cause: str | None = None):
        super().__init__(message)
        self.root = root
        self.cause = cause


class VersionMismatchError(MTCError):
    """Head and sidecar run different versions of something that must match."""


class SaveError(MTCError):
    """A background save failed on one or more hosts."""

    def __init__(self, message: str, *, step: int | None = None, hosts: dict[str, str] | None = None):
        super().__init__(message)
        self.step = step
        self.hosts = dict(hosts or {})


class ProtocolError(MTCError):
    """A message on a control socket is malformed, too large, truncated, or of another protocol version."""


class HostUnreachableError(MTCError, ConnectionError):
    """A sidecar daemon cannot be reached, or its connection broke in the middle of a request."""


class PartUnreachableError(HostUnreachableError):
    """A host that saved a step is down and no other host holds its part of it (whole, as a data-parallel
    twin's, or in pieces): what needs that part (a backup of the step) waits for the host."""


class StepsUnconfirmedError(HostUnreachableError):
    """Hosts could not be asked what they hold and no step is confirmed without them: whether a step is
    committed is not known, which is not "no step" (``latest_step()`` raises this rather than answer None).
    ``hosts``: host -> why it could not be asked."""

    def __init__(self, message: str, *, hosts: dict[str, str] | None = None):
        super().__init__(message)
        self.hosts = dict(hosts or {})


class AuthenticationError(MTCError):
    """A control request did not prove it comes from this job's head (no or a wrong job token)."""


class FencedError(MTCError):
    """A newer head drives these hosts: this head may no longer change them (docs/architecture.md, "One head at a time")."""

    def __init__(self, message: str, *, current: dict | None = None):
        super().__init__(message)
        self.current = current


class BackupSupersededError(MTCError):
    """A newer finalize of the backup tier started while this one ran (one its head gave up on, still
    running on its host), or this one could not keep its marker alive: it stopped before its next bucket
    operation (``sidecar/backup/fence.py``)."""


class InjectedFaultError(MTCError):
    """A failure injected at a named fault point (``MTC_FAIL_AT``), for tests."""
