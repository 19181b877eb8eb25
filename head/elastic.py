"""Errors that mean "a slice is gone", in the types elastic training retries on.

``pathwaysutils.elastic``'s ``Manager.elastic_retry`` (and MaxText's elastic path, which
bubbles only ``jax.errors.JaxRuntimeError`` and ``ScaleUpSignalError`` out of a save) retries
a ``JaxRuntimeError`` whose text names a slice-down status such as ``DATA_LOSS``. A sidecar
that stops answering in the middle of a save or restore is exactly that event, so the
manager raises these, which are mtc errors and ``JaxRuntimeError``s at once. They live in
``mtc.head`` because only the head raises them (the sidecars do not import jax to start).
"""

from __future__ import annotations

import contextlib

import jax

from mtc.shared.errors import HostUnreachableError, SaveError, StepNotFoundError, cause_in_chain

# The status pathwaysutils.elastic.is_error_due_to_slice_down looks for first.
SLICE_DOWN_STATUS = "DATA_LOSS"


class HostLostError(HostUnreachableError, jax.errors.JaxRuntimeError):
    """A sidecar stopped answering during a save or restore: its slice is taken as lost."""


class SaveHostLostError(SaveError, HostLostError):
    """A background save failed because a host stopped answering (a ``SaveError`` too)."""


class StepOnLostHostError(StepNotFoundError, HostLostError):
    """No step could be confirmed because a host did not answer (a ``StepNotFoundError`` too)."""


def as_host_lost(e: BaseException) -> BaseException:
    """``e`` as a HostLostError (SaveHostLostError for a SaveError) when a host was lost; else ``e``."""
    if isinstance(e, HostLostError) or cause_in_chain(e, HostUnreachableError) is None:
        return e
    text = f"{SLICE_DOWN_STATUS}: {e} (a host stopped answering: its slice is taken as lost; an elastic retry " \
           "restores on the live slices)"
    if isinstance(e, SaveError):
        out: BaseException = SaveHostLostError(text, step=e.step, hosts=e.hosts)
    elif isinstance(e, StepNotFoundError):
        out = StepOnLostHostError(text)
    else:
        out = HostLostError(text)
    out.__cause__ = e
    return out


@contextlib.contextmanager
def host_lost_as_elastic():
    """Inside: an error caused by a lost host leaves as ``as_host_lost`` makes it; others unchanged."""
    try:
        yield
    except Exception as e:
        lost = as_host_lost(e)
        if lost is e:
            raise
        raise lost from e
